"""`ensemble.fit` / `load` / `Ensemble` from Python: a user's own linen or NNX model on the user's own arrays."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import serialization

import ensemble
import user_models
from conftest import COMPILE_FLAGS, run_main, synthetic_mnist, timeless, write_mnist
from ensemble import evaluate, export, predict, writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
# What every run here shares: small, so that two epochs of K=4 cost seconds; the learning rate of the tests' runs;
# a constant rate, so that a 1-epoch run resumed to 2 trains as a 2-epoch run (a cosine's length is the run's).
SETTINGS = {'epochs': 2, 'batch_size': 32, 'learning_rate': 0.05, 'schedule': 'constant', 'progress': False,
            'eval_every': 1}

evaluate.define_flags()  # for the command lines run in this process


@pytest.fixture(scope='module')
def arrays():
  """MNIST-shaped synthetic digits, as `conftest.write_mnist` writes them to IDX files: the same arrays."""
  (x_train, y_train), (x_test, y_test) = synthetic_mnist()
  return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64)


@pytest.fixture(scope='module')
def linen_run(arrays, tmp_path_factory):
  """K=4 TinyNets (BatchNorm, Dropout) on 4 devices with pmap, two epochs, in a workdir of its own."""
  x_train, y_train, x_test, y_test = arrays
  workdir = str(tmp_path_factory.mktemp('linen') / 'run')
  ens = ensemble.fit(user_models.TinyNet(width=32), (x_train, y_train), test=(x_test, y_test), ensemble_size=4,
                     workdir=workdir, **SETTINGS)
  return ens


def _leaves(tree) -> dict:
  return jax.tree.map(np.asarray, serialization.to_state_dict(tree))


def test_fit_predict_evaluate_a_linen_model_with_batchnorm_and_dropout(linen_run, arrays):
  ens, (_, _, x_test, y_test) = linen_run, arrays
  assert isinstance(ens, ensemble.Ensemble) and ens.size == 4 and len(ens.devices) == 4
  result = ens.predict(x_test)
  assert result['probs'].shape == (len(x_test), 10)
  np.testing.assert_allclose(result['probs'].sum(-1), 1.0, rtol=1e-5)
  scores = ens.evaluate(x_test, y_test)
  assert set(scores['ensemble']) >= {'accuracy', 'nll', 'brier', 'ece'}
  assert set(scores['mean_member']) >= {'accuracy', 'nll', 'brier', 'ece'}
  assert scores['ensemble']['accuracy'] == pytest.approx(np.mean(result['class'] == y_test))
  assert scores['ensemble']['accuracy'] > 0.5  # ten classes: chance is 0.1
  state = _leaves(ens.state)
  # Each member its own initialisation, and BatchNorm's running averages moved by training.
  assert not np.allclose(state['params']['Dense_0']['kernel'][0], state['params']['Dense_0']['kernel'][1])
  assert np.abs(state['batch_stats']['BatchNorm_0']['mean']).max() > 1e-3
  # The run reads as any other: its config names the model by import path, with its arguments.
  with open(os.path.join(ens.workdir, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  assert config['model'] == 'user_models:TinyNet' and config['model_kwargs'] == {'num_classes': 10, 'width': 32}
  assert [line['epoch'] for line in writers.read_jsonl(os.path.join(ens.workdir, 'metrics.jsonl'))] == [1, 2]


def test_float_images_keep_their_precision_at_prediction_as_in_training(linen_run, arrays):
  """uint8 pixels and the same pixels as [0, 1] floats predict alike; a float image is not rounded to 8 bits
  (`data.base.as_images`), so a change below one 8-bit step changes what the members see."""
  ens, x_test = linen_run, arrays[2][:16]
  as_floats = (x_test / 255.0).astype(np.float32)
  np.testing.assert_allclose(ens.predict(as_floats)['probs'], ens.predict(x_test)['probs'], rtol=1e-5, atol=1e-6)
  nudged = (as_floats + 0.0015).clip(0, 1)  # would round back to the same uint8
  assert not np.array_equal(ens.predict(nudged)['probs'], ens.predict(as_floats)['probs'])


def test_dropout_draws_a_key_per_step_and_is_off_at_test_time(linen_run, arrays):
  ens = linen_run
  member, state = ens.member, jax.tree.map(lambda x: x[0], ens.state)
  images = member.prepare(arrays[2][:8])
  apply = lambda train, key: member.apply(state, state.params, images, train=train, key=key)[0]
  one, two = jax.random.key(1), jax.random.key(2)
  assert not np.allclose(apply(True, one), apply(True, two))
  np.testing.assert_array_equal(apply(False, one), apply(False, two))


def test_pmap_and_jit_train_the_same_members_of_a_user_model(linen_run, arrays, tmp_path):
  x_train, y_train, x_test, y_test = arrays
  jit = ensemble.fit(user_models.TinyNet(width=32), (x_train, y_train), test=(x_test, y_test), ensemble_size=4,
                     backend='jit', **SETTINGS)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
               _leaves(jit.state), _leaves(linen_run.state))


def test_fit_resumes_a_workdir(linen_run, arrays, tmp_path):
  x_train, y_train, x_test, y_test = arrays
  workdir = str(tmp_path / 'run')
  fit = functools.partial(ensemble.fit, user_models.TinyNet(width=32), (x_train, y_train), test=(x_test, y_test),
                          ensemble_size=4, workdir=workdir, **{**SETTINGS, 'epochs': 1})
  fit()
  resumed = fit(epochs=2)
  assert resumed.epoch == 2
  read = lambda ens: timeless(writers.read_jsonl(os.path.join(ens.workdir, 'metrics.jsonl')))
  assert read(resumed) == read(linen_run)  # a resume continues exactly where the first run stopped
  with pytest.raises(ensemble.UsageError, match='a resume must keep the data settings'):
    fit(epochs=3, seed=1)


def test_the_programs_read_a_workdir_that_fit_wrote(linen_run, tmp_path):
  """evaluate, predict and export, as for a run of `python -m ensemble.train`; the data from an IDX copy."""
  mnist = write_mnist(str(tmp_path / 'mnist'))  # the same synthetic arrays as `arrays`
  out = tmp_path / 'eval'
  assert run_main(evaluate.main, 'evaluate', '--workdir', linen_run.workdir, '--data_dir', mnist, '--angles=0',
                  '--output_dir', str(out)) == 0
  with open(out / 'metrics.json', encoding='utf-8') as f:
    assert json.load(f)['ensemble']['accuracy'] > 0.5
  images = tmp_path / 'images.npy'
  np.save(images, synthetic_mnist(8, 1)[0][0])
  summary = predict.predict_files(linen_run.workdir, str(images), str(tmp_path / 'rows.csv'), flag=False)
  assert summary['images'] == 8
  exported = export.write(linen_run.workdir, str(tmp_path / 'model.jax'), platforms=['cpu'])
  assert exported.out_avals[1].shape[1:] == (10,)


def test_an_nnx_model_with_batchnorm_and_dropout(arrays, tmp_path):
  x_train, y_train, x_test, y_test = arrays
  ens = ensemble.fit(functools.partial(user_models.NNXNet, din=28 * 28), (x_train, y_train), test=(x_test, y_test),
                     ensemble_size=2, **SETTINGS)
  assert ens.evaluate(x_test, y_test)['ensemble']['accuracy'] > 0.5
  state = _leaves(ens.state)
  assert not np.allclose(state['params']['hidden']['kernel'][0], state['params']['hidden']['kernel'][1])
  assert np.abs(state['batch_stats']['norm']['mean']).max() > 1e-3
  member, first = ens.member, jax.tree.map(lambda x: x[0], ens.state)
  images = member.prepare(x_test[:8])
  apply = lambda train, key: member.apply(first, first.params, images, train=train, key=key)[0]
  assert not np.allclose(apply(True, jax.random.key(1)), apply(True, jax.random.key(2)))
  np.testing.assert_array_equal(apply(False, jax.random.key(1)), apply(False, jax.random.key(2)))
  # config.json rebuilds it in another process: ensemble.load needs no model.
  reloaded = ensemble.load(ens.save(str(tmp_path / 'nnx')).workdir)
  np.testing.assert_allclose(reloaded.predict(x_test)['probs'], ens.predict(x_test)['probs'], rtol=1e-6)


def _tabular(n: int = 600):
  """Three classes by two features on very different scales: standardisation matters."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 6)) * np.array([1.0, 1000.0, 1.0, 1.0, 0.001, 1.0])
  y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)
  return x, y


