"""Bayesian optimisation's trust region (TuRBO's): the box's side replayed from the values alone, and a loop whose
chosen points lie in the box about the best point that its record implies."""

import numpy as np
import pytest

import ensemble
from ensemble.errors import UsageError
from ensemble.loops import trust_region


def test_the_side_doubles_after_successes_halves_after_failures_and_starts_again_below_its_least():
  side = lambda rounds, dimensions=2: trust_region.side(0.0, rounds, dimensions)
  better = [[1.0], [2.0], [3.0]]  # three rounds in a row that improved on the best
  assert side([]) == trust_region.INITIAL
  assert side(better) == 1.6 and side(better * 2) == 1.6  # doubled, to at most 1.6
  worse = [[-1.0]] * 4  # max(4, D=2) / q=1 rounds in a row that did not
  assert side(worse) == 0.4 and side(worse[:3]) == 0.8
  assert trust_region.side(1.0, [[1.0005]] * 4, 2) == 0.4  # within 1e-3 of the best's magnitude: no improvement
  assert side(worse * 6) == 0.8 * 0.5 ** 6 and side(worse * 7) == 0.8  # below 0.5^7: the box starts again
  # a round counts by its best value; q=2 of D=20 allows 10 failures
  assert side([[-1.0, 1.0], [-1.0, 2.0], [3.0, -1.0]], dimensions=20) == 1.6
  assert side([[-1.0, -1.0]] * 10, dimensions=20) == 0.4 and side([[-1.0, -1.0]] * 9, dimensions=20) == 0.8


def test_the_box_is_about_the_centre_and_within_the_unit_box():
  low, high = trust_region.box(np.array([0.1, 0.5]), 0.4)
  np.testing.assert_allclose(low, [0.0, 0.3])
  np.testing.assert_allclose(high, [0.3, 0.7])


def _flat(x):
  return 1.0  # nothing improves on the first point: the box about it halves every 4 rounds (D = 2)


@pytest.mark.parametrize('acquisition, batch', [('epistemic_std', 1), ('ei', 2), ('thompson', 2)])
def test_a_loop_with_a_trust_region_chooses_points_in_the_box_its_record_implies(acquisition, batch):
  """One point a round, 4 rounds without improvement halve the box (max(4, D=2) / 1); two a round, 2 rounds."""
  bounds = np.array([[-1.0, 2.0], [0.0, 1.0]])
  result = ensemble.bayesian_optimization('mlp', _flat, bounds.tolist(), evaluations=17, initial=5,
                                          acquisition=acquisition, batch=batch, trust_region=True, candidates=64,
                                          steps=5, ensemble_size=2, epochs=5, seed=0)
  sides = [entry['trust_region'] for entry in result.curve[5:]]
  assert sides == [0.8] * 4 + [0.4] * 4 + [0.2] * 4
  centre = (result.x[0] - bounds[:, 0]) / (bounds[:, 1] - bounds[:, 0])  # the best, the first of equals
  unit = (result.x[5:] - bounds[:, 0]) / (bounds[:, 1] - bounds[:, 0])
  distance = np.abs(unit - centre).max(1)
  assert (distance <= np.asarray(sides) / 2 + 1e-6).all()
  assert distance[-4:].max() <= 0.1 + 1e-6 < np.abs(
      np.random.default_rng(0).uniform(size=(1000, 2)) - centre).max(1).mean()  # where a whole-box search goes


def test_a_trust_region_for_random_search_is_refused_in_one_line():
  with pytest.raises(UsageError, match=r"trust_region=True narrows where the acquisition is maximised, and "
                                       r"acquisition='random' has none") as raised:
    ensemble.bayesian_optimization('mlp', _flat, [(0, 1)], evaluations=3, initial=2, acquisition='random',
                                   trust_region=True)
  assert '\n' not in str(raised.value)
