"""The uncertainty scores against cases worked out by hand, and conformal coverage over many random draws."""

import math

import numpy as np
import pytest

from ensemble import calibration
from ensemble.uncertainty import conformal, decomposition, ood, selective

LOG2 = math.log(2)
H = lambda *p: -sum(x * math.log(x) for x in p if x > 0)  # entropy of one distribution, by hand


# Decomposition.

def test_members_that_agree_exactly_have_no_epistemic_uncertainty():
  probs = np.array([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]])
  parts = decomposition.decompose(np.stack([probs] * 4))
  np.testing.assert_allclose(parts['entropy'], [H(0.7, 0.2, 0.1), LOG2])
  np.testing.assert_allclose(parts['aleatoric'], parts['entropy'])
  np.testing.assert_allclose(parts['mutual_information'], 0.0, atol=1e-12)
  assert parts['disagreement'].tolist() == [0.0, 0.0]


def test_confident_members_that_contradict_each_other_are_all_epistemic():
  """[1, 0] and [0, 1]: the mean [1/2, 1/2] has entropy log 2, each member 0, so the mutual information is log 2."""
  parts = decomposition.decompose(np.array([[[1.0, 0.0]], [[0.0, 1.0]]]))
  assert parts['entropy'] == pytest.approx([LOG2]) and parts['aleatoric'] == pytest.approx([0.0])
  assert parts['mutual_information'] == pytest.approx([LOG2]) and parts['disagreement'].tolist() == [1.0]


def test_same_vote_different_confidence():
  """[0.9, 0.1] and [0.5, 0.5]: both vote class 0 (no disagreement), yet the mutual information is positive.

  Mean [0.7, 0.3]: total H(0.7, 0.3) = 0.6109; aleatoric (H(0.9, 0.1) + log 2) / 2 = (0.3251 + 0.6931) / 2 = 0.5091;
  mutual information 0.1018.
  """
  parts = decomposition.decompose(np.array([[[0.9, 0.1]], [[0.5, 0.5]]]))
  assert parts['entropy'][0] == pytest.approx(H(0.7, 0.3)) == pytest.approx(0.6109, abs=1e-4)
  assert parts['aleatoric'][0] == pytest.approx((H(0.9, 0.1) + LOG2) / 2) == pytest.approx(0.5091, abs=1e-4)
  assert parts['mutual_information'][0] == pytest.approx(0.1018, abs=1e-4)
  assert parts['disagreement'][0] == 0.0


def test_disagreement_counts_pairs():
  """Votes 0, 0, 1 of three members: one agreeing pair of three, so 2/3 disagree; a single member never does."""
  votes = np.eye(2)[[0, 0, 1]][:, None, :]
  assert decomposition.disagreement(votes).tolist() == [pytest.approx(2 / 3)]
  assert decomposition.disagreement(votes[:1]).tolist() == [0.0]


def test_per_example_scores_average_to_the_reports_figures():
  rng = np.random.default_rng(0)
  member_probs = rng.dirichlet(np.full(5, 0.5), size=(4, 50))
  parts = decomposition.decompose(member_probs)
  assert np.mean(parts['entropy']) == pytest.approx(calibration.entropy(member_probs.mean(0)))
  assert np.mean(parts['disagreement']) == pytest.approx(calibration.disagreement(member_probs))
  np.testing.assert_allclose(parts['entropy'], parts['aleatoric'] + parts['mutual_information'])
  assert (parts['mutual_information'] >= 0).all()


# Out-of-distribution detection.

def test_separable_scores():
  figures = ood.detection(in_scores=[0.1, 0.2, 0.3], out_scores=[0.5, 0.9])
  assert figures == {'auroc': 1.0, 'aupr': 1.0, 'fpr95': 0.0}
  reversed_ = ood.detection(in_scores=[0.5, 0.9], out_scores=[0.1, 0.2, 0.3])
  assert reversed_['auroc'] == 0.0 and reversed_['fpr95'] == 1.0


