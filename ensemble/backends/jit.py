"""`jax.jit` with `NamedSharding`: one global (K, ...) array per state leaf, sharded over 'ensemble'.

Inside the jitted step, `jax.shard_map` hands each device its block of K/D
members and `jax.vmap` runs them (on CPU, one after another:
`backends.map_members`). Leaving the member axis to XLA's automatic partitioner
instead is much slower: it turns the vmapped convolutions into one grouped
convolution that it does not split, so every device all-gathers the parameters
and computes all K members (seen in the compiled HLO; on 8 CPU
devices about 20x slower). The backend's layout is the canonical one, so
conversions are free, but for BatchEnsemble's shared leaves with several
members per device: one copy per device, repeated for the canonical layout.
Across processes, batches are global arrays built from each process's rows,
and a shared batch arrives split over all devices and is gathered back on each
of them. With fewer members than devices, each member
has a row of the mesh's 'data' axis to itself (`backends.ensemble_mesh`); under
member_sharding=model, a row of its 'model' axis, and the steps are traced with
that mesh and the logical axis rules in context, so that the model's weight and
activation annotations split each member's computation over its devices.
"""

import contextlib
import functools
from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ensemble import distributed, steps
from ensemble.backends.epochs import EpochPrograms, train_epochs_function
from ensemble.backends import (DATA_AXIS, ENSEMBLE_AXIS, MODEL_AXIS, SharedSplit,
                               abstract_member_state, devices_per_member, ensemble_mesh, evaluate_members,
                               gathering_batches, init_members, train_functions, train_program)
from ensemble.keys import seed_key
from ensemble.parallel import logical


