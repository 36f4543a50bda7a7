"""The distance step (Ensemble.distance): far from the training data the members agree and are confident, and the
distance in their penultimate features still tells those inputs apart; it travels with the value."""

import json
import os

import numpy as np
import pytest

import ensemble
from ensemble import export, predict as predict_cli
from ensemble.uncertainty import distance, ood

CLASSES, FEATURES = 4, 12


def blobs(n: int, seed: int):
  """Four overlapping Gaussian blobs in 12 features: (x float32, y int32)."""
  centres = np.random.default_rng(0).normal(0, 1.5, (CLASSES, FEATURES))
  rng = np.random.default_rng(seed)
  y = rng.integers(0, CLASSES, n)
  return (centres[y] + rng.normal(0, 1, (n, FEATURES))).astype(np.float32), y.astype(np.int32)


@pytest.fixture(scope='module')
def fitted():
  (x, y), (x_test, _) = blobs(2000, 1), blobs(500, 2)
  ens = ensemble.fit('mlp', (x, y), ensemble_size=4, epochs=5, standardize_features=True, learning_rate=0.05,
                     progress=False)
  # The test rows moved 6 standard deviations of the training data, each feature away from its mean.
  far = x_test + 6 * x.std(0) * np.sign(x_test - x.mean(0))
  return ens, ens.distance(x, y), (x, y), x_test, far


def test_far_rows_are_told_apart_by_the_distance_alone(fitted):
  ens, measured, _, x_test, far = fitted
  near, away = measured.predict(x_test), measured.predict(far)
  assert ens.predict(x_test).keys() == {k for k in near if k != 'distance'}
  assert near['distance'].shape == (len(x_test),)
  # The members are as sure far away as near: their disagreement does not see it, the distance does.
  assert away['probs'].max(-1).mean() > 0.8
  assert ood.auroc(near['mutual_information'], away['mutual_information']) < 0.8
  assert ood.auroc(near['distance'], away['distance']) >= 0.95


def test_the_value_saves_loads_exports_and_predicts(fitted, tmp_path):
  _, measured, _, x_test, far = fitted
  rows = np.concatenate([x_test[:20], far[:20]])
  loaded = ensemble.load(measured.save(str(tmp_path / 'saved')).workdir)
  assert loaded.posthoc == measured.posthoc and 'distance 4 Gaussians' in repr(loaded)
  # A restored member standardises its features itself, in float32 (the value in memory did on the host).
  np.testing.assert_allclose(loaded.predict(rows)['distance'], measured.predict(rows)['distance'], rtol=1e-5)
  with open(os.path.join(loaded.workdir, 'ensemble.json'), encoding='utf-8') as f:
    assert [step['kind'] for step in json.load(f)['posthoc']] == ['distance']
  served = export.export(loaded, ['cpu']).call(rows)
  np.testing.assert_allclose(np.asarray(served['distance']), measured.predict(rows)['distance'], rtol=1e-3)
  np.save(tmp_path / 'rows.npy', rows)
  predict_cli.predict_files(loaded.workdir, str(tmp_path / 'rows.npy'), str(tmp_path / 'out.jsonl'), flag=False)
  with open(tmp_path / 'out.jsonl', encoding='utf-8') as f:
    written = [json.loads(line)['distance'] for line in f]
  np.testing.assert_allclose(written, measured.predict(rows)['distance'], rtol=1e-5)


def test_the_report_scores_the_distance_beside_the_probabilities(fitted):
  ens, measured, _, x_test, far = fitted
  y_test = ens.predict(x_test)['class']
  found = measured.report(x_test, y_test, ood={'far': far})['ood']['far']['ensemble']
  assert found['distance']['auroc'] >= 0.95 > found['mutual_information']['auroc']
  assert 'distance' not in ens.report(x_test, y_test, ood={'far': far})['ood']['far']['ensemble']


