"""The multi-label scores against values worked out by hand, a known temperature and conformal coverage bounds."""

import json
import math

import numpy as np
import pytest
import scipy.special

from ensemble.errors import UsageError
from ensemble.uncertainty import conformal, multilabel

LOG2 = math.log(2)
TINY_COST = -math.log(np.finfo(np.float64).tiny)  # ~708 nats: what a probability of 0 on the true value costs


# Entropy and its decomposition.

def test_binary_entropy_by_hand_and_at_the_ends():
  entropy = multilabel.binary_entropy(np.array([0.0, 1.0, 0.5, 0.2]))
  np.testing.assert_allclose(entropy, [0.0, 0.0, LOG2, -(0.2 * math.log(0.2) + 0.8 * math.log(0.8))], rtol=1e-12)
  assert not np.isnan(entropy).any()


def test_members_that_contradict_each_other_are_all_epistemic_and_agreeing_members_none():
  """Label 0: members say 0 and 1 (total log 2, each member 0). Label 1: both say 0.5 (all aleatoric)."""
  member_probs = np.array([[[0.0, 0.5]], [[1.0, 0.5]]])  # (K=2, N=1, L=2)
  parts = multilabel.decompose(member_probs)
  np.testing.assert_allclose(parts['entropy'], [[LOG2, LOG2]], rtol=1e-12)
  np.testing.assert_allclose(parts['aleatoric'], [[0.0, LOG2]], rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(parts['mutual_information'], [[LOG2, 0.0]], rtol=1e-12, atol=1e-15)

  probs = np.random.default_rng(0).uniform(size=(50, 4))
  agreeing = multilabel.decompose(np.stack([probs] * 5))
  np.testing.assert_allclose(agreeing['mutual_information'], 0.0, atol=1e-12)
  np.testing.assert_allclose(agreeing['entropy'], agreeing['aleatoric'], rtol=1e-12)


def test_total_is_aleatoric_plus_epistemic():
  member_probs = np.random.default_rng(1).uniform(size=(5, 200, 3))
  parts = multilabel.decompose(member_probs)
  assert all(parts[key].shape == (200, 3) for key in ('entropy', 'aleatoric', 'mutual_information'))
  np.testing.assert_allclose(parts['entropy'], parts['aleatoric'] + parts['mutual_information'], rtol=1e-12, atol=1e-15)
  assert (parts['mutual_information'] > 0).mean() > 0.99  # members that differ disagree somewhere: not a clipped zero


# NLL, Brier, ECE.

def test_nll_and_brier_by_hand():
  """Label 0: p 0.8 on a 1 and 0.3 on a 0. Label 1: p 0 on a 1 (clipped, ~708 nats) and 0 on a 0 (free)."""
  probs, labels = np.array([[0.8, 0.0], [0.3, 0.0]]), np.array([[1, 1], [0, 0]])
  np.testing.assert_allclose(multilabel.nll(probs, labels), [-(math.log(0.8) + math.log(0.7)) / 2, TINY_COST / 2])
  np.testing.assert_allclose(multilabel.brier(probs, labels), [(0.2 ** 2 + 0.3 ** 2) / 2, 0.5])
  # Booleans read as 0/1.
  np.testing.assert_allclose(multilabel.nll(probs, labels.astype(bool)), multilabel.nll(probs, labels))


def test_ensemble_nll_from_logits_keeps_the_cost_of_a_confident_mistake():
  """Two members on one example whose label is 1, at logits -1000 and -900: sigmoid is 0 for both in float64,
  yet -log((e^-1000 + e^-900) / 2) = 900 + log 2 - log1p(e^-100)."""
  member_logits = np.array([[[-1000.0, 2.0]], [[-900.0, -1.0]]])  # (K=2, N=1, L=2)
  labels = np.array([[1, 0]])
  member_probs = scipy.special.expit(member_logits)
  expected_second = -math.log((scipy.special.expit(-2.0) + scipy.special.expit(1.0)) / 2)
  np.testing.assert_allclose(multilabel.ensemble_nll(member_logits, labels), [900 + LOG2, expected_second],
                             rtol=1e-12)
  assert multilabel.nll(member_probs.mean(0), labels)[0] == pytest.approx(TINY_COST)  # from probabilities: clipped

  rng = np.random.default_rng(2)
  logits, labels = rng.normal(size=(1, 100, 3)) * 3, rng.integers(0, 2, (100, 3))
  np.testing.assert_allclose(multilabel.ensemble_nll(logits, labels),
                             multilabel.nll(scipy.special.expit(logits[0]), labels), rtol=1e-10)


def test_ece_bins_the_probability_of_a_one_against_the_share_of_ones():
  """Label 0, 15 bins: p 0.1 twice (one 1: gap 0.4), 0.9 twice (both 1: gap 0.1), 0.5 once (a 0: gap 0.5).
  ECE = 2/5 * 0.4 + 2/5 * 0.1 + 1/5 * 0.5 = 0.3 (the top-label variant would give 0.22). Label 1: p 0.5 on
  two 1s and three 0s; one bin, gap |0.4 - 0.5| = 0.1."""
  probs = np.array([[0.1, 0.5], [0.1, 0.5], [0.9, 0.5], [0.9, 0.5], [0.5, 0.5]])
  labels = np.array([[0, 1], [1, 1], [1, 0], [1, 0], [0, 0]])
  np.testing.assert_allclose(multilabel.ece(probs, labels), [0.3, 0.1])
  # One bin: the global gap |mean p - share of ones| = |0.5 - 0.6| for label 0.
  np.testing.assert_allclose(multilabel.ece(probs, labels, num_bins=1), [0.1, 0.1])
  # p = 0 and p = 1 land in the first and last bins, and a perfect prediction scores 0.
  assert multilabel.ece(np.array([[0.0], [1.0]]), np.array([[0], [1]])).tolist() == [0.0]


# Average precision.

def test_average_precision_by_hand():
  """Label 0, scikit-learn's documented example: thresholds 0.8 (P 1, R 1/2), 0.4 (P 1/2), 0.35 (P 2/3, R 1):
  AP = 1/2 * 1 + 1/2 * 2/3. Label 1, ties: a 1 and a 0 both at 0.5, listed 1 first, are one threshold
  (0.9: P 0, R 0; 0.5: P 1/3, R 1/2; 0.1: P 1/2, R 1): AP = 1/2 * 1/3 + 1/2 * 1/2 = 5/12, where taking the 1
  first would give 1/2."""
  probs = np.array([[0.1, 0.9], [0.4, 0.5], [0.35, 0.5], [0.8, 0.1]])
  labels = np.array([[0, 0], [0, 1], [1, 0], [1, 1]])
  np.testing.assert_allclose(multilabel.average_precision(probs, labels), [5 / 6, 5 / 12])
  assert multilabel.mean_average_precision(probs, labels) == pytest.approx((5 / 6 + 5 / 12) / 2)


def test_average_precision_matches_a_loop_over_distinct_thresholds():
  rng = np.random.default_rng(6)
  probs = np.round(rng.uniform(size=(300, 4)), 1)  # eleven distinct values: many ties
  labels = (rng.random((300, 4)) < probs).astype(int)
  expected = []
  for p, y in zip(probs.T, labels.T):
    area, last_recall = 0.0, 0.0
    for threshold in np.unique(p)[::-1]:
      flagged = p >= threshold
      recall = (flagged & (y == 1)).sum() / y.sum()
      area += (recall - last_recall) * (flagged & (y == 1)).sum() / flagged.sum()
      last_recall = recall
    expected.append(area)
  np.testing.assert_allclose(multilabel.average_precision(probs, labels), expected, rtol=1e-12)


def test_labels_with_no_positive_or_no_negative():
  """A label never 1 reads 0.0 and mAP skips it; one always 1 has precision 1 throughout."""
  probs = np.array([[0.9, 0.2, 0.3], [0.2, 0.6, 0.4], [0.7, 0.1, 0.9]])
  labels = np.array([[1, 0, 1], [0, 0, 1], [1, 0, 1]])
  np.testing.assert_allclose(multilabel.average_precision(probs, labels), [1.0, 0.0, 1.0])
  assert multilabel.mean_average_precision(probs, labels) == 1.0

  scores = multilabel.scores(probs, labels)
  json.dumps(scores, allow_nan=False)  # JSON-ready: plain floats and lists, no NaN
  assert scores['average_precision_per_label'] == [1.0, 0.0, 1.0] and scores['map'] == 1.0
  assert set(scores) == {'nll', 'nll_per_label', 'brier', 'brier_per_label', 'ece', 'ece_per_label',
                         'average_precision_per_label', 'map', 'subset_accuracy', 'hamming_loss'}
  assert scores['nll'] == pytest.approx(np.mean(scores['nll_per_label']))
  assert all(isinstance(value, (float, list)) for value in scores.values())


def test_no_label_with_a_positive_is_a_usage_error():
  with pytest.raises(UsageError, match='needs a label that is 1 on some example'):
    multilabel.mean_average_precision(np.full((4, 3), 0.2), np.zeros((4, 3), int))
  with pytest.raises(UsageError):
    multilabel.scores(np.full((4, 3), 0.2), np.zeros((4, 3), int))


# Thresholded scores.

def test_subset_accuracy_and_hamming_loss_by_hand():
  """Predicted [[1, 0, 1], [0, 1, 0]] (0.5 reads 0) against [[1, 0, 1], [0, 1, 1]]: one example all right, one
  pair of six wrong."""
  probs = np.array([[0.9, 0.2, 0.6], [0.4, 0.7, 0.5]])
  labels = np.array([[1, 0, 1], [0, 1, 1]])
  assert multilabel.subset_accuracy(probs, labels) == 0.5
  assert multilabel.hamming_loss(probs, labels) == pytest.approx(1 / 6)
  assert multilabel.subset_accuracy(probs, labels, threshold=0.45) == 1.0
  assert multilabel.hamming_loss(probs, labels, threshold=0.45) == 0.0


# Temperature scaling.

def _draws(temperature, n=20000, num_labels=3, seed=3):
  """The model says sigmoid(z); the labels are drawn from sigmoid(z / T0)."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(n, num_labels)) * 4
  labels = (rng.random((n, num_labels)) < scipy.special.expit(logits / temperature)).astype(int)
  return scipy.special.expit(logits), labels


def test_temperature_scale_is_sigmoid_of_the_scaled_logit():
  probs = np.array([[0.2, 0.5, 0.9], [0.0, 1.0, 0.7]])
  np.testing.assert_allclose(multilabel.temperature_scale(probs[:1], 2.0),
                             scipy.special.expit(scipy.special.logit(probs[:1]) / 2.0), rtol=1e-12)
  per_label = multilabel.temperature_scale(probs[:1], np.array([1.0, 3.0, 0.5]))
  np.testing.assert_allclose(per_label, [[0.2, 0.5, scipy.special.expit(scipy.special.logit(0.9) * 2)]], rtol=1e-12)
  ends = multilabel.temperature_scale(probs[1:], 2.0)[0]
  assert np.isfinite(ends).all() and ends[0] < 1e-150 and ends[1] == 1.0  # clipped at tiny, not NaN


def test_fit_temperature_recovers_a_known_temperature():
  probs, labels = _draws(2.0)
  temperature = multilabel.fit_temperature(probs, labels)
  assert isinstance(temperature, float) and temperature == pytest.approx(2.0, rel=0.1)
  fitted = multilabel.nll(multilabel.temperature_scale(probs, temperature), labels).mean()
  for other in (1.0, temperature * 1.05, temperature / 1.05):
    assert fitted < multilabel.nll(multilabel.temperature_scale(probs, other), labels).mean()


def test_fit_temperature_per_label_recovers_each_labels_temperature():
  true = np.array([2.0, 1.0, 0.5])
  probs, labels = _draws(true, seed=4)
  temperatures = multilabel.fit_temperature(probs, labels, per_label=True)
  assert temperatures.shape == (3,)
  np.testing.assert_allclose(temperatures, true, rtol=0.1)
  # Each label's own temperature beats one for all on that label.
  shared = multilabel.fit_temperature(probs, labels)
  own = multilabel.nll(multilabel.temperature_scale(probs, temperatures), labels)
  assert (own < multilabel.nll(multilabel.temperature_scale(probs, shared), labels)).all()


# Conformal sets per label.

def test_conformal_sets_by_hand():
  """Scores 1 - p(y); with q = 0.3 a value is in when its probability is at least 0.7."""
  probs, labels = np.array([[0.9, 0.2], [0.4, 0.5]]), np.array([[1, 1], [0, 0]])
  np.testing.assert_allclose(multilabel.label_scores(probs, labels), [[0.1, 0.8], [0.4, 0.5]])
  sets = multilabel.prediction_sets(probs, np.array([0.3, 0.5]))
  assert sets.shape == (2, 2, 2)
  assert sets[:, 0].tolist() == [[False, True], [False, False]]  # {1}; p 0.4 is too ambiguous at q 0.3: empty
  assert sets[:, 1].tolist() == [[True, False], [True, True]]  # {0}; p 0.5 at q 0.5: {0, 1}


def test_conformal_coverage_per_label_within_the_binomial_bounds():
  """Calibrated on n draws and judged on m fresh ones, each label's coverage falls within coverage_bounds (99%),
  for a calibrated label, an overconfident one and an underconfident one."""
  n, m, alpha = 1000, 2000, 0.1
  rng = np.random.default_rng(5)
  model_temperature = np.array([1.0, 3.0, 0.5])  # the model says sigmoid(z * T) of labels drawn from sigmoid(z)

  def draw(size):
    logits = rng.normal(size=(size, 3)) * 2
    labels = (rng.random((size, 3)) < scipy.special.expit(logits)).astype(int)
    return scipy.special.expit(logits * model_temperature), labels

  quantiles = multilabel.calibrated_quantiles(*draw(n), alpha)
  assert quantiles.shape == (3,)
  test_probs, test_labels = draw(m)
  sets = multilabel.prediction_sets(test_probs, quantiles)
  covered = np.take_along_axis(sets, test_labels[..., None], axis=-1)[..., 0]
  low, high = conformal.coverage_bounds(n, m, alpha)
  for label, coverage in enumerate(covered.mean(0)):
    assert low <= coverage <= high, (label, coverage, (low, high))
  assert (quantiles >= 0.5).all() and sets.any(-1).all()  # at alpha 0.1 no set is empty
