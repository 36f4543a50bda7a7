"""task='multilabel': L labels of 0 and 1 per example, a sigmoid per label (ensemble/tasks/multilabel.py). The
contract (tests/contract) runs it over every method, data path and chain of post-hoc steps; here, what one ensemble
shows: it learns, its scores and its uncertainty per label, the positive weights, the command line, and each bad
input in one line."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensemble
from conftest import assert_printed_as_the_page_says, run_guide_example
import user_models
from ensemble.errors import UsageError
from ensemble.tasks import multilabel
from ensemble.uncertainty import conformal, ood

FIT = {'task': 'multilabel', 'ensemble_size': 2, 'epochs': 15, 'batch_size': 32, 'optimizer': 'adamw',
       'learning_rate': 0.01, 'standardize_features': True, 'progress': False}
LABELS = 3


def _rows(n: int, seed: int):
  """Three labels of 5 features: two linear, one a product (which a linear model cannot fit)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 5)).astype(np.float32)
  y = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0.5, x[:, 3] * x[:, 4] > 0], 1).astype(np.int32)
  return x, y


@pytest.fixture(scope='module')
def fitted():
  return ensemble.fit('mlp', _rows(400, 0), test=_rows(200, 1), **FIT)


def test_it_learns_every_label_and_scores_each(fitted):
  x, y = _rows(500, 2)
  scores = fitted.evaluate(x, y)
  ensemble_scores = scores['ensemble']
  base_rates = y.mean(0)
  # Each label's average precision well above what ranking at random gives (its base rate).
  assert all(ap > rate + 0.2 for ap, rate in zip(ensemble_scores['average_precision_per_label'], base_rates)), (
      ensemble_scores['average_precision_per_label'], base_rates)
  assert ensemble_scores['nll'] < np.log(2) and 0 <= ensemble_scores['hamming_loss'] < 0.3
  assert len(scores['members']) == 2 and len(scores['ensemble_size_curve']) == 2
  assert all(np.isfinite(v) for v in scores['mean_member'].values())
  summary = fitted.summary  # the summary's accuracy: the share of labels right, the evaluation's 1 - Hamming loss
  assert 0.7 < summary['test_accuracy'] <= 1 and 'member_test_loss/1' in summary


def test_predict_gives_per_label_probabilities_decisions_and_uncertainty(fitted):
  x, _ = _rows(50, 3)
  got = fitted.predict(x, members=True)
  assert got['probs'].shape == (50, LABELS) and got['member_probs'].shape == (2, 50, LABELS)
  np.testing.assert_allclose(got['probs'], got['member_probs'].mean(0), rtol=1e-12)
  np.testing.assert_allclose(fitted.member_probs(x), got['member_probs'], rtol=1e-12)
  np.testing.assert_array_equal(got['labels'], got['probs'] > 0.5)
  np.testing.assert_array_equal(fitted.predict(x, threshold=0.2)['labels'], got['probs'] > 0.2)
  np.testing.assert_allclose(got['entropy'], got['aleatoric'] + got['mutual_information'], atol=1e-12)
  # The members' own logits are what apply gives: their sigmoids the members' probabilities.
  logits = fitted.apply(fitted.params, jnp.asarray(x))
  np.testing.assert_allclose(jax.nn.sigmoid(logits), got['member_probs'], rtol=1e-4, atol=1e-6)
  assert repr(fitted).startswith('Ensemble(2 members of mlp, multilabel of 3 labels from 5 features')


