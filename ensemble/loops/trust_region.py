"""A trust region for Bayesian optimisation in many dimensions (TuRBO: Eriksson et al. 2019, "Scalable global
optimization via local Bayesian optimization"): the acquisition is maximised in a box about the best point so far,
not in the whole domain.

In twenty dimensions a surrogate fitted on a few hundred points is unsure almost
everywhere, and a global acquisition keeps sending points to the domain's far
corners; a box about the best point, grown while rounds improve on it and shrunk
while they do not, spends the evaluations where they can pay. The box's side (a
fraction of the domain's, per dimension) starts at 0.8, doubles (to at most 1.6)
after `SUCCESSES` rounds in a row that improved on the best and halves after
max(4, D) / q rounds in a row that did not (q points a round); once below 0.5^7 it
starts again at 0.8. TuRBO-1 restarts its whole design there; the loop keeps its
evaluations and its surrogate, and only the box starts again.

The region is a function of the values the record holds and nothing else: a
stopped loop replays it from them (`side`), so nothing more is kept on disk.
"""

import math
from typing import Sequence

import numpy as np

INITIAL, SMALLEST, LARGEST = 0.8, 0.5 ** 7, 1.6
SUCCESSES = 3  # the paper's; BoTorch's tutorial uses 10
IMPROVEMENT = 1e-3  # relative to the best's magnitude: what counts as a round that improved on it
# In many dimensions a candidate changes only some coordinates of the best point: each with this chance, out of D
# (TuRBO's perturbation mask; with a few dimensions, every coordinate).
PERTURBED = 20


def side(best_before: float, rounds: Sequence[Sequence[float]], dimensions: int) -> float:
  """The box's side after `rounds` (each round's values, to maximise, in order), starting from the best value of the
  points before them: TuRBO's counters replayed."""
  q = max((len(values) for values in rounds), default=1)
  failures_allowed = math.ceil(max(4.0, float(dimensions)) / q)
  length, successes, failures, best = INITIAL, 0, 0, best_before
  for values in rounds:
    top = max(values)
    if top > best + IMPROVEMENT * abs(best):
      successes, failures = successes + 1, 0
    else:
      successes, failures = 0, failures + 1
    if successes == SUCCESSES:
      length, successes = min(2 * length, LARGEST), 0
    elif failures == failures_allowed:
      length, failures = length / 2, 0
    best = max(best, top)
    if length < SMALLEST:
      length, successes, failures = INITIAL, 0, 0
  return length


def box(center: np.ndarray, length: float) -> tuple[np.ndarray, np.ndarray]:
  """The region in the unit box: a cube of side `length` about `center` (the best point, in the unit box), cut to
  the unit box."""
  low = np.clip(center - length / 2, 0.0, 1.0)
  high = np.clip(center + length / 2, 0.0, 1.0)
  return low.astype(np.float32), high.astype(np.float32)
