"""Backends place the ensemble's members on devices and map `steps` over them.

Both keep the members' state stacked on a leading member axis of size K and
differ only in how that axis meets the devices. Their common currency is the
canonical layout: every leaf a global (K, ...) array sharded over a 1-D mesh
axis named 'ensemble'. Checkpoints store that layout, so they do not know
which backend wrote them.
"""

import functools
from typing import Any, Protocol, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ensemble import distributed, parallel, sharing, steps
from ensemble.data import stream
from ensemble.methods import batchensemble
from ensemble.parallel import fsdp, logical
from ensemble.errors import UsageError

ENSEMBLE_AXIS = 'ensemble'
DATA_AXIS = parallel.DATA_AXIS  # a member's own devices, when there are fewer members than devices (backend jit)
MODEL_AXIS = parallel.MODEL_AXIS  # a member's own devices under member_sharding=model
MEMBER_AXIS = 'member'  # the members that one device holds
# How a member's state lies on its devices when it has several (backend jit, fewer members than devices):
# 'replicated' (a copy on each), 'fsdp' (each leaf split over them, as parallel/fsdp.py splits one model) or
# 'model' (the leaves its model annotates split along 'model', as the mesh MLP's are; the others copied).
MEMBER_SHARDINGS = ('replicated', 'fsdp', 'model')
# Where the leaves that all members share lie (backend jit): a copy on each device, or split over all of them.
SHARED_SHARDINGS = ('replicated', 'fsdp')
# An fsdp member's leaves with fewer values stay whole, as configs/fsdp.py's min_weight_size keeps them.
FSDP_MIN_WEIGHT_SIZE = 2**14
NAMES = ('pmap', 'jit', 'sharded', 'dp', 'fsdp')
# The mesh backends (backends/sharded.py) train one model, not an ensemble, and
# each trains the model its placement is written for.
MESH_MODELS = {'sharded': 'mlp', 'dp': 'classifier', 'fsdp': 'classifier'}


def devices_per_member(ensemble_size: int | None, num_devices: int) -> int:
  """How many devices one member spans: 1 unless there are fewer members than devices."""
  return 1 if not ensemble_size or ensemble_size >= num_devices else num_devices // ensemble_size


def ensemble_mesh(devices: Sequence[jax.Device], ensemble_size: int | None = None,
                  layout: str = 'replicated') -> Mesh:
  """The 1-D 'ensemble' mesh; with fewer members than devices, ('ensemble', 'data'): a row of devices per member.

  A member's devices are adjacent, so on a multi-device host (and across
  processes) a member's gradient reductions stay on its closest devices.
  Under `layout` 'model' the row is ('data', 'model') of shape (1, D/K): the
  axes the mesh models' annotations and activation constraints name, the
  member's batch whole on each device and its annotated weights split.
  """
  per_member = devices_per_member(ensemble_size, len(devices))
  if per_member == 1:
    return Mesh(np.asarray(devices), (ENSEMBLE_AXIS,))
  if layout == 'model':
    return Mesh(np.asarray(devices).reshape(-1, 1, per_member), (ENSEMBLE_AXIS, DATA_AXIS, MODEL_AXIS))
  return Mesh(np.asarray(devices).reshape(-1, per_member), (ENSEMBLE_AXIS, DATA_AXIS))


def member_sharding(devices: Sequence[jax.Device], ensemble_size: int | None = None) -> NamedSharding:
  """The canonical sharding: members split in contiguous blocks over the devices (each on its row of them)."""
  return NamedSharding(ensemble_mesh(devices, ensemble_size), P(ENSEMBLE_AXIS))


def abstract_member_state(member: steps.Member, ensemble_size: int, devices: Sequence[jax.Device],
                          layout: str = 'replicated', rules=logical.DEFAULT_RULES):
  """The canonical ensemble state as shapes, dtypes and shardings: a restore target."""
  abstract = member.abstract_ensemble_state(ensemble_size)
  return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      abstract, state_shardings(abstract, devices, ensemble_size, layout, rules))


def _is_box(x) -> bool:
  return isinstance(x, nn.Partitioned)