def test_a_temperature_per_label_and_conformal_sets_per_label(fitted):
  x, y = _rows(600, 4)
  one, each = fitted.calibrate(x, y), fitted.calibrate(x, y, per_label=True)
  assert isinstance(one.temperature, float) and len(each.temperature) == LABELS
  assert 'temperature (' in repr(each)
  test_x, test_y = _rows(2000, 5)
  # Fitted on held-out labels, the temperature lowers the held-out NLL it was fitted on, and so on fresh rows.
  assert each.evaluate(test_x, test_y)['temperature_scaled']['nll'] <= fitted.evaluate(test_x, test_y)['ensemble'][
      'nll'] + 1e-3
  sets = each.conformal(x, y, alpha=0.1).predict(test_x)['set']
  assert sets.shape == (2000, LABELS, 2)
  covered = np.take_along_axis(sets, test_y[..., None], -1)[..., 0].mean(0)
  low, high = conformal.coverage_bounds(600, 2000, 0.1, probability=1 - 1e-6)
  assert ((low <= covered) & (covered <= high)).all(), (covered, low, high)


def test_the_report_from_python_per_label_with_its_bounds_and_files(fitted, tmp_path):
  x, y = _rows(400, 9)
  calibration = _rows(600, 10)
  unfamiliar = np.random.default_rng(11).normal(size=(400, 5)).astype(np.float32) * 6  # far from the rows trained on
  results = fitted.report(x, y, calibration=calibration, ood={'far': unfamiliar}, output_dir=str(tmp_path))
  assert results['task'] == 'multilabel' and results['test_examples'] == 400
  assert results['ensemble'] == fitted.evaluate(x, y)['ensemble']  # one implementation
  assert len(results['temperature_scaling']['temperature']) == LABELS
  for row in results['conformal']['rows']:
    assert len(row['coverage_per_label']) == LABELS and 0 < row['mean_set_size'] <= 2  # a set may be empty
    low, high = row['bounds']
    assert row['within_bounds'] == all(low <= c <= high for c in row['coverage_per_label'])
  for score in ('mutual_information', 'entropy'):  # each summed over the labels, as predict gives them
    inside, outside = fitted.predict(x)[score].sum(-1), fitted.predict(unfamiliar)[score].sum(-1)
    np.testing.assert_allclose(results['ood']['far']['ensemble'][score]['auroc'], ood.auroc(inside, outside))
  written = (tmp_path / 'report.md').read_text()
  assert '## Conformal sets per label' in written and '## Temperature per label' in written and 'far' in written
  assert (tmp_path / 'ensemble_size.png').stat().st_size > 0 and (tmp_path / 'metrics.json').exists()


def test_positive_weights_raise_the_probabilities_of_their_labels():
  x, y = _rows(400, 0)
  plain = ensemble.fit('mlp', (x, y), **{**FIT, 'epochs': 5})
  weighted = ensemble.fit('mlp', (x, y), pos_weight=(1.0, 1.0, 5.0), **{**FIT, 'epochs': 5})
  test = _rows(300, 6)[0]
  plain_probs, weighted_probs = plain.predict(test)['probs'], weighted.predict(test)['probs']
  assert weighted_probs[:, 2].mean() > plain_probs[:, 2].mean() + 0.05, (plain_probs.mean(0), weighted_probs.mean(0))
  with pytest.raises(UsageError, match=r'pos_weight holds 2 weights.*3 labels'):
    ensemble.fit('mlp', (x, y), pos_weight=(1.0, 2.0), **FIT)
  with pytest.raises(UsageError, match=r'pos_weight=.*must be positive'):
    ensemble.fit('mlp', (x, y), pos_weight=(1.0, -2.0, 1.0), **FIT)
  with pytest.raises(UsageError, match=r'classification data: pos_weight weighs the labels of task=multilabel'):
    ensemble.fit('mlp', (x, y[:, 0]), **{**FIT, 'task': 'classification', 'pos_weight': (2.0,)})


def test_snapshots_combine_as_the_mean_of_their_probabilities():
  logits = jnp.asarray([[[-3.0, 0.0, 40.0]], [[1.0, 2.0, -40.0]], [[9.0, 9.0, 9.0]]])  # 3 snapshots, 1 input
  combined = multilabel.Multilabel().combine_snapshots(logits, jnp.asarray(2), logits[0])
  np.testing.assert_allclose(jax.nn.sigmoid(combined), jax.nn.sigmoid(logits[:2]).mean(0), rtol=1e-5)
  before = multilabel.Multilabel().combine_snapshots(logits, jnp.asarray(0), logits[2])
  np.testing.assert_array_equal(before, logits[2])


