"""The classic recipe: `jax.pmap` over devices, `jax.vmap` over the members each device holds.

State leaves are (D, K/D, ...): D devices, K/D members on each. Batches that all
members share are replicated with `flax.jax_utils.replicate`.
"""

import functools
from typing import Sequence

import jax
import numpy as np
from flax import jax_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ensemble import steps
from ensemble.backends import ENSEMBLE_AXIS, abstract_member_state, member_sharding

_MEMBER_AXIS = 'member'  # the vmapped members on one device


class PmapBackend:
  """One pmapped program per step; the devices each run their own members."""

  def __init__(self, *, model, tx, devices: Sequence[jax.Device], ensemble_size: int,
               member_data: str, input_shape: Sequence[int]):
    self.devices = list(devices)
    self.ensemble_size = ensemble_size
    self._abstract = functools.partial(abstract_member_state, model, tx, ensemble_size, input_shape, devices)
    self.members_per_device = ensemble_size // len(self.devices)
    self._shared_data = member_data == 'shared'
    self._canonical = member_sharding(self.devices)
    self._pmapped = NamedSharding(Mesh(np.asarray(self.devices), ('devices',)), P('devices'))
    data_axis = None if self._shared_data else 0
    pmap = functools.partial(jax.pmap, axis_name=ENSEMBLE_AXIS, devices=self.devices)
    create = functools.partial(steps.create_member_state, model=model, tx=tx, input_shape=input_shape)
    self._init = pmap(jax.vmap(create))
    self._train = pmap(jax.vmap(steps.train_step, in_axes=(0, data_axis, data_axis)),
                       donate_argnums=0)
    self._train_steps = pmap(jax.vmap(steps.train_steps, in_axes=(0, None, None, data_axis)),
                             donate_argnums=0)
    evaluate = functools.partial(steps.eval_step, axis_name=(ENSEMBLE_AXIS, _MEMBER_AXIS))
    self._eval = pmap(jax.vmap(evaluate, in_axes=(0, None, None), axis_name=_MEMBER_AXIS))

  def _by_device(self, x: np.ndarray) -> np.ndarray:
    return x.reshape(len(self.devices), self.members_per_device, *x.shape[1:])

  def init(self, seed: int) -> steps.TrainState:
    keys = steps.member_keys(seed, self.ensemble_size)
    return self._init(self._by_device(keys))

  def abstract_state(self):
    return self._abstract()

  def train_step(self, state, images: np.ndarray, labels: np.ndarray):
    if self._shared_data:
      images, labels = jax_utils.replicate((images, labels), self.devices)
    else:
      images, labels = self._by_device(images), self._by_device(labels)
    return self._train(state, images, labels)

  def put_dataset(self, split):
    """The whole training set, one copy per device, for `train_steps`."""
    return jax_utils.replicate((split['image'], split['label']), self.devices)

  def train_steps(self, state, dataset, indices: np.ndarray):
    """`indices` is (S, batch) for shared data, else (S, K, batch)."""
    if self._shared_data:
      indices = jax_utils.replicate(indices, self.devices)
    else:
      indices = self._by_device(np.moveaxis(indices, 1, 0))
    return self._train_steps(state, *dataset, indices)

  def eval_step(self, state, images: np.ndarray, labels: np.ndarray) -> steps.Metrics:
    return self._eval(state, *jax_utils.replicate((images, labels), self.devices))

  def to_host(self, tree):
    """Device outputs as numpy arrays with the member axis first, (K, ...)."""
    return jax.tree.map(lambda x: np.asarray(x).reshape(self.ensemble_size, *x.shape[2:]), tree)

  def to_canonical(self, state):
    """(D, K/D, ...) per device -> one global (K, ...) array; each shard stays on its device."""
    def convert(x):
      shards = [s.data.reshape(s.data.shape[1:]) for s in x.addressable_shards]
      return jax.make_array_from_single_device_arrays(
          (self.ensemble_size, *x.shape[2:]), self._canonical, shards)
    return jax.tree.map(convert, state)

  def from_canonical(self, state):
    def convert(x):
      shards = [s.data.reshape(1, *s.data.shape) for s in x.addressable_shards]
      return jax.make_array_from_single_device_arrays(
          (len(self.devices), self.members_per_device, *x.shape[1:]), self._pmapped, shards)
    return jax.tree.map(convert, state)