def test_a_tabular_mlp_on_feature_vectors(tmp_path):
  x, y = _tabular()
  ens = ensemble.fit(user_models.TinyNet(num_classes=3), (x[:500], y[:500]), test=(x[500:], y[500:]),
                     ensemble_size=2, standardize_features=True, heldout_fraction=0.1,
                     **{**SETTINGS, 'epochs': 6, 'learning_rate': 0.3})
  assert ens.member.inputs == 'features' and ens.member.augment == 'none'
  assert ens.evaluate(x[500:], y[500:])['ensemble']['accuracy'] > 0.8
  with pytest.raises(ensemble.UsageError, match='NaN or infinite'):
    ens.predict(np.full((2, 6), np.nan))
  # In memory until saved; the saved copy loads, its features standardised on the host by the training split's
  # statistics, as in memory: the same predictions.
  assert ens.workdir is None
  kept = str(tmp_path / 'kept')
  expected = ens.predict(x[500:])['probs']
  assert ens.save(kept).workdir == kept and ens.workdir is None  # the value saved there; this one stays in memory
  with pytest.raises(ensemble.UsageError, match='exists; save to a new path'):
    ens.save(kept)
  loaded = ensemble.load(kept)
  statistics = loaded.variables['statistics']  # the training split's, held-out apart
  np.testing.assert_allclose(statistics['input_std'], x[:450].std(0), rtol=1e-6)
  np.testing.assert_array_equal(statistics['input_std'], ens.variables['statistics']['input_std'])
  np.testing.assert_array_equal(loaded.predict(x[500:])['probs'], expected)