@pytest.mark.parametrize('n_in, n_out', [(3, 2), (5, 5), (1, 7)])
def test_identical_scores_are_chance_whatever_the_order(n_in, n_out):
  figures = ood.detection(np.full(n_in, 0.3), np.full(n_out, 0.3))
  assert figures['auroc'] == 0.5 and figures['fpr95'] == 1.0
  assert figures['aupr'] == pytest.approx(n_out / (n_in + n_out))  # precision at the only threshold


def test_a_mixed_case_by_hand():
  """In [0.1, 0.4], out [0.35, 0.8]. Pairs out > in: 3 of 4, AUROC 0.75. From the top: 0.8 (out; precision 1,
  recall 1/2), 0.4 (in), 0.35 (out; precision 2/3, recall 1): AP = 1/2 * 1 + 1/2 * 2/3 = 5/6. Catching 95% of
  out needs the threshold 0.35, which also flags 0.4: FPR 1/2."""
  figures = ood.detection([0.1, 0.4], [0.35, 0.8])
  assert figures == {'auroc': pytest.approx(0.75), 'aupr': pytest.approx(5 / 6), 'fpr95': 0.5}


def test_ties_across_the_sets_count_half():
  """In [0.5, 0.2], out [0.5, 0.9]: of the 4 pairs, 3 are won and the tie 0.5 = 0.5 counts half: 3.5 / 4."""
  assert ood.auroc([0.5, 0.2], [0.5, 0.9]) == 0.875
  assert ood.auroc([0.2, 0.5], [0.9, 0.5]) == 0.875


def test_auroc_is_the_mann_whitney_statistic():
  rng = np.random.default_rng(1)
  inside, outside = rng.integers(0, 20, 300) / 10, rng.integers(5, 25, 200) / 10  # many ties
  pairs = (outside[None, :] > inside[:, None]) + 0.5 * (outside[None, :] == inside[:, None])
  assert ood.auroc(inside, outside) == pytest.approx(pairs.mean())


# Selective prediction.

def test_risk_coverage_by_hand():
  """Uncertainties 0.1 .. 0.4, the third wrong: accepting 1, 2, 3, 4 gives risks 0, 0, 1/3, 1/4;
  AURC = (0 + 0 + 1/3 + 1/4) / 4 = 7/48."""
  curve = selective.risk_coverage(np.array([0.3, 0.1, 0.4, 0.2]), np.array([False, True, True, True]))
  np.testing.assert_allclose(curve.threshold, [0.1, 0.2, 0.3, 0.4])
  np.testing.assert_allclose(curve.coverage, [0.25, 0.5, 0.75, 1.0])
  np.testing.assert_allclose(curve.risk, [0.0, 0.0, 1 / 3, 1 / 4])
  assert selective.area(curve) == pytest.approx(7 / 48)
  np.testing.assert_allclose(selective.risk_at(curve, [0.5, 0.6, 1.0]), [0.0, 1 / 3, 0.25])
  assert selective.threshold_for_risk(curve, 0.3) == {'threshold': 0.4, 'coverage': 1.0, 'risk': 0.25}
  assert selective.threshold_for_risk(curve, 0.2) == {'threshold': 0.2, 'coverage': 0.5, 'risk': 0.0}


def test_tied_uncertainty_is_accepted_together():
  """All alike: a single point at full coverage, the error rate; the AURC of uninformative uncertainty."""
  curve = selective.risk_coverage(np.zeros(4), np.array([True, False, True, True]))
  assert curve.coverage.tolist() == [1.0] and curve.risk.tolist() == [0.25]
  assert selective.area(curve) == 0.25
  assert selective.threshold_for_risk(curve, 0.1) == {'threshold': -np.inf, 'coverage': 0.0, 'risk': 0.0}


# Conformal prediction.

def test_the_finite_sample_quantile():
  """n = 10 scores 0.1 .. 1.0. alpha 0.2: rank ceil(11 * 0.8) = ceil(8.8) = 9, the score 0.9.
  alpha 0.1: ceil(9.9) = 10, the largest. alpha 0.05: ceil(10.45) = 11 > 10, every class."""
  scores = np.arange(10, 0, -1) / 10
  assert conformal.quantile(scores, 0.2) == 0.9
  assert conformal.quantile(scores, 0.1) == 1.0
  assert conformal.quantile(scores, 0.05) == math.inf
  # (n + 1)(1 - alpha) exactly whole: 20 * 0.95 = 19, not 20 because of 0.95's binary rounding.
  assert conformal.quantile(np.arange(1, 20), 0.05) == 19


