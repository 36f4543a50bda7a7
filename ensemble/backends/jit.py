"""`jax.jit` with `NamedSharding`: one global (K, ...) array per state leaf, sharded over 'ensemble'.

Inside the jitted step, `jax.shard_map` hands each device its block of K/D
members and `jax.vmap` runs them (on CPU, one after another:
`backends.map_members`). Leaving the member axis to XLA's automatic partitioner
instead is much slower: it turns the vmapped convolutions into one grouped
convolution that it does not split, so every device all-gathers the parameters
and computes all K members (seen in the compiled HLO; on 8 CPU
devices about 20x slower). The backend's layout is the canonical one, so
conversions are free. Across processes, batches are global arrays built from
each process's rows, and a shared batch arrives split over all devices and is
gathered back on each of them.
"""

import functools
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ensemble import distributed, steps
from ensemble.backends import (ENSEMBLE_AXIS, abstract_member_state, ensemble_mesh, evaluate_members,
                               gathering_batches, train_functions)


class JitBackend:
  """One jitted program per step over a 1-D 'ensemble' mesh, members mapped with shard_map + map_members."""

  def __init__(self, *, member: steps.Member, devices: Sequence[jax.Device], ensemble_size: int,
               member_data: str, config=None):
    del config  # everything it needs is in `member`
    self.devices = list(devices)
    self.ensemble_size = ensemble_size
    self._abstract = functools.partial(abstract_member_state, member, ensemble_size, devices)
    mesh = ensemble_mesh(self.devices)
    members, whole = P(ENSEMBLE_AXIS), P()
    self._replicated = NamedSharding(mesh, whole)
    self._members = NamedSharding(mesh, members)
    self._shared_data = member_data == 'shared'
    # One process feeds whole shared batches; several each feed their devices' slices
    # (distributed.process_rows), which every device then gathers.
    split = distributed.spans_processes(self.devices)
    batch_spec, gather = (members, gathering_batches) if split else (whole, lambda fn: fn)
    self._batches = NamedSharding(mesh, batch_spec)
    # Per step: a batch (plain path), or its indices into the resident training set (fast path).
    data_axis, data_spec, index_spec = (None, batch_spec, whole) if self._shared_data else (0, members, members)
    self._data = NamedSharding(mesh, data_spec)

    def compile_mapped(member_fn, in_specs, out_specs, donate=()):
      """jit(shard_map(member_fn)) with the shardings of its specs stated and `donate` donated."""
      # check_vma=False: JAX's varying-axes check cannot yet follow a pmean that spans a
      # mesh axis and a vmapped axis together, which is what the ensemble mean is.
      mapped = jax.shard_map(member_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
      named = lambda specs: jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
      return jax.jit(mapped, in_shardings=named(in_specs), out_shardings=named(out_specs),
                     donate_argnums=donate)

    self._init = compile_mapped(jax.vmap(member.init), members, members)
    train, many = train_functions(member, self.devices, data_axis)
    self._train = compile_mapped(
        gather(train) if self._shared_data else train, (members, data_spec, data_spec), (members, members),
        donate=0)
    self._train_steps = compile_mapped(many, (members, whole, whole, index_spec), (members, members), donate=0)
    self._eval = compile_mapped(
        gather(evaluate_members(member, self.devices)),
        (members, batch_spec, batch_spec), members)

  def init(self, seed: int) -> steps.TrainState:
    keys = steps.member_keys(seed, self.ensemble_size)
    return self._init(keys)

  def abstract_state(self):
    return self._abstract()

  def train_step(self, state, images: np.ndarray, labels: np.ndarray):
    return self._train(state, *jax.make_array_from_process_local_data(self._data, (images, labels)))

  def put_dataset(self, split):
    """The whole training set, replicated on every device, for `train_steps`."""
    return jax.device_put((split['image'], split['label']), self._replicated)

  def train_steps(self, state, dataset, indices: np.ndarray):
    """`indices` is (S, batch) for shared data, else (S, K, batch)."""
    if not self._shared_data:
      members = np.moveaxis(indices, 1, 0)
      own = members[distributed.process_rows(self.devices, self.ensemble_size)]
      indices = jax.make_array_from_process_local_data(self._members, own, members.shape)
    return self._train_steps(state, *dataset, indices)

  def eval_step(self, state, images: np.ndarray, labels: np.ndarray) -> steps.Metrics:
    return self._eval(state, *jax.make_array_from_process_local_data(self._batches, (images, labels)))

  def to_host(self, tree):
    return distributed.to_numpy(tree)

  def to_canonical(self, state):
    return state

  def from_canonical(self, state):
    return state