class JitBackend:
  """One jitted program per step over the 'ensemble' mesh (with a 'data' axis when members span several devices)."""

  def __init__(self, *, member: steps.Member, devices: Sequence[jax.Device], ensemble_size: int,
               member_data: str, config=None):
    self.devices = list(devices)
    self.ensemble_size = ensemble_size
    layout = config.member_sharding if config is not None else 'replicated'
    rules = logical.check_rules(config.logical_axis_rules if config is not None else logical.DEFAULT_RULES,
                                logical_axes=None)
    mesh = ensemble_mesh(self.devices, ensemble_size, layout)
    self._mesh, self._rules = mesh, rules if MODEL_AXIS in mesh.axis_names else None
    self._abstract_state = functools.partial(abstract_member_state, member, ensemble_size, devices, layout, rules)
    self._state = self._canonical = jax.tree.map(lambda x: x.sharding, self.abstract_state())
    members, whole = P(ENSEMBLE_AXIS), P()
    # The state's specs inside shard_map: the members over 'ensemble', and under shared_sharding=fsdp the leaves
    # they share split over all the devices (`backends.SharedSplit`).
    self._split, state = None, members
    if config is not None and config.shared_sharding == 'fsdp':
      self._split = SharedSplit(member.method, self.abstract_state(), mesh, config.min_weight_size)
      self._state, state = self._split.shardings, self._split.specs
    # Fewer members than devices: a member's batch rows are split over its row of the mesh, 'data', which
    # shard_map leaves to XLA's partitioner. It then computes each member's step data-parallel, as jit does
    # one model's: gradients and BatchNorm statistics over the member's whole batch, reduced among its
    # devices only, so the member trains as it would on a device of its own.
    spread = devices_per_member(ensemble_size, len(self.devices)) > 1
    rows = (lambda spec: P(*spec, DATA_AXIS)) if spread else (lambda spec: spec)
    index_rows = (lambda spec: P(*spec, None, DATA_AXIS)) if spread else (lambda spec: spec)  # (S, batch) per member
    self._replicated = NamedSharding(mesh, whole)
    self._indices = NamedSharding(mesh, index_rows(members))
    self._shared_indices = NamedSharding(mesh, index_rows(whole))
    self._shared_data = member_data == 'shared'
    # One process feeds whole shared batches; several each feed their devices' slices
    # (distributed.process_rows), which every device then gathers.
    split = distributed.spans_processes(self.devices)
    batch_spec, gather = (members, gathering_batches) if split else (whole, lambda fn: fn)
    # A shared batch split over the processes is one axis of examples over every device in order,
    # ('ensemble', 'data') together; shard_map hands each member's devices their slices to gather.
    shared_rows = (lambda spec: P((ENSEMBLE_AXIS, DATA_AXIS)) if spec == members else rows(spec)) if spread else rows
    self._batches = NamedSharding(mesh, shared_rows(batch_spec))
    # Per step: a batch (plain path), or its indices into the resident training set (fast path).
    data_axis, data_spec, index_spec = (None, batch_spec, whole) if self._shared_data else (0, members, members)
    data_rows = shared_rows if self._shared_data else rows
    self._data = NamedSharding(mesh, data_rows(data_spec))

    def compile_mapped(member_fn, in_specs, out_specs, donate=(), batches=0, state_in=True, state_out=True,
                       split=rows):
      """jit(shard_map(member_fn)) with the shardings of its specs stated and `donate` donated.

      The first input and output are the members' state (unless `state_in`, `state_out` say otherwise), laid
      out by `self._state`; the last `batches` inputs are batches (or their indices), whose rows `split` puts
      over 'data' when members are spread. shard_map maps 'ensemble' only, and leaves 'data' to XLA.
      """
      # check_vma=False: JAX's varying-axes check cannot yet follow a pmean that spans a
      # mesh axis and a vmapped axis together, which is what the ensemble mean is.
      mapped = jax.shard_map(member_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False,
                             axis_names={ENSEMBLE_AXIS})
      named = lambda spec: NamedSharding(mesh, spec)
      inputs = [None if i == 0 and state_in else named(split(spec) if i >= len(in_specs) - batches else spec)
                for i, spec in enumerate(in_specs)]
      outputs = list(out_specs) if isinstance(out_specs, tuple) else [out_specs]
      outputs = [None if i == 0 and state_out else named(spec) for i, spec in enumerate(outputs)]
      if state_in:
        inputs[0] = self._state
      if state_out:
        outputs[0] = self._state
      return jax.jit(mapped, in_shardings=tuple(inputs),
                     out_shardings=tuple(outputs) if isinstance(out_specs, tuple) else outputs[0],
                     donate_argnums=donate)

    init = init_members(member)  # (member keys, the seed's key)
    self._init = compile_mapped(
        init if self._split is None else lambda keys, seed: self._split.slice(init(keys, seed)),
        (members, whole), state, state_in=False)
    # Shared leaves (BatchEnsemble) hold a copy per device: a member's, repeated for the device's members.
    per_device = ensemble_size // mesh.shape[ENSEMBLE_AXIS] if member.method.shares_weights and not self._split else 1
    self._repeat_shared = self._first_of_each = None
    self._method = member.method
    if per_device > 1:
      on_devices = functools.partial(jax.jit, out_shardings=NamedSharding(mesh, members))
      self._repeat_shared = on_devices(lambda x: jax.numpy.repeat(x, per_device, axis=0))
      self._first_of_each = on_devices(lambda x: x[::per_device])
    # One member over all the devices: no collective over 'ensemble' (`backends.evaluate_members`).
    ensemble_axis = ENSEMBLE_AXIS if mesh.shape[ENSEMBLE_AXIS] > 1 else None
    train, many = train_functions(member, self.devices, data_axis, ensemble_axis, self._split)
    self._train = train_program(compile_mapped(
        gather(train) if self._shared_data else train, (state, data_spec, data_spec), (state, members),
        donate=0, batches=2, split=data_rows), devices, config, member)
    self._train_steps = train_program(compile_mapped(
        many, (state, whole, whole, index_spec), (state, members), donate=0, batches=1, split=index_rows),
        devices, config, member)
    # Whole fits in one program (`train_epochs`): members on devices of their own, in one process.
    self.trains_epochs = not spread and not split
    self._epochs = EpochPrograms(
        lambda *shape: train_program(compile_mapped(
            train_epochs_function(many, member_data, *shape), (state, whole, whole, members, whole, whole, whole),
            (state, members, members), donate=0), devices, config, member),
        jax.device_put(np.arange(ensemble_size, dtype=np.int32), NamedSharding(mesh, members)))
    self._keys = {}
    evaluate = evaluate_members(member, self.devices, ensemble_axis)
    if self._split is not None:
      evaluate = self._split.gathering(evaluate)
    self._eval = compile_mapped(gather(evaluate), (state, batch_spec, batch_spec), members, batches=2,
                                state_out=False, split=shared_rows)
    if self._split is not None:  # the canonical layout: the shared leaves repeated for the members
      self._to_canonical = jax.jit(lambda state: member.method.map_shared(
          lambda x: jax.numpy.broadcast_to(x, (ensemble_size, *x.shape[1:])), state), out_shardings=self._canonical)
      self._from_canonical = jax.jit(lambda state: member.method.map_shared(lambda x: x[:1], state),
                                     out_shardings=self._state)

  def _context(self):
    """Where a member's annotations find the mesh and the logical rules while traced (member_sharding=model)."""
    stack = contextlib.ExitStack()
    if self._rules is not None:
      stack.enter_context(jax.set_mesh(self._mesh))
      stack.enter_context(nn.logical_axis_rules(self._rules))
    return stack

  def init(self, seed: int) -> steps.TrainState:
    if seed not in self._keys:  # a loop of fits starts from the same keys: drawn once
      self._keys[seed] = steps.member_keys(seed, self.ensemble_size), seed_key(seed)
    with self._context():
      return self._init(*self._keys[seed])

  def abstract_state(self):
    with self._context():  # the model's init runs, constraints and all
      return self._abstract_state()

  def train_step(self, state, images: np.ndarray, labels: np.ndarray):
    with self._context():
      return self._train(state, *jax.make_array_from_process_local_data(self._data, (images, labels)))

  def put_dataset(self, split):
    """The whole training set, replicated on every device, for `train_steps`."""
    return jax.device_put((split['image'], split['label']), self._replicated)

  def train_steps(self, state, dataset, indices: np.ndarray):
    """`indices` is (S, batch) for shared data, else (S, K, batch)."""
    if not self._shared_data:
      members = np.moveaxis(indices, 1, 0)
      # Each member's steps (S) aside, its rows are split as a per-member batch's are.
      own = np.moveaxis(distributed.process_block(self.devices, np.moveaxis(members, 1, 2)), 2, 1)
      indices = jax.make_array_from_process_local_data(self._indices, own, members.shape)
    else:  # the same on every process; split over a spread member's devices, which may be other processes'
      indices = jax.make_array_from_callback(indices.shape, self._shared_indices, lambda i, host=indices: host[i])
    with self._context():
      return self._train_steps(state, *dataset, indices)

  def train_epochs(self, state, dataset, *args):
    """Whole epochs in one program (`backends.EpochPrograms`' arguments); only where `trains_epochs`."""
    with self._context():
      return self._epochs(state, dataset, *args)

  def eval_step(self, state, images: np.ndarray, labels: np.ndarray) -> steps.Metrics:
    with self._context():
      return self._eval(state, *jax.make_array_from_process_local_data(self._batches, (images, labels)))

  def to_host(self, tree):
    return distributed.to_numpy(tree)

  def to_canonical(self, state):
    if self._split is not None:
      return self._to_canonical(state)
    if self._repeat_shared is None:
      return state
    return self._method.map_shared(self._repeat_shared, state)

  def from_canonical(self, state):
    if self._split is not None:
      return self._from_canonical(state)
    if self._repeat_shared is None:
      return state
    return self._method.map_shared(self._first_of_each, state)
