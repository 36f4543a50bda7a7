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
  sq_mean      running mean of their squares (the diagonal second moment)
  deviations   the last `swag_rank` of theta_i - mean_i (mean_i: the mean after collection i), a ring buffer,
               the rows of Maddox et al.'s deviation matrix D

At prediction a member draws `swag_samples` parameter sets (Maddox et al. eq. 1-2, with scale 1/2)
  theta = mean + sqrt(var / 2) * z1 + D^T z2 / sqrt(2 (R - 1)),   var = max(sq_mean - mean^2, 0),
R the filled rows of D, under keys fixed by the member's key, and combines their outputs as the task combines
snapshots (`combine_snapshots`): classification the log of their mean probability, regression each sample a
mixture component. The ensemble's mean over K members is then the mean over all K x S samples. Before two
collections a member predicts with its current parameters.

SWAG recomputes BatchNorm's statistics for each sample with a pass over the training data; prediction here has no
training data, so every sample uses the member's running averages at the end of training.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ensemble import optim
from ensemble.errors import UsageError
from ensemble.methods.independent import Independent

# fold_in tag of a member's sampling key: its training steps fold the step number into the same key.
SAMPLE_KEY = 0x5357_4147


def _whole(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check(config):
  """Refuses MultiSWAG fields that cannot work, in one line each, before anything runs."""
  samples, rank, start, rate = config.swag_samples, config.swag_rank, config.swag_start, config.swag_learning_rate
  if not (_whole(samples) and samples >= 1):
    raise UsageError(f'swag_samples={samples!r} must be a whole number >= 1, the parameter samples each member '
                     'predicts with: set e.g. --config.swag_samples=10')
  if not (_whole(rank) and rank >= 2):
    raise UsageError(f'swag_rank={rank!r} must be a whole number >= 2, the deviations each member keeps for its '
                     'low-rank covariance: set e.g. --config.swag_rank=10')
  if not (isinstance(start, (int, float)) and not isinstance(start, bool) and 0 < start < 1):
    raise UsageError(f'swag_start={start!r} must be in (0, 1), the fraction of the run before the moments are '
                     'collected: set e.g. --config.swag_start=0.5')
  if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate)
          and 0 < rate <= config.learning_rate):
    raise UsageError(f'swag_learning_rate={rate!r} must be in (0, learning_rate={config.learning_rate}], the '
                     'constant rate of the collection phase: set e.g. '
                     f'--config.swag_learning_rate={config.learning_rate / 10:g}')
  if not config.get('num_train_steps', 0) and config.warmup_epochs >= start * config.num_epochs:
    raise UsageError(f'warmup_epochs={config.warmup_epochs} must end before the collection phase starts (epoch '
                     f'{start * config.num_epochs:g} of {config.num_epochs}): lower --config.warmup_epochs or '
                     'raise --config.swag_start')


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

  def init(self, member, state, key: jax.Array):
    del member, key
    zeros = lambda shape: (lambda x: jnp.zeros((*shape, *x.shape), x.dtype))
    return state.replace(snapshots={
        'count': jnp.zeros((), jnp.int32), 'mean': jax.tree.map(zeros(()), state.params),
        'sq_mean': jax.tree.map(zeros(()), state.params),
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
  """The moments with `params` collected: running means updated, then the deviation from the new mean written
  over the oldest row of D (Maddox et al.'s `collect_model`)."""
  count = moments['count']
  weight = 1.0 / (count + 1).astype(jnp.float32)
  running = lambda average, x: average + (x - average) * weight
  mean = jax.tree.map(running, moments['mean'], params)
  sq_mean = jax.tree.map(lambda average, x: running(average, x * x), moments['sq_mean'], params)
  row = count % jax.tree.leaves(moments['deviations'])[0].shape[0]
  deviations = jax.tree.map(lambda rows, x, m: rows.at[row].set(x - m), moments['deviations'], params, mean)
  return {'count': count + 1, 'mean': mean, 'sq_mean': sq_mean, 'deviations': deviations}


def sample(moments, key: jax.Array):
  """One parameter set from the SWAG Gaussian N(mean, var / 2 + D^T D / (2 (R - 1))), R = the filled rows of D
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

  def leaf(mean, sq_mean, deviations, z):
    std = jnp.sqrt(jnp.maximum(sq_mean - mean * mean, 0.0) / 2)
    low_rank = jnp.tensordot(z2, deviations, axes=1) * low_rank_scale
    return (mean + std * z + low_rank).astype(mean.dtype)
  return jax.tree.map(leaf, moments['mean'], moments['sq_mean'], moments['deviations'], jax.tree.unflatten(treedef, z1))
