"""Split-conformal prediction sets: sets of classes that hold the true class with probability at least 1 - alpha.

A score says how badly a class fits an input (`SCORES`); the threshold is a
quantile of the true classes' scores on n calibration examples, and a test
input's set is every class scoring at or below it. If the calibration and test
examples are exchangeable (drawn alike), the set holds the true class with
probability in [1 - alpha, 1 - alpha + 1/(n + 1)] (the upper bound when scores
do not tie), over the draw of both, whatever the model (Vovk et al. 2005;
Angelopoulos and Bates 2021). The guarantee is on average over inputs, not for
each input, and it does not survive a shift of the data.
"""

import math

import numpy as np


def _as_float(values, xp):
  """On the host in float64; traced (`xp=jnp`, `ensemble.export`) as they come."""
  return np.asarray(values, np.float64) if xp is np else values


def threshold_scores(probs: np.ndarray, u: np.ndarray | None = None, xp=np) -> np.ndarray:
  """(N, C): 1 - p(class), the least-ambiguous-set score (Sadinle et al. 2019): the smallest sets on average,
  the same threshold for easy and hard inputs. `u` is unused (the score is deterministic)."""
  del u
  return 1.0 - _as_float(probs, xp)


def aps_scores(probs: np.ndarray, u: np.ndarray | None = None, xp=np) -> np.ndarray:
  """(N, C): adaptive prediction sets (Romano et al. 2020), the probability of the classes ranked above a class
  plus `u` times its own; `u` (N,) uniform in [0, 1] makes the scores continuous, so coverage is exact.

  A confident input gets a small set and an ambiguous one a large set. Without
  `u` the class's whole probability counts: sets are larger and coverage conservative.
  """
  probs = _as_float(probs, xp)
  order = xp.argsort(-probs, axis=-1, stable=True)
  ranked = xp.take_along_axis(probs, order, axis=-1)
  own = 1.0 if u is None else _as_float(u, xp)[:, None]
  ranked_scores = xp.cumsum(ranked, axis=-1) - (1.0 - own) * ranked
  return xp.take_along_axis(ranked_scores, xp.argsort(order, axis=-1), axis=-1)  # back in the classes' order


SCORES = {'thr': threshold_scores, 'aps': aps_scores}


def quantile(calibration_scores: np.ndarray, alpha: float) -> float:
  """The ceil((n + 1)(1 - alpha))-th smallest of the n scores: the finite-sample correction that makes the
  guarantee hold; inf when that rank exceeds n (too few examples for this alpha: every set is every class)."""
  n = len(calibration_scores)
  rank = math.ceil((n + 1) * (1 - alpha) - 1e-9)  # the tolerance absorbs (n + 1)(1 - alpha) landing a hair above
  if rank > n:
    return math.inf
  return float(np.sort(np.asarray(calibration_scores, np.float64))[max(rank, 1) - 1])


def group_quantiles(calibration_scores: np.ndarray, groups: np.ndarray, count: int, alpha: float
                    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
  """(quantiles (count,), examples (count,), pooled): Mondrian (class-conditional) thresholds, one per group 0..count-1,
  each `quantile` of the scores of the examples in that group (Vovk et al. 2005, section 4.5), so that each group's
  sets cover it at 1 - alpha, not only all groups on average, where a hard group hides behind easy ones.

  A group with too few examples for `alpha` (ceil((n + 1)(1 - alpha)) > n, none at all included) would get an
  infinite threshold, sets of every class for it; it is pooled instead: given the marginal quantile of all the
  scores, which keeps the marginal guarantee for it but not its own. `pooled` lists those groups, for the caller to
  say so."""
  calibration_scores, groups = np.asarray(calibration_scores, np.float64), np.asarray(groups)
  marginal = quantile(calibration_scores, alpha)
  examples = np.bincount(groups, minlength=count)[:count]
  quantiles = np.array([quantile(calibration_scores[groups == g], alpha) for g in range(count)])
  pooled = [g for g in range(count) if math.isinf(quantiles[g])]
  quantiles[pooled] = marginal
  return quantiles, examples, pooled


def label_scores(class_scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
  return np.take_along_axis(class_scores, np.asarray(labels)[:, None], axis=-1)[:, 0]


def split_conformal(calibration_probs: np.ndarray, calibration_labels: np.ndarray, test_probs: np.ndarray,
                    test_labels: np.ndarray, alpha: float, score: str = 'thr', seed: int = 0) -> dict[str, float]:
  """Calibrates sets at `alpha` on one labelled split and judges them on another: 'quantile', 'coverage' (the
  share of test sets holding the true class) and 'mean_size' (classes per set).

  The APS randomisation is drawn from `seed`, so a report is reproducible.
  """
  score_fn = SCORES[score]
  rng = np.random.default_rng(seed)
  calibration = score_fn(calibration_probs, rng.uniform(size=len(calibration_labels)))
  q = quantile(label_scores(calibration, calibration_labels), alpha)
  sets = score_fn(test_probs, rng.uniform(size=len(test_labels))) <= q
  return {'quantile': q, 'coverage': float(np.mean(label_scores(sets, test_labels))),
          'mean_size': float(np.mean(sets.sum(-1)))}


def calibrated_quantile(probs: np.ndarray, labels: np.ndarray, alpha: float, score: str) -> float:
  """The threshold of `score`'s sets at miscoverage `alpha`, calibrated on labelled (N, C) probabilities, the scores
  deterministic (APS counts each class's whole probability): what `Ensemble.conformal` keeps. Still valid at any
  n; conservative for APS, by at most the randomisation's share."""
  return quantile(label_scores(SCORES[score](probs), labels), alpha)


def prediction_sets(probs: np.ndarray, threshold: float, score: str, xp=np) -> np.ndarray:
  """(N, C) boolean: the classes whose `score` is at or below `threshold` (`calibrated_quantile`'s); traced with
  `xp=jnp` for `ensemble.export`."""
  return SCORES[score](probs, xp=xp) <= threshold


def rows_needed(alpha: float) -> int:
  """The fewest calibration examples for which sets at `alpha` are not every class (intervals not infinite):
  ceil((n + 1)(1 - alpha)) <= n."""
  return math.ceil((1 - alpha) / alpha - 1e-9)


def coverage_bounds(n: int, m: int, alpha: float, probability: float = 0.99) -> tuple[float, float]:
  """The range in which the coverage measured on m test examples falls with `probability`, for sets (intervals)
  calibrated on n examples at `alpha`, where all are exchangeable and the scores continuous: given the calibration
  examples, the coverage is Beta(k, n + 1 - k), k = ceil((n + 1)(1 - alpha)), so the share of m covered is
  beta-binomial (Vovk 2012; Angelopoulos and Bates 2021, section 3.2). A measurement outside it says that the test
  examples are not drawn as the calibration examples were (a shift), or that the scores tie."""
  import scipy.stats  # pylint: disable=g-import-not-at-top  # only where a report is made
  k = math.ceil((n + 1) * (1 - alpha) - 1e-9)
  if k > n or not m:  # every set is every class: coverage 1
    return 1.0, 1.0
  share = scipy.stats.betabinom(m, k, n + 1 - k)
  tail = (1 - probability) / 2
  return float(share.ppf(tail) / m), float(share.ppf(1 - tail) / m)
