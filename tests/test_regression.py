"""Regression ensembles: the mixture's formulas against hand-worked cases and numerical integration, and
`ensemble.fit(task='regression')` end to end (pmap == jit, resume, methods, the CLI's .npz and .csv, bad input)."""

import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import scipy.integrate
import scipy.stats
from flax import serialization

import ensemble
import user_models
from conftest import timeless
from ensemble import defaults, evaluation, export, predict, writers
from ensemble.methods import batchensemble
from ensemble.tasks import mixture, regression

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {'epochs': 2, 'batch_size': 32, 'learning_rate': 0.01, 'optimizer': 'adamw', 'weight_decay': 0.0,
            'schedule': 'constant', 'progress': False, 'task': 'regression', 'eval_every': 1}


# --- the mixture, on the host -------------------------------------------------------------------------------------

def _two_members():
  """Two members at one input: N(0, 1) and N(2, 1)."""
  return np.array([0.0, 2.0]).reshape(2, 1, 1), np.array([1.0, 1.0]).reshape(2, 1, 1)


def test_mixture_moments_split_into_aleatoric_and_epistemic_by_hand():
  # mean (0 + 2) / 2 = 1; aleatoric (1 + 1) / 2 = 1; epistemic ((0-1)^2 + (2-1)^2) / 2 = 1; total 2.
  moments = mixture.mixture_moments(*_two_members())
  assert moments['mean'].item() == 1.0 and moments['aleatoric'].item() == 1.0
  assert moments['epistemic'].item() == 1.0 and moments['variance'].item() == 2.0
  # Unequal variances: N(1, 4) and N(3, 0.25): mean 2, aleatoric 2.125, epistemic 1.
  moments = mixture.mixture_moments(np.array([1.0, 3.0]).reshape(2, 1, 1), np.array([4.0, 0.25]).reshape(2, 1, 1))
  np.testing.assert_allclose([moments['mean'].item(), moments['aleatoric'].item(), moments['epistemic'].item()],
                             [2.0, 2.125, 1.0])


def test_mixture_quantiles_are_exact():
  # One component: the Gaussian's own quantiles.
  low, high = mixture.mixture_interval(np.zeros((1, 1, 1)), np.full((1, 1, 1), 4.0), 0.9)
  np.testing.assert_allclose([low.item(), high.item()], [-2 * 1.6448536269514722, 2 * 1.6448536269514722], atol=1e-9)
  # Two symmetric components: the median is the centre, and the bounds hold the mixture's CDF at the levels.
  means, variances = _two_members()
  assert mixture.mixture_quantile(means, variances, 0.5).item() == pytest.approx(1.0, abs=1e-9)
  for level in regression.LEVELS:
    low, high = mixture.mixture_interval(means, variances, level)
    cdf = lambda x: 0.5 * (scipy.stats.norm.cdf(x, 0, 1) + scipy.stats.norm.cdf(x, 2, 1))
    assert cdf(low.item()) == pytest.approx((1 - level) / 2, abs=1e-10)
    assert cdf(high.item()) == pytest.approx((1 + level) / 2, abs=1e-10)
  # Traced in float32 (what ensemble.export runs), the same bounds to float32's resolution.
  traced = jax.jit(lambda m, v: mixture.predictive(m, v, xp=jax.numpy))(means.astype(np.float32),
                                                                         variances.astype(np.float32))
  for key, value in mixture.predictive(means, variances).items():
    np.testing.assert_allclose(traced[key], value, rtol=1e-6, atol=1e-6, err_msg=key)