def test_a_chain_with_a_distance_step_reports_and_evaluates_as_it_predicts(fitted):
  """The chain the docs build up to: a temperature, class-conditional sets, then the distance. The report's and
  evaluate's passes over the chain take the members' outputs without their features; they give the sets and the
  scaled probabilities that `predict` gives (they ended in KeyError: 'features')."""
  ens, _, (x, y), x_test, _ = fitted
  (xc, yc), (xt, yt) = blobs(400, 3), blobs(300, 4)
  scaled = ens.calibrate(xc, yc).conformal(xc, yc, alpha=0.2, class_conditional=True)
  chained = scaled.distance(x, y)
  predicted = chained.predict(xt)
  covered = predicted['set'][np.arange(len(yt)), yt]
  reported = chained.report(xt, yt)['posthoc_conformal']
  assert reported['coverage'] == pytest.approx(covered.mean()) and reported['test_examples'] == len(yt)
  assert [g['coverage'] for g in reported['groups']] == pytest.approx([covered[yt == c].mean() for c in range(CLASSES)])
  evaluated = chained.evaluate(xt, yt)['temperature_scaled']
  assert evaluated == pytest.approx(scaled.evaluate(xt, yt)['temperature_scaled'])
  assert evaluated['nll'] == pytest.approx(-np.log(predicted['probs'][np.arange(len(yt)), yt]).mean(), rel=1e-5)


def test_a_regression_s_report_judges_its_distance_on_unfamiliar_rows(fitted, tmp_path):
  """Its outputs are no probabilities, so the chain's distance is its one score of unfamiliar inputs: the report
  scores it (it refused ood= whatever the chain), and without a distance step refuses ood= in one line."""
  _, _, (x, _), x_test, far = fitted
  targets = lambda rows: (rows[:, :2] @ np.array([1.0, -0.5]) + np.sin(rows[:, 2])).astype(np.float32)
  ens = ensemble.fit('mlp', (x, targets(x)), task='regression', ensemble_size=2, epochs=3, progress=False)
  measured = ens.distance(x)
  found = measured.report(x_test, targets(x_test), ood={'far': far}, output_dir=str(tmp_path / 'report'))['ood']
  assert found['far']['examples'] == len(far) and list(found['far']['ensemble']) == ['distance']
  assert found['far']['ensemble']['distance']['auroc'] >= 0.95
  with pytest.raises(ensemble.UsageError, match=r'regression ensemble: fit a distance step first'):
    ens.report(x_test, targets(x_test), ood={'far': far})


def test_bad_input_is_one_line(fitted):
  ens, _, (x, y), _, _ = fitted
  few = np.isin(y, [0, 1, 2]) | (np.cumsum(y == 3) <= 1)  # one row of class 3
  with pytest.raises(ensemble.UsageError, match=r'^distance: class 3 has 1 of the \d+ rows given.*pooled') as e:
    ens.distance(x[few], y[few])
  assert '\n' not in str(e.value)
  with pytest.raises(ensemble.UsageError, match="per class; give the rows' labels"):
    ens.distance(x)
  with pytest.raises(ensemble.UsageError, match='distance'):
    ens.distance(x[:, :5], y)
  with pytest.raises(ensemble.UsageError, match='distance'):
    ens.distance(x, y[:10])


def test_methods_without_one_feature_space_are_refused():
  x, y = blobs(64, 3)
  ens = ensemble.fit('mlp', (x, y), ensemble_size=2, epochs=1, method='snapshot', snapshot_cycles=1,
                     batch_size=32, progress=False)
  with pytest.raises(ensemble.UsageError, match=r'^distance: method snapshot .*; use method independent'):
    ens.distance(x, y)


def test_the_gaussians_measure_in_standard_deviations():
  """One Gaussian of known covariance: the distance of a point is its Mahalanobis distance, the same traced."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  scale = np.array([1.0, 10.0])
  rows = rng.normal(0, 1, (20000, 2)) * scale
  fitted = distance.fit(rows[None], None)
  points = np.array([[3.0, 0.0], [0.0, 30.0], [0.0, 0.0]])
  np.testing.assert_allclose(distance.score(fitted['means'], fitted['whitening'], points[None]), [3, 3, 0], atol=0.1)
  traced = distance.score(fitted['means'], fitted['whitening'], jnp.asarray(points[None], jnp.float32), xp=jnp)
  np.testing.assert_allclose(np.asarray(traced), [3, 3, 0], atol=0.1)
