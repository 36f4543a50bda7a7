"""The active-learning and Bayesian-optimisation loops: their rounds, their records, a stop and a resume that
records the same curve, every pool path giving the same rounds, and each bad input in one line."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

import ensemble
from ensemble import data, errors, tasks
from ensemble.errors import UsageError
from ensemble.loops import record as record_lib

FIT = {'ensemble_size': 2, 'epochs': 3, 'batch_size': 8}


def _blobs(n, seed):
  rng = np.random.default_rng(seed)
  centres = np.random.default_rng(7).normal(size=(4, 6)) * 3
  labels = rng.integers(0, 4, n)
  return (centres[labels] + rng.normal(size=(n, 6))).astype(np.float32), labels.astype(np.int32)


SEED, POOL, TEST = _blobs(8, 0), _blobs(60, 1), _blobs(40, 2)


def _timeless(curve):
  return [{k: v for k, v in entry.items() if k != 'seconds'} for entry in curve]


def _learn(pool=POOL, train=SEED, test=TEST, **kwargs):
  settings = {'acquisition': 'bald', 'batch': 4, 'rounds': 2, **FIT, **kwargs}
  return ensemble.active_learning('mlp', train, pool, test, **settings)


@pytest.fixture(scope='module')
def warm_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('warm') / 'loop')
  return workdir, _learn(workdir=workdir, warm=True)


def test_each_round_labels_a_batch_of_the_pool_and_records_it(warm_run):
  workdir, result = warm_run
  assert [entry['labels'] for entry in result.curve] == [8, 12, 16]
  assert all(0 <= entry['accuracy'] <= 1 and np.isfinite(entry['nll']) for entry in result.curve)
  assert len(result.acquired) == 8 and len(set(result.acquired.tolist())) == 8
  np.testing.assert_array_equal(result.labels, POOL[1][result.acquired])
  assert result.curve[-1]['acquired'] == []  # the last round fits and scores only
  for entry in result.curve:
    assert set(entry['seconds']) >= {'fit', 'test', 'loop', 'round'} and entry['seconds']['loop'] >= 0
  assert sorted(os.listdir(workdir)) == sorted([record_lib.LAST, record_lib.SETTINGS, record_lib.CURVE,
                                                record_lib.ANSWERS, 'lock'])
  with open(os.path.join(workdir, record_lib.CURVE)) as f:
    assert _timeless([json.loads(line) for line in f]) == _timeless(result.curve)
  assert ensemble.load(os.path.join(workdir, record_lib.LAST)).summary['epoch'] == FIT['epochs']


def test_sigterm_between_rounds_loses_nothing_and_the_resumed_loop_records_the_same_curve(warm_run, tmp_path):
  _, whole = warm_run
  workdir, asked = str(tmp_path / 'loop'), []

  def label(indices, inputs):
    asked.append(indices.tolist())
    if len(asked) == 2:  # the second round's labeller: stopped before it answers
      os.kill(os.getpid(), signal.SIGTERM)
    return POOL[1][indices]
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(KeyboardInterrupt, match='SIGTERM'):
    _learn(workdir=workdir, warm=True, pool=POOL[0], label=label)
  assert signal.getsignal(signal.SIGTERM) is before
  with open(os.path.join(workdir, record_lib.CURVE)) as f:
    assert len(f.readlines()) == 1  # the first round, whole
  resumed = _learn(workdir=workdir, warm=True, pool=POOL[0], label=label)
  assert len(asked) == 3 and asked[2] == asked[1]  # the recorded round is not asked again; the stopped one is
  assert _timeless(resumed.curve) == _timeless(whole.curve)
  np.testing.assert_array_equal(resumed.acquired, whole.acquired)
  assert _timeless(_learn(workdir=workdir, warm=True, pool=POOL[0], label=label).curve) == _timeless(whole.curve)
  assert len(asked) == 3  # a finished loop run again asks nothing


def test_a_pool_read_from_a_source_gives_the_same_rounds_as_arrays():
  import grain  # pylint: disable=g-import-not-at-top
  arrays = _learn(acquisition='batch_bald')
  pairs = list(zip(*POOL))
  for source in (pairs, grain.MapDataset.source(pairs)):
    result = _learn(acquisition='batch_bald', pool=source)
    assert _timeless(result.curve) == _timeless(arrays.curve)


def test_candidates_score_a_random_part_of_the_pool_and_random_acquires_within_it():
  result = _learn(acquisition='random', candidates=10, rounds=1)
  assert len(result.acquired) == 4 and result.curve[0]['seconds']['pool'] >= 0


def test_a_regression_loop_acquires_by_the_members_disagreement():
  rng = np.random.default_rng(0)
  x = rng.uniform(-2, 2, (50, 1)).astype(np.float32)
  y = np.sin(2 * x[:, 0])
  result = ensemble.active_learning('mlp', (x[:6], y[:6]), x[6:], (x[:20], y[:20]), task='regression',
                                    acquisition='epistemic_std', batch=3, rounds=1,
                                    label=lambda indices, inputs: np.sin(2 * inputs[:, 0]), **FIT)
  assert {'rmse', 'nll', 'crps'} <= set(result.curve[0]) and np.isfinite(result.curve[1]['rmse'])
  np.testing.assert_allclose(result.labels, y[6:][result.acquired])


@pytest.mark.parametrize('kwargs, message', [
    ({'pool': POOL[0][:, :4]}, r'pool= holds inputs of shape \(4,\), and the labelled ones are \(6,\)'),
    ({'batch': 40}, r'batch=40 x rounds=2 acquires 80 labels, and the pool holds 60 inputs'),
    ({'pool': POOL[0]}, 'pool= holds inputs without labels and no label= is given'),
    ({'pool': POOL[0], 'label': lambda i, x: np.zeros(len(i), np.float32)},
     r'the labels label= returned: labels of dtype float32, expected integers'),
    ({'pool': POOL[0], 'label': lambda i, x: np.zeros(len(i) + 1, np.int32)},
     'label= returned 5 answers of dtype int32 for 4 inputs'),
    ({'pool': POOL[0], 'label': lambda i, x: np.full(len(i), -1)}, r'the labels label= returned: negative label -1'),
    ({'pool': POOL[0], 'label': lambda i, x: ['cat'] * len(i)}, r'the labels label= returned: labels of dtype <U3'),
    ({'acquisition': 'ei'}, "acquisition='ei' is not one for a classification ensemble"),
    ({'candidates': 2}, r'candidates=2 must be a whole number >= 4'),
    ({'init': None}, 'init= is set by the loop'),
    ({'task': 'dense'}, "task='dense': the active-learning loop takes a classification or regression ensemble"),
    ({'label': 'ask'}, r'label=str: give a function f\(indices, inputs\) -> labels'),
])
def test_bad_inputs_are_one_line(kwargs, message):
  with pytest.raises(UsageError, match=message) as raised:
    _learn(**kwargs)
  assert '\n' not in str(raised.value)


def test_a_workdir_of_other_settings_is_refused_in_one_line(warm_run):
  workdir, _ = warm_run
  with pytest.raises(UsageError, match=r"holds a loop with acquisition='bald', and this one has "
                                       r"acquisition='entropy': give the settings it was started with"):
    _learn(workdir=workdir, warm=True, acquisition='entropy')


# --- Bayesian optimisation --------------------------------------------------------------------------------------

BOUNDS = [(-1.0, 2.0), (0.0, 1.0)]


def _peak(x):
  return -float((x[0] - 1.2) ** 2 + (x[1] - 0.3) ** 2)


def _optimise(function=_peak, **kwargs):
  # 60 steps a fit, the fewest that pass near enough to the points: after 30, with random initial biases, EI at the
  # box's corner evaluated ninth stayed above 0 and the eleventh evaluation repeated it.
  settings = {'evaluations': 11, 'initial': 8, 'acquisition': 'ei', 'candidates': 256, 'steps': 20,
              'ensemble_size': 2, 'epochs': 60, **kwargs}
  return ensemble.bayesian_optimization('mlp', function, BOUNDS, **settings)


@pytest.fixture(scope='module')
def optimised(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('bo') / 'loop')
  return workdir, _optimise(workdir=workdir)


def test_bayesian_optimisation_evaluates_within_the_bounds_and_records_the_best(optimised):
  _, result = optimised
  assert result.x.shape == (11, 2) and len(result.curve) == 11
  assert ((result.x >= [-1, 0]) & (result.x <= [2, 1])).all()
  assert [entry['acquisition'] for entry in result.curve] == ['initial'] * 8 + ['ei'] * 3
  assert result.best_y == max(result.y) == result.curve[-1]['best']
  assert all(np.isfinite(entry['acquisition_value']) for entry in result.curve[8:])
  assert result.ensemble is not None and result.ensemble.task.name == 'regression'
  assert all(entry['seconds']['fit'] > 0 and entry['seconds']['acquire'] > 0 for entry in result.curve[8:])


def test_a_stopped_loop_without_a_workdir_says_it_kept_nothing():
  """Without a workdir nothing can be resumed: the stop says so, and how to make a loop resumable."""
  def function(x):
    raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt, match='^Ctrl-C: the loop stopped, and without a workdir it kept no round; '
                                               'give workdir= to make it resumable$'):
    _optimise(function)


def test_a_stopped_optimisation_resumes_without_evaluating_a_point_twice(optimised, tmp_path):
  _, whole = optimised
  workdir, calls = str(tmp_path / 'loop'), []

  def function(x):
    calls.append(x.tolist())
    if len(calls) == 10:
      raise KeyboardInterrupt
    return _peak(x)
  with pytest.raises(KeyboardInterrupt, match='^Ctrl-C: the loop stopped; run it again with the same workdir to go on'):
    _optimise(function, workdir=workdir)  # a bare Ctrl-C's says how to go on, as SIGTERM's
  resumed = _optimise(function, workdir=workdir)
  assert len(calls) == 12 and calls[10] == calls[9]  # the nine recorded are not evaluated again; the stopped one is
  assert _timeless(resumed.curve) == _timeless(whole.curve)


def test_minimising_and_random_search():
  result = _optimise(lambda x: -_peak(x), maximize=False, acquisition='random', evaluations=9)
  assert result.ensemble is None and result.best_y == min(result.y)
  assert [entry['acquisition'] for entry in result.curve] == ['initial'] * 8 + ['random']


@pytest.mark.parametrize('noise', [False, True], ids=['deterministic', 'noisy'])
@pytest.mark.parametrize('acquisition', ['ei', 'pi', 'ucb', 'thompson', 'epistemic_std'])
def test_every_acquisition_proposes_new_points_within_the_bounds(acquisition, noise):
  """Each acquisition climbed on either surrogate: epistemic_std of the deterministic one's single Gaussian was a
  spread of 0, whose gradient made every proposal NaN."""
  result = _optimise(acquisition=acquisition, noise=noise, evaluations=9, epochs=5, candidates=64, steps=5)
  chosen = result.x[8:]
  assert np.isfinite(chosen).all() and ((chosen >= [-1, 0]) & (chosen <= [2, 1])).all()
  assert all(np.isfinite(entry['acquisition_value']) for entry in result.curve[8:])


@pytest.mark.parametrize('kwargs, message', [
    ({'bounds': [(0, 1, 2)]}, r'give one \(low, high\) pair per dimension'),
    ({'bounds': [(1, 0), (0, 1)]}, r'each \(low, high\) must be finite with low < high'),
    ({'function': lambda x: np.nan, 'evaluations': 1}, r'function returned nan at x=\[.*\]: return a finite number'),
    ({'function': lambda x: x, 'evaluations': 1}, r'function returned ndarray \(2,\) at x=.*: return one real number'),
    ({'acquisition': 'bald'}, "acquisition='bald': give one of ei, pi, ucb"),
    ({'task': 'classification'}, 'task= is set by the loop'),
    ({'starts': 2000}, r'starts=2000 refines that many of the candidates=1000'),
    ({'noise': 'yes'}, r"noise='yes' must be True or False"),
    ({'transform': 'sqrt'}, r"transform='sqrt': give None \(the values as they are\), 'rank' or 'log'"),
    ({'prior': -1.0}, r'prior=-1.0 must be a number >= 0'),
    ({'prior': 3.0, 'model': 'cnn'}, r"prior=3.0 adds a random network to the built-in model, and model='cnn' is "
                                     r"another: give model='mlp', or prior=0"),
    ({'train_steps': 10, 'epochs': 5}, r'train_steps=10 and epochs= both say how long each fit trains: give one'),
    ({'train_steps': 0}, r'train_steps=0 must be a whole number >= 1'),
])
def test_bad_optimisation_inputs_are_one_line(kwargs, message):
  bounds = kwargs.pop('bounds', BOUNDS)
  with pytest.raises(UsageError, match=message) as raised:
    ensemble.bayesian_optimization(kwargs.pop('model', 'mlp'), kwargs.pop('function', _peak), bounds,
                                   **{'evaluations': 11, 'initial': 8, **kwargs})
  assert '\n' not in str(raised.value)


def _branin(x):
  """Branin on [-5, 10] x [0, 15], negated to be maximised: deterministic, smooth, three optima."""
  b, c, t = 5.1 / (4 * np.pi ** 2), 5 / np.pi, 1 / (8 * np.pi)
  return -float((x[1] - b * x[0] ** 2 + c * x[0] - 6) ** 2 + 10 * (1 - t) * np.cos(x[0]) + 10)


def test_a_deterministic_function_is_fitted_through_its_points_and_never_evaluated_twice():
  """The defaults (noise=False, train_steps Adam steps however few the points): each fit passes through the points
  it was given (within 5% of their spread, where 10 epochs of 1 step each left it far off), the members agree there,
  so the acquisition, which reads their disagreement, never proposes a point already evaluated."""
  result = ensemble.bayesian_optimization('mlp', _branin, [(-5.0, 10.0), (0.0, 15.0)], evaluations=16, initial=8,
                                          ensemble_size=4)
  repeats = [i for i in range(1, 16) if np.any(np.all(result.x[:i] == result.x[i], axis=1))]
  assert not repeats, f'evaluations {repeats} were at points evaluated before'
  fitted = result.x[:-1].astype(np.float32)  # the last fit's points: all but the last
  means = np.asarray(result.ensemble.apply(result.ensemble.params, fitted)[0])[..., 0]  # (K, N)
  np.testing.assert_allclose(means.mean(0), result.y[:-1], atol=0.05 * np.std(result.y[:-1]))
  assert means.std(0).max() < 0.05 * np.std(result.y[:-1])
  assert result.ensemble.task.loss_name == 'mse'


def test_the_randomised_prior_puts_the_members_disagreement_away_from_the_points():
  """prior > 0: each member is its network plus a fixed random one (frozen: never trained), so the members, which
  all pass through the points, part between them, as a GP's posterior draws do; with prior=0 they agree there
  almost as they do at the points (a fourth of the spread, measured: 0.033 against 0.139)."""
  spread = {}
  box = np.random.default_rng(5).uniform(0.0, 1.0, (256, 3)).astype(np.float32)
  for prior in (0.0, 3.0):
    result = ensemble.bayesian_optimization('mlp', lambda x: float(np.sin(3 * x[0]) + np.cos(2 * x[1]) * x[2]),
                                            [(0.0, 1.0)] * 3, evaluations=9, initial=8, ensemble_size=4, prior=prior,
                                            train_steps=500)
    fitted = result.ensemble  # fitted on the eight initial points
    member_means = lambda x, fitted=fitted: np.asarray(fitted.apply(fitted.params, x)[0])[..., 0]
    spread[prior] = (member_means(result.x[:8].astype(np.float32)).std(0).max(), member_means(box).std(0).mean())
  assert spread[3.0][1] > 20 * spread[3.0][0] and spread[3.0][1] > 2 * spread[0.0][1], spread


def test_the_members_part_amid_the_points_as_well_as_at_the_box_s_corners(monkeypatch):
  """The built-in surrogate's networks start with random biases (BIAS): without them each member's prior vanishes
  at the points' mean, so the members agreed there, a tenth of their spread at the corners (measured: 0.016
  against 0.12), and EI went to the corners; with them the spread at the mean is 0.10 against 0.15."""
  from ensemble.loops import bayesian_optimization as bo_lib  # pylint: disable=g-import-not-at-top
  corners = np.array(np.meshgrid(*[[0.0, 1.0]] * 3)).reshape(3, -1).T.astype(np.float32)
  ratio = {}
  for bias in (0.0, bo_lib.BIAS):
    monkeypatch.setattr(bo_lib, 'BIAS', bias)
    result = ensemble.bayesian_optimization('mlp', lambda x: float(np.sin(3 * x[0]) + np.cos(2 * x[1]) * x[2]),
                                            [(0.0, 1.0)] * 3, evaluations=9, initial=8, ensemble_size=4,
                                            train_steps=500)
    fitted = result.ensemble  # fitted on the eight initial points
    member_means = lambda x, fitted=fitted: np.asarray(fitted.apply(fitted.params, x)[0])[..., 0]
    centre = result.x[:8].mean(0, keepdims=True).astype(np.float32)
    ratio[bias] = member_means(centre).std(0).mean() / member_means(corners).std(0).mean()
  assert bo_lib.BIAS > 0 and ratio[bo_lib.BIAS] > 0.4 > 0.2 > ratio[0.0], ratio


def test_each_member_s_input_scales_are_its_own_and_frozen_with_its_prior():
  """RandomPrior(input_scales=(low, high)): each member's model and prior see the inputs times its own scales, one a
  dimension drawn log-uniformly in [low, high], never trained when frozen with the prior (the script's `scales`
  row: an ensemble over lengthscales)."""
  from ensemble.models import mlp, prior as prior_lib  # pylint: disable=g-import-not-at-top
  model = prior_lib.RandomPrior(mlp.Plain(num_classes=2), mlp.Plain(num_classes=1), 3.0, input_scales=(0.5, 4.0))
  scales = []
  for train_steps in (1, 100):
    result = ensemble.bayesian_optimization(model, lambda x: float(np.sin(3 * x[0]) + x[1]), [(0.0, 1.0)] * 3,
                                            evaluations=9, initial=8, ensemble_size=4, train_steps=train_steps,
                                            frozen=(prior_lib.PRIOR, prior_lib.INPUT_SCALES))
    scales.append(np.asarray(result.ensemble.params[prior_lib.INPUT_SCALES]))
  np.testing.assert_array_equal(scales[0], scales[1])
  assert scales[0].shape == (4, 3) and ((scales[0] >= 0.5) & (scales[0] <= 4.0)).all()
  assert len(np.unique(scales[0])) == 12  # each member's own, each dimension's own


@pytest.mark.parametrize('transform', ['rank', 'log'])
def test_the_surrogate_is_fitted_to_the_transformed_values(transform):
  """transform='rank' (normal quantiles of the ranks) or 'log': the members are fitted to the values so
  transformed, which keep their order."""
  from ensemble.loops import bayesian_optimization as bo_lib  # pylint: disable=g-import-not-at-top
  result = ensemble.bayesian_optimization('mlp', _branin, [(-5.0, 10.0), (0.0, 15.0)], evaluations=9, initial=8,
                                          ensemble_size=2, transform=transform)
  values = bo_lib.transformed(result.y[:8], transform)
  np.testing.assert_array_equal(np.argsort(values), np.argsort(result.y[:8]))
  assert not np.allclose(values, (result.y[:8] - result.y[:8].mean()) / result.y[:8].std())  # not a rescaling
  mean = result.ensemble.predict(result.x[:8].astype(np.float32))['mean'].ravel()
  np.testing.assert_allclose(mean, values, atol=0.05 * np.std(values))


def test_a_noisy_function_has_members_that_predict_its_noise():
  """noise=True: the members are trained by the Gaussian NLL (their variances are the noise) and the acquisition
  reads their mixture."""
  result = ensemble.bayesian_optimization('mlp', _branin, [(-5.0, 10.0), (0.0, 15.0)], evaluations=9, initial=8,
                                          ensemble_size=2, noise=True)
  assert result.ensemble.task.loss_name == 'nll' and np.isfinite(result.curve[-1]['acquisition_value'])


def test_fits_on_other_images_keep_their_programs_and_normalise_by_their_own_statistics(tmp_path):
  """Images are normalised on the device by their training rows' per-channel statistics, which are data of the
  programs (each member's state holds them), as the schedule's length is: fits on other images, and on more of
  them whose epochs gain a step, compile nothing that the first compiled. Each fit's ensemble normalises by its
  own statistics, not by those of the fit that compiled the programs: it predicts as its saved and loaded copy
  (whose member is built from its own description) does."""
  from conftest import compiles  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  images = lambda n, high=256: rng.integers(0, high, (n, 8, 8, 1)).astype(np.uint8)
  labels = lambda n: rng.integers(0, 3, n).astype(np.int32)
  fit = {'ensemble_size': 2, 'epochs': 1, 'batch_size': 8, 'augment': 'none', 'progress': False}
  ensemble.fit('cnn', (images(20), labels(20)), **fit)  # padded to 32 rows, as the fits below
  with compiles() as counts:
    dark = images(20, high=64)  # other statistics: mean about 32, not 128
    ens = ensemble.fit('cnn', (dark, labels(20)), **fit)
    ensemble.fit('cnn', (images(24), labels(24)), **fit)  # a cosine schedule over epochs of 3 steps, not 2
  assert not counts, f'{sum(counts.values())} programs compiled'
  mean, std = data.channel_stats(dark)
  info = ens._data_info  # pylint: disable=protected-access
  np.testing.assert_allclose([info['mean'], info['std']], [mean, std])
  x = images(6, high=64)
  loaded = ensemble.load(ens.save(str(tmp_path / 'dark')).workdir)
  np.testing.assert_allclose(loaded.predict(x)['probs'], ens.predict(x)['probs'], rtol=1e-5, atol=1e-6)


@pytest.mark.optimized
@pytest.mark.parametrize('heading', ['## Active learning: a worked example', '## Bayesian optimisation'])
def test_the_page_s_examples_run_as_written(heading, capsys):
  """docs/active-learning.md's examples run as written and print what the page shows (to 0.01)."""
  from conftest import assert_printed_as_the_page_says, run_guide_example  # pylint: disable=g-import-not-at-top
  assert_printed_as_the_page_says(*run_guide_example(heading, capsys, 'active-learning.md'))


def test_regression_improvement_is_over_the_best_target_labelled_so_far():
  """'ei' in the pool loop improves on the highest target labelled, not on zero: with targets far above zero, the
  loop's choice is the top of `acquire.expected_improvement` at that best."""
  from ensemble.loops import active_learning as loop  # pylint: disable=g-import-not-at-top
  from ensemble import acquire  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  means, variances = rng.normal(100.0, 3.0, (4, 50)), rng.uniform(0.5, 4.0, (4, 50))
  best = 104.0
  chosen = loop.acquisition_program('ei', tasks.named('regression'), 3)((means, variances), None, best)
  want = np.argsort(-np.asarray(acquire.expected_improvement((means, variances), best)))[:3]
  np.testing.assert_array_equal(chosen, want)
  assert not np.array_equal(chosen, np.argsort(-np.asarray(acquire.expected_improvement((means, variances),
                                                                                        0.0)))[:3])


# --- the round engine: answers kept, classes that arrive, data checked up front, programs kept ---------------------


@pytest.mark.parametrize('warm', [False, True], ids=['cold', 'warm'])
def test_a_class_the_seed_rows_lack_arrives_in_the_answers_and_the_members_grow_an_output(warm, tmp_path):
  seed = (SEED[0][SEED[1] < 3][:6], SEED[1][SEED[1] < 3][:6])  # classes 0..2 (0..1 where the draw lacks one)
  given = []

  def label(indices, inputs):
    given.extend(indices.tolist())
    return np.full(len(indices), 3)  # a class no seed row has
  with pytest.warns(errors.EnsembleWarning, match='fits afresh') if warm else contextlib.nullcontext():
    result = ensemble.active_learning('mlp', seed, POOL[0], batch=4, rounds=1, label=label, warm=warm,
                                      workdir=str(tmp_path / 'loop'), **FIT)
  assert result.labels.tolist() == [3] * 4 and result.ensemble.num_classes == 4
  with open(tmp_path / 'loop' / record_lib.ANSWERS) as f:
    assert json.load(f) == {str(i): 3 for i in given}


def test_answers_are_recorded_before_they_are_refused_and_the_refusal_says_where(tmp_path):
  workdir = str(tmp_path / 'loop')
  with pytest.raises(UsageError, match=r'real-valued targets .*the answers are kept in .*answers.json: correct them '
                                       'there'):
    _learn(pool=POOL[0], label=lambda i, x: np.full(len(i), 0.5), workdir=workdir, rounds=1)
  with open(os.path.join(workdir, record_lib.ANSWERS)) as f:
    assert list(json.load(f).values()) == [0.5] * 4
  os.remove(os.path.join(workdir, record_lib.ANSWERS))  # removed, they are asked again
  asked = []
  result = _learn(pool=POOL[0], label=lambda i, x: asked.extend(i.tolist()) or POOL[1][i], workdir=workdir, rounds=1)
  assert len(asked) == 4 and result.labels.tolist() == POOL[1][asked].tolist()


def test_a_test_class_the_seed_rows_lack_is_refused_before_the_first_fit(tmp_path, monkeypatch):
  monkeypatch.setattr(ensemble.api, 'fit', lambda *a, **k: pytest.fail('fitted'))
  seed = (SEED[0][SEED[1] < 2], SEED[1][SEED[1] < 2])
  with pytest.raises(UsageError, match=r"test= holds class 3, and the seed rows' classes end at 1: .*seed the loop "
                                       'with a row of class 3') as raised:
    _learn(train=seed)
  assert '\n' not in str(raised.value)
  with pytest.raises(UsageError, match=r'test= holds inputs of shape \(5,\), and the seed rows \(6,\)'):
    _learn(test=(TEST[0][:, :5], TEST[1]))


def test_an_own_acquisition_gets_the_candidates_outputs_unpadded_and_may_be_numpy():
  seen = []

  def least_confident(log_probs, key):
    seen.append((type(log_probs), log_probs.shape))
    return 1.0 - np.exp(log_probs).mean(0).max(-1)  # numpy throughout
  result = _learn(acquisition=least_confident, candidates=20, rounds=1)
  assert seen == [(np.ndarray, (2, 20, 4))] and len(set(result.acquired.tolist())) == 4
  def bad(outputs, key):
    return np.zeros(3)
  with pytest.raises(UsageError, match=r'acquisition=bad returned scores of shape \(3,\) for 20 candidates'):
    _learn(acquisition=bad, candidates=20, rounds=1)


def test_a_number_of_numpy_s_is_recorded_as_the_number_and_resumes_as_one(tmp_path):
  workdir = str(tmp_path / 'loop')
  first = _optimise(evaluations=3, initial=3, workdir=workdir, ensemble_size=np.int64(4), epochs=np.int32(60))
  with open(os.path.join(workdir, record_lib.SETTINGS)) as f:
    kept = json.load(f)
  assert kept['ensemble_size'] == 4 and kept['fit']['epochs'] == 60
  again = _optimise(lambda x: pytest.fail('evaluated again'), evaluations=3, initial=3, workdir=workdir,
                    ensemble_size=4, epochs=60)
  assert _timeless(again.curve) == _timeless(first.curve)


@pytest.mark.parametrize('members', [2, None])
def test_a_record_from_before_batches_trust_regions_and_ensemble_sizes_resumes_as_it_ran(tmp_path, members):
  """Such a record ran one point a round in the whole box, with the members its fit's keywords gave (2) or the 8
  that were the default before ENSEMBLE_SIZE was 16 (None): it resumes with those, and the new default is
  refused, not trained silently on another ensemble."""
  workdir = str(tmp_path / 'loop')
  settings = {'evaluations': 3, 'initial': 3, 'workdir': workdir, 'ensemble_size': members or 8}
  first = _optimise(**settings)
  path = os.path.join(workdir, record_lib.SETTINGS)
  with open(path) as f:
    kept = json.load(f)
  assert kept['batch'] == 1 and kept['trust_region'] is False and kept['ensemble_size'] == (members or 8)
  assert 'ensemble_size' not in kept['fit']
  old = {k: v for k, v in kept.items() if k not in ('batch', 'trust_region', 'ensemble_size')}
  old['fit'] = {**kept['fit'], **({'ensemble_size': members} if members else {})}  # where a given size was recorded
  with open(path, 'w') as f:  # as a loop wrote it before these settings existed
    json.dump(old, f)
  asked = []
  again = _optimise(lambda x: asked.append(x) or _peak(x), **settings)
  assert not asked and _timeless(again.curve) == _timeless(first.curve)
  with pytest.raises(UsageError, match=r"holds a loop with batch=1, and this one has batch=2") as raised:
    _optimise(**settings, batch=2)
  assert '\n' not in str(raised.value)
  from ensemble.loops import bayesian_optimization as bo_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(UsageError, match=rf"holds a loop with ensemble_size={members or 8}, and this one has "
                                       r"ensemble_size=16: give the settings it was started with"):
    _optimise(**{**settings, 'ensemble_size': bo_lib.ENSEMBLE_SIZE})  # recorded as the default is


def test_a_finished_optimisation_keeps_its_last_ensemble_and_returns_it_when_run_again(optimised):
  workdir, result = optimised
  assert os.path.isdir(os.path.join(workdir, record_lib.LAST))
  again = _optimise(lambda x: pytest.fail('evaluated again'), workdir=workdir)
  points = np.array([[0.0, 0.5], [1.5, 0.2]], np.float32)
  np.testing.assert_allclose(again.ensemble.predict(points)['mean'], result.ensemble.predict(points)['mean'],
                             rtol=1e-6)


def test_the_maximiser_never_ends_below_its_best_candidate(optimised):
  """Each start keeps where it began if its Adam steps ended lower: steps of a rate far too large, which bounce
  the starts to the box's corners, still end at the best candidate's value or above (without it they ended
  below it)."""
  from ensemble.loops import bayesian_optimization as bo_lib  # pylint: disable=g-import-not-at-top
  _, result = optimised
  low, high = np.array(BOUNDS).T
  leader = int(np.argmax(result.y[:-1]))
  found = {}
  for steps in (0, 20):
    propose = bo_lib.proposer(result.ensemble, 'ei', low, high, 256, 10, steps, False, learning_rate=10.0)
    found[steps] = propose(result.ensemble, jax.random.key(3), result.y[leader], result.x[leader])[1]
  assert found[20] >= found[0] > 0, found


def test_an_optimisation_compiles_its_acquisition_once_for_all_its_fits():
  """Each fit's parameters and statistics are arguments of the acquisition's program, not its constants: a loop of
  three fits compiles it once (and its fits, of shapes compiled before, nothing)."""
  from conftest import compiles  # pylint: disable=g-import-not-at-top
  _optimise(evaluations=11)  # the fits' programs, and one loop's acquisition
  with compiles() as counts:
    result = _optimise(evaluations=11, seed=1)  # other points, other fits, other statistics
  assert [entry['acquisition'] for entry in result.curve[8:]] == ['ei'] * 3
  assert sum(counts.values()) == 1, f'{sum(counts.values())} programs compiled'



def _repeats(x):
  return [i for i in range(1, len(x)) if np.any(np.all(x[:i] == x[i], axis=1))]


@pytest.fixture(scope='module')
def optimised_in_batches():
  return _optimise(evaluations=14, batch=3)


def test_a_batch_s_first_point_is_the_sequential_one_and_none_is_evaluated_twice(optimised, optimised_in_batches):
  """batch=3: rounds of three points chosen from one fit (recorded one entry each, with their round). The first is
  the point the sequential loop chooses from the same fit; no point is one evaluated before."""
  _, sequential = optimised
  result = optimised_in_batches
  assert [entry['round'] for entry in result.curve] == [0] * 8 + [1] * 3 + [2] * 3
  assert [entry['acquisition'] for entry in result.curve] == ['initial'] * 8 + ['ei'] * 6
  np.testing.assert_array_equal(result.x[8], sequential.x[8])
  assert not _repeats(result.x), f'evaluations {_repeats(result.x)} were at points evaluated before'
  assert all(np.isfinite(entry['acquisition_value']) for entry in result.curve[8:])
  firsts = [result.curve[i]['seconds'] for i in (8, 11)]  # a round's fit and acquisition are its first's seconds
  assert all(seconds['fit'] > 0 and seconds['acquire'] > 0 for seconds in firsts)
  assert result.best_y == max(result.y) == result.curve[-1]['best']


class _Bumps:
  """An ensemble's stand-in: members f_k(x) = a_k bump(x - 0.3) + b_k bump(x - 0.7) on [0, 1], which disagree more
  at 0.3 than at 0.7 and say nothing at one about the other."""
  size = 8

  def __init__(self):
    rng = np.random.default_rng(0)
    heights = np.stack([rng.normal(0.0, 1.0, self.size), rng.normal(0.0, 0.7, self.size)], 1)
    self.variables, self.params = {'statistics': {}, 'heights': heights.astype(np.float32)}, {}

  def apply_variables(self, variables, params, x):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    means = variables['heights'] @ jnp.exp(-((x[:, :1] - jnp.array([0.3, 0.7])) / 0.05) ** 2).T  # (K, N)
    return means[..., None], jnp.ones_like(means)[..., None]


def test_a_batch_s_next_point_is_where_the_members_draws_are_not_those_of_the_points_before_it():
  """Greedy q-EI over the members' joint draws: the first point is the sequential choice (0.3, where the members
  disagree most); next to it the draws move with it and add nothing, so the second is the other bump (0.7). EI
  that ignores the points chosen (the draws' thresholds left at the best) takes 0.3 three times."""
  import jax  # pylint: disable=g-import-not-at-top
  from ensemble.loops import bayesian_optimization as bo_lib  # pylint: disable=g-import-not-at-top
  bumps, box = _Bumps(), (np.zeros(1), np.ones(1))
  sequential, _ = bo_lib.proposer(bumps, 'ei', *box, 200, 5, 50, False)(bumps, jax.random.key(0), 0.0, np.ones(1) / 2)
  points, gains = bo_lib.batch_proposer(bumps, 'ei', *box, 200, 5, 50, False, 3)(bumps, jax.random.key(0), 0.0,
                                                                                 np.ones(1) / 2)
  np.testing.assert_array_equal(points[0], sequential)
  assert abs(points[0, 0] - 0.3) < 0.01 and abs(points[1, 0] - 0.7) < 0.01, points.ravel()
  assert gains[0] > gains[1] > gains[2] > 0  # each the batch's expected improvement over the points before it


class _Slopes(_Bumps):
  """Members f_k(x) = c_k x, c_k > 0, on [0, 1]: every member's optimum is the same point, the box's edge."""

  def __init__(self):
    slopes = np.linspace(1.0, 2.0, self.size, dtype=np.float32)[:, None]
    self.variables, self.params = {'statistics': {}, 'slopes': slopes}, {}

  def apply_variables(self, variables, params, x):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    means = variables['slopes'] * x[:, 0]  # (K, N)
    return means[..., None], jnp.ones_like(means)[..., None]


def test_a_thompson_batch_never_takes_one_point_twice_where_members_share_their_optimum():
  """Two members' optima clipped to the same corner of the box were one point of a deterministic function
  evaluated twice (Hartmann-6, a batch of 5): each member's optimum is taken apart from the round's points before
  it, and as near its own optimum as that allows."""
  import jax  # pylint: disable=g-import-not-at-top
  from ensemble.loops import bayesian_optimization as bo_lib  # pylint: disable=g-import-not-at-top
  slopes, box = _Slopes(), (np.zeros(1), np.ones(1))
  points, values = bo_lib.batch_proposer(slopes, 'thompson', *box, 200, 5, 50, False, 4)(
      slopes, jax.random.key(0), 0.0, np.ones(1) / 2)
  assert points[0, 0] == 1.0 and len(np.unique(points)) == 4, points.ravel()
  assert (points > 0.95).all() and np.isfinite(values).all(), (points.ravel(), values)


@pytest.mark.parametrize('acquisition', ['thompson', 'random'])
def test_thompson_batches_take_distinct_members_optima_and_random_ones_uniform_points(acquisition):
  result = _optimise(evaluations=13, batch=3, acquisition=acquisition, ensemble_size=3)
  assert [entry['round'] for entry in result.curve] == [0] * 8 + [1] * 3 + [2] * 2  # the last round what is left
  assert not _repeats(result.x)
  if acquisition == 'random':  # the same uniform points as one a round
    np.testing.assert_array_equal(result.x, _optimise(evaluations=13, acquisition='random').x)


def test_a_noisy_function_s_batch_draws_its_noise_from_the_members_variances():
  """noise=True: each point's draws add the members' mean variance (the noise), as the mixture's EI does, so a
  point already in the batch is worth less (its value is partly known) but not nothing: a noisy function's second
  value at a point is worth something, and the batch may replicate it (a deterministic one's never: the test
  above)."""
  result = _optimise(evaluations=11, batch=3, noise=True)
  assert result.ensemble.task.loss_name == 'nll' and [entry['round'] for entry in result.curve[8:]] == [1] * 3
  values = [entry['acquisition_value'] for entry in result.curve[8:]]
  assert all(np.isfinite(values)) and values[0] > values[1] > values[2] > 0
  assert ((result.x >= [-1, 0]) & (result.x <= [2, 1])).all()


def test_a_batch_optimisation_compiles_its_acquisition_once_for_all_its_fits(optimised_in_batches):
  from conftest import compiles  # pylint: disable=g-import-not-at-top
  with compiles() as counts:
    result = _optimise(evaluations=14, batch=3, seed=1)
  assert [entry['acquisition'] for entry in result.curve[8:]] == ['ei'] * 6
  assert sum(counts.values()) == 1, f'{sum(counts.values())} programs compiled'


@pytest.mark.parametrize('kwargs, message', [
    ({'batch': 0}, r'batch=0 must be a whole number >= 1'),
    ({'batch': 2, 'acquisition': 'ucb'}, r"batch=2 chooses points jointly by ei, thompson, random, and "
                                         r"acquisition='ucb' one at a time: give one of those, or batch=1"),
    ({'batch': 3, 'acquisition': 'thompson', 'ensemble_size': 2},
     r'batch=3 Thompson draws take as many distinct members, and ensemble_size=2: give ensemble_size >= batch'),
])
def test_bad_batches_are_one_line(kwargs, message):
  with pytest.raises(UsageError, match=message) as raised:
    _optimise(**kwargs)
  assert '\n' not in str(raised.value)


class ThreeClasses(nn.Module):
  """A model object of a fixed width: outputs for classes 0, 1 and 2 only."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


def test_a_class_beyond_a_model_objects_outputs_is_refused_where_it_is_answered(tmp_path):
  """The answer is kept in answers.json and refused in the round that asked for it, naming the file, not by the
  next round's fit; run again, the kept answer is refused alike and nothing is asked again."""
  workdir, asked = str(tmp_path / 'loop'), []

  def label(indices, inputs):
    asked.append(len(indices))
    return np.full(len(indices), 3, np.int32)
  seed = (SEED[0], SEED[1] % 3)
  for _ in range(2):
    with pytest.raises(UsageError, match=r'label= answered class 3, and the model object has outputs for classes '
                                         r'0..2: .*the answers are kept in .*answers.json') as raised:
      ensemble.active_learning(ThreeClasses(), seed, POOL[0], label=label, batch=4, rounds=2, workdir=workdir, **FIT)
    assert '\n' not in str(raised.value)
  assert asked == [4]


# A loop whose first fit is sent SIGTERM while JAX traces its model: where a signal in a fit lands, deep in JAX.
_STOPPED_IN_A_FIT = '''
import os, signal, sys
import flax.linen as nn
import numpy as np
import ensemble

class Stops(nn.Module):
  outputs: int

  @nn.compact
  def __call__(self, x, train=False):
    os.kill(os.getpid(), signal.SIGTERM)
    return nn.Dense(self.outputs)(x)

kind, workdir = sys.argv[1:]
fit = {'ensemble_size': 2, 'epochs': 1, 'batch_size': 8, 'workdir': workdir}
if kind == 'active_learning':
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(40, 6)).astype(np.float32), rng.integers(0, 4, 40).astype(np.int32)
  ensemble.active_learning(Stops(4), (x[:8], y[:8]), (x[8:], y[8:]), batch=4, rounds=2, **fit)
else:
  ensemble.bayesian_optimization(Stops(2), lambda x: -float((x ** 2).sum()), [(-1.0, 1.0)] * 2, evaluations=3,
                                 initial=2, **fit)
'''


@pytest.mark.parametrize('kind', ['active_learning', 'bayesian_optimization'])
def test_a_loop_stopped_inside_jax_ends_in_its_message_not_jax_s_frames(kind, tmp_path):
  """Issue 89: SIGTERM in a loop's fit printed some sixty lines of JAX's frames before the one that says how to go
  on. Now Python's own report of the stop is the caller's line, the loop's boundary and that message, last."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([repo, os.environ.get('PYTHONPATH', '')])}
  done = subprocess.run([sys.executable, '-W', 'ignore', '-c', _STOPPED_IN_A_FIT, kind, str(tmp_path / 'loop')],
                        cwd=repo, env=env, capture_output=True, text=True, timeout=300)
  lines = done.stderr.strip().splitlines()
  assert done.returncode == -signal.SIGINT, done.stderr  # Python's end of an uncaught KeyboardInterrupt
  assert lines[-1] == 'KeyboardInterrupt: SIGTERM: the loop stopped; run it again with the same workdir to go on'
  assert len(lines) <= 8 and not any('jax' in line or '_src' in line for line in lines), done.stderr