def test_aps_scores_by_hand():
  """Probabilities [0.2, 0.5, 0.3]: ranked 0.5, 0.3, 0.2, cumulated 0.5, 0.8, 1.0. With u = 0.5 each class counts
  half its own probability: 0.25, 0.65, 0.9."""
  probs = np.array([[0.2, 0.5, 0.3]])
  np.testing.assert_allclose(conformal.aps_scores(probs), [[1.0, 0.5, 0.8]])
  np.testing.assert_allclose(conformal.aps_scores(probs, np.array([0.5])), [[0.9, 0.25, 0.65]])
  np.testing.assert_allclose(conformal.threshold_scores(probs), [[0.8, 0.5, 0.7]])


def test_split_conformal_by_hand():
  """Calibration: true-class probabilities 0.9, 0.8, 0.6, 0.3 -> scores 0.1, 0.2, 0.4, 0.7. alpha 0.4: rank
  ceil(5 * 0.6) = 3, q = 0.4; a test set holds every class of probability >= 0.6."""
  calibration_probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.7, 0.3]])
  test_probs = np.array([[0.65, 0.35], [0.5, 0.5], [0.1, 0.9]])
  result = conformal.split_conformal(calibration_probs, np.array([0, 1, 0, 1]), test_probs, np.array([0, 1, 0]),
                                     alpha=0.4)
  assert result == {'quantile': pytest.approx(0.4), 'coverage': pytest.approx(1 / 3), 'mean_size': 2 / 3}


def test_coverage_is_exactly_rank_over_n_plus_one():
  """With continuous scores the expected coverage is rank / (n + 1): n = 9, alpha = 0.25 -> rank ceil(7.5) = 8,
  coverage 0.8, inside [0.75, 0.75 + 1/10]. Rank ceil(n (1 - alpha)) = 7 would give 0.7 and break the guarantee."""
  rng = np.random.default_rng(0)
  draws = 20_000
  calibration_scores, test_scores = rng.uniform(size=(draws, 9)), rng.uniform(size=(draws, 50))
  q = np.array([conformal.quantile(s, 0.25) for s in calibration_scores])
  coverage = np.mean(test_scores <= q[:, None])
  assert coverage == pytest.approx(0.8, abs=0.005)  # 3 standard errors: sd(coverage per draw) ~ 0.12 / sqrt(20,000)


@pytest.mark.parametrize('score', sorted(conformal.SCORES))
@pytest.mark.parametrize('alpha', [0.05, 0.1, 0.2])
def test_coverage_holds_over_many_draws(score, alpha):
  """A miscalibrated 5-class model on exchangeable data: mean coverage over 300 draws of 200 calibration and 200
  test examples lies in [1 - alpha, 1 - alpha + 1/(n + 1)], up to 3 standard errors of the mean."""
  n, seeds = 200, 300
  coverages, sizes = [], []
  for seed in range(seeds):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (2 * n, 5))
    true_probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    labels = (true_probs.cumsum(-1) < rng.uniform(size=(2 * n, 1))).sum(-1)
    overconfident = np.exp(2 * logits) / np.exp(2 * logits).sum(-1, keepdims=True)
    result = conformal.split_conformal(overconfident[:n], labels[:n], overconfident[n:], labels[n:], alpha, score,
                                       seed=seed)
    coverages.append(result['coverage'])
    sizes.append(result['mean_size'])
  standard_error = np.std(coverages) / math.sqrt(seeds)
  assert 1 - alpha - 3 * standard_error <= np.mean(coverages) <= 1 - alpha + 1 / (n + 1) + 3 * standard_error
  assert 1 <= np.mean(sizes) < 5  # informative: fewer than all classes