class _TokenModel(user_models.nn.Module):
  @user_models.nn.compact
  def __call__(self, tokens):
    return user_models.nn.Dense(2)(user_models.nn.Embed(16, 8)(tokens).mean(1))


def test_a_sequence_model_on_token_ids():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 16, (600, 10))
  labels = (tokens == 3).any(1).astype(np.int64)
  # Without a test set, a held-out slice (here the last 10% of the training arrays) is each epoch's test set.
  ens = ensemble.fit(_TokenModel(), (tokens[:500], labels[:500]), ensemble_size=2, heldout_fraction=0.1,
                     **{**SETTINGS, 'epochs': 4, 'learning_rate': 0.5})
  assert ens.member.inputs == 'tokens'
  assert ens.config.heldout_fraction == 0.1 and ens.summary['test_accuracy'] > 0.8
  assert ens.evaluate(tokens[500:], labels[500:])['ensemble']['accuracy'] > 0.8
  with pytest.raises(ensemble.UsageError, match='token ids of dtype float'):
    ens.predict(tokens[:2].astype(np.float32))
  for bad in (2 ** 32 + 3, -1):  # as fit refuses them: not wrapped round to another id
    with pytest.raises(ensemble.UsageError, match=r'^predict: token ids must lie in 0\.\.2\*\*31-1'):
      ens.predict(np.full((2, 10), bad, np.int64))


def _with_nan(images):
  images = images.astype(np.float32) / 255
  images[3, 4, 5] = np.nan
  return images


