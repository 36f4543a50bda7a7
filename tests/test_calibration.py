"""The scores, against values worked out by hand and against a second computation."""

import functools
import itertools
import math

import jax
import numpy as np
import pytest
import scipy.special
import scipy.stats

from ensemble import calibration, scoring, steps


def _random_probs(n=500, num_classes=10, seed=0):
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.full(num_classes, 0.3), size=n)
  return probs, rng.integers(0, num_classes, n)


def test_perfectly_confident_and_correct():
  probs, labels = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), np.array([1, 0])
  assert calibration.scores(probs, labels) == {'accuracy': 1.0, 'nll': 0.0, 'brier': 0.0, 'ece': 0.0}
  assert calibration.entropy(probs) == 0.0


def test_perfectly_confident_and_wrong():
  probs, labels = np.array([[1.0, 0.0]]), np.array([1])
  scores = calibration.scores(probs, labels)
  assert scores['accuracy'] == 0.0 and scores['brier'] == 2.0 and scores['ece'] == 1.0
  # log(0) is clipped to log(float64 tiny): large and finite, so one such example cannot turn a mean into inf.
  assert scores['nll'] == pytest.approx(-math.log(np.finfo(np.float64).tiny))


def test_uniform_prediction():
  """1/4 on each of 4 balanced classes: calibrated (ECE 0) yet uninformative (NLL log 4)."""
  probs, labels = np.full((4, 4), 0.25), np.array([0, 1, 2, 3])
  scores = calibration.scores(probs, labels)
  assert scores['accuracy'] == 0.25  # ties go to class 0, right once in four
  assert scores['nll'] == pytest.approx(math.log(4))
  assert scores['brier'] == pytest.approx(0.75 ** 2 + 3 * 0.25 ** 2)
  assert scores['ece'] == pytest.approx(0.0)
  assert calibration.entropy(probs) == pytest.approx(math.log(4))


def test_two_bin_ece():
  """Three examples at confidence 0.95 (two right) and one at 0.7 (right).

  Bin 14 (0.933, 1]: accuracy 2/3, confidence 0.95, weight 3/4.
  Bin 10 (0.667, 0.733]: accuracy 1, confidence 0.7, weight 1/4.
  ECE = 3/4 * |2/3 - 0.95| + 1/4 * |1 - 0.7| = 0.2125 + 0.075 = 0.2875.
  """
  probs = np.array([[0.95, 0.05], [0.95, 0.05], [0.05, 0.95], [0.3, 0.7]])
  labels = np.array([0, 0, 0, 1])
  counts, confidence, accuracy = calibration.reliability(probs, labels)
  assert np.flatnonzero(counts).tolist() == [10, 14] and counts[[10, 14]].tolist() == [1, 3]
  np.testing.assert_allclose(confidence[[10, 14]], [0.7, 0.95])
  np.testing.assert_allclose(accuracy[[10, 14]], [1.0, 2 / 3])
  assert np.isnan(accuracy[0]) and np.isnan(confidence[0])
  assert calibration.ece(probs, labels) == pytest.approx(0.2875)
  # Not the global gap |accuracy - mean confidence| = |0.75 - 0.8875|.
  assert calibration.ece(probs, labels, num_bins=1) == pytest.approx(0.1375)


def test_ece_matches_a_loop_over_bin_edges():
  probs, labels = _random_probs()
  confidence, correct = probs.max(-1), probs.argmax(-1) == labels
  edges = np.linspace(0, 1, 16)
  expected = 0.0
  for lo, hi in zip(edges[:-1], edges[1:]):
    in_bin = (confidence > lo) & (confidence <= hi)
    if in_bin.any():
      expected += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
  assert calibration.ece(probs, labels) == pytest.approx(expected, rel=1e-12)


def test_nll_brier_entropy_match_other_formulas():
  rng = np.random.default_rng(1)
  logits, labels = rng.normal(size=(300, 10)) * 3, rng.integers(0, 10, 300)
  probs = scipy.special.softmax(logits, axis=-1)
  log_probs = scipy.special.log_softmax(logits, axis=-1)
  assert calibration.nll(probs, labels) == pytest.approx(-log_probs[np.arange(300), labels].mean(), rel=1e-10)
  # Brier expanded: sum_c (p_c - y_c)^2 = 1 - 2 p_y + sum_c p_c^2.
  expanded = 1 - 2 * probs[np.arange(300), labels] + (probs ** 2).sum(-1)
  assert calibration.brier(probs, labels) == pytest.approx(expanded.mean(), rel=1e-10)
  assert calibration.entropy(probs) == pytest.approx(scipy.stats.entropy(probs, axis=-1).mean(), rel=1e-10)


