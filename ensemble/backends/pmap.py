"""The classic recipe: `jax.pmap` over devices; a device's members mapped with `jax.vmap`
(on CPU, traced one after another: `backends.map_members`).

State leaves are (D, K/D, ...): D devices, K/D members on each (BatchEnsemble's
shared leaves (D, 1, ...): a copy per device). Batches that all
members share are replicated with `flax.jax_utils.replicate`. Across processes,
each process pmaps over its own devices (host-local inputs and outputs, as pmap
wants them), and a shared batch arrives split over all devices and is gathered
back on each of them.
"""

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import jax_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ensemble import distributed, steps
from ensemble.backends.epochs import EpochPrograms, train_epochs_function
from ensemble.backends import (ENSEMBLE_AXIS, abstract_member_state, evaluate_members,
                               gathering_batches, init_members, member_sharding,
                               train_functions, train_program)
from ensemble.keys import seed_key


class PmapBackend:
  """One pmapped program per step; the devices each run their own members."""

  def __init__(self, *, member: steps.Member, devices: Sequence[jax.Device], ensemble_size: int,
               member_data: str, config=None):
    self.devices = list(devices)
    self.ensemble_size = ensemble_size
    self._abstract = functools.partial(abstract_member_state, member, ensemble_size, devices)
    self.members_per_device = ensemble_size // len(self.devices)
    self._local_devices = [d for d in self.devices if d.process_index == jax.process_index()]
    self._shared_data = member_data == 'shared'
    self._split_batches = distributed.spans_processes(self.devices)
    whole = gathering_batches if self._split_batches else lambda fn: fn
    self._canonical = member_sharding(self.devices)
    self._pmapped = _pmapped(self.devices)
    data_axis = None if self._shared_data else 0
    pmap = functools.partial(jax.pmap, axis_name=ENSEMBLE_AXIS, devices=self.devices)
    self._init = pmap(init_members(member), in_axes=(0, None))  # the seed's key broadcast
    # Shared leaves (BatchEnsemble's, `shared=`) hold a copy per device: (D, 1, ...) where the others are (D, K/D, ...).
    self._shares_weights = member.method.shares_weights
    self._sharing = member.method if self._shares_weights else None
    train, many = train_functions(member, self.devices, data_axis)
    self._train = train_program(pmap(whole(train) if self._shared_data else train, donate_argnums=0), devices,
                                config, member)
    self._train_steps = train_program(pmap(many, donate_argnums=0), devices, config, member)
    # Whole fits in one program (`train_epochs`), in one process; the seed, first epoch and count broadcast.
    self.trains_epochs = not self._split_batches
    self.train_epochs = EpochPrograms(
        lambda *shape: train_program(pmap(train_epochs_function(many, member_data, *shape),
                                          in_axes=(0, 0, 0, 0, None, None, None), donate_argnums=0),
                                     devices, config, member),
        jax.device_put(np.arange(ensemble_size, dtype=np.int32).reshape(len(self.devices), -1), self._pmapped))
    self._keys = {}
    self._eval = pmap(whole(evaluate_members(member, self.devices)))

  def _by_device(self, x: np.ndarray) -> np.ndarray:
    """This process's rows -> (its devices, rows per device, ...)."""
    return x.reshape(len(self._local_devices), -1, *x.shape[1:])

  def _own_members(self, x: np.ndarray) -> np.ndarray:
    """The rows of a (K, ...) array that belong to this process's members, by device."""
    if not self._split_batches:  # one process: all of them
      return self._by_device(x)
    return self._by_device(x[distributed.process_rows(self.devices, self.ensemble_size)])

  def _shared_batch(self, images: np.ndarray, labels: np.ndarray):
    if self._split_batches:
      return self._by_device(images), self._by_device(labels)
    return jax_utils.replicate((images, labels), self._local_devices)

  def init(self, seed: int) -> steps.TrainState:
    if seed not in self._keys:  # a loop of fits starts from the same keys: drawn (and laid out) once
      self._keys[seed] = self._own_members(steps.member_keys(seed, self.ensemble_size)), seed_key(seed)
    return self._init(*self._keys[seed])

  def abstract_state(self):
    return self._abstract()

  def train_step(self, state, images: np.ndarray, labels: np.ndarray):
    if self._shared_data:
      images, labels = self._shared_batch(images, labels)
    else:
      images, labels = self._by_device(images), self._by_device(labels)
    return self._train(state, images, labels)

  def put_dataset(self, split):
    """The whole training set, one copy per device of this process, for `train_steps`."""
    return jax_utils.replicate((split['image'], split['label']), self._local_devices)

  def train_steps(self, state, dataset, indices: np.ndarray):
    """`indices` is (S, batch) for shared data, else (S, K, batch)."""
    if self._shared_data:
      indices = jax_utils.replicate(indices, self._local_devices)
    else:
      indices = self._own_members(np.moveaxis(indices, 1, 0))
    return self._train_steps(state, *dataset, indices)

  def eval_step(self, state, images: np.ndarray, labels: np.ndarray) -> steps.Metrics:
    return self._eval(state, *self._shared_batch(images, labels))

  def to_host(self, tree):
    """Device outputs of all processes as numpy arrays with the member axis first, (K, ...).

    In one process, read as they are, (D, K/D, ...), and reshaped on the host: no program runs for it.
    """
    if jax.process_count() == 1 and not self._shares_weights:
      return jax.tree.map(lambda x: np.asarray(x).reshape(-1, *x.shape[2:]), tree)
    return distributed.to_numpy(self.to_canonical(tree))

  def to_canonical(self, state):
    """(D, K/D, ...) per device -> one global (K, ...) array; each shard stays on its device.

    A shared leaf's (D, 1, ...) copy is repeated for the device's members, on the device. In one process, one
    program for the whole tree (`_conversions`, kept per layout); across processes, shard by shard.
    """
    if jax.process_count() == 1:
      return self._programs()[0](state)

    def convert(x, repeats=1):
      shards = [jnp.repeat(s.data.reshape(s.data.shape[1:]), repeats, axis=0) if repeats > 1
                else s.data.reshape(s.data.shape[1:]) for s in x.addressable_shards]
      return jax.make_array_from_single_device_arrays(
          (self.ensemble_size, *x.shape[2:]), self._canonical, shards)
    return self._map_shared(functools.partial(convert, repeats=self.members_per_device), convert, state)

  def from_canonical(self, state):
    """The canonical (K, ...) layout -> (D, K/D, ...) per device (a shared leaf: its first member's copy)."""
    if jax.process_count() == 1:
      return self._programs()[1](state)

    def convert(x, keep=None):
      shards = [s.data[:keep].reshape(1, -1, *s.data.shape[1:]) for s in x.addressable_shards]
      return jax.make_array_from_single_device_arrays(
          (len(self.devices), keep or self.members_per_device, *x.shape[1:]), self._pmapped, shards)
    return self._map_shared(functools.partial(convert, keep=1), convert, state)

  def _programs(self):
    return _conversions(tuple(self.devices), self.ensemble_size, self._sharing)

  def _map_shared(self, shared, other, state):
    return _map_shared(self._sharing, shared, other, state)