@pytest.mark.parametrize('labels, message', [
    (lambda y: y * 2, r"train labels: a label of 2; task='multilabel' takes 0 or 1 per label"),
    (lambda y: y[:, :, None], r"train labels: labels of shape \(400, 3, 1\).*takes \(N, L\) labels of 0 and 1"),
])
def test_bad_labels_are_one_line(labels, message):
  x, y = _rows(400, 0)
  with pytest.raises(UsageError, match=message) as refused:
    ensemble.fit('mlp', (x, labels(y)), **FIT)
  assert '\n' not in str(refused.value)


def test_every_mismatch_after_fit_is_one_line(fitted):
  x, y = _rows(100, 7)
  for call, message in (
      (lambda: fitted.evaluate(x, y[:, :2]), r'evaluate: 2 labels per input, but the ensemble predicts 3'),
      (lambda: fitted.calibrate(x, y + 1), r"calibrate: a label of 2; task='multilabel' takes 0 or 1"),
      (lambda: fitted.predict(x, threshold=1.5), r'threshold=1.5 must be in \(0, 1\)'),
      (lambda: fitted.flags(x, y), r'holds a multilabel ensemble; flags is for classification ensembles'),
      (lambda: fitted.conformal(x, y, score='aps'), r"score='aps': give one of \['label'\]"),
  ):
    with pytest.raises(UsageError, match=message) as refused:
      call()
    assert '\n' not in str(refused.value)
  with pytest.raises(UsageError, match=r'the model maps inputs .* not to \(batch, 3\) logits, one per label'):
    ensemble.fit(user_models.TinyNet(num_classes=4), _rows(64, 0), **FIT)
  classifier = ensemble.fit('mlp', (x, y[:, 0]), **{**FIT, 'task': 'classification', 'epochs': 1})
  for call, message in ((lambda: classifier.predict(x, threshold=0.3), r'threshold=0.3 decides the labels of a '
                         'multilabel ensemble'),
                        (lambda: classifier.calibrate(x, y[:, 0], per_label=True), r'per_label=True is for '
                         'multilabel ensembles')):
    with pytest.raises(UsageError, match=message):
      call()