def test_disagreement_by_hand_and_by_pairs():
  one_hot = np.eye(2)
  # Member votes on two examples: [0, 0], [0, 1], [1, 1]. Each example: 2 of the 3 pairs disagree.
  member_probs = one_hot[np.array([[0, 0], [0, 1], [1, 1]])]
  assert calibration.disagreement(member_probs) == pytest.approx(2 / 3)
  assert calibration.disagreement(np.stack([member_probs[0]] * 4)) == 0.0
  assert calibration.disagreement(member_probs[:1]) == 0.0

  member_probs = np.stack([_random_probs(num_classes=3, seed=seed)[0] for seed in range(6)])
  top = member_probs.argmax(-1)
  by_pairs = np.mean([np.mean(top[i] != top[j]) for i, j in itertools.combinations(range(6), 2)])
  assert calibration.disagreement(member_probs) == pytest.approx(by_pairs, rel=1e-12)


def test_temperature_one_changes_nothing():
  probs, _ = _random_probs()
  np.testing.assert_allclose(calibration.temperature_scale(probs, 1.0), probs, rtol=1e-12, atol=1e-300)


def test_fit_temperature_recovers_a_known_temperature():
  """Labels drawn from softmax(z / 2) while the model says softmax(z): the fit must find T = 2."""
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(20000, 10)) * 4
  true = scipy.special.softmax(logits / 2, axis=-1)
  labels = (true.cumsum(-1) > rng.random((20000, 1))).argmax(-1)
  probs = scipy.special.softmax(logits, axis=-1)
  temperature = calibration.fit_temperature(probs, labels)
  assert temperature == pytest.approx(2.0, rel=0.05)
  fitted = calibration.nll(calibration.temperature_scale(probs, temperature), labels)
  for other in (1.0, temperature * 1.05, temperature / 1.05):
    assert fitted < calibration.nll(calibration.temperature_scale(probs, other), labels)
  # Scaling after averaging keeps the ranking of classes, so accuracy does not move.
  assert calibration.accuracy(calibration.temperature_scale(probs, temperature), labels) == \
      calibration.accuracy(probs, labels)


def test_trainer_and_evaluator_agree_on_the_ensemble_nll_where_probabilities_underflow():
  """Two members, three examples; on the last two both put on the label a probability that float32 (and, at
  e^-1000, float64) rounds to 0. The NLL of their mean comes from log-probabilities on both sides."""
  logits = np.array([[[2.0, 0.0, -1.0], [0.0, -150.0, 0.0], [0.0, -1000.0, 0.0]],
                     [[1.0, 0.5, 0.0], [0.0, -120.0, 0.0], [0.0, -900.0, 0.0]]])  # (members, examples, classes)
  labels = np.array([0, 1, 1])
  log_probs = scipy.special.log_softmax(logits, axis=-1)
  label_log_probs = np.take_along_axis(log_probs, labels[None, :, None], axis=-1)[..., 0]
  # log((e^a + e^b) / 2) = max + log1p(e^-|a-b|) - log 2, by hand.
  expected = -(label_log_probs.max(0) + np.log1p(np.exp(-np.abs(label_log_probs[0] - label_log_probs[1])))
               - np.log(2))
  assert expected[2] > 900 and expected[1] > 120  # beyond the clips: 708 nats (float64), 87 nats (float32)

  trainer_side = jax.vmap(functools.partial(steps.eval_outputs, axis_name='members'), in_axes=(0, None),
                          axis_name='members')(logits.astype(np.float32), labels)['ensemble_loss']
  np.testing.assert_allclose(trainer_side[0], expected, rtol=1e-6)  # every member holds the ensemble's loss

  evaluator_side = calibration.ensemble_nll(log_probs, labels)
  np.testing.assert_allclose(evaluator_side, expected.mean(), rtol=1e-12)
  np.testing.assert_allclose(evaluator_side, np.mean(trainer_side[0]), rtol=1e-6)
  scored = scoring.score_test_set(log_probs, labels)
  assert scored['ensemble']['nll'] == evaluator_side
  assert scored['ensemble_size_curve'][-1]['nll'] == evaluator_side
  np.testing.assert_allclose([m['nll'] for m in scored['members']], -label_log_probs.mean(1), rtol=1e-12)
