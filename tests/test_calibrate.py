"""`Ensemble.calibrate` and `Ensemble.conformal` from Python: the fitted temperature (variance scale) is the NLL's
minimiser on the given rows, and the conformal sets and intervals cover at least 1 - alpha of new rows over many
draws of the calibration rows; refusals in one line."""

import numpy as np
import pytest

import ensemble
from conftest import run_guide_example
from ensemble import calibration
from ensemble.uncertainty import conformal
from ensemble.errors import UsageError
from ensemble.tasks import mixture

FIT = {'epochs': 8, 'ensemble_size': 4, 'batch_size': 32, 'progress': False}


def _regression(n: int, seed: int):
  """A sine whose noise grows with |x|: heteroscedastic, as a user's toy."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(-3, 3, size=(n, 1)).astype(np.float32)
  return x, (np.sin(x[:, 0]) + (0.1 + 0.2 * np.abs(x[:, 0])) * rng.normal(size=n)).astype(np.float32)


def _classes(n: int, seed: int):
  """Three overlapping classes in 4 features: sets of one class and of two both occur."""
  rng = np.random.default_rng(seed)
  y = rng.integers(0, 3, n).astype(np.int32)
  x = (rng.normal(size=(n, 4)) + np.eye(3, 4)[y] * 1.5).astype(np.float32)
  return x, y


@pytest.fixture(scope='module')
def fitted():
  return {'regression': ensemble.fit('mlp', _regression(400, 0), task='regression', **FIT),
          'classification': ensemble.fit('mlp', _classes(400, 0), **FIT)}


def test_calibrate_fits_the_variance_scale_by_nll_and_predict_uses_it(fitted):
  ens = fitted['regression']
  x, y = _regression(500, 1)
  calibrated = ens.calibrate(x, y)
  means, variances = ens.components(x)
  scale = mixture.scale_variances(means, variances, y[:, None].astype(np.float64))
  assert calibrated.temperature == pytest.approx(scale) and calibrated.summary['variance_scale'] == pytest.approx(scale)
  assert ens.temperature == 1.0  # a copy: the original predicts as before
  np.testing.assert_allclose(calibrated.predict(x)['std'] ** 2,
                             mixture.mixture_moments(means, variances * scale)['variance'][:, 0], rtol=1e-6)
  scores = calibrated.evaluate(x, y)
  assert scores['variance_scaled']['nll'] <= scores['ensemble']['nll'] + 1e-9
  assert f'variance_scale {scale:.4g}' in repr(calibrated)


def test_calibrate_fits_the_temperature_by_nll(fitted):
  ens = fitted['classification']
  x, y = _classes(500, 1)
  calibrated = ens.calibrate(x, y)
  assert calibrated.temperature == pytest.approx(calibration.fit_temperature(ens.member_probs(x).mean(0), y))
  scores = calibrated.evaluate(x, y)
  assert scores['temperature_scaled']['nll'] <= scores['ensemble']['nll'] + 1e-9
  np.testing.assert_allclose(calibrated.predict(x)['probs'],
                             calibration.temperature_scale(ens.predict(x)['probs'], calibrated.temperature), rtol=1e-6)


@pytest.mark.parametrize('task, score', [('regression', 'normalised'), ('classification', 'thr'),
                                         ('classification', 'aps')])
def test_conformal_covers_at_least_one_minus_alpha_over_many_calibration_draws(fitted, task, score):
  """Split conformal's promise, over the draw of the calibration rows: on average over 40 random splits of 3,000
  new rows into 200 to calibrate on and 2,800 to judge, coverage >= 1 - alpha (and, for the continuous scores, at
  most 1 - alpha + 1 / (n + 1), a little above for the conservative APS without randomisation)."""
  ens, alpha, n = fitted[task], 0.1, 200
  x, y = (_regression if task == 'regression' else _classes)(3000, 2)
  outputs = ens.predict(x)
  coverages, sizes = [], []
  for seed in range(40):
    order = np.random.default_rng(seed).permutation(len(y))
    cal, test = order[:n], order[n:]
    calibrated = ens.conformal(x[cal], y[cal], alpha=alpha, **({} if task == 'regression' else {'score': score}))
    got = calibrated.predict(x[test])
    if task == 'regression':
      coverages.append(np.mean((got['conformal_lower'] <= y[test]) & (y[test] <= got['conformal_upper'])))
      np.testing.assert_allclose(got['mean'], outputs['mean'][test], rtol=1e-6)
    else:
      coverages.append(got['set'][np.arange(len(test)), y[test]].mean())
      sizes.append(got['set'].sum(-1).mean())
  mean = float(np.mean(coverages))
  assert mean >= 1 - alpha - 0.005, (mean, coverages)
  assert mean <= 1 - alpha + 1 / (n + 1) + (0.05 if score == 'aps' else 0.01), mean
  if sizes:  # informative sets: not every class
    assert 1 <= np.mean(sizes) < 3, np.mean(sizes)


@pytest.mark.parametrize('call, message', [
    (lambda e, x, y: e.conformal(x, y, alpha=1.5), r'alpha=1.5 must be in \(0, 1\)'),
    (lambda e, x, y: e.conformal(x, y, alpha=True), 'alpha=True must be in'),
    (lambda e, x, y: e.conformal(x[:50], y[:50], alpha=0.01), 'alpha=0.01 needs at least 99 calibration examples'),
    (lambda e, x, y: e.conformal(x, y, score='raps'), "score='raps': give one of"),
    (lambda e, x, y: e.conformal(x, y, class_conditional='yes'), "class_conditional='yes' must be True or False"),
    (lambda e, x, y: e.calibrate(x, y[:-1]), 'give 100 integer class indices'),
    (lambda e, x, y: e.calibrate(x, y + 5), r'outside the 3 classes'),
])
def test_bad_calibration_is_refused_in_one_line(fitted, call, message):
  x, y = _classes(100, 3)
  with pytest.raises(UsageError, match=message):
    call(fitted['classification'], x, y)


def test_a_calibrated_ensemble_saves_and_loads_calibrated(fitted, tmp_path):
  x, y = _regression(300, 4)
  calibrated = fitted['regression'].calibrate(x, y).conformal(x, y, alpha=0.2)
  loaded = ensemble.load(str(calibrated.save(str(tmp_path / 'saved')).workdir))
  assert loaded.temperature == calibrated.temperature
  assert loaded.conformal_calibration == calibrated.conformal_calibration
  for key, value in calibrated.predict(x).items():  # features standardised on the host in memory, loaded on the device
    np.testing.assert_allclose(loaded.predict(x)[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_the_guide_s_calibration_example_runs_as_written(capsys):
  """docs/python-api.md leads with fit -> calibrate -> conformal -> predict on the regression toy: it runs as
  written, and its conformal intervals cover about 90% of the new rows."""
  printed, _ = run_guide_example('## Calibrated predictions', capsys)
  coverage = float(printed.split()[-1])
  assert 0.86 <= coverage <= 0.95, coverage


@pytest.mark.parametrize('task, score', [('classification', 'thr'), ('classification', 'aps'), ('regression', None)])
def test_the_exported_artifact_gives_the_conformal_sets_and_intervals_predict_gives(fitted, tmp_path, task, score):
  """Issue 67: a calibrated ensemble's artifact (`ensemble.export`, and `python -m ensemble.export` of a saved one)
  carries its temperature and its conformal sets or intervals: the same as `predict`'s, to float32's rounding."""
  import jax  # pylint: disable=g-import-not-at-top
  from ensemble import export  # pylint: disable=g-import-not-at-top
  data, keys = (_classes, ['set']) if task == 'classification' else (_regression, ['conformal_lower',
                                                                                    'conformal_upper'])
  x, y = data(300, 5)
  calibrated = fitted[task].calibrate(x, y).conformal(x, y, alpha=0.1, **({'score': score} if score else {}))
  saved = calibrated.save(str(tmp_path / 'saved'))
  export.write(saved.workdir, str(tmp_path / 'model.jax'), platforms=['cpu'])
  served = jax.export.deserialize(bytearray((tmp_path / 'model.jax').read_bytes()))
  new, _ = data(200, 6)
  out, expected = served.call(new), calibrated.predict(new)
  for key in keys:
    got = np.asarray(out[key])
    want = expected[key][:, None] if task == 'regression' and got.ndim == 2 else expected[key]
    if key == 'set':
      assert np.mean(got == want) > 0.995 and 0 < got.mean() < 1  # a boundary class may round either way
    else:
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=key)


# --- class-conditional (Mondrian) conformal sets -------------------------------------------------------------------

def _hard_class(n: int, seed: int):
  """Synthetic (N, 3) probabilities whose class 0 is hard (its true class's probability low, about 0.35) and
  classes 1 and 2 easy (about 0.9): one marginal quantile, set by the easy majority, covers class 0 far below 90%."""
  rng = np.random.default_rng(seed)
  y = rng.choice(3, n, p=[0.2, 0.4, 0.4]).astype(np.int32)
  own = np.where(y == 0, rng.uniform(0.1, 0.6, n), rng.uniform(0.75, 1.0, n))
  other = rng.dirichlet([1, 1], n) * (1 - own)[:, None]
  probs = np.empty((n, 3))
  probs[np.arange(n), y] = own
  rest = np.array([[c for c in range(3) if c != k] for k in y])
  probs[np.arange(n)[:, None], rest] = other
  return probs, y


def _class_coverage(task, step, probs, y):
  """Each class's share of fresh examples whose set holds it, under a fitted conformal step's settings."""
  sets = task.apply_conformal(step, {'probs': probs}, np)['set']
  return [float(sets[y == c, c].mean()) for c in range(probs.shape[1])], [int((y == c).sum()) for c in range(3)]


def test_class_conditional_quantiles_cover_a_hard_class_the_marginal_one_leaves_below_its_bounds():
  """Synthetic probabilities through the classification task's conformal step: with one marginal quantile the
  hard class is covered well below the 99.9999% beta-binomial bounds of 1 - alpha, with a quantile per class every
  class within its own bounds."""
  from ensemble import posthoc, tasks  # pylint: disable=g-import-not-at-top
  task, alpha = tasks.named('classification'), 0.1
  cal_probs, cal_y = _hard_class(3000, 0)
  probs, y = _hard_class(20000, 1)
  step = lambda **options: posthoc.Step('conformal', posthoc._settings(  # pylint: disable=protected-access
      task.fit_conformal({'probs': cal_probs}, cal_y, alpha, 'thr', **options)), None, task)
  marginal, per_class = step(), step(class_conditional=True)
  assert per_class['class_examples'] == tuple(int((cal_y == c).sum()) for c in range(3)) and not per_class['pooled']
  coverage, counts = _class_coverage(task, per_class, probs, y)
  for c in range(3):
    low, high = conformal.coverage_bounds(per_class['class_examples'][c], counts[c], alpha, probability=1 - 1e-6)
    assert low <= coverage[c] <= high, (c, coverage[c], (low, high))
  coverage, counts = _class_coverage(task, marginal, probs, y)
  low, _ = conformal.coverage_bounds(int((cal_y == 0).sum()), counts[0], alpha, probability=1 - 1e-6)
  assert coverage[0] < low - 0.1, (coverage, low)  # the hard class, hidden by the easy ones
  assert min(coverage[1:]) > 1 - alpha  # the easy ones over-covered


def test_a_class_too_rare_for_alpha_is_pooled_into_the_marginal_quantile_and_named(fitted, recwarn):
  """A class with fewer calibration examples than alpha needs (9 at alpha=0.1) gets the marginal quantile, not an
  infinite one (every class in every set), and a hint names it."""
  x, y = _classes(1500, 7)
  keep = (y != 2) | (np.cumsum(y == 2) <= 5)  # five examples of class 2
  per_class = fitted['classification'].conformal(x[keep], y[keep], alpha=0.1, class_conditional=True)
  found = per_class.conformal_calibration
  assert found['pooled'] == (2,) and found['class_examples'][2] == 5, found
  marginal = fitted['classification'].conformal(x[keep], y[keep], alpha=0.1).conformal_calibration['quantile']
  assert found['quantile'][2] == marginal and all(np.isfinite(found['quantile']))
  hints = [str(w.message) for w in recwarn if 'class_conditional' in str(w.message)]
  assert len(hints) == 1 and 'of class 2:' in hints[0] and '\n' not in hints[0], hints


def test_class_conditional_sets_cover_each_class_on_fresh_rows_and_the_value_keeps_them(fitted, tmp_path):
  """A trained ensemble's per-class sets: each class's coverage of fresh rows within its beta-binomial bounds;
  the same sets after `save`/`load` (the chain records the per-class quantiles), from the exported artifact (a (C,)
  constant) and with a temperature fitted before or after; the report gives each class's coverage beside the
  marginal."""
  from ensemble import export  # pylint: disable=g-import-not-at-top
  ens = fitted['classification']
  x, y = _classes(1500, 8)
  per_class = ens.conformal(x, y, alpha=0.1, class_conditional=True)
  found = per_class.conformal_calibration
  assert found['class_conditional'] and len(found['quantile']) == 3 and 'per class' in repr(per_class)
  new_x, new_y = _classes(6000, 9)
  sets = per_class.predict(new_x)['set']
  for c in range(3):
    low, high = conformal.coverage_bounds(found['class_examples'][c], int((new_y == c).sum()), 0.1,
                                          probability=1 - 1e-6)
    assert low <= sets[new_y == c, c].mean() <= high, (c, sets[new_y == c, c].mean(), (low, high))
  loaded = ensemble.load(per_class.save(str(tmp_path / 'saved')).workdir)
  assert loaded.posthoc == per_class.posthoc and loaded.conformal_calibration == found
  np.testing.assert_array_equal(loaded.predict(new_x)['set'], sets)
  served = np.asarray(export.export(per_class, ['cpu']).call(new_x[:500])['set'])
  assert np.mean(served == sets[:500]) > 0.995
  cal_x, cal_y = _classes(500, 10)
  after = per_class.calibrate(cal_x, cal_y)  # a temperature after it leaves its sets
  np.testing.assert_array_equal(after.predict(new_x)['set'], sets)
  before = ens.calibrate(cal_x, cal_y).conformal(x, y, alpha=0.1, class_conditional=True)
  assert before.conformal_calibration['quantile'] != found['quantile'] and before.predict(new_x)['set'].shape == (
      6000, 3)
  report = per_class.report(new_x[:2000], new_y[:2000], angles=(), noise=False, ood={},
                            output_dir=str(tmp_path / 'report'))['posthoc_conformal']
  assert report['class_conditional'] and report['coverage'] == pytest.approx(
      np.take_along_axis(sets[:2000], new_y[:2000, None], -1).mean())
  assert [g['class'] for g in report['groups']] == [0, 1, 2] and all(g['within_bounds'] for g in report['groups'])
  assert '| class 2 |' in (tmp_path / 'report' / 'report.md').read_text()


def test_class_conditional_is_refused_where_there_are_no_classes(fitted):
  x, y = _regression(100, 3)
  with pytest.raises(UsageError, match='class_conditional=True: a regression ensemble has no classes') as refused:
    fitted['regression'].conformal(x, y, class_conditional=True)
  assert '\n' not in str(refused.value)
