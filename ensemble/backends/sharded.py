"""The mesh backends: one model, not an ensemble, split over a ('data', 'model') device mesh.

- 'sharded': `jax.jit` with the shardings the model's parameter annotations ask
  for (the MLP: batch over 'data', hidden units over 'model'); XLA's SPMD
  partitioner inserts the collectives.
- 'dp' and 'fsdp': `shard_map` over 'data' with explicit collectives
  (`parallel.fsdp`): parameters and optimizer state replicated, or sharded.

The state lives in its sharded layout, which is also the checkpoint layout:
every leaf one global array of the model's full shape, so a checkpoint
restores onto any mesh whose axes divide it, and an FSDP checkpoint resumes
under DP. To the trainer the model is an ensemble of one: outputs carry a
leading member axis of size 1, and its ensemble metrics apply unchanged.
"""

import contextlib
import copy
import dataclasses
import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ensemble import steps, tasks
from ensemble.backends import ENSEMBLE_AXIS, MESH_MODELS, jit, train_program
from ensemble.errors import UsageError
from ensemble.keys import seed_key
from ensemble.parallel import DATA_AXIS, MESH_AXES, fsdp, logical


def data_parallel_step(state: steps.TrainState, images: jnp.ndarray, labels: jnp.ndarray, *, axis_name: str,
                       num_minibatches: int, dropout_key: jax.Array) -> tuple[steps.TrainState, steps.Metrics]:
  """One SGD step on the global batch, of which this device holds its slice.

  The slice is processed in `num_minibatches` chunks whose gradients are
  averaged (memory for activations scales with the chunk). Dropout keys are
  a function of (dropout_key, step, device index on the data axis, chunk):
  every device drops different units, and a rerun drops the same ones.
  """
  key = jax.random.fold_in(jax.random.fold_in(dropout_key, state.step), jax.lax.axis_index(axis_name))

  def loss_fn(params, images, labels, key):
    logits = state.apply_fn({'params': params}, images, train=True, rngs={'dropout': key})
    return steps.cross_entropy(logits, labels).mean(), jnp.mean(jnp.argmax(logits, -1) == labels)

  def minibatch(grads, chunk):
    images, labels, index = chunk
    (loss, accuracy), chunk_grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, images, labels, jax.random.fold_in(key, index))
    return jax.tree.map(jnp.add, grads, chunk_grads), (loss, accuracy)

  chunks = (images.reshape(num_minibatches, -1, *images.shape[1:]),
            labels.reshape(num_minibatches, -1), jnp.arange(num_minibatches))
  zeros = jax.tree.map(jnp.zeros_like, state.params)
  grads, (losses, accuracies) = jax.lax.scan(minibatch, zeros, chunks)
  grads = fsdp.sync_gradients(jax.tree.map(lambda g: g / num_minibatches, grads), axis_name)
  metrics = jax.lax.pmean({'loss': losses.mean(), 'accuracy': accuracies.mean()}, axis_name)
  return state.apply_gradients(grads=grads), metrics


def make_mesh(mesh_shape: Sequence[int], devices: Sequence[jax.Device]) -> Mesh:
  """The ('data', 'model') mesh of a recipe's resolved `mesh_shape` (ensemble/recipe.py checked it against the
  devices)."""
  return Mesh(np.asarray(devices).reshape(tuple(mesh_shape)), MESH_AXES)


def bytes_on_device(tree: Any, device: jax.Device) -> int:
  """What `tree`'s arrays hold on `device`, read from their addressable shards."""
  return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
             if shard.device == device)


