"""`ensemble.fit` as an in-memory trainer (ensemble/loop.py): nothing written without a workdir, the same members as a
workdir's run, save/load across processes, no test set, no new compiles in a loop of fits, warm starts, `apply` under
JAX's transformations, the caller's logging and JAX settings left alone, and messages in fit's terms."""

import copy
import functools
import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from flax import serialization

import ensemble
import user_models
from conftest import compiles
from ensemble import data as data_lib, loop, recipe as recipe_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
# Small and fast: K=4 tanh MLPs, two epochs of three steps; a constant rate, so that 1 epoch resumed to 2 is 2 epochs.
SETTINGS = {'ensemble_size': 4, 'epochs': 2, 'batch_size': 32, 'learning_rate': 0.01, 'optimizer': 'adamw',
            'weight_decay': 0.0, 'schedule': 'constant', 'progress': False}
REGRESSION = {**SETTINGS, 'task': 'regression', 'standardize_features': True}
def _model(width: int = 16, num_classes: int = 2):
  return user_models.Regressor(width=width, num_classes=num_classes)


def _features(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Three features on very different scales (standardising them matters) and a smooth target of two of them."""
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(n, 3)) * np.array([1.0, 100.0, 0.01])).astype(np.float32)
  y = (np.sin(x[:, 0]) + 0.01 * x[:, 1] + 0.1 * rng.normal(size=n)).astype(np.float32)
  return x, y


@pytest.fixture(scope='module')
def pool():
  """(x, y): 104 rows, of which an active-learning loop trains on more and more."""
  return _features(104, 0)


@pytest.fixture(scope='module')
def data(pool):
  """(x, y) to train on, the pool's first 100 rows, and (x, y) to test on, 32 rows."""
  x, y = pool
  return (x[:100], y[:100]), _features(32, 1)


@pytest.fixture(scope='module')
def regression(data):
  """K=4 regression MLPs on 4 devices with pmap, trained in memory on standardised features, with a test set."""
  train, test = data
  return ensemble.fit(_model(), train, test=test, **REGRESSION)


@pytest.fixture(scope='module')
def classifier(data):
  """K=4 MLPs classifying the regression target binned into 3 classes, in memory, without a test set."""
  (x, y), _ = data
  labels = np.digitize(y, [-0.5, 0.5]).astype(np.int64)
  return ensemble.fit(_model(num_classes=3), (x, labels), standardize_features=True, **SETTINGS)


def _leaves(tree) -> dict:
  return jax.tree.map(np.asarray, serialization.to_state_dict(tree))


def _assert_same_members(a: ensemble.Ensemble, b: ensemble.Ensemble, rtol: float = 1e-5, atol: float = 0.0):
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol), _leaves(a.params),
               _leaves(b.params))


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([TESTS, REPO])}
  return subprocess.run([sys.executable, '-c', code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)


def test_the_compile_event_is_this_jaxs():
  """What `_compiles` counts is what this JAX reports: a fresh program is one backend compile."""
  with compiles() as counts:
    jax.jit(lambda v: v * 3.0 + 0.5).lower(np.arange(7.0, dtype=np.float32)).compile()
  assert sum(counts.values()) == 1, counts


# --- in memory ------------------------------------------------------------------------------------------------------

def test_fit_in_memory_writes_nothing_and_trains_the_members_a_workdir_run_does(data, tmp_path, monkeypatch):
  train, test = data
  temporary, here = tmp_path / 'tmp', tmp_path / 'cwd'
  temporary.mkdir()
  here.mkdir()
  monkeypatch.setenv('TMPDIR', str(temporary))
  monkeypatch.setattr(tempfile, 'tempdir', str(temporary))
  monkeypatch.chdir(here)
  in_memory = ensemble.fit(_model(), train, test=test, **REGRESSION)
  assert in_memory.workdir is None
  assert in_memory.predict(test[0])['mean'].shape == (len(test[0]),)
  assert os.listdir(temporary) == [] and os.listdir(here) == []
  monkeypatch.undo()
  workdir = str(tmp_path / 'run')
  written = ensemble.fit(_model(), train, test=test, workdir=workdir, **REGRESSION)
  assert written.workdir == workdir and os.path.exists(os.path.join(workdir, 'config.json'))
  assert in_memory.epoch == written.epoch == 2
  _assert_same_members(in_memory, written)
  np.testing.assert_allclose(in_memory.predict(test[0])['mean'], written.predict(test[0])['mean'], rtol=1e-5,
                             atol=1e-5)


# What a caller's script does in a process of its own: nothing set up before, and its own logging after.
NEW_PROCESS = '''
import logging, sys
import jax
import numpy as np
import ensemble, user_models
cache = jax.config.jax_compilation_cache_dir
saved, inputs, output = sys.argv[1:]
result = ensemble.load(saved).predict(np.load(inputs))
np.savez(output, mean=result['mean'], std=result['std'])
x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
ens = ensemble.fit(user_models.Regressor(width=8), (x, x[:, 0]), ensemble_size=2, epochs=1, batch_size=32,
                   task='regression')  # the progress bar and lines shown: the default
ens.predict(x[:4])
print('handlers', logging.getLogger().handlers)
print('cache', repr(cache), repr(jax.config.jax_compilation_cache_dir))
logging.basicConfig(level=logging.INFO, format='CUSTOM %(message)s')
logging.getLogger('x').info('hello')
'''


@pytest.fixture(scope='module')
def new_process(regression, data, tmp_path_factory):
  """`NEW_PROCESS` run on `regression` saved, predicting the test inputs: (its result, its predictions)."""
  _, (x_test, _) = data
  folder = tmp_path_factory.mktemp('new_process')
  path = str(folder / 'saved')
  saved = regression.save(path)  # the value as saved there; the module's stays the value in memory
  assert saved.workdir == path and regression.workdir is None and saved.state is regression.state
  np.save(folder / 'x.npy', x_test)
  result = _python(NEW_PROCESS, path, str(folder / 'x.npy'), str(folder / 'out.npz'))
  assert result.returncode == 0, result.stderr[-3000:]
  return result, np.load(folder / 'out.npz')


def test_a_saved_ensemble_predicts_the_same_in_a_new_process(regression, data, new_process):
  """Features standardised on the host in memory, and on the device by the restored members: the same predictions."""
  _, (x_test, _) = data
  expected, (_, loaded) = regression.predict(x_test), new_process
  assert np.ptp(expected['mean']) > 0.1  # the members predict something, not a constant
  np.testing.assert_allclose(loaded['mean'], expected['mean'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loaded['std'], expected['std'], rtol=1e-5, atol=1e-5)


def test_fit_without_a_test_set_trains_and_predicts(regression, data):
  train, (x_test, y_test) = data
  ens = ensemble.fit(_model(), train, **REGRESSION)
  assert ens.config.heldout_fraction == 0.0 and ens.epoch == 2
  assert 'train_loss' in ens.summary and np.isfinite(ens.summary['train_loss'])
  assert not [key for key in ens.summary if key.startswith('test_')], ens.summary
  result = ens.predict(x_test)
  assert result['mean'].shape == (len(x_test),) and np.isfinite(result['mean']).all()
  # The test set changes what is reported, not what is trained.
  _assert_same_members(ens, regression)
  assert 'test_loss' in regression.summary and np.isfinite(regression.summary['test_loss'])
  assert ens.evaluate(x_test, y_test)['ensemble']['rmse'] < y_test.std()


# --- a loop of fits -------------------------------------------------------------------------------------------------

def _growing_fit(x, y, rows: int, init=None):
  """The active-learning loop's fit: the first `rows` of the pool, from `init`'s members."""
  return ensemble.fit(_model(), (x[:rows], y[:rows]), init=init, **REGRESSION)


def test_a_loop_of_fits_on_a_growing_training_set_compiles_nothing_new(pool, data):
  """An active-learning loop: fit on 100 rows, then on one more row at a time from the last fit's members, and ask
  each about the same candidates. Each fit reuses the first one's programs."""
  (x, y), (_, (candidates, _)) = pool, data
  ens = start = _growing_fit(x, y, 100)
  ens.predict(candidates)
  compiled = {}
  for rows in range(101, 105):
    with compiles() as counts:
      grown = _growing_fit(x, y, rows, init=ens)
      grown.predict(candidates)
    compiled[rows] = dict(counts)
    assert grown.member is ens.member  # the programs are shared
    kernel = lambda e: _leaves(e.params)['Dense_0']['kernel']
    assert kernel(grown).shape == kernel(ens).shape and not np.allclose(kernel(grown), kernel(ens))  # it trained
    ens = grown
  # The same data again, from scratch: nothing new, and the same members.
  with compiles() as counts:
    again = _growing_fit(x, y, 100)
  assert not counts, dict(counts)
  _assert_same_members(start, again, rtol=0.0)
  assert not any(compiled[rows] for rows in (102, 103, 104)), compiled
  # The first fit from another ensemble's members compiles one program more (placing them in the backend's
  # layout); the later ones nothing.
  assert sum(compiled[101].values()) <= 1, compiled


def test_fits_whose_epochs_gain_a_step_share_their_programs():
  """The schedule's length and an epoch's number of steps are data of the programs, not their constants: a loop's
  fits on 100, then 128 rows (3, then 4 steps an epoch of 32; one padded size) compile nothing after the first, and
  the second trains the members that the epoch-by-epoch path trains."""
  x, y = _features(128, 2)
  fit = lambda rows, **more: ensemble.fit(_model(), (x[:rows], y[:rows]), **{**REGRESSION, 'schedule': 'cosine',
                                                                              **more})
  fit(100)
  with compiles() as counts:
    grown = fit(128)
  assert not counts, dict(counts)
  _assert_same_members(grown, fit(128, steps_per_dispatch=0), rtol=1e-5, atol=1e-6)


def test_init_continues_from_the_members(regression, data):
  train, (x_test, _) = data
  params = _leaves(regression.params)
  tiny = {**REGRESSION, 'epochs': 1, 'learning_rate': 1e-6}
  warm = ensemble.fit(_model(), train, init=regression, **tiny)
  fresh = ensemble.fit(_model(), train, **tiny)
  distance = lambda a, b: max(float(np.abs(u - v).max()) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert distance(_leaves(warm.params), params) < 1e-4
  assert distance(_leaves(fresh.params), params) > 1e-2
  assert distance(_leaves(warm.params), _leaves(fresh.params)) > 1e-2
  np.testing.assert_allclose(warm.predict(x_test)['mean'], regression.predict(x_test)['mean'], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize('backend', ['pmap', 'jit'])
def test_init_leaves_the_ensemble_it_starts_from_usable(data, backend):
  """The steps donate the state they train: `init`'s must be copied first. (The jit backend's steps take the
  members' arrays as they are, without pmap's copy per device.)"""
  train, (x_test, _) = data
  old = ensemble.fit(_model(), train, backend=backend, **REGRESSION)
  before, params = old.predict(x_test)['mean'], _leaves(old.params)
  warm = ensemble.fit(_model(), train, init=old, backend=backend, **REGRESSION)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(old.state))
  np.testing.assert_array_equal(old.predict(x_test)['mean'], before)
  jax.tree.map(np.testing.assert_array_equal, _leaves(old.params), params)
  assert not np.allclose(warm.predict(x_test)['mean'], before)  # the warm start trained on


# --- apply ------------------------------------------------------------------------------------------------------------

def test_apply_is_the_regression_members_as_a_jax_function(regression, data):
  _, (x_test, _) = data
  x = x_test[:8]
  means, variances = regression.apply(regression.params, x)
  assert means.shape == variances.shape == (4, 8, 1) and (np.asarray(variances) > 0).all()
  np.testing.assert_allclose(np.asarray(means).mean(0)[:, 0], regression.predict(x)['mean'], rtol=1e-4, atol=1e-4)
  jitted = jax.jit(regression.apply)(regression.params, x)
  np.testing.assert_allclose(jitted[0], means, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jitted[1], variances, rtol=1e-5, atol=1e-5)

  f = jax.jit(lambda x: regression.apply(regression.params, x)[0].mean())
  grad = np.asarray(jax.jit(jax.grad(f))(x))
  assert grad.shape == x.shape and np.isfinite(grad).all() and np.abs(grad).max() > 0
  # Central differences along a direction on each feature's own scale (standardised, they differ by 10^4).
  direction = np.random.default_rng(0).normal(size=x.shape) * x.std(0)
  eps = 1e-2
  numeric = (float(f(x + eps * direction)) - float(f(x - eps * direction))) / (2 * eps)
  assert float((grad * direction).sum()) == pytest.approx(numeric, rel=0.05, abs=1e-4)
  # Differentiable in the parameters too.
  param_grad = jax.jit(jax.grad(lambda p: regression.apply(p, x)[0].mean()))(regression.params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(param_grad))


def test_apply_is_the_classifiers_log_probabilities(classifier, data):
  _, (x_test, _) = data
  log_probs = classifier.apply(classifier.params, x_test)
  assert log_probs.shape == (4, len(x_test), 3)
  np.testing.assert_allclose(np.exp(np.asarray(log_probs)).mean(0), classifier.predict(x_test)['probs'], rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(jax.jit(classifier.apply)(classifier.params, x_test), log_probs, rtol=1e-5, atol=1e-5)
  grad = jax.jit(jax.grad(lambda x: jax.numpy.exp(classifier.apply(classifier.params, x))[:, :, 0].mean()))(x_test)
  assert np.isfinite(grad).all() and np.abs(grad).max() > 0


# --- the caller's process -------------------------------------------------------------------------------------------

def test_fit_and_load_leave_the_callers_logging_and_jax_settings_alone(new_process):
  result, _ = new_process
  assert 'handlers []' in result.stdout, result.stdout
  assert 'cache None None' in result.stdout, result.stdout
  assert 'CUSTOM hello' in result.stderr.splitlines(), result.stderr[-3000:]


# --- workdirs and messages ------------------------------------------------------------------------------------------

def _listing(workdir: str) -> tuple[str, list[str]]:
  """config.json's text and every path under the checkpoints folder."""
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    config = f.read()
  root = os.path.join(workdir, 'checkpoints')
  paths = sorted(os.path.relpath(os.path.join(folder, name), root)
                 for folder, folders, names in os.walk(root) for name in folders + names)
  return config, paths


def test_a_workdir_refuses_other_arrays_and_resumes_on_its_own(regression, data, tmp_path):
  (x, y), _ = data
  workdir = str(tmp_path / 'run')
  fit = functools.partial(ensemble.fit, _model(), workdir=workdir, **{**REGRESSION, 'epochs': 1})
  assert fit((x, y)).epoch == 1
  before = _listing(workdir)
  assert before[1], 'no checkpoint was written'
  other = (x[::-1].copy(), y[::-1].copy())  # the same shapes and dtypes, other values
  with pytest.raises(ensemble.UsageError, match='other arrays') as error:
    fit(other)
  assert 'workdir=' in str(error.value) and '--workdir' not in str(error.value)
  assert _listing(workdir) == before
  assert json.loads(before[0])['num_epochs'] == 1
  resumed = fit((x, y), epochs=2)
  assert resumed.epoch == 2
  _assert_same_members(resumed, regression)  # as if trained for two epochs at once


def test_a_diverging_fit_names_fits_keywords(data):
  train, _ = data
  with pytest.raises(ensemble.UsageError, match='diverged') as error:
    ensemble.fit(_model(), train, **{**REGRESSION, 'optimizer': 'sgd', 'learning_rate': 1e6})
  message = str(error.value)
  assert 'learning_rate=' in message and '--config.' not in message, message
  assert 'checkpoints saved so far' not in message, message


# --- one epoch per dispatch -----------------------------------------------------------------------------------------

@pytest.mark.parametrize('backend', ['pmap', 'jit'])
def test_one_epoch_per_dispatch_trains_the_members_the_plain_path_does(data, backend):
  train, _ = data
  fit = functools.partial(ensemble.fit, _model(), train, backend=backend, **REGRESSION)
  fast, plain = fit(), fit(steps_per_dispatch=0)
  # fit's default chooses for the data (-2): this small set of an MLP's, a whole epoch per dispatch.
  assert fast.config.steps_per_dispatch == loop.AUTO_DISPATCH and plain.config.steps_per_dispatch == 0
  dataset = data_lib.arrays.from_arrays(train, None, task='regression')
  recipe, devices = recipe_lib.resolve(fast.config, jax.devices(), model=_model(), dataset=dataset)
  assert loop.prepare(recipe, devices, dataset, _model()).steps_per_dispatch == -1
  _assert_same_members(fast, plain, rtol=1e-5, atol=1e-6)


def test_freed_memory_is_kept_only_when_asked(data, monkeypatch):
  """glibc's settings are the caller's process's: `fit` changes them only with keep_freed_memory=True."""
  from ensemble import host_memory  # pylint: disable=g-import-not-at-top
  calls = []
  monkeypatch.setattr(host_memory, 'keep_freed_memory', lambda *args, **kwargs: calls.append(args) or True)
  train, _ = data
  ensemble.fit(_model(), train, **{**REGRESSION, 'epochs': 1})
  assert not calls
  ensemble.fit(_model(), train, keep_freed_memory=True, **{**REGRESSION, 'epochs': 1})
  assert len(calls) == 1


# --- empty splits, held-out slices and classes absent from training (issue 56) -------------------------------------

ONE_EPOCH = {**SETTINGS, 'ensemble_size': 2, 'epochs': 1}


def _labelled(split, task: str):
  """`split` as regression has it, or with its target binned into the classes 0, 1, 2."""
  x, y = split
  return (x, y) if task == 'regression' else (x, np.digitize(y, [-0.5, 0.5]))


@pytest.mark.parametrize('task', ['classification', 'regression'])
@pytest.mark.parametrize('empty', ['train', 'test'])
def test_fit_refuses_an_empty_split_in_one_line(data, task, empty):
  """Zero rows used to fail in numpy (`zero-size array to reduction operation maximum`, `cannot reshape array of
  size 0`)."""
  splits = {name: _labelled(split, task) for name, split in zip(('train', 'test'), data)}
  splits[empty] = tuple(array[:0] for array in splits[empty])
  with pytest.raises(ensemble.UsageError, match=f'^{empty} inputs: no examples, the split is empty; give it at '
                                                'least one example$'):
    ensemble.fit(_model(), splits['train'], test=splits['test'], task=task, **ONE_EPOCH)


def test_fit_refuses_a_heldout_fraction_that_leaves_nothing_to_train_on(data):
  (x, y), test = data
  with pytest.raises(ensemble.UsageError, match='heldout_fraction=0.9 of the 3 training examples holds out all of '
                                                'them, leaving none to train on; lower it: heldout_fraction=0.66 or '
                                                'less, or 0 to hold out nothing$'):
    ensemble.fit(_model(), (x[:3], y[:3]), test=test, task='regression', heldout_fraction=0.9,
                 **{**ONE_EPOCH, 'batch_size': 1})


def test_fit_without_a_test_set_refuses_a_heldout_fraction_of_no_rows(data):
  """The held-out slice is then the test set: a fraction of no rows names the fraction, not an empty test split."""
  (x, y), _ = data
  with pytest.raises(ensemble.UsageError, match='^heldout_fraction=0.001 of the 100 training examples holds out '
                                                'none; '):
    ensemble.fit(_model(), (x, y), task='regression', heldout_fraction=0.001, **ONE_EPOCH)


def test_fit_on_labels_1_2_3_trains_4_classes_and_names_the_absent_one(data):
  """The class ids are the user's: C is the largest training label + 1, and the class never trained on is named, in
  a warning a script sees (issue 76), pointing at its `fit` call."""
  (x, y), _ = data
  with pytest.warns(ensemble.errors.EnsembleWarning) as caught:
    ens = ensemble.fit(_model(num_classes=4), (x, np.digitize(y, [-0.5, 0.5]) + 1), **ONE_EPOCH)
  assert ens.num_classes == 4 and np.isfinite(ens.summary['train_loss'])
  hints = [w for w in caught if issubclass(w.category, ensemble.errors.EnsembleWarning)]
  assert [str(w.message) for w in hints] == ['class 0 never appears in the training labels: the members will never '
                                             'predict it; relabel to 0..C-1 if that is not meant'], hints
  assert hints[0].filename == __file__


def test_float64_targets_far_from_zero_keep_their_precision(data):
  """1.7e9 + y in float64 is standardised before any cast to float32 (which would leave ~1 distinct value in 512):
  the members are those trained on y, and the scores are in the targets' own units."""
  (x, y), (x_test, y_test) = data
  offset = 1.7e9
  near = ensemble.fit(_model(), (x, y.astype(np.float64)), **{**REGRESSION, 'epochs': 1})
  far = ensemble.fit(_model(), (x, offset + y.astype(np.float64)), **{**REGRESSION, 'epochs': 1})
  _assert_same_members(near, far, rtol=1e-4, atol=1e-6)
  scores = far.evaluate(x_test, offset + y_test.astype(np.float64))['ensemble']
  assert scores['rmse'] == pytest.approx(near.evaluate(x_test, y_test)['ensemble']['rmse'], rel=1e-3)
  np.testing.assert_allclose(far.predict(x_test)['mean'] - offset, near.predict(x_test)['mean'], atol=1e-3)


def test_targets_beyond_float32_are_refused_in_one_line(data):
  (x, y), _ = data
  message = (r"^the targets' mean and standard deviation reach [0-9.]+e\+39, beyond float32 \(3.4e38\) that the "
             r'members compute in; rescale them$')
  with pytest.raises(ensemble.UsageError, match=message):
    ensemble.fit(_model(), (x, 1e39 * (1 + y.astype(np.float64))), **ONE_EPOCH, task='regression')


def test_the_nll_is_the_members_log_probabilities_unclipped(classifier, data):
  """A confidently wrong ensemble keeps its whole cost: no probability is clipped at float64's tiny (log 1e-308)."""
  (x, y), _ = data
  loud = jax.tree.map(lambda p: 3000.0 * p, classifier.state.params)  # logits thousands apart
  wrong = ensemble.api.Ensemble(None, classifier.config, classifier.member, classifier.state.replace(params=loud),
                                classifier.devices, classifier.epoch, task=classifier.task,
                                data_info=classifier._data_info)  # pylint: disable=protected-access
  log_probs = wrong.member_outputs(x)
  labels = np.argmin(log_probs.mean(0), -1)  # each input's least likely class
  nll = -float(np.mean(jax.nn.logsumexp(log_probs, 0)[np.arange(len(x)), labels] - np.log(wrong.size)))
  assert nll > 1000  # beyond what a clip at float64's tiny (708.4) could report
  assert wrong.evaluate(x, labels)['ensemble']['nll'] == pytest.approx(nll, rel=1e-6)


def test_zero_inputs_predict_empty_answers_and_evaluate_refuses_them(regression, classifier, data):
  (x, y), _ = data
  result = regression.predict(x[:0])
  assert {key: value.shape for key, value in result.items()} == {key: (0,) for key in result}
  assert classifier.predict(x[:0])['probs'].shape == (0, 3)
  for ens, labels in ((regression, y[:0]), (classifier, np.zeros(0, np.int64))):
    with pytest.raises(ensemble.UsageError, match='^evaluate got 0 inputs; give at least one'):
      ens.evaluate(x[:0], labels)


def test_an_empty_workdir_is_refused_and_a_saved_one_takes_the_umasks_mode(regression, tmp_path, monkeypatch):
  (x, y) = _features(40, 2)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ensemble.UsageError, match="^workdir='' names no folder"):
    ensemble.fit(_model(), (x, y), workdir='', **ONE_EPOCH, task='regression')
  assert not os.listdir(tmp_path)
  mask = os.umask(0o022)
  try:
    saved = tmp_path / 'saved'
    copy.copy(regression).save(str(saved))
  finally:
    os.umask(mask)
  assert oct(os.stat(saved).st_mode & 0o777) == oct(0o755)
  assert repr(regression) == ("Ensemble(4 members of user_models:Regressor, regression of 1 target from 3 features, "
                              "epoch 2, in memory)")


def test_a_class_below_one_8_bit_step_trains_from_float_images():
  """Two classes 1/1000 apart in brightness, the same pixels once rounded to 8 bits (what every image was before):
  float images keep their precision, so the members tell them apart."""
  rng = np.random.default_rng(0)
  y = rng.integers(0, 2, 256).astype(np.int32)
  x = (0.501 + y[:, None, None, None] / 1000 + rng.normal(0, 1e-4, (256, 4, 4, 1))).astype(np.float32)
  assert len(np.unique(np.rint(x * 255))) == 1
  ens = ensemble.fit('mlp', (x[:192], y[:192]), test=(x[192:], y[192:]), ensemble_size=2, epochs=3, batch_size=32,
                     progress=False, optimizer='adamw', learning_rate=0.01, augment='none')
  assert ens.summary['test_accuracy'] > 0.95
