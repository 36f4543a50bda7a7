"""What one ensemble member computes: init, train step, eval step.

Written once for every backend. Each function sees a single member; a backend
maps it over members (vmap, and pmap over devices) and passes the names of the
mapped axes as `axis_name`, so `lax.pmean` over them averages the members'
probabilities into the ensemble prediction wherever the members live.
"""

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from ensemble import keys, optim, sharing
from ensemble.data import augment as augment_lib
from ensemble.keys import member_keys  # also where the backends and tests find it
from ensemble.methods import adversarial
from ensemble.methods.independent import Independent
from ensemble.tasks import classification
# The classification task's functions, where the backends and tests have always found them.
from ensemble.tasks.classification import cross_entropy, ensemble_probs, eval_outputs, log_mean_exp  # noqa: F401

AxisName = str | Sequence[str]
Metrics = dict[str, jnp.ndarray]


class TrainState(train_state.TrainState):
  """One member's state: flax's TrainState plus what makes the member its own network.

  `batch_stats` holds the model's variables besides its parameters: for most
  models BatchNorm's running averages, linen's 'batch_stats' collection as it
  is ({} without BatchNorm); for a model with other collections (a constant,
  a count that it updates in training), every one of them by name,
  {'batch_stats': ..., 'constants': ...}. The optimizer leaves them alone; a
  train step keeps what the model changed (`Member.apply`), and checkpoints,
  snapshots and warm starts keep them with the parameters. `key` is the
  member's random key as raw key data (a plain uint32 array that checkpoints
  store like any other): each step's augmentation and dropout keys are folded
  from it and the step, so they depend on the seed, the member index and the
  step only, and an exact resume draws the same ones.
  `snapshots` holds what a method keeps besides the parameters (a snapshot
  ensemble's snapshots; {} for the others).
  """
  batch_stats: Any
  key: jax.Array
  snapshots: Any = struct.field(default_factory=dict)
  # The run's `optim.horizon` (its steps, warmup, ...), which the schedule reads: data, not a constant of the
  # programs, so that fits of other lengths share them. Each run sets it (`loop.with_run`; a fresh member has
  # the one it was built for); all zeros (a checkpoint's from before it existed): the optimizer's own.
  horizon: jax.Array = struct.field(default_factory=lambda: jnp.zeros(len(optim.HORIZON), jnp.int32))
  # Images': the per-channel {'mean', 'std'} the run's training split gives (`Member.standardize`), data of the
  # programs as the horizon is, so that fits on other images share them (zeros: the member's own, from the data's
  # description). {} for other inputs.
  inputs: Any = struct.field(default_factory=dict)

  def apply_gradients(self, *, grads, **kwargs):
    """flax's, with the member's horizon passed to the optimizer (`optim.scale_by_rate`)."""
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params, horizon=self.horizon)
    return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates), opt_state=opt_state,
                        **kwargs)


# What a member's inputs are, which decides how they are prepared on the device (`Member.prepare`).
INPUTS = ('images', 'features', 'tokens')