def test_mixture_nll_and_crps_against_numerical_integration():
  means, variances = np.array([-1.0, 0.5, 3.0]).reshape(3, 1, 1), np.array([0.3, 1.0, 2.5]).reshape(3, 1, 1)
  pdf = lambda x: np.mean([scipy.stats.norm.pdf(x, m, np.sqrt(v)) for m, v in zip(means.ravel(), variances.ravel())])
  cdf = lambda x: mixture.mixture_cdf(means, variances, np.array([[x]])).item()
  assert scipy.integrate.quad(pdf, -np.inf, np.inf)[0] == pytest.approx(1.0, abs=1e-8)
  for y in (-2.0, 0.7, 4.0):
    log_density = mixture.mixture_log_density(means, variances, np.array([[y]])).item()
    assert log_density == pytest.approx(np.log(pdf(y)), abs=1e-10)
    # CRPS = integral of (F(x) - 1{x >= y})^2 dx.
    crps = (scipy.integrate.quad(lambda x: cdf(x) ** 2, -40, y, limit=200)[0]
            + scipy.integrate.quad(lambda x: (1 - cdf(x)) ** 2, y, 40, limit=200)[0])
    assert mixture.mixture_crps(means, variances, np.array([[y]])).item() == pytest.approx(crps, abs=1e-7)
  # A point forecast's CRPS is its absolute error.
  assert mixture.mixture_crps(np.full((1, 1, 1), 2.0), np.full((1, 1, 1), 1e-12),
                                 np.array([[5.0]])).item() == pytest.approx(3.0, abs=1e-5)


def test_a_two_dimensional_mixture_density_is_the_product_per_component():
  means = np.array([[[0.0, 1.0]], [[2.0, -1.0]]])  # (M=2, N=1, D=2)
  variances = np.array([[[1.0, 0.5]], [[2.0, 1.0]]])
  y = np.array([[0.5, 0.0]])
  expected = np.log(np.mean([np.prod(scipy.stats.norm.pdf(y[0], means[m, 0], np.sqrt(variances[m, 0])))
                             for m in range(2)]))
  assert mixture.mixture_log_density(means, variances, y).item() == pytest.approx(expected, abs=1e-12)


# --- fit ----------------------------------------------------------------------------------------------------------