def _map_shared(sharing, shared, other, state):
  """`shared` on the leaves the members share (`sharing`, the method, where they share any), `other` on the rest."""
  if sharing is None:
    return jax.tree.map(other, state)
  return sharing.map_shared(shared, state, other)


def _pmapped(devices: Sequence[jax.Device]) -> NamedSharding:
  """As pmap lays out its outputs (its axis name names the mesh axis): a restored or warm-started state is then the
  same argument to the programs as a trained one, and compiles nothing new."""
  return NamedSharding(Mesh(np.asarray(devices), (ENSEMBLE_AXIS,)), P(ENSEMBLE_AXIS))


@functools.lru_cache(maxsize=32)
def _conversions(devices: tuple[jax.Device, ...], ensemble_size: int, sharing):
  """(to canonical, from canonical) as jitted programs of a whole state: reshapes that move nothing between
  devices. Kept per layout, for every backend of that layout (a loop of fits, the tests' many runs): shard by
  shard, every shard's reshape compiled a program of its own."""
  per_device, num_devices = ensemble_size // len(devices), len(devices)
  merge = lambda repeats: lambda x: jnp.repeat(x, repeats, axis=1).reshape(-1, *x.shape[2:])
  split = lambda keep: lambda x: x.reshape(num_devices, per_device, *x.shape[1:])[:, :keep]
  to_canonical = jax.jit(functools.partial(_map_shared, sharing, merge(per_device), merge(1)),
                         out_shardings=member_sharding(devices))
  from_canonical = jax.jit(functools.partial(_map_shared, sharing, split(1), split(per_device)),
                           out_shardings=_pmapped(devices))
  return to_canonical, from_canonical