def state_shardings(abstract_state: Any, devices: Sequence[jax.Device], ensemble_size: int,
                    layout: str = 'replicated', rules=logical.DEFAULT_RULES) -> Any:
  """Each (K, ...) leaf's sharding: members over 'ensemble', and within a member as `layout` says.

  fsdp splits a member's large leaves over its 'data' devices; model splits
  the leaves whose partitioning annotations map (by `rules`, for logical
  names) onto 'model', and copies the rest. Either way a leaf stays one
  global (K, ...) array, so checkpoints do not see the layout, and XLA
  gathers or partitions each member's computation as its weights lie.
  Annotated leaves keep their boxes, so the shardings mirror the state's tree.
  """
  mesh = ensemble_mesh(devices, ensemble_size, layout)
  per_member = devices_per_member(ensemble_size, len(devices))
  split_any = []

  def sharding(path, x):
    box, x = (x, x.value) if _is_box(x) else (None, x)
    spec = [None] * (len(x.shape) - 1)
    if layout == 'fsdp':
      dim = fsdp.split_dimension(x.shape[1:], per_member, FSDP_MIN_WEIGHT_SIZE)
      if dim is not None:
        spec[dim] = DATA_AXIS
    elif layout == 'model' and per_member > 1 and box is not None:
      for dim, name in enumerate(logical.mesh_axes(box, rules)):
        if name == MODEL_AXIS:
          if x.shape[1 + dim] % per_member:
            raise UsageError(f'{jax.tree_util.keystr(path)} has shape {x.shape[1:]}: its dimension {dim}, which '
                             f"its annotation splits over 'model', cannot be split over a member's {per_member} "
                             'devices; make it a multiple of that, or set --config.member_sharding=fsdp')
          spec[dim] = MODEL_AXIS
          split_any.append(path)
    named = NamedSharding(mesh, P(ENSEMBLE_AXIS, *spec))
    return box.replace_boxed(named) if box is not None else named

  shardings = jax.tree_util.tree_map_with_path(sharding, abstract_state, is_leaf=_is_box)
  if layout == 'model' and per_member > 1 and not split_any:
    raise UsageError("member_sharding=model splits the parameters a model annotates onto the 'model' mesh axis, "
                     "and this model annotates none: annotate its large weights with nn.with_logical_partitioning "
                     f'(mapped by --config.logical_axis_rules, now {tuple(rules)!r}) or nn.with_partitioning, '
                     'or set --config.member_sharding=fsdp')
  return shardings


def bytes_per_device(state: Any) -> int:
  """The state's bytes on its fullest device: what a layout costs each device."""
  per_device = {}
  for leaf in jax.tree.leaves(state):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values())