def cubic(n: int, seed: int, low: float = -4.0, high: float = 4.0):
  """The paper's toy problem: y = x^3 + e, e ~ N(0, 3^2), x uniform in [low, high]."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(low, high, (n, 1)).astype(np.float32)
  return x, (x[:, 0] ** 3 + rng.normal(0, 3, n)).astype(np.float32)


@pytest.fixture(scope='module')
def data():
  return cubic(256, 0), cubic(64, 1)


@pytest.fixture(scope='module')
def run(data, tmp_path_factory):
  """K=4 Regressors on 4 devices with pmap, two epochs, in a workdir of its own."""
  train, test = data
  workdir = str(tmp_path_factory.mktemp('regression') / 'run')
  return ensemble.fit(user_models.Regressor(), train, test=test, ensemble_size=4, workdir=workdir, **SETTINGS)


def _leaves(tree) -> dict:
  return jax.tree.map(np.asarray, serialization.to_state_dict(tree))


def test_fit_predicts_the_mixture_in_the_targets_units(run, data):
  (_, y_train), (x_test, y_test) = data
  assert run.task.name == 'regression' and run.task.targets == 1
  result = run.predict(x_test, members=True)
  for key in ('mean', 'std', 'variance', 'aleatoric', 'epistemic', 'lower_90', 'upper_95'):
    assert result[key].shape == (len(x_test),)
  np.testing.assert_allclose(result['variance'], result['aleatoric'] + result['epistemic'], rtol=1e-12)
  assert (result['lower_95'] < result['lower_50']).all() and (result['upper_50'] < result['upper_95']).all()
  assert result['member_means'].shape == (4, len(x_test), 1)
  # The targets were standardised for training and the prediction is back in their units.
  assert abs(result['mean'].mean() - y_train.mean()) < 2 * y_train.std()
  scores = run.evaluate(x_test, y_test)
  assert set(scores['ensemble']) == {'rmse', 'nll', 'crps', 'coverage_50', 'coverage_80', 'coverage_90',
                                     'coverage_95'}
  assert len(scores['members']) == 4 and set(scores['mean_member']) == set(scores['ensemble'])
  assert scores['ensemble']['rmse'] == pytest.approx(np.sqrt(np.mean((result['mean'] - y_test) ** 2)))
  assert scores['ensemble']['rmse'] < y_test.std()  # better than the mean
  # The trainer's test NLL is the same exact mixture density, in float32.
  line = writers.read_jsonl(os.path.join(run.workdir, 'metrics.jsonl'))[-1]
  assert line['test_loss'] == pytest.approx(scores['ensemble']['nll'], rel=1e-3)
  assert line['test_rmse'] == pytest.approx(scores['ensemble']['rmse'], rel=1e-3)


def test_pmap_and_jit_train_the_same_regression_members(run, data):
  train, test = data
  jit = ensemble.fit(user_models.Regressor(), train, test=test, ensemble_size=4, backend='jit', **SETTINGS)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
               _leaves(jit.state), _leaves(run.state))


def test_a_regression_fit_resumes_and_keeps_its_task(run, data, tmp_path):
  train, test = data
  workdir = str(tmp_path / 'run')
  fit = functools.partial(ensemble.fit, user_models.Regressor(), train, test=test, ensemble_size=4, workdir=workdir,
                          **{**SETTINGS, 'epochs': 1})
  fit()
  resumed = fit(epochs=2)
  read = lambda ens: timeless(writers.read_jsonl(os.path.join(ens.workdir, 'metrics.jsonl')))
  assert read(resumed) == read(run)
  with pytest.raises(ensemble.UsageError, match='task'):
    ensemble.fit(user_models.Regressor(), (train[0], (train[1] > 0).astype(np.int32)),
                 test=(test[0], (test[1] > 0).astype(np.int32)), ensemble_size=4, workdir=workdir,
                 **{**SETTINGS, 'epochs': 3, 'task': 'classification'})


@pytest.mark.parametrize('method, extra', [('bagging', {}), ('hyper', {'hyper_learning_rate': (0.005, 0.02)}),
                                           ('snapshot', {'snapshot_cycles': 2, 'schedule': 'cosine'}),
                                           ('batchensemble', {})])
def test_methods_fit_regression(method, extra, data):
  train, test = data
  rank1 = method == 'batchensemble'  # BatchEnsemble's members are a model with rank-1 layers
  ens = ensemble.fit(user_models.Regressor(width=8, rank1=rank1), train, test=test, ensemble_size=2, method=method,
                     **{**SETTINGS, **extra})
  means, _ = ens.components(test[0])
  assert means.shape == (2 * extra.get('snapshot_cycles', 1), len(test[0]), 1)  # a snapshot is a component
  scores = ens.evaluate(*test)['ensemble']
  # Two epochs take every method well below predicting the mean (RMSE about 16 against 23 in a trial).
  assert np.isfinite(scores['nll']) and scores['rmse'] < 0.85 * test[1].std()
  if rank1:
    shared = batchensemble.is_shared(jax.tree.map(lambda leaf: leaf[0], ens.state.params))
    for leaf, is_shared in zip(jax.tree.leaves(ens.state.params), jax.tree.leaves(shared)):
      assert np.array_equal(leaf[0], leaf[1]) == is_shared  # the members share their weights, not their factors


@pytest.mark.parametrize('loss', ['beta_nll', 'mse'])
def test_other_losses_train(loss, data):
  train, test = data
  ens = ensemble.fit(user_models.Regressor(width=8), train, test=test, ensemble_size=2, loss=loss, **SETTINGS)
  assert np.isfinite(ens.predict(test[0])['mean']).all()


def test_two_targets(data):
  (x, y), (x_test, y_test) = data
  two = lambda y: np.stack([y, -2 * y + 5], 1)
  ens = ensemble.fit(user_models.Regressor(width=8, num_classes=4), (x, two(y)), test=(x_test, two(y_test)),
                     ensemble_size=2, **SETTINGS)
  result = ens.predict(x_test)
  assert result['mean'].shape == (len(x_test), 2) and result['upper_90'].shape == (len(x_test), 2)
  assert ens.evaluate(x_test, two(y_test))['ensemble']['rmse'] > 0


def test_bad_regression_input_is_one_line_and_writes_nothing(run, data, tmp_path):
  (x, y), test = data
  workdir = tmp_path / 'never'
  fit = functools.partial(ensemble.fit, user_models.Regressor(), test=test, ensemble_size=2, workdir=str(workdir),
                          **SETTINGS)
  bad = y.copy()
  bad[3] = np.nan
  for targets, message in ((y.astype(np.int32), 'regression needs float targets'), (bad, 'NaN or infinite'),
                           (y[:, None, None], r'give \(N,\) or \(N, D\)')):
    with pytest.raises(ensemble.UsageError, match=message):
      fit((x, targets))
  with pytest.raises(ensemble.UsageError, match='give its last layer 2 outputs'):
    ensemble.fit(user_models.Regressor(num_classes=3), (x, y), test=test, ensemble_size=2, workdir=str(workdir),
                 **SETTINGS)
  with pytest.raises(ensemble.UsageError, match='method batchensemble needs a model built with rank-1 layers'):
    fit((x, y), method='batchensemble')
  with pytest.raises(ensemble.UsageError, match='unknown loss'):
    fit((x, y), loss='huber')
  with pytest.raises(ensemble.UsageError, match='unknown task'):
    fit((x, y), task='ranking')
  assert not workdir.exists()
  # A regression ensemble asked for classification output, and the reverse.
  with pytest.raises(ensemble.UsageError, match='for classification ensembles'):
    run.member_probs(x)
  with pytest.raises(ensemble.UsageError, match='regression needs float targets'):
    run.evaluate(x, y.astype(np.int32))
  classes = (y > 0).astype(np.int32)
  classifier = ensemble.fit(user_models.Regressor(width=8), (x, classes),
                            test=(test[0], (test[1] > 0).astype(np.int32)), ensemble_size=2,
                            **{**SETTINGS, 'task': 'classification', 'epochs': 1})
  with pytest.raises(ensemble.UsageError, match='for regression ensembles'):
    classifier.components(x)
  with pytest.raises(ensemble.UsageError, match='integer class'):
    classifier.evaluate(x, y)


def _train_cli(workdir: str, *args: str) -> subprocess.CompletedProcess:
  """`python -m ensemble.train` for regression with configs/regression.py, as a user runs it (tests/ on the path
  for user_models)."""
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([REPO, TESTS])}
  return subprocess.run(
      [sys.executable, '-m', 'ensemble.train', f'--workdir={workdir}', '--config=configs/regression.py',
       '--cpu_devices=2', '--config.model=user_models:Regressor', '--config.ensemble_size=2',
       '--config.num_epochs=1', '--config.batch_size=32', *args],
      cwd=REPO, env=env, capture_output=True, text=True, check=False)


def _the_programs_read_a_regression_workdir(workdir: str, x_test: np.ndarray, tmp_path):
  """ensemble.evaluate's report, ensemble.predict's columns and ensemble.export's artifact."""
  results = evaluation.evaluate(workdir, alphas=(0.1, 0.2))
  assert {'rmse', 'nll', 'crps', 'coverage_90'} <= set(results['ensemble']) and results['mean_member']['rmse'] > 0
  assert results['variance_scaling']['scale'] > 0 and len(results['conformal']['rows']) == 2
  assert results['selective'][0]['coverage'] == 1.0 and len(results['calibration']['expected']) == 11
  for name in ('metrics.json', 'report.md', 'coverage.png'):
    assert os.path.exists(os.path.join(workdir, 'eval', name))
  with pytest.raises(ensemble.UsageError, match='leave --ood out'):
    evaluation.evaluate(workdir, ood_names=['uniform_noise'])
  np.save(tmp_path / 'x.npy', x_test[:5])
  predict.predict_files(workdir, str(tmp_path / 'x.npy'), str(tmp_path / 'out.csv'))
  lines = (tmp_path / 'out.csv').read_text().splitlines()
  assert lines[0] == 'name,mean,std,aleatoric_std,epistemic_std,lower_90,upper_90' and len(lines) == 6
  exported = export.write(workdir, str(tmp_path / 'model.jax'), platforms=['cpu'])
  out = exported.call(x_test[:5])
  # The artifact returns what predict does, intervals and the fitted variance scale included, in float32.
  predicted = ensemble.load(workdir).predict(x_test[:5])
  assert set(out) == {*predicted, 'member_means', 'member_variances'} and 'upper_95' in out
  for key, value in predicted.items():
    np.testing.assert_allclose(out[key][:, 0], value, rtol=1e-4, atol=1e-3, err_msg=key)