# case -> (fit's arguments from (x_train, y_train, x_test, y_test), the error it must raise)
BAD_INPUTS = {
    'too few logits': (lambda x, y, tx, ty: dict(model=user_models.TinyNet(num_classes=3), train=(x, y), test=(tx, ty)),
                       r'not to \(batch, 10\) logits'),
    'the wrong input shape': (lambda x, y, tx, ty: dict(model=user_models.WrongInputSize(), train=(x, y),
                                                       test=(tx, ty)),
                              r'fails on inputs of shape \(batch, 28, 28, 1\)'),
    'float labels': (lambda x, y, tx, ty: dict(model=user_models.TinyNet(), train=(x, y + 0.5), test=(tx, ty)),
                     r"real-valued targets \(dtype float64\) with task='classification': pass task='regression'"),
    'different lengths': (lambda x, y, tx, ty: dict(model=user_models.TinyNet(), train=(x, y[:-1]), test=(tx, ty)),
                          '256 inputs but 255 labels'),
    'NaN inputs': (lambda x, y, tx, ty: dict(model=user_models.TinyNet(), train=(_with_nan(x), y), test=(tx, ty)),
                   'NaN or infinite'),
    'a path that does not import': (lambda x, y, tx, ty: dict(model='no_such_module:Net', train=(x, y), test=(tx, ty)),
                                    "module 'no_such_module' does not import"),
    'a path to no model': (lambda x, y, tx, ty: dict(model='user_models:Missing', train=(x, y), test=(tx, ty)),
                           "module 'user_models' has no 'Missing'"),
    'no model at all': (lambda x, y, tx, ty: dict(model=user_models.NOT_A_MODEL, train=(x, y), test=(tx, ty)),
                        'neither a flax.linen Module nor an NNX model'),
    # Called with nnx.Rngs as an NNX builder, it returns (or fails on) them: not a model that fails on the data.
    'a plain function of the inputs': (lambda x, y, tx, ty: dict(model=lambda images: images, train=(x, y),
                                                                 test=(tx, ty)),
                                       r'^model <lambda>, called with nnx.Rngs to build an NNX model, returned a '
                                       r'Rngs: the model must be a flax.linen Module, a function of nnx.Rngs'),
    'a plain def of the inputs': (lambda x, y, tx, ty: dict(model=user_models.plain_function, train=(x, y),
                                                            test=(tx, ty)),
                                  r'^model plain_function, called with nnx.Rngs to build an NNX model, failed '
                                  r'\(.*\): the model must be a flax.linen Module'),
    'an unknown field': (lambda x, y, tx, ty: dict(model=user_models.TinyNet(), train=(x, y), test=(tx, ty),
                                                   learning_rat=0.1),
                         r"unknown field 'learning_rat' \(did you mean learning_rate"),
    'batchensemble without rank-1 layers': (lambda x, y, tx, ty: dict(model=user_models.TinyNet(), train=(x, y),
                                                                      test=(tx, ty), method='batchensemble'),
                                            'ensemble.models.rank1'),
}


@pytest.mark.parametrize('case', list(BAD_INPUTS))
def test_bad_input_is_one_error_and_writes_nothing(arrays, tmp_path, case):
  make, message = BAD_INPUTS[case]
  workdir = tmp_path / 'run'
  with pytest.raises(ensemble.UsageError, match=message) as error:
    ensemble.fit(**make(*arrays), ensemble_size=2, workdir=str(workdir), **SETTINGS)
  assert isinstance(error.value, ValueError) and '\n' not in str(error.value)
  assert not workdir.exists()


def _python(code: str, **env) -> subprocess.CompletedProcess:
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([TESTS, REPO]), **env}
  return subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


PROGRAM_WITH_ITS_OWN_FLAGS = '''
import logging
from absl import app, flags
flags.DEFINE_string('workdir', None, 'Where this program keeps its runs.')
FLAGS = flags.FLAGS

def main(argv):
  import ensemble, numpy as np, user_models
  root = logging.getLogger()
  before = (list(root.handlers), root.level, [list(h.filters) for h in root.handlers])
  x = np.random.default_rng(0).integers(0, 255, (64, 28, 28, 1), dtype=np.uint8)
  y = np.arange(64) % 10
  ensemble.fit(user_models.TinyNet(), (x, y), test=(x, y), ensemble_size=2, epochs=1, batch_size=32,
               workdir=FLAGS.workdir, progress=False)
  ens = ensemble.load(FLAGS.workdir)
  assert (list(root.handlers), root.level, [list(h.filters) for h in root.handlers]) == before
  assert not [name for name in ('angles', 'input', 'platforms', 'config', 'cpu_devices') if name in FLAGS]
  print('members', ens.size)

app.run(main)
'''