class SharedSplit:
  """The leaves that all members share split over all the devices (backend jit, shared_sharding=fsdp), as FSDP
  splits one model's.

  A shared leaf of the parameters or of their optimizer state is one (1, ...) global array split along its largest
  dimension that the device count divides (`fsdp.split_dimension`; leaves under `min_weight_size` values stay
  whole, a copy on each device), so each device stores 1/D of the shared part. A step gathers the shared
  parameters (not their optimizer state), computes every member's gradients with them, reduce-scatters the shared
  gradients' mean over all members, and updates each device's slice only: the optimizers (ensemble/optim.py)
  update every value alone, so the slices follow the replicated layout's trajectory. Inside `shard_map`, which
  maps 'ensemble' alone, the collectives run over 'ensemble', and XLA splits the rest over a member's other axes.
  """

  def __init__(self, method, abstract_state: Any, mesh: Mesh, min_weight_size: int):
    self._axis = ENSEMBLE_AXIS if mesh.shape[ENSEMBLE_AXIS] > 1 else None  # one member: no collective (see above)
    every_device = tuple(mesh.axis_names)

    def layout(path, x):
      """(the leaf's sharding, its spec inside shard_map, its split dimension or -1)."""
      if not method.is_shared_path(path):
        return x.sharding, P(ENSEMBLE_AXIS), -1
      splits = path[0].name in ('params', 'opt_state')  # a shared model variable (BatchNorm's) stays whole
      dim = fsdp.split_dimension(x.shape[1:], mesh.devices.size, min_weight_size) if splits else None
      if dim is None:
        return NamedSharding(mesh, P()), P(), -1
      spec = [None] * x.ndim
      return (NamedSharding(mesh, P(*spec[:dim + 1], every_device)),
              P(*spec[:dim + 1], ENSEMBLE_AXIS), dim + 1)

    paths, tree = jax.tree_util.tree_flatten_with_path(abstract_state)
    layouts = [layout(path, x) for path, x in paths]
    self.shardings, self.specs, self.dims = (tree.unflatten(part) for part in zip(*layouts))
    self._method = method

  def _map(self, fn, tree, dims):
    return jax.tree.map(lambda x, dim: x if dim < 0 or self._axis is None else fn(x, dim), tree, dims)

  def gather(self, params):
    """A device's slices of the shared parameters, (1, ...) each, whole."""
    return self._map(lambda x, dim: jax.lax.all_gather(x, self._axis, axis=dim, tiled=True), params,
                     self.dims.params)

  def gathering(self, fn):
    """`fn(state, ...)` fed the state with its shared parameters whole."""
    return lambda state, *args: fn(state.replace(params=self.gather(state.params)), *args)

  def slice(self, state):
    """A device's members' state, its shared leaves whole, with each split one cut to the device's slice."""
    def cut(x, dim):
      part = x.shape[dim] // jax.lax.axis_size(self._axis)
      return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self._axis) * part, part, axis=dim)
    return self._map(cut, state, self.dims)

  def average(self, grads):
    """A device's members' gradients (M, ...): the shared ones replaced by their mean over all members, those
    split cut to the device's slice (one reduce-scatter); `method.average_shared`'s for split leaves."""
    def average(grad, dim, shared):
      if not shared:
        return grad
      mean = jnp.mean(grad, axis=0)
      if self._axis is not None:
        mean = (jax.lax.pmean(mean, self._axis) if dim < 0 else
                jax.lax.psum_scatter(mean, self._axis, scatter_dimension=dim - 1, tiled=True)
                / jax.lax.axis_size(self._axis))
      return jnp.broadcast_to(mean, (grad.shape[0], *mean.shape))
    return jax.tree.map(average, grads, self.dims.params, self._method.shared(grads))


class Backend(Protocol):
  """What the trainer, the evaluator and the benchmark need from a backend; every backend implements it.

  A backend decides where the members live and how `steps.Member`'s functions
  are mapped over them; it never decides what they compute. `images` and
  `labels` are the rows of a batch that this process feeds
  (`distributed.process_rows` of `devices`): whole batches unless the devices
  span several processes.
  """
  devices: list[jax.Device]

  def init(self, seed: int) -> Any:
    """Every member's fresh state, in the backend's own layout."""

  def abstract_state(self) -> Any:
    """The canonical state as `jax.ShapeDtypeStruct`s with shardings: the restore target."""

  def train_step(self, state: Any, images: np.ndarray, labels: np.ndarray) -> tuple[Any, steps.Metrics]:
    """One step of every member; metrics per member."""

  def put_dataset(self, split: dict[str, np.ndarray]) -> Any:
    """The training split resident on the devices, for `train_steps`."""

  def train_steps(self, state: Any, dataset: Any, indices: np.ndarray) -> tuple[Any, steps.Metrics]:
    """The fast path: `len(indices)` steps on batches of the resident `dataset` in one program."""

  # Whether `train_epochs` serves (pmap and jit, in one process, each member on devices of its own).
  trains_epochs: bool

  def train_epochs(self, state: Any, dataset: Any, seed: int, first_epoch: int, num_epochs: int, num_examples: int,
                   steps_per_epoch: int, batch_size: int, bootstrap: bool) -> tuple[Any, steps.Metrics, jax.Array]:
    """A whole in-memory fit in one program: `num_epochs` epochs on the resident `dataset`, their orders drawn
    inside it (`EpochPrograms`); (state, metrics (K, epochs, steps), whether each member is finite (K,))."""

  def eval_step(self, state: Any, images: np.ndarray, labels: np.ndarray) -> steps.Metrics:
    """Per-example outputs of every member and of the ensemble, over the whole batch."""

  def to_host(self, tree: Any) -> Any:
    """Device outputs as numpy, member axis first, gathered from all processes."""

  def to_canonical(self, state: Any) -> Any:
    """The backend's layout -> the canonical (K, ...) layout that checkpoints store."""

  def from_canonical(self, state: Any) -> Any:
    """The canonical layout -> the backend's own."""