def test_the_cli_trains_on_npz_and_csv(data, tmp_path):
  (x, y), (x_test, y_test) = data
  np.savez(tmp_path / 'cubic.npz', x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  done = _train_cli(str(tmp_path / 'npz'), f'--config.data_dir={tmp_path / "cubic.npz"}')
  assert done.returncode == 0, done.stderr[-2000:]
  # The log names what a regression member predicts: targets, not classes.
  assert '1 target, features 1.' in done.stderr and 'ensemble RMSE' in done.stderr
  assert 'classes' not in done.stderr, done.stderr
  ens = ensemble.load(str(tmp_path / 'npz'))
  assert ens.task.name == 'regression' and ens.predict(x_test)['mean'].shape == (len(x_test),)
  recipe = ens.config  # configs/regression.py is fit's regression recipe
  as_read = lambda value: tuple(value) if isinstance(value, (list, tuple)) else value  # config.json keeps lists
  assert {key: as_read(getattr(recipe, key)) for key in defaults.REGRESSION} == defaults.REGRESSION
  assert recipe.augment == 'none'
  _the_programs_read_a_regression_workdir(str(tmp_path / 'npz'), x_test, tmp_path)
  rows = ['a,label,y'] + [f'{v:.6f},{i % 3},{t:.6f}' for i, (v, t) in enumerate(zip(x[:, 0], y))]
  (tmp_path / 'cubic.csv').write_text('\n'.join(rows) + '\n')
  done = _train_cli(str(tmp_path / 'csv'), f'--config.data_dir={tmp_path / "cubic.csv"}', '--config.target=y')
  assert done.returncode == 0, done.stderr[-2000:]
  assert ensemble.load(str(tmp_path / 'csv')).input_shape == (2,)  # 'a' and 'label' are the features
  refused = _train_cli(str(tmp_path / 'no'), f'--config.data_dir={tmp_path / "cubic.csv"}', '--config.target=z')
  assert refused.returncode == 2 and "no column 'z'" in refused.stderr
  (tmp_path / 'text.csv').write_text('a,b,y\n1,red,2\n2,blue,3\n3,red,4\n')
  refused = _train_cli(str(tmp_path / 'no'), f'--config.data_dir={tmp_path / "text.csv"}', '--config.target=y')
  assert refused.returncode == 2 and "feature column 'b' holds 'red'" in refused.stderr
  assert not (tmp_path / 'no').exists()


def test_normalised_conformal_intervals_hold_their_coverage_over_many_seeds():
  """With a wrong std (half the true one at some inputs, double at others), the calibrated intervals still cover
  at least 1 - alpha on average over draws, and at most 1 - alpha + 1/(n + 1) (no ties)."""
  n, alpha, seeds, covered = 99, 0.1, 400, []
  for seed in range(seeds):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n + 50, 1))
    y = np.sin(3 * x) + rng.normal(0, 0.2 + 0.3 * np.abs(x))
    mean, std = np.sin(3 * x), 0.3 * np.exp(x)  # a right mean, a misshapen std
    q = mixture.conformal_quantile(mean[:n], std[:n], y[:n], alpha)
    covered.append(np.mean(np.abs(y[n:] - mean[n:]) <= q * std[n:]))
  # Each draw's test coverage averages to the marginal coverage; 400 draws of 50 points: std about 0.003.
  assert 1 - alpha - 0.01 <= np.mean(covered) <= 1 - alpha + 1 / (n + 1) + 0.01
  assert np.isinf(mixture.conformal_quantile(mean[:5], std[:5], y[:5], alpha)).all()  # 5 < 1 / 0.1 - 1


