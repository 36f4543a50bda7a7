"""Selective prediction: answer only when certain enough, and say how often the answers are then wrong.

Inputs are accepted from the least uncertain up; the risk at a coverage is the
error rate among the accepted ones (Geifman and El-Yaniv 2017). Tied
uncertainties are accepted or rejected together, so the curve has one point
per distinct value and nothing depends on the order of the inputs.
"""

from typing import NamedTuple

import numpy as np


class Curve(NamedTuple):
  """One point per distinct uncertainty `threshold` (ascending): accepting every input at or below it keeps
  `coverage` of the inputs, of which a share `risk` is wrong."""
  threshold: np.ndarray
  coverage: np.ndarray
  risk: np.ndarray


def risk_coverage(uncertainty: np.ndarray, correct: np.ndarray) -> Curve:
  uncertainty = np.asarray(uncertainty, np.float64)
  if not len(uncertainty):
    raise ValueError('risk_coverage needs at least one input')
  order = np.argsort(uncertainty, kind='stable')
  sorted_uncertainty = uncertainty[order]
  errors = np.cumsum(~np.asarray(correct, bool)[order])
  last_of_each = np.r_[np.flatnonzero(np.diff(sorted_uncertainty)), len(uncertainty) - 1]
  accepted = last_of_each + 1
  return Curve(sorted_uncertainty[last_of_each], accepted / len(uncertainty), errors[last_of_each] / accepted)


def area(curve: Curve) -> float:
  """Area under the risk-coverage curve (AURC): the mean over inputs of the risk when that input is the last
  one accepted. Lower is better; uninformative uncertainty gives the overall error rate."""
  return float(np.sum(np.diff(np.r_[0.0, curve.coverage]) * curve.risk))


def risk_at(curve: Curve, coverages: np.ndarray) -> np.ndarray:
  """The risk at each requested coverage: at the first point of the curve that covers at least that much."""
  index = np.searchsorted(curve.coverage, np.asarray(coverages, np.float64) - 1e-12)
  return curve.risk[np.minimum(index, len(curve.risk) - 1)]


def threshold_for_risk(curve: Curve, target_risk: float) -> dict[str, float]:
  """The largest coverage whose risk is at most `target_risk`: its 'threshold', 'coverage' and 'risk'.

  Inputs more uncertain than the threshold are the ones to refer. When even
  the most certain inputs miss the target, the threshold is -inf: refer all.
  """
  meets = np.flatnonzero(curve.risk <= target_risk)
  if not len(meets):
    return {'threshold': -np.inf, 'coverage': 0.0, 'risk': 0.0}
  best = meets[-1]
  return {'threshold': float(curve.threshold[best]), 'coverage': float(curve.coverage[best]),
          'risk': float(curve.risk[best])}