def _registry() -> dict[str, Any]:
  # Imported here so that `NAMES` stays importable without building any backend.
  from ensemble.backends import jit, pmap, sharded  # pylint: disable=g-import-not-at-top
  return {'pmap': pmap.PmapBackend, 'jit': jit.JitBackend, **sharded.BACKENDS}


def create(name: str, *, member: steps.Member, devices: Sequence[jax.Device], ensemble_size: int,
           member_data: str = 'shared', config=None) -> Backend:
  """The backend `name` for `ensemble_size` members on `devices`; the mesh backends also read `config`."""
  backends = _registry()
  if name not in backends:
    raise UsageError(f'unknown backend {name!r}: set --config.backend to one of {list(NAMES)}')
  return backends[name](member=member, devices=devices, ensemble_size=ensemble_size, member_data=member_data,
                        config=config)


def for_seed(backend: Backend, seed: int) -> Backend:
  """`backend` for a run of `seed`, whatever seed it was built for: itself, as its programs take the seed where
  they need it (`init`'s keys); for a backend whose training programs take the seed's key as well (dp and fsdp:
  their dropout keys), a copy that passes `seed`'s to the same programs (its `with_seed`)."""
  with_seed = getattr(backend, 'with_seed', None)
  return backend if with_seed is None else with_seed(seed)


def train_program(fn, devices: Sequence[jax.Device], config=None, member: steps.Member | None = None):
  """A jitted or pmapped training function as the backends run it: on CPU, compiled with XLA's own kernels.

  Since jaxlib 0.9, XLA:CPU hands convolutions, dots and the elementwise work
  around them to YNNPACK. On the CNN's train step its kernels ran 1.04-1.06x
  slower than XLA's own (one convolution's weight gradient is the slow part),
  while the test pass ran 2x faster with them (docs/speed.md): so the training
  programs go without and the others keep JAX's default.
  `config.xla_cpu_ynnpack` keeps the default for training too. Across
  processes the programs keep it as well: there pmap takes process-local
  arguments, which its ahead-of-time path does not. So does a `member`
  without convolutions (a small MLP's step: 42.1 ms a fit with YNNPACK, 43.0
  without, where `CompiledWith`'s Python dispatch costs more than the kernels),
  and one whose step runs its convolutions forward only (heads on a frozen
  convolutional backbone, `fit(frozen=...)`: 8 CNN heads trained in 7.9 s with
  YNNPACK, 13.2-15.3 s without).
  """
  if (devices[0].platform != 'cpu' or distributed.spans_processes(devices)
      or (config is not None and config.xla_cpu_ynnpack)
      or (member is not None and not trains_through_convolutions(member))):
    return fn
  return CompiledWith(fn, {'xla_cpu_experimental_ynn_fusion_type': ''})


class CompiledWith:
  """`fn` (jitted or pmapped) compiled with XLA `options`, once for each signature of its arguments.

  JAX takes XLA options for one program only on its ahead-of-time path
  (`lower(...).compile(options)`), which serves one signature; this keeps one
  program per signature, as `jax.jit` does. A jaxlib that does not know an
  option (YNNPACK's came with 0.9) compiles without it.
  """

  def __init__(self, fn, options: dict[str, Any]):
    self._fn, self._options = fn, options
    self.programs = {}  # signature -> compiled program

  def __call__(self, *args):
    leaves, tree = jax.tree.flatten(args)
    key = (tree, tuple((np.shape(x), getattr(x, 'dtype', type(x)), getattr(x, 'weak_type', False),
                        getattr(x, 'sharding', None)) for x in leaves))
    if key not in self.programs:
      self.programs[key] = self._compile(self._fn.lower(*args))
    return self.programs[key](*args)

  def lower(self, *args):
    """The function's own lowering (for inspecting a program), as `jax.jit`'s `lower`."""
    return self._fn.lower(*args)

  def _compile(self, lowered):
    try:
      return lowered.compile(self._options)
    except jax.errors.JaxRuntimeError as e:
      if 'No such compile option' not in str(e):
        raise
      return lowered.compile()