def _abstract(state: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def _ensemble_of_one(eval_step):
  """`member.eval_step` over a member axis of size 1, so the outputs are (1, batch) like an ensemble's."""
  evaluate = functools.partial(eval_step, axis_name=ENSEMBLE_AXIS)
  return jax.vmap(evaluate, in_axes=(None, None, None), axis_size=1, axis_name=ENSEMBLE_AXIS)


def _with_member_axis(metrics: steps.Metrics) -> steps.Metrics:
  return {name: value[None] for name, value in metrics.items()}


def _as_ensemble_of_one(step_fn):
  """A train step whose metrics carry a member axis of size 1, like an ensemble's."""
  def step(*args):
    state, metrics = step_fn(*args)
    return state, _with_member_axis(metrics)
  return step


class _MeshBackend:
  """What the mesh backends share: the mesh, batches split over 'data', the trainer's interface."""

  def __init__(self, *, devices: Sequence[jax.Device], config, ensemble_size: int, member_data: str):
    del ensemble_size, member_data  # one model, shared batches, no augmentation: ensemble/recipe.py checked
    self.devices = list(devices)
    self.mesh = make_mesh(config.mesh_shape, devices)
    self._batch = NamedSharding(self.mesh, P(DATA_AXIS))
    self._replicated = NamedSharding(self.mesh, P())
    # Examples on the second axis: (member, example) outputs, (step, example) batch indices.
    self._by_column = NamedSharding(self.mesh, P(None, DATA_AXIS))
    self._rules = None  # logical axis rules, for models annotated with logical axes

  def _context(self):
    """Where the model's sharding constraints find the mesh (and logical rules) when traced."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    if self._rules is not None:
      stack.enter_context(nn.logical_axis_rules(self._rules))
    return stack

  def _log_bytes(self, state):
    device = self.mesh.devices.flat[0]
    logging.info('Per device: %d parameter bytes, %d optimizer-state bytes (%s mesh %s).',
                 bytes_on_device(state.params, device), bytes_on_device(state.opt_state, device),
                 type(self).__name__, dict(self.mesh.shape))

  def init(self, seed: int) -> steps.TrainState:
    with self._context():
      state = self._init(steps.member_keys(seed, 1)[0], seed_key(seed))
    self._log_bytes(state)
    return state

  def abstract_state(self):
    return self._abstract

  def train_step(self, state, images: np.ndarray, labels: np.ndarray):
    with self._context():
      return self._train(state, images, labels)

  def train_steps(self, state, dataset, indices: np.ndarray):
    """The fast path: `indices` (S, batch) of the resident `dataset`, S steps in one program."""
    with self._context():
      return self._train_steps(state, *dataset, indices)

  def eval_step(self, state, images: np.ndarray, labels: np.ndarray) -> steps.Metrics:
    with self._context():
      return self._eval(state, images, labels)

  # As under the jit backend, the resident training set is replicated.
  put_dataset = jit.JitBackend.put_dataset
  to_host = jit.JitBackend.to_host

  def to_canonical(self, state):
    """The state already is global arrays in their checkpoint layout."""
    return state

  def from_canonical(self, state):
    return state


class AnnotatedBackend(_MeshBackend):
  """`jax.jit` with each parameter sharded as its annotation asks ('sharded')."""

  def __init__(self, *, member: steps.Member, devices, config, **kwargs):
    super().__init__(devices=devices, config=config, **kwargs)
    if config.logical:
      self._rules = logical.check_rules(config.logical_axis_rules)
    create = member.init
    with self._context():
      boxed = jax.eval_shape(create, jax.random.key(0))  # the seed's key left at seed 0's: shapes alike
    specs = nn.get_partition_spec(boxed)
    shardings = (nn.logical_to_mesh_sharding(specs, self.mesh, self._rules) if config.logical
                 else nn.get_sharding(boxed, self.mesh))
    state = nn.meta.unbox(boxed)
    self._check_divisible(state.params, shardings.params)
    self._abstract = _abstract(state, shardings)
    # The state is created sharded: no device ever holds all the parameters.
    self._init = jax.jit(lambda key, seed: nn.meta.unbox(create(key, seed)), out_shardings=shardings)
    self._train = train_program(jax.jit(
        _as_ensemble_of_one(member.train_step), in_shardings=(shardings, self._batch, self._batch),
        out_shardings=(shardings, self._replicated), donate_argnums=0), devices, config)
    self._train_steps = train_program(jax.jit(
        _as_ensemble_of_one(functools.partial(steps.train_steps, step_fn=member.train_step)),
        in_shardings=(shardings, *(self._replicated,) * 3), out_shardings=(shardings, self._replicated),
        donate_argnums=0), devices, config)
    self._eval = jax.jit(_ensemble_of_one(member.eval_step),
                         in_shardings=(shardings, self._batch, self._batch), out_shardings=self._by_column)

  def _check_divisible(self, params, shardings):
    flat_params = traverse_util.flatten_dict(params, sep='/')
    for path, sharding in traverse_util.flatten_dict(shardings, sep='/').items():
      shape = flat_params[path].shape
      for dim, axes in enumerate(sharding.spec):
        devices = math.prod(self.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        if shape[dim] % devices:
          raise UsageError(f'params/{path} has shape {shape}: its dimension {dim} cannot be split over '
                           f'{devices} devices of mesh axis {axes!r}; set --config.depth to a multiple of '
                           f'{devices}, or change --config.mesh_shape')


class ShardMapBackend(_MeshBackend):
  """`shard_map` over 'data': replicated parameters ('dp') or sharded ones ('fsdp')."""

  def __init__(self, *, member: steps.Member, devices, config, shard_params: bool, **kwargs):
    super().__init__(devices=devices, config=config, **kwargs)
    if shard_params:
      member = dataclasses.replace(
          member, model=member.model.clone(fsdp_axis=DATA_AXIS, min_weight_size=config.min_weight_size))
    shard = functools.partial(jax.shard_map, mesh=self.mesh, check_vma=False)
    create = member.init
    # One device's view of the state: boxes name the axis of every sharded weight.
    local = jax.eval_shape(shard(create, in_specs=P(), out_specs=P()), jax.random.key(0))
    specs = nn.get_partition_spec(local)
    # Inside shard_map a step sees its device's slices, boxed again so the model knows to gather them.
    rebox = functools.partial(fsdp.rebox, local)

    # The dropout keys are folded from the seed's key, an argument of the training programs (the run's, which
    # `with_seed` sets), so that they serve every seed.
    self._seed = jax.device_put(seed_key(config.seed), self._replicated)
    fsdp_step = functools.partial(data_parallel_step, axis_name=DATA_AXIS, num_minibatches=config.num_minibatches)

    def train(state, images, labels, seed):
      state, metrics = fsdp_step(rebox(state), member.prepare(images, stats=state.inputs), labels, dropout_key=seed)
      return fsdp.unbox(state), _with_member_axis(metrics)

    def train_many(state, images, labels, indices, seed):  # indices: this device's columns of each batch
      step = lambda state, images, labels: fsdp_step(state, member.prepare(images, stats=state.inputs), labels,
                                                      dropout_key=seed)
      state, metrics = steps.train_steps(rebox(state), images, labels, indices, step_fn=step)
      return fsdp.unbox(state), _with_member_axis(metrics)

    def evaluate(state, images, labels):
      return _ensemble_of_one(member.eval_step)(rebox(state), images, labels)

    init = shard(lambda key, seed: fsdp.unbox(create(key, seed)), in_specs=(P(), P()), out_specs=specs)
    shardings = nn.get_sharding(local, self.mesh)
    self._abstract = _abstract(jax.eval_shape(init, jax.random.key(0), jax.random.key(0)), shardings)
    self._init = jax.jit(init, out_shardings=shardings)
    self._train = train_program(jax.jit(
        shard(train, in_specs=(specs, P(DATA_AXIS), P(DATA_AXIS), P()), out_specs=(specs, P())),
        in_shardings=(shardings, self._batch, self._batch, self._replicated),
        out_shardings=(shardings, self._replicated), donate_argnums=0), devices, config)
    columns = self._by_column.spec
    self._train_steps = train_program(jax.jit(
        shard(train_many, in_specs=(specs, P(), P(), columns, P()), out_specs=(specs, P())),
        in_shardings=(shardings, self._replicated, self._replicated, self._by_column, self._replicated),
        out_shardings=(shardings, self._replicated), donate_argnums=0), devices, config)
    self._eval = jax.jit(shard(evaluate, in_specs=(specs, P(DATA_AXIS), P(DATA_AXIS)), out_specs=columns),
                         in_shardings=(shardings, self._batch, self._batch), out_shardings=self._by_column)

  def with_seed(self, seed: int) -> 'ShardMapBackend':
    """This backend for a run of `seed`: its programs, given that seed's key (`backends.for_seed`)."""
    run = copy.copy(self)
    run._seed = jax.device_put(seed_key(seed), self._replicated)  # pylint: disable=protected-access
    return run

  def train_step(self, state, images: np.ndarray, labels: np.ndarray):
    with self._context():
      return self._train(state, images, labels, self._seed)

  def train_steps(self, state, dataset, indices: np.ndarray):
    """The fast path: `indices` (S, batch) of the resident `dataset`, S steps in one program."""
    with self._context():
      return self._train_steps(state, *dataset, indices, self._seed)


BACKENDS = {
    'sharded': AnnotatedBackend,
    'dp': functools.partial(ShardMapBackend, shard_params=False),
    'fsdp': functools.partial(ShardMapBackend, shard_params=True),
}


def resolved(r, devices: Sequence[jax.Device]) -> dict[str, Any]:
  """A mesh backend splits one model over all the devices: an ensemble of one, the model its placement is written
  for, on plain batches; its mesh's shape resolved (ensemble/recipe.py asks, with the other rules)."""
  backend, model = r.backend, MESH_MODELS[r.backend]
  example = f"configs/{'mlp' if backend == 'sharded' else backend}.py"
  plain = f'backend {backend!r} trains one model on plain batches: set'
  n = len(devices)
  fix = f'set --config.mesh_shape to a (data, model) pair whose product is {n}, e.g. ({n}, 1) or (-1, 1)'
  refusals = [
      (not (r.mesh_shape and r.num_layers),
       f'backend {backend!r} needs the mesh fields (mesh_shape, ...) of {example}: run with --config={example}'),
      (r.model != model, f'backend {backend!r} trains model {model!r}, not {r.model!r}: set --config.model={model}'),
      (r.ensemble_size not in (0, 1), f'backend {backend!r} trains one model, not an ensemble: set '
                                      '--config.ensemble_size=1, or use backend pmap or jit for ensembles'),
      (r.method != 'independent', f'backend {backend!r} trains one model, not an ensemble: leave --config.method at '
                                  'independent, or use backend pmap or jit for the ensembling methods'),
      (r.member_data != 'shared', f'backend {backend!r} trains one model: set --config.member_data=shared'),
      (r.task != tasks.DEFAULT,
       f'backend {backend!r} trains one classifier: use backend pmap or jit for --config.task={r.task}'),
      (r.augment != 'none', f'{plain} --config.augment=none, or use backend pmap or jit for augmented training'),
      (r.adversarial_epsilon, f'{plain} --config.adversarial_epsilon=0, or use backend pmap or jit for adversarial '
                              'training'),
      (jax.process_count() != 1,
       f'backend {backend!r} runs in a single process; use backend pmap or jit across processes')]
  shape = r.mesh_shape
  if not any(refused for refused, _ in refusals) and -1 in shape:
    known = max(shape)
    refusals.append((n % known, f'mesh_shape={shape!r}: {known} does not divide the {n} devices in use; {fix}'))
    shape = tuple(n // known if s == -1 else s for s in shape)
  for refused, message in refusals:
    if refused:
      raise UsageError(message)
  if math.prod(shape) != n:
    raise UsageError(f'mesh_shape={r.mesh_shape} has {math.prod(shape)} devices but {n} are in use; {fix}, or use '
                     '--config.num_devices')
  for name in ('batch_size', 'eval_batch_size'):
    if getattr(r, name) % shape[0]:
      raise UsageError(f'{name}={getattr(r, name)} cannot be split over the {shape[0]} devices of the data axis; set '
                       f'--config.{name} to a multiple of {shape[0]}')
  if backend in ('dp', 'fsdp'):
    if shape != (n, 1):
      raise UsageError(f'mesh_shape={r.mesh_shape}: dp and fsdp split over the data axis only; set '
                       f'--config.mesh_shape=({n}, 1)')
    per_device = r.batch_size // n
    if per_device % r.num_minibatches:
      raise UsageError(f'num_minibatches={r.num_minibatches} does not divide the {per_device} examples each device '
                       f'gets per step; set --config.num_minibatches to a divisor of {per_device}')
  return {'ensemble_size': 1, 'mesh_shape': shape}