@dataclasses.dataclass(frozen=True, eq=False)
class Member:
  """What every member is: its model, its optimizer, and how its inputs are prepared.

  One object describes all members; they differ only in their `TrainState`.
  `inputs` says what the model takes. 'images' arrive as uint8 pixels (or
  floats in [0, 1]), are augmented and normalised with the training split's
  per-channel `mean` and `std` on the device. 'features' are floats, centred
  and scaled per feature by `mean` and `std` when those have one value per
  feature (a run that standardises them), else passed as they are. 'tokens'
  are integer ids, passed as int32. `image_shape` is the shape of one input
  of any kind. `model` is a linen Module that takes `train`, or one of
  `models.user`'s wrappers (a user's linen or NNX model). `method`
  (ensemble/methods/) is the ensembling method: how a member starts, what it
  keeps after each step and what it predicts. `task` (ensemble/tasks/) says
  what the outputs mean: the loss, and how the members' outputs combine.
  """
  model: Any
  tx: optax.GradientTransformation
  image_shape: tuple[int, ...]
  mean: tuple[float, ...] = (0.0,)
  std: tuple[float, ...] = (1.0,)
  augment: str = 'none'
  method: Any = Independent()
  inputs: str = 'images'
  dtype: str = 'float32'  # of the forward pass (`apply`); the state is float32 either way
  task: Any = classification.Classification()
  adversarial_epsilon: float = 0.0  # > 0: each step also trains on FGSM's perturbed inputs (methods/adversarial.py)
  frozen: tuple[str, ...] = ()  # module paths of parameters not trained (ensemble/sharing.py)
  adapter_rank: int = 0  # > 0: each member a rank-r adapter of the shared kernels (ensemble/sharing.py)
  positions: tuple[int, ...] = ()  # a dense task's: the labels' shape per input, a class at each position
  # The horizon a fresh member's state starts with (`optim.horizon` of the run it was built for): a run sets its
  # own (`loop.with_run`), so that one program serves runs of any length; () leaves it to the optimizer's own.
  horizon: tuple[int, ...] = ()

  def prepare(self, images: jnp.ndarray, key: jax.Array | None = None, stats: Any = None) -> jnp.ndarray:
    """Inputs as they arrive -> the model's input; images with a `key` are augmented first (training only).
    `stats`: a state's `inputs` (`standardize`)."""
    return self.standardize(self.unstandardized(images, key), stats)

  def unstandardized(self, images: jnp.ndarray, key: jax.Array | None = None) -> jnp.ndarray:
    """The first half of `prepare`: images as floats in [0, 1] (augmented, with a `key`), features as float32,
    token ids as int32. Adversarial training perturbs the inputs here, in the units of their range."""
    if self.inputs == 'tokens':
      return images.astype(jnp.int32)
    if self.inputs == 'features':
      return images.astype(jnp.float32)
    images = augment_lib.to_unit_range(images)
    transform = augment_lib.AUGMENTATIONS[self.augment]
    if key is not None and transform is not None:
      images = transform(key, images)
    return images

  def standardize(self, inputs: jnp.ndarray, stats: Any = None) -> jnp.ndarray:
    """The second half of `prepare`: images per channel, features per feature when `mean` and `std` have one value
    per feature; token ids as they are. Images by `stats` (a state's `inputs`: the run's statistics, arguments of
    the programs) where it holds them, else by the member's own."""
    if self.inputs == 'tokens':
      return inputs
    mean, std = self._per_input(self.mean, inputs), self._per_input(self.std, inputs)
    if stats:
      given = stats['std'] > 0  # zeros: a restored state, which no run set
      mean, std = jnp.where(given, stats['mean'], jnp.asarray(mean)), jnp.where(given, stats['std'], jnp.asarray(std))
    return augment_lib.normalize(inputs, mean, std)

  def input_stats(self, mean: Any, std: Any) -> dict[str, jax.Array]:
    """A state's `inputs` for these per-channel statistics: images' only ({} for other inputs)."""
    if self.inputs != 'images':
      return {}
    return {'mean': jnp.asarray(mean, jnp.float32), 'std': jnp.asarray(std, jnp.float32)}

  def _per_input(self, stats: tuple[float, ...], inputs: jnp.ndarray):
    """Features' per-feature statistics shaped as one input; a channel's or a single value as they are."""
    return jnp.reshape(jnp.asarray(stats), inputs.shape[1:]) if self.inputs == 'features' and len(stats) > 1 else stats

  def input_range(self, inputs: jnp.ndarray):
    """The range of each input dimension, in `unstandardized` units: what `adversarial_epsilon` is a fraction of.

    Images: 1, the pixel range [0, 1] (255 in uint8 units). Features: their
    training split's standard deviation times `adversarial.FEATURE_RANGE_IN_STDS`,
    as the data's description keeps a feature's mean and standard deviation,
    not its minimum and maximum (features that the host standardised arrive here
    with a standard deviation of 1).
    """
    if self.inputs == 'images':
      return 1.0
    return adversarial.FEATURE_RANGE_IN_STDS * jnp.asarray(self._per_input(self.std, inputs), jnp.float32)

  def example_input(self) -> jnp.ndarray:
    """One prepared input of zeros: what `init` traces the model with."""
    return jnp.zeros((1, *self.image_shape), jnp.int32 if self.inputs == 'tokens' else jnp.float32)

  def init_variables(self, key: jax.Array) -> dict[str, Any]:
    return self.model.init(key, self.method.model_input(self.example_input()), train=False)

  def initial_params(self, key: jax.Array) -> Any:
    """The model's parameters drawn from `key`, with the member's adapters where it has them."""
    variables = self.init_variables(key)
    return sharing.with_adapters(self.method.shared_filters, self.adapter_rank, variables['params'],
                                 jax.random.fold_in(key, 1)), variables

  def init(self, key: jax.Array, seed_key: jax.Array | None = None) -> TrainState:
    """A fresh member from its key: the parameters from one half, the member's own `key` from the other.
    `seed_key` is the seed's key (`keys.seed_key`), which the members' keys are split from: what a method draws the
    weights that all members share from (`method.init`), an argument so that a program serves every seed; None:
    seed 0's."""
    init_key, own_key = jax.random.split(key)
    params, variables = self.initial_params(init_key)
    state = TrainState.create(apply_fn=self.model.apply, params=params, tx=self.tx,
                              batch_stats=_held(variables), key=jax.random.key_data(own_key),
                              horizon=jnp.asarray(self.horizon or (0,) * len(optim.HORIZON), jnp.int32),
                              inputs=self.input_stats(self.mean, self.std))
    # A typed step, as a trained or restored state has (flax's 0 is weakly typed): one program serves all three.
    state = state.replace(step=jnp.zeros((), jnp.int32))
    return self.method.init(self, state, key, keys.seed_key(0) if seed_key is None else seed_key)

  @functools.cached_property
  def _collection_names(self) -> tuple[str, ...]:
    """The model's collections besides 'params', from its initialisation traced once: what decides how
    `TrainState.batch_stats` holds them."""
    return tuple(name for name in jax.eval_shape(self.init_variables, jax.random.key(0)) if name != 'params')

  def _collections(self, batch_stats: Any) -> dict[str, Any]:
    """`TrainState.batch_stats` -> the model's collections besides 'params', by name."""
    if not batch_stats:
      return {}
    return dict(batch_stats) if set(self._collection_names) - {'batch_stats'} else {'batch_stats': batch_stats}

  def apply(self, state: TrainState, params, images: jnp.ndarray, *, train: bool,
            key: jax.Array | None = None) -> tuple[jnp.ndarray, Any]:
    """(logits, the model's other variables as `TrainState.batch_stats` holds them).

    In training every collection is mutable, and comes back as the model
    left it: BatchNorm's statistics updated from this batch, a counter
    counted, a constant as it was. Otherwise nothing changes (the running
    averages serve).

    With `dtype` bfloat16 the forward pass sees the parameters, inputs and
    other variables cast to bfloat16, so that its activations and matmuls run
    in it, while the state stays float32: the gradients flow back through the
    casts as float32, and the logits (for the loss) and the updated variables
    come back as float32. float32 casts nothing; integers (counters) stay.
    """
    compute = functools.partial(_cast_floats, dtype=jnp.dtype(self.dtype))
    collections = self._collections(state.batch_stats)
    sent = compute(collections)
    variables = {'params': compute(sharing.merged(params)), **sent}
    images, rngs = compute(images), ({} if key is None else {'dropout': key})
    if not collections:
      return _float32(state.apply_fn(variables, images, train=train, rngs=rngs)), state.batch_stats
    if not train:
      return _float32(state.apply_fn(variables, images, train=False, rngs=rngs)), state.batch_stats
    logits, updates = state.apply_fn(variables, images, train=True, rngs=rngs, mutable=list(collections))
    if self.dtype == 'float32':  # nothing was cast: the updates are the state
      return _float32(logits), _held(dict(updates))
    # What the model left as it was sent keeps its float32 value: a constant is not rounded to bfloat16.
    kept = lambda new, sent, old: jnp.where(new == sent, old, new.astype(old.dtype))
    return _float32(logits), _held(jax.tree.map(kept, dict(updates), sent, collections))

  def train_step(self, state: TrainState, images: jnp.ndarray, labels: jnp.ndarray) -> tuple[TrainState, Metrics]:
    """One optimizer step of one member on its batch, augmented with the member's own key for this step.

    Members train independently (that is what makes a deep ensemble), so there
    is no collective here: the ensemble only meets at prediction time. Methods
    whose members share weights split the step in two (`gradients`, then
    `update`) and average the shared gradients in between (`backends.train_functions`).
    """
    return self.update(state, *self.gradients(state, images, labels))

  def gradients(self, state: TrainState, images: jnp.ndarray,
                labels: jnp.ndarray) -> tuple[Any, tuple[Any, Metrics]]:
    """(gradients, (updated batch statistics, metrics)) of one member's step. With `adversarial_epsilon`, the
    gradients are the mean of the clean batch's and of its FGSM examples' (methods/adversarial.py); the statistics
    and metrics are the clean batch's."""
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    augment_key, dropout_key = jax.random.split(step_key)
    inputs = self.unstandardized(images, augment_key)

    def loss_fn(params, inputs):  # the method's grouping (MIMO's) inside: FGSM perturbs the batch as it arrived
      params = sharing.stop_frozen(self.frozen, params)
      model_inputs, model_labels = self.method.training_batch(self.standardize(inputs, state.inputs), labels)
      logits, batch_stats = self.apply(state, params, model_inputs, train=True, key=dropout_key)
      batch_stats = sharing.kept_frozen(self.frozen, state.batch_stats, batch_stats)  # a frozen module's too
      loss, metrics = self.method.loss(self.task, logits, model_labels)
      return loss, (metrics, batch_stats)

    if not self.adversarial_epsilon:
      (_, (metrics, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, inputs)
      return grads, (batch_stats, metrics)
    # One backward pass gives the clean loss's gradients for the parameters and for the inputs, which FGSM needs.
    (_, (metrics, batch_stats)), (grads, input_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state.params, inputs)
    perturbed = adversarial.fgsm(inputs, input_grads, self.adversarial_epsilon * self.input_range(inputs))
    perturbed_grads = jax.grad(lambda params: loss_fn(params, perturbed)[0])(state.params)
    return adversarial.mean_of(grads, perturbed_grads), (batch_stats, metrics)

  def update(self, state: TrainState, grads, aux: tuple[Any, Metrics]) -> tuple[TrainState, Metrics]:
    """Applies a step's gradients; the method then keeps what it keeps (a snapshot at a cycle's end)."""
    batch_stats, metrics = aux
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return self.method.after_update(state), metrics

  def predict(self, state: TrainState, images: jnp.ndarray) -> jnp.ndarray:
    """One member's logits (or log-probabilities) at test time: shared by evaluation, the eval step and export."""
    return self.method.predict(self, state, images)

  def logits(self, state: TrainState, images: jnp.ndarray, key: jax.Array | None = None) -> jnp.ndarray:
    """The logits of the member's current parameters (BatchNorm's running averages); `key` seeds the model's
    'dropout' stream, for MC dropout's passes (methods/mc_dropout.py)."""
    logits, _ = self.apply(state, state.params, self.prepare(images, stats=state.inputs), train=False, key=key)
    return logits

  def eval_step(self, state: TrainState, images: jnp.ndarray, labels: jnp.ndarray, *,
                axis_name: AxisName) -> Metrics:
    """Per-example losses and hits of this member and of the whole ensemble."""
    return self.task.eval_outputs(self.predict(state, images), labels, axis_name=axis_name)

  def abstract_ensemble_state(self, ensemble_size: int) -> Any:
    """Shapes and dtypes of the stacked (K, ...) ensemble state, computed without allocating it."""
    return jax.eval_shape(jax.vmap(self.init), jax.eval_shape(lambda: member_keys(0, ensemble_size)))


def _held(variables: dict[str, Any]) -> Any:
  """A model's variables besides 'params' as `TrainState.batch_stats` holds them: the 'batch_stats' collection
  alone where it is the only one (as checkpoints have always held it), else every collection by name."""
  collections = {name: tree for name, tree in variables.items() if name != 'params'}
  return collections if set(collections) - {'batch_stats'} else collections.get('batch_stats', {})


def _cast_floats(tree: Any, dtype: jnp.dtype) -> Any:
  """`tree`'s floating-point leaves as `dtype`; integer leaves (token ids, counters) as they are."""
  if dtype == jnp.float32:
    return tree
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _float32(logits: jnp.ndarray) -> jnp.ndarray:
  return logits.astype(jnp.float32)


def train_steps(state: TrainState, images: jnp.ndarray, labels: jnp.ndarray,
                indices: jnp.ndarray, step_fn, unroll: bool = False) -> tuple[TrainState, Metrics]:
  """`len(indices)` train steps in one program, on batches gathered from a resident training set.

  The fast path: the training set stays on the device, so the chunk's batches
  cost one on-device gather instead of host-to-device copies, and one dispatch
  and one host sync serve many steps. Each step is `step_fn` (a member's
  `train_step`, or the mesh backend's `data_parallel_step`), so results match
  the plain path. The gather happens before the loop: a dataset referenced
  inside the scan body rides in the loop state, and XLA on CPU copied it every
  iteration (14x slower).

  `unroll` traces the steps one after another instead of as a `lax.scan`
  loop; backends set it on CPU (see `backends.unrolls`).
  """
  batches = (images[indices], labels[indices])
  step = lambda state, batch: step_fn(state, *batch)
  if not unroll:
    return jax.lax.scan(step, state, batches)
  outputs = []
  for i in range(len(indices)):
    state, output = step(state, (batches[0][i], batches[1][i]))
    outputs.append(output)
  return state, stack(outputs)


def stack(trees: Sequence[Any]) -> Any:
  """Equally shaped pytrees -> one pytree with a new leading axis: what a traced loop would return."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)