def unrolls(devices: Sequence[jax.Device], member: steps.Member | None = None) -> bool:
  """Whether loops over steps and members are traced unrolled: on CPU, for the convolutions' sake.

  XLA:CPU gives a convolution its fast kernel only outside loop bodies (inside
  one the weight gradients ran 10-15x slower), and runs the grouped convolution
  that `jax.vmap` makes of several members' convolutions 4x slower per member
  than separate ones. Accelerators run loops and grouped convolutions well,
  and loops compile faster; so do a CPU's for a `member` without convolutions
  (an MLP's, a sequence model's), whose steps then run as a `lax.scan`.
  """
  return devices[0].platform == 'cpu' and (member is None or has_convolutions(member))


def has_convolutions(member: steps.Member) -> bool:
  """Whether the member's forward pass convolves: read off its traced program, never run; kept per model (a
  linen Module is compared by its fields), input shape and method (which may shape the model's input: MIMO's)."""
  key = (member.model, member.image_shape, member.inputs, member.method)
  try:
    return _convolves(*key)
  except TypeError:  # a model that cannot be hashed (a field holding a list): traced every time
    return _convolves.__wrapped__(*key)


@functools.lru_cache(maxsize=64)
def _convolves(model, image_shape: tuple[int, ...], inputs: str, method) -> bool:
  example = jax.ShapeDtypeStruct((1, *image_shape), jax.numpy.int32 if inputs == 'tokens' else jax.numpy.float32)

  def forward(key, x):
    x = method.model_input(x)
    return model.apply(model.init(key, x, train=False), x, train=False)
  try:
    return 'conv_general_dilated' in str(jax.make_jaxpr(forward)(jax.random.key(0), example))
  except Exception:  # pylint: disable=broad-except  # traceable only in its mesh's context (a mesh model): unrolled
    return True


def trains_through_convolutions(member: steps.Member) -> bool:
  """Whether the member's gradients flow back through a convolution: its traced step (never run) holds more
  convolutions than its forward pass. Not where every convolution lies beneath what the step trains, frozen
  (`member.frozen`): JAX's gradient then never reaches them. Kept per member where it can be hashed."""
  try:
    return _trains_through_convolutions(member)
  except TypeError:  # a model that cannot be hashed (a field holding a list): traced every time
    return _trains_through_convolutions.__wrapped__(member)


@functools.lru_cache(maxsize=64)
def _trains_through_convolutions(member: steps.Member) -> bool:
  if not has_convolutions(member):
    return False
  dtype = jax.numpy.int32 if member.inputs == 'tokens' else jax.numpy.float32
  inputs = jax.ShapeDtypeStruct((1, *member.image_shape), dtype)

  def outputs(params, x, state):
    logits, _ = member.apply(state, sharing.stop_frozen(member.frozen, params), member.method.model_input(x),
                             train=True, key=jax.random.key(0))
    return sum(jax.numpy.sum(leaf) for leaf in jax.tree.leaves(logits))

  def count(fn, state):
    return str(jax.make_jaxpr(fn)(state.params, inputs, state)).count('conv_general_dilated')
  try:
    state = jax.eval_shape(member.init, jax.random.key(0))
    return count(jax.grad(outputs), state) > count(outputs, state)
  except Exception:  # pylint: disable=broad-except  # traceable only in its mesh's context (a mesh model): it may
    return True


