"""A restored or trained ensemble's forward pass over a split: every member's outputs, each device running its own.

What `Ensemble.predict` and `ensemble.evaluate` run. Kept apart from
`ensemble.evaluation` (scores, shifts, reports, checkpoints), so that
`ensemble.fit` and a prediction load jax, flax and numpy alone.
"""

import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from ensemble import backends, data, features, posthoc, steps


class Predictor:
  """Every member's probabilities for a split: one jitted program, each device running its own members.

  The members are mapped as in training (shard_map over 'ensemble', then
  `backends.predict_members`). Left to XLA's partitioner, the vmapped members
  became one grouped convolution computed whole on every device: at K=32 on 8
  CPU devices, a batch of 1,000 images got the process killed (exit 137) on a
  machine with 24 GB.
  """

  def __init__(self, member: steps.Member, state: steps.TrainState, devices: Sequence[jax.Device], batch_size: int):
    self._member, self._devices = member, tuple(devices)
    self._log_probs = _program(member, self._devices, 'log_probs')
    self._state = state
    self._batch_size = batch_size

  def __call__(self, split: data.Split) -> np.ndarray:
    """(K, N, C) float64 probabilities."""
    return np.exp(self.log_probs(split))

  def log_probs(self, split: data.Split) -> np.ndarray:
    """(K, N, C) float64 log-probabilities: the ensemble's NLL is computed from them (`calibration.ensemble_nll`).

    For regression, the members' raw outputs (`tasks.regression.Regression.components` reads them).
    """
    return self._run('log_probs', split)

  def features(self, split: data.Split) -> np.ndarray:
    """(K, N, F) float64: every member's penultimate-layer features (ensemble/features.py)."""
    return self._run('features', split)

  def _run(self, what: str, split: data.Split) -> np.ndarray:
    program = self._log_probs if what == 'log_probs' else _program(self._member, self._devices, what)
    batches = [np.asarray(program(self._state, images))[:, mask]
               for images, _, mask in data.eval_batches(split, self._batch_size)]
    return np.concatenate(batches, axis=1).astype(np.float64)

  def labels(self, split: data.Split) -> np.ndarray:
    """The split's labels, a streamed one's read a batch at a time as `log_probs` reads it, never whole."""
    return data.stream.labels(split, self._batch_size)


@functools.lru_cache(maxsize=16)
def _program(member: steps.Member, devices: tuple[jax.Device, ...], what: str):
  """The members' outputs ('log_probs') or penultimate features ('features') as one jitted program of (state,
  inputs), kept for the member: the ensembles that `fit` returns in a loop share their member (ensemble/loop.py),
  and so their programs."""
  members, whole = P(backends.ENSEMBLE_AXIS), P()
  if what == 'features':
    fn = functools.partial(features.penultimate, member)
  else:
    fn = lambda state, images: member.task.member_output(member.predict(state, images))
  mapped = jax.shard_map(backends.predict_members(fn, member, devices),
                         mesh=backends.ensemble_mesh(devices), in_specs=(members, whole), out_specs=members)
  return jax.jit(mapped)


class Forward:
  """An `Ensemble`'s forward pass as `Task.report` asks for it (`Ensemble.report`), as `Predictor` gives it a
  workdir's: a split's every member's outputs (its inputs checked already, images as uint8 or in [0, 1]), their
  probabilities, its labels."""

  def __init__(self, ens: Any):  # an `ensemble.trained.Ensemble`, which imports this module
    self._ens = ens

  def log_probs(self, split: data.Split) -> np.ndarray:
    return self._ens._member_outputs(np.asarray(split['image']), role='report')  # pylint: disable=protected-access

  def __call__(self, split: data.Split) -> np.ndarray:
    return np.exp(self.log_probs(split))

  def labels(self, split: data.Split) -> np.ndarray:
    return split['label']

  def distance(self, split: data.Split) -> np.ndarray | None:
    """(N,) the chain's distance of each input from the data it was fitted on; None without a distance step."""
    step = posthoc.last(self._ens.posthoc, 'distance')
    if step is None:
      return None
    found = self._ens._member_outputs(np.asarray(split['image']), role='report',  # pylint: disable=protected-access
                                      what='features')
    return step.apply({'features': found})['distance']