def test_a_program_with_its_own_workdir_flag_uses_the_library(tmp_path):
  result = subprocess.run(
      [sys.executable, '-c', PROGRAM_WITH_ITS_OWN_FLAGS, f'--workdir={tmp_path / "run"}'], cwd=REPO,
      env={**os.environ, 'PYTHONPATH': os.pathsep.join([TESTS, REPO])}, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'members 2' in result.stdout


def test_cpu_devices_before_and_after_jax_starts():
  result = _python('import ensemble\n'
                   'ensemble.cpu_devices(3)\n'
                   'import jax\n'
                   'assert jax.device_count() == 3, jax.devices()\n'
                   'ensemble.cpu_devices(2)  # fewer than JAX has: fine\n'
                   'try:\n'
                   '  ensemble.cpu_devices(5)\n'
                   'except ensemble.UsageError as e:\n'
                   '  print(e)\n', XLA_FLAGS=COMPILE_FLAGS)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'JAX has already started with 3 CPU devices; call ensemble.cpu_devices(5) before' in result.stdout


def test_the_compilation_cache_is_the_users_unless_the_process_has_one(tmp_path):
  result = _python('import jax\n'
                   'from ensemble import devices\n'
                   'print(devices.compilation_cache("auto"))\n'
                   'print(devices.compilation_cache("elsewhere"))  # set already: kept\n'
                   'jax.config.update("jax_compilation_cache_dir", None)\n'
                   'print(devices.compilation_cache(""))\n', XDG_CACHE_HOME=str(tmp_path))
  assert result.returncode == 0, result.stderr[-3000:]
  folder = str(tmp_path / 'ensemble' / 'jax')
  assert result.stdout.split() == [folder, folder, 'None'] and os.path.isdir(folder)


def test_the_compilation_cache_keeps_fast_compiles_unless_the_user_sets_a_threshold(tmp_path):
  code = ('import os, jax\n'
          'from ensemble import devices\n'
          'folder = devices.compilation_cache("auto")\n'
          'jax.jit(lambda x: x * 3 + 1)(1.0).block_until_ready()  # compiles in milliseconds\n'
          'print(len(os.listdir(folder)))\n')
  default = _python(code, XDG_CACHE_HOME=str(tmp_path / 'default'))
  users = _python(code, XDG_CACHE_HOME=str(tmp_path / 'users'), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='60')
  assert default.returncode == 0 and users.returncode == 0, default.stderr[-3000:] + users.stderr[-3000:]
  assert int(default.stdout) >= 1 and int(users.stdout) == 0


def test_the_cli_trains_a_model_named_by_import_path(mnist_dir, tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      [sys.executable, '-m', 'ensemble.train', '--config=configs/classic.py', f'--workdir={workdir}',
       '--config.model=user_models:TinyNet', "--config.model_kwargs={'width': 16}", f'--config.data_dir={mnist_dir}',
       '--cpu_devices=2', '--config.num_epochs=1', '--config.batch_size=32', '--config.learning_rate=0.05'],
      cwd=REPO, env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS, 'PYTHONPATH': TESTS}, capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  ens = ensemble.load(str(workdir))
  assert ens.size == 2 and _leaves(ens.state)['params']['Dense_0']['kernel'].shape == (2, 28 * 28, 16)


# The examples that train on real digits run faster compiled as users compile (linen_cnn_mnist.py 24 s of CPU
# against 49 s, sequence_tokens.py 16 s against 31 s); the others compile more than they run.
COMPUTE_BOUND_EXAMPLES = ('linen_cnn_mnist.py', 'sequence_tokens.py')


@pytest.mark.parametrize('example', [
    pytest.param(f, marks=[pytest.mark.compute_bound] if f in COMPUTE_BOUND_EXAMPLES else [])
    for f in sorted(f for f in os.listdir(os.path.join(REPO, 'examples')) if f.endswith('.py'))])
def test_examples_run(example, monkeypatch, capsys):
  """Each example as it is, with its --quick setting; in this process, whose 8 devices it asks for."""
  import runpy  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sys, 'argv', [example, '--quick'])
  runpy.run_path(os.path.join(REPO, 'examples', example), run_name='__main__')
  out = capsys.readouterr().out
  assert 'accuracy' in out or 'RMSE' in out  # a classifier's or a regression's scores