def map_members(fn, in_axes: Sequence[int | None], devices: Sequence[jax.Device], member: steps.Member | None = None):
  """`jax.vmap(fn, in_axes)` over one device's members; where `unrolls`, one member after another."""
  if not unrolls(devices, member):
    return jax.vmap(fn, in_axes=in_axes)

  def mapped(*args):
    size = len(jax.tree.leaves([a for a, axis in zip(args, in_axes) if axis == 0])[0])
    member = lambda i: [a if axis is None else jax.tree.map(lambda x: x[i], a) for a, axis in zip(args, in_axes)]
    return steps.stack([fn(*member(i)) for i in range(size)])
  return mapped


def predict_members(fn, member: steps.Member, devices: Sequence[jax.Device]):
  """`fn(state, images)` (a member's forward pass and what follows it) over a device's members: `map_members`, or,
  where the members share weights, one vmap that leaves the shared leaves unmapped (the first member's copy serves
  all). vmap then batches only what depends on a member's own state: MIMO's M heads come out of one pass of its
  network (unless each member has its own BatchNorm statistics), MC dropout's passes share all that precedes the
  first dropout, and BatchEnsemble's shared kernels are one matmul or convolution over all members' rows. On a
  CPU that last one ran 3x slower than the members' convolutions one after another (`unrolls`; 4 CNN members,
  docs/benchmarks.md), so there BatchEnsemble's members are mapped as others'. `state` may hold a shared leaf
  once per device (the backends' layout) or once per member (the canonical one)."""
  one_network = isinstance(member.method, batchensemble.OneNetwork)
  if not member.method.shares_weights or (unrolls(devices, member) and not one_network):
    return map_members(fn, (0, None), devices, member)

  def predict(state, images):
    state = state.replace(opt_state=None)  # no prediction reads it (and its shared leaves may be once per device)
    shared = member.method.shared(state.params)
    params = jax.tree.map(lambda x, one: x[0] if one else x, state.params, shared)
    axes = jax.tree.map(lambda _: 0, state).replace(params=jax.tree.map(lambda one: None if one else 0, shared))
    return jax.vmap(fn, in_axes=(axes, None))(state.replace(params=params), images)
  return predict


def once_per_device(member: steps.Member, state: Any) -> Any:
  """A device's stacked members' state with the leaves they share (BatchEnsemble's) kept once: (1, ...)."""
  return member.method.map_shared(lambda x: x[:1], state) if member.method.shares_weights else state


def for_each_member(member: steps.Member, state: Any, size: int) -> Any:
  """Undoes `once_per_device` for `size` members, without copying; shared leaves already (size, ...) stay."""
  return member.method.map_shared(lambda x: jax.numpy.broadcast_to(x, (size, *x.shape[1:])), state)


def init_members(member: steps.Member):
  """A device's members' fresh state from their keys and the seed's key (`keys.seed_key`, which they were split
  from: arguments, so that one program serves every seed), in the backends' layout (`once_per_device`)."""
  return lambda keys, seed_key: once_per_device(member, jax.vmap(member.init, in_axes=(0, None))(keys, seed_key))


