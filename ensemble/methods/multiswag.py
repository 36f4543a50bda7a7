"""MultiSWAG (Wilson and Izmailov 2020): K independent members, each a Gaussian over its weights fitted by SWAG.

SWAG (Maddox et al. 2019) reads the iterates of SGD at a constant learning
rate as samples around a mode: their mean and covariance make a Gaussian
posterior over the weights. Here every member trains as a member of the deep
ensemble does (its own initialisation and data order); `optim.schedule` runs
the configured schedule over the first `swag_start` of the run, shifted to end
at `swag_learning_rate`, then holds that rate, so the iterates keep moving. Over
that last part each member collects, at `swag_rank` or a few more evenly
spaced steps, the SWAG moments of its parameters into `TrainState.snapshots`
(so checkpoints hold them and a resume continues exactly):

  count        collections so far
  mean         running mean of the collected parameters (the SWA solution)
  variance     their variance, each weight's (the diagonal), kept by Welford's update: computed as
               mean(x^2) - mean(x)^2 in float32, it cancels to noise for a weight that moves little, and a sample's
               spread would depend on how XLA fused that subtraction
  deviations   the last `swag_rank` of theta_i - mean_i (mean_i: the mean after collection i), a ring buffer,
               the rows of Maddox et al.'s deviation matrix D

At prediction a member draws `swag_samples` parameter sets (Maddox et al. eq. 1-2, with scale 1/2)
  theta = mean + sqrt(variance / 2) * z1 + D^T z2 / sqrt(2 (R - 1)),
R the filled rows of D, under keys fixed by the member's key, and combines their outputs as the task combines
snapshots (`combine_snapshots`): classification the log of their mean probability, regression each sample a
mixture component. The ensemble's mean over K members is then the mean over all K x S samples. Before two
collections a member predicts with its current parameters.

SWAG recomputes BatchNorm's statistics for each sample with a pass over the training data; prediction here has no
training data, so every sample uses the member's running averages at the end of training.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ensemble import optim
from ensemble.methods.independent import Independent

# What a member's samples are drawn from, besides the count of collections.
MOMENTS = ('mean', 'variance', 'deviations')
# fold_in tag of a member's sampling key: its training steps fold the step number into the same key.
SAMPLE_KEY = 0x5357_4147


@dataclasses.dataclass(frozen=True)
class MultiSWAG(Independent):
  name: str = 'multiswag'
  samples: int = 10
  rank: int = 10
  # Only training reads these two: the step after which the rate is constant, and the steps between collections.
  collection_start: int = 0
  collection_every: int = 1

  @classmethod
  def from_config(cls, config, steps_per_epoch: int):
    start, total = optim.swag_collection_start(config, steps_per_epoch)
    return cls(samples=config.swag_samples, rank=config.swag_rank, collection_start=start,
               collection_every=max(1, (total - start) // config.swag_rank))

  def init(self, member, state, key: jax.Array, seed_key: jax.Array | None = None):
    del member, key, seed_key
    zeros = lambda shape: (lambda x: jnp.zeros((*shape, *x.shape), x.dtype))
    return state.replace(snapshots={
        'count': jnp.zeros((), jnp.int32), 'mean': jax.tree.map(zeros(()), state.params),
        'variance': jax.tree.map(zeros(()), state.params),
        'deviations': jax.tree.map(zeros((self.rank,)), state.params)})

  def after_update(self, state):
    """Every `collection_every` steps of the constant-rate phase, the parameters go into the moments.

    A `lax.cond`, as in methods/snapshot.py: members traced one after another (CPU) update the moments only at a
    collection, not every step.
    """
    since = state.step - self.collection_start
    collects = (since > 0) & (since % self.collection_every == 0)
    return state.replace(snapshots=jax.lax.cond(collects, lambda moments: collect(moments, state.params),
                                                lambda moments: moments, state.snapshots))

  def params_of(self, state):
    """The current parameters and the SWAG moments the samples are drawn from (their mean, variance and
    deviations): a member predicts with the samples once two collections are in, with the current parameters
    before."""
    moments = state.snapshots
    return {'params': state.params, **{name: moments[name] for name in MOMENTS}}

  def with_params(self, state, params):
    return state.replace(params=params['params'], snapshots={
        **state.snapshots, **{name: params[name] for name in MOMENTS}})

  def predict(self, member, state, images):
    """The `samples` draws' outputs combined as the task combines snapshots; the current parameters' before the
    moments hold two collections."""
    moments = state.snapshots
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), SAMPLE_KEY)
    keys = jax.random.split(key, self.samples)
    outputs = jax.lax.map(lambda k: member.logits(state.replace(params=sample(moments, k)), images), keys)
    count = jnp.where(moments['count'] >= 2, self.samples, 0)
    return member.task.combine_snapshots(outputs, count, member.logits(state, images))


def collect(moments, params):
  """The moments with `params` collected: the running mean and variance updated (Welford: the variance from the
  products of deviations from the old and the new mean, which never cancel), then the deviation from the new mean
  written over the oldest row of D (Maddox et al.'s `collect_model`)."""
  count = moments['count']
  weight = 1.0 / (count + 1).astype(jnp.float32)
  mean = jax.tree.map(lambda average, x: average + (x - average) * weight, moments['mean'], params)
  variance = jax.tree.map(lambda variance, x, old, new: variance + ((x - old) * (x - new) - variance) * weight,
                          moments['variance'], params, moments['mean'], mean)
  row = count % jax.tree.leaves(moments['deviations'])[0].shape[0]
  deviations = jax.tree.map(lambda rows, x, m: rows.at[row].set(x - m), moments['deviations'], params, mean)
  return {'count': count + 1, 'mean': mean, 'variance': variance, 'deviations': deviations}


def sample(moments, key: jax.Array):
  """One parameter set from the SWAG Gaussian N(mean, variance / 2 + D^T D / (2 (R - 1))), R = the filled rows of D
  (the unfilled rows are zeros, and add nothing).

  One normal draw for the whole tree, sliced into its leaves: a draw per leaf compiled 20x slower on CPU (the CNN's
  8 leaves: 14 s against 0.7 s), each draw being its own random-bits kernel.
  """
  leaves, treedef = jax.tree.flatten(moments['mean'])
  rank = jax.tree.leaves(moments['deviations'])[0].shape[0]
  normals = jax.random.normal(key, (rank + sum(leaf.size for leaf in leaves),))
  z2, ends = normals[:rank], np.cumsum([rank] + [leaf.size for leaf in leaves])
  z1 = [normals[start:end].reshape(leaf.shape) for start, end, leaf in zip(ends[:-1], ends[1:], leaves)]
  filled = jnp.minimum(moments['count'], rank)
  low_rank_scale = jax.lax.rsqrt(2.0 * jnp.maximum(filled - 1, 1).astype(jnp.float32))

  def leaf(mean, variance, deviations, z):
    # sqrt's derivative is infinite at 0, where a weight that never moved has its variance: 0 there, so that a
    # gradient with respect to the moments (`Ensemble.apply`) stays finite.
    half = jnp.maximum(variance, 0.0) / 2
    std = jnp.where(half > 0, jnp.sqrt(jnp.where(half > 0, half, 1.0)), 0.0)
    low_rank = jnp.tensordot(z2, deviations, axes=1) * low_rank_scale
    return (mean + std * z + low_rank).astype(mean.dtype)
  return jax.tree.map(leaf, moments['mean'], moments['variance'], moments['deviations'],
                      jax.tree.unflatten(treedef, z1))