def test_bfloat16_learns_keeps_float32_state_and_pmap_equals_jit(arrays):
  x_train, y_train, x_test, y_test = arrays
  # Two devices, a member each: jit would spread 2 members over 8 (each data-parallel on 4), another sum order.
  fit = functools.partial(ensemble.fit, user_models.TinyNet(width=32), (x_train, y_train), test=(x_test, y_test),
                          ensemble_size=2, num_devices=2, dtype='bfloat16', **SETTINGS)
  pmap, jit = fit(backend='pmap'), fit(backend='jit')
  floats = [leaf for leaf in jax.tree.leaves((pmap.state.params, pmap.state.opt_state, pmap.state.batch_stats))
            if np.issubdtype(leaf.dtype, np.floating)]
  assert {leaf.dtype for leaf in floats} == {np.dtype('float32')}
  first = jax.tree.map(lambda x: x[0], pmap.state)
  images = pmap.member.prepare(x_test[:16])
  logits = pmap.member.apply(first, first.params, images, train=False)[0]
  exact = dataclasses.replace(pmap.member, dtype='float32').apply(first, first.params, images, train=False)[0]
  assert logits.dtype == np.float32 and not np.array_equal(logits, exact)  # computed in bfloat16, returned float32
  np.testing.assert_allclose(logits, exact, rtol=0.1, atol=0.1)
  assert pmap.evaluate(x_test, y_test)['ensemble']['accuracy'] > 0.5
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
               _leaves(jit.state), _leaves(pmap.state))


def test_fit_splits_a_users_annotated_members_over_their_devices_with_member_sharding_model(arrays, tmp_path):
  """member_sharding and logical_axis_rules are fit's keywords like any field; config.json records them."""
  x, y, x_test, y_test = arrays
  ens = ensemble.fit(user_models.Annotated(), (x, y), test=(x_test, y_test), ensemble_size=2, backend='jit',
                     num_devices=8, member_sharding='model', logical_axis_rules=[('mlp', 'model')],
                     workdir=str(tmp_path / 'run'), **{**SETTINGS, 'epochs': 1})
  with open(tmp_path / 'run' / 'config.json', encoding='utf-8') as f:
    recorded = json.load(f)
  assert recorded['member_sharding'] == 'model' and recorded['logical_axis_rules'] == [['mlp', 'model']]
  assert ens.predict(x_test[:4])['probs'].shape == (4, 10)


def test_a_script_loads_the_ensemble_of_a_model_it_defined(tmp_path):
  """Issue 67: a model defined in a script (or a notebook) could not be loaded by that same script: its import path
  '__main__:Name' was refused. The script that defines it now loads it; another program still gets the one-line
  refusal that says how."""
  script = tmp_path / 'script.py'
  script.write_text(textwrap.dedent('''
      import sys
      import flax.linen as nn
      import numpy as np
      import ensemble

      class Net(nn.Module):
        width: int = 8

        @nn.compact
        def __call__(self, x):
          return nn.Dense(2)(nn.relu(nn.Dense(self.width)(x)))

      x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
      ens = ensemble.fit(Net(width=6), (x, (x[:, 0] > 0).astype(np.int32)), ensemble_size=2, epochs=1, batch_size=8,
                         progress=False)
      ens.save(sys.argv[1])
      loaded = ensemble.load(sys.argv[1])
      np.testing.assert_allclose(loaded.predict(x)['probs'], ens.predict(x)['probs'], rtol=1e-5)
      print('loaded', loaded.config.model, dict(loaded.config.model_kwargs))
  '''))
  workdir = str(tmp_path / 'saved')
  done = subprocess.run([sys.executable, str(script), workdir], capture_output=True, text=True, check=False,
                        env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS, 'PYTHONPATH': REPO})
  assert done.returncode == 0, done.stderr[-3000:]
  assert "loaded __main__:Net {'width': 6}" in done.stdout
  with pytest.raises(ensemble.UsageError, match="model '__main__:Net' was defined in the script that trained it"):
    ensemble.load(workdir)
