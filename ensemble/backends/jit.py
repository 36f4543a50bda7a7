"""`jax.jit` with `NamedSharding`: one global (K, ...) array per state leaf, sharded over 'ensemble'.

Members are computed with `jax.vmap` over the member axis; XLA's SPMD partitioner
splits that axis over the devices and inserts the collective that the ensemble
mean needs. The backend's layout is the canonical one, so conversions are free.
"""

import functools
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ensemble import steps
from ensemble.backends import ENSEMBLE_AXIS, abstract_member_state, ensemble_mesh, member_sharding


class JitBackend:
  """One jitted, SPMD-partitioned program per step over a 1-D 'ensemble' mesh."""

  def __init__(self, *, model, tx, devices: Sequence[jax.Device], ensemble_size: int,
               member_data: str, input_shape: Sequence[int]):
    self.devices = list(devices)
    self.ensemble_size = ensemble_size
    self._abstract = functools.partial(abstract_member_state, model, tx, ensemble_size, input_shape, devices)
    members = member_sharding(self.devices)
    replicated = NamedSharding(ensemble_mesh(self.devices), P())
    self._shared_data = member_data == 'shared'
    data_axis, data_sharding = (None, replicated) if self._shared_data else (0, members)
    create = functools.partial(steps.create_member_state, model=model, tx=tx, input_shape=input_shape)
    self._init = jax.jit(jax.vmap(create), in_shardings=members, out_shardings=members)
    self._train = jax.jit(
        jax.vmap(steps.train_step, in_axes=(0, data_axis, data_axis)),
        in_shardings=(members, data_sharding, data_sharding),
        out_shardings=(members, members),
        donate_argnums=0)
    self._replicated = replicated
    self._train_steps = jax.jit(
        jax.vmap(steps.train_steps, in_axes=(0, None, None, data_axis)),
        in_shardings=(members, replicated, replicated, data_sharding),
        out_shardings=(members, members),
        donate_argnums=0)
    evaluate = functools.partial(steps.eval_step, axis_name=ENSEMBLE_AXIS)
    self._eval = jax.jit(
        jax.vmap(evaluate, in_axes=(0, None, None), axis_name=ENSEMBLE_AXIS),
        in_shardings=(members, replicated, replicated),
        out_shardings=members)

  def init(self, seed: int) -> steps.TrainState:
    keys = steps.member_keys(seed, self.ensemble_size)
    return self._init(keys)

  def abstract_state(self):
    return self._abstract()

  def train_step(self, state, images: np.ndarray, labels: np.ndarray):
    return self._train(state, images, labels)

  def put_dataset(self, split):
    """The whole training set, replicated on every device, for `train_steps`."""
    return jax.device_put((split['image'], split['label']), self._replicated)

  def train_steps(self, state, dataset, indices: np.ndarray):
    """`indices` is (S, batch) for shared data, else (S, K, batch)."""
    if not self._shared_data:
      indices = np.moveaxis(indices, 1, 0)
    return self._train_steps(state, *dataset, indices)

  def eval_step(self, state, images: np.ndarray, labels: np.ndarray) -> steps.Metrics:
    return self._eval(state, images, labels)

  def to_host(self, tree):
    return jax.tree.map(np.asarray, tree)

  def to_canonical(self, state):
    return state

  def from_canonical(self, state):
    return state