def test_a_variance_scale_recovers_a_known_misscaling():
  rng = np.random.default_rng(0)
  y = rng.normal(0, 2.0, (5000, 1))
  scale = mixture.scale_variances(np.zeros((1, 5000, 1)), np.ones((1, 5000, 1)), y)
  assert scale == pytest.approx(4.0, rel=0.05)  # the NLL's minimum is at the sample variance


def heteroscedastic(n: int, seed: int):
  """x uniform in [-3, 3], y = sin(x) + e with e ~ N(0, sigma(x)^2), sigma(x) = 0.1 + 0.3 |x|: known noise."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(-3, 3, (n, 1)).astype(np.float32)
  sigma = 0.1 + 0.3 * np.abs(x[:, 0])
  return x, (np.sin(x[:, 0]) + sigma * rng.normal(size=n)).astype(np.float32), sigma


def test_heteroscedastic_noise_is_learned_and_the_90_percent_intervals_cover_90_percent():
  x, y, _ = heteroscedastic(2000, 0)
  x_test, y_test, sigma_test = heteroscedastic(10_000, 1)
  ens = ensemble.fit(user_models.Regressor(), (x, y), test=(x_test[:1000], y_test[:1000]), ensemble_size=4,
                     **{**SETTINGS, 'epochs': 30, 'batch_size': 64, 'learning_rate': 0.005,
                        'standardize_features': True})
  result = ens.predict(x_test)
  aleatoric_std = np.sqrt(result['aleatoric'])
  assert np.corrcoef(aleatoric_std, sigma_test)[0, 1] > 0.95
  assert 0.8 < np.median(aleatoric_std / sigma_test) < 1.25
  scores = ens.evaluate(x_test, y_test)
  print('\nheteroscedastic, 10,000 test points:', {who: {k: round(v, 4) for k, v in scores[who].items()}
                                                   for who in ('ensemble', 'mean_member')})
  # The binomial spread of 10,000 Bernoulli(0.9) hits is sqrt(0.9 * 0.1 / 10,000) = 0.003; 3 of them, 0.009, bound
  # the sampling error. The tolerance 0.025 adds 0.016 for what 4 members trained 30 epochs still miss (this run
  # over-covers by 0.013).
  assert abs(scores['ensemble']['coverage_90'] - 0.9) < 0.025
  assert scores['ensemble']['nll'] < scores['mean_member']['nll']


def test_fit_regresses_with_adam_on_standardised_features_unless_told_otherwise():
  """The image recipe's SGD at 0.1 sent Gaussian-NLL members astray: the cubic toy, noise 3, fitted at RMSE 194."""
  rng = np.random.default_rng(0)
  x = rng.uniform(-4, 4, (1024, 1)).astype(np.float32)
  y = (x[:, 0] ** 3 + rng.normal(0, 3, 1024)).astype(np.float32)
  ens = ensemble.fit('mlp', (x, y), task='regression', ensemble_size=2, epochs=40, progress=False)
  recipe = ens.config
  assert (recipe.optimizer, recipe.learning_rate, recipe.weight_decay, recipe.standardize_features) == (
      'adamw', 0.01, 0.0, True)
  hyper = ensemble.fit('mlp', (x[:256], y[:256]), task='regression', ensemble_size=2, epochs=1, method='hyper',
                       progress=False)  # its drawn rates around the recipe's
  assert tuple(hyper.config.hyper_learning_rate) == (0.004, 0.012)
  assert ens.evaluate(x, y)['ensemble']['rmse'] < 3.5
  told = ensemble.fit('mlp', (x[:256], y[:256]), task='regression', ensemble_size=2, epochs=1, optimizer='sgd',
                      standardize_features=False, progress=False).config
  assert (told.optimizer, told.learning_rate, told.standardize_features) == ('sgd', 0.01, False)