def train_functions(member: steps.Member, devices: Sequence[jax.Device], data_axis: int | None,
                    ensemble_axis: str | None = ENSEMBLE_AXIS, split: SharedSplit | None = None):
  """(one step, many steps) of the members a device holds, inside pmap or shard_map over 'ensemble'.

  `data_axis` is 0 when each member has its own batch, None when all share it.
  Members train independently: each one's `train_step`, mapped with
  `map_members`, and the fast path's `steps.train_steps` per member. When the
  method's members share weights (BatchEnsemble) a step is one program over
  the device's members: their gradients, the shared ones averaged over all
  members (`method.average_shared`), then each member's update; the fast path
  loops over such steps. `ensemble_axis` None: the devices hold one member in all (see `evaluate_members`).
  `split`: the shared leaves lie split over the devices (`SharedSplit`), and each step gathers them.
  """
  unroll = unrolls(devices, member)
  if not member.method.shares_weights:
    many = functools.partial(steps.train_steps, step_fn=member.train_step, unroll=unroll)
    return (map_members(member.train_step, (0, data_axis, data_axis), devices, member),
            map_members(many, (0, None, None, data_axis), devices, member))
  gradients = map_members(member.gradients, (0, data_axis, data_axis), devices, member)

  def shared_gradients(state, images, labels):
    """The members' gradients with the shared parameters left unmapped (one copy, in_axes None): what depends on
    them alone (a frozen backbone's forward pass on a batch all members share, unaugmented) is computed once, and a
    shared kernel meets all members' rows in one matmul. Members that are unrolled (`unrolls`) get a copy each."""
    if unroll:
      return gradients(for_each_member(member, state, len(state.step)), images, labels)
    shared = member.method.shared(state.params)
    params = jax.tree.map(lambda x, one: x[0] if one else x, state.params, shared)
    state = state.replace(params=params, opt_state=None)
    axes = jax.tree.map(lambda _: 0, state).replace(params=jax.tree.map(lambda one: None if one else 0, shared))
    return jax.vmap(member.gradients, in_axes=(axes, data_axis, data_axis))(state, images, labels)

  def one(state, images, labels):
    """The device's one copy of the shared leaves serves each member, and one copy of their update is kept."""
    whole = state if split is None else state.replace(params=split.gather(state.params))
    grads, aux = shared_gradients(whole, images, labels)
    grads = member.method.average_shared(grads, ensemble_axis) if split is None else split.average(grads)
    state = for_each_member(member, state, len(state.step))
    state, metrics = jax.vmap(member.update)(state, grads, aux)
    return once_per_device(member, state), metrics

  def many(state, images, labels, indices):
    """`indices` (M, S, batch) per member, or (S, batch) shared; metrics come back (M, S) like the others'."""
    if data_axis is not None:
      indices = jax.numpy.moveaxis(indices, 0, 1)
    state, metrics = steps.train_steps(state, images, labels, indices, step_fn=one, unroll=unroll)
    return state, jax.tree.map(lambda x: jax.numpy.moveaxis(x, 0, 1), metrics)
  return one, many


def evaluate_members(member: steps.Member, devices: Sequence[jax.Device], ensemble_axis: str | None = ENSEMBLE_AXIS):
  """`member.eval_step` for the members a device holds, inside pmap or shard_map over 'ensemble'.

  The forward passes go through `predict_members`; only the cheap ensemble mean
  needs the members as a named (vmapped) axis, which with 'ensemble' spans all.
  `ensemble_axis` None leaves a mesh's 'ensemble' axis of size 1 (one member
  over all the devices) out of the mean: XLA's partitioner refuses a reduction
  over a manual axis of size 1 beside automatic ones.
  """
  predict = predict_members(member.predict, member, devices)
  axis_name = (ensemble_axis, MEMBER_AXIS) if ensemble_axis else MEMBER_AXIS
  outputs = jax.vmap(functools.partial(member.task.eval_outputs, axis_name=axis_name),
                     in_axes=(0, None), axis_name=MEMBER_AXIS)
  return lambda state, images, labels: outputs(predict(state, images), labels)


def train_chunk(backend, state, split: Any, resident, chunk: np.ndarray,
                batch: tuple[np.ndarray, np.ndarray] | None = None):
  """Trains on the batches whose example indices `chunk` holds, (steps, ...) of them.

  Plain path (`resident` is None): one step on `batch`, this process's rows of
  the step already read (`data.stream.batches`, which streams them ahead), or
  gathered here from `split`. Fast path (`resident` from `backend.put_dataset`):
  every step of the chunk in one program. The loop and the benchmarks all go
  through here.
  """
  if resident is not None:
    return backend.train_steps(state, resident, chunk)
  if batch is None:
    (rows,) = chunk
    batch = stream.take(split, distributed.process_block(backend.devices, rows))
  return backend.train_step(state, *batch)


def gathering_batches(fn):
  """`fn(state, images, labels)` under pmap or shard_map, fed slices of a batch that all members share.

  Across processes, each device receives only its slice of such a batch (see
  `distributed.process_rows`); every device gathers the whole batch back
  before its members use it.
  """
  def gathered(state, images, labels):
    return fn(state, *jax.lax.all_gather((images, labels), ENSEMBLE_AXIS, tiled=True))
  return gathered