def test_the_command_line_trains_evaluates_and_predicts_rows_of_labels(tmp_path):
  (x, y), (x_test, y_test) = _rows(256, 0), _rows(64, 1)
  path = tmp_path / 'labels.npz'
  np.savez(path, x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  workdir = tmp_path / 'run'
  env = {**os.environ, 'PYTHONPATH': os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
  run = lambda *args: subprocess.run([sys.executable, '-m', *args], capture_output=True, text=True, env=env,
                                     timeout=600)
  trained = run('ensemble.train', f'--workdir={workdir}', '--config=configs/default.py', '--config.task=multilabel',
                f'--config.data_dir={path}', '--config.num_epochs=2', '--config.ensemble_size=2',
                '--config.heldout_fraction=0', '--config.compilation_cache=', '--cpu_devices=2')
  assert trained.returncode == 0, trained.stderr[-3000:]
  loaded = ensemble.load(str(workdir))
  assert loaded.task.name == 'multilabel' and loaded.predict(x_test)['probs'].shape == (64, LABELS)
  evaluated = run('ensemble.evaluate', f'--workdir={workdir}')
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  results = json.loads((workdir / 'eval' / 'metrics.json').read_text())
  assert results['task'] == 'multilabel' and results['test_examples'] == 64
  np.testing.assert_allclose(results['ensemble']['nll'], loaded.evaluate(x_test, y_test)['ensemble']['nll'],
                             rtol=1e-6)
  assert '(multi-label)' in (workdir / 'eval' / 'report.md').read_text()
  inputs, rows = tmp_path / 'inputs.npy', tmp_path / 'rows.csv'
  np.save(inputs, x_test[:5])
  predicted = run('ensemble.predict', f'--workdir={workdir}', f'--input={inputs}', f'--output={rows}')
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  lines = rows.read_text().splitlines()
  assert lines[0] == ','.join(['name', 'labels', *(f'probability_{i}' for i in range(LABELS)),
                               *(f'mutual_information_{i}' for i in range(LABELS))])
  got = ensemble.load(str(workdir)).predict(x_test[:5])  # with the temperatures the evaluation fitted
  for line, labels, probs in zip(lines[1:], got['labels'], got['probs'], strict=True):
    cells = line.split(',')
    assert cells[1] == ' '.join(map(str, np.flatnonzero(labels)))
    np.testing.assert_allclose([float(c) for c in cells[2:2 + LABELS]], probs, rtol=1e-5)
  refused = run('ensemble.predict', f'--workdir={workdir}', f'--input={inputs}', f'--output={tmp_path / "r.npz"}')
  assert refused.returncode == 2 and "an .npz holds a dense ensemble's maps" in refused.stderr, refused.stderr


def test_the_guide_s_example_runs_as_written(capsys):
  """docs/python-api.md's multi-label example runs as written and prints what the page shows (to 0.01: the page's
  figures are one device's, these eight simulated devices')."""
  assert_printed_as_the_page_says(*run_guide_example('## Multi-label', capsys))


def test_it_distils_into_one_network_on_the_ensemble_s_label_probabilities(fitted):
  x, y = _rows(400, 0)
  student = ensemble.distill(fitted, 'mlp', x, test=_rows(500, 8), epochs=30, progress=False,
                             standardize_features=True, learning_rate=0.01, optimizer='adamw')
  assert student.task.name == 'multilabel' and student.size == 1
  report = student.distillation
  # The student keeps most of what the members learned: its NLL within 0.05 nats a label of the ensemble's.
  assert report.student_nll < report.ensemble_nll + 0.05, report
  with pytest.raises(UsageError, match='temperature=2 sharpens or softens class probabilities.*multilabel'):
    ensemble.distill(fitted, 'mlp', x, temperature=2)


def test_class_conditional_sets_cover_each_label_s_each_value(fitted):
  """A quantile per label and value, (L, 2), each fitted on the examples whose label has that value: each label's
  0s and 1s covered within their own beta-binomial bounds on fresh rows, each set the values whose 1 - p(value) is
  at most that value's quantile."""
  x, y = _rows(1500, 12)
  per_class = fitted.conformal(x, y, alpha=0.1, class_conditional=True)
  found = per_class.conformal_calibration
  assert np.shape(found['quantile']) == (LABELS, 2) and not found['pooled']
  np.testing.assert_array_equal(found['class_examples'], np.stack([(y == 0).sum(0), (y == 1).sum(0)], 1))
  test_x, test_y = _rows(4000, 13)
  result = per_class.predict(test_x)
  probs, sets = result['probs'], result['set']
  quantiles = np.asarray(found['quantile'])
  np.testing.assert_array_equal(sets, np.stack([probs <= quantiles[:, 0], 1 - probs <= quantiles[:, 1]], -1))
  for label in range(LABELS):
    for value in (0, 1):
      hits = sets[test_y[:, label] == value, label, value]
      low, high = conformal.coverage_bounds(found['class_examples'][label][value], hits.size, 0.1,
                                            probability=1 - 1e-6)
      assert low <= hits.mean() <= high, (label, value, hits.mean(), (low, high))
  report = per_class.report(test_x[:500], test_y[:500], ood={})['posthoc_conformal']
  assert [(g['label'], g['value']) for g in report['groups']] == [(i, v) for i in range(LABELS) for v in (0, 1)]
