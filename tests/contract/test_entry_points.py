"""The contract's entry points: every keyword of `fit`, `predict`, `evaluate` and `distill` is checked; every kind
of input and source trains as its arrays do; a refit compiles nothing, whatever the model's kind; nothing non-finite
is returned silently; a workdir is only ever a workdir.
"""

import functools
import math
import os

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensemble
from ensemble import data, defaults
from ensemble.data import arrays as data_arrays, convert
from conftest import compiles
from lab import COMMON, TRAIN_ROWS, as_source, assert_same_members, folder_digest, mnist_train, problem

FIT = {**COMMON, 'progress': False}


@pytest.fixture(scope='module')
def classifier():
  train, test = problem('classification')
  return ensemble.fit('mlp', train, test=test, **FIT)


@pytest.fixture(scope='module')
def regressor():
  train, test = problem('regression')
  return ensemble.fit('mlp', train, test=test, task='regression', **FIT)


def _one_line(error: pytest.ExceptionInfo) -> str:
  message = str(error.value)
  assert message and '\n' not in message, message
  return message


# --- every keyword -------------------------------------------------------------------------------------------------

class _Opaque:
  """A value of no type any keyword takes."""

  def __repr__(self):
    return '<opaque>'


# Values out of range for fields whose type is right: each must be refused in one line.
OUT_OF_RANGE = {
    'ensemble_size': [-1], 'num_epochs': [0, -2], 'batch_size': [0, -16], 'eval_batch_size': [0],
    'learning_rate': [0.0, -0.1, math.nan, math.inf], 'momentum': [1.0, -0.5], 'weight_decay': [-1e-4, math.nan],
    'warmup_epochs': [-1, 5], 'seed': [-1, 2**40], 'heldout_fraction': [1.0, -0.1], 'num_devices': [-1, 999],
    'dropout_rate': [1.5], 'adversarial_epsilon': [-0.1, 1.0, math.nan], 'beta': [2.0], 'snapshot_cycles': [0],
    'packed_alpha': [0.0], 'packed_gamma': [0], 'swag_samples': [0], 'swag_rank': [1], 'swag_start': [0.0, 1.0],
    'swag_learning_rate': [-0.01], 'distill_temperature': [0.0, -1.0], 'num_train_steps': [-5],
    'checkpoint_every_steps': [-1], 'checkpoints_to_keep': [0], 'eval_every': [-1], 'steps_per_dispatch': [-3],
    'hyper_learning_rate': [(0.2, 0.1), (0.0, 0.1)], 'hyper_weight_decay': [(1.0,)], 'resnet_depth': [7],
    'resnet_width': [0], 'method': ['nope'], 'optimizer': ['nope'], 'schedule': ['nope'], 'backend': ['nope'],
    'member_data': ['nope'], 'augment': ['nope'], 'task': ['nope'], 'loss': ['nope'], 'inputs': ['nope'],
    'dtype': ['float16'], 'streaming': ['sometimes'], 'member_sharding': ['nope'], 'model': ['nope'],
}
# Fields whose value `fit` sets itself, or that name what the arrays are: any type is refused as any other field's.
FIT_KEYWORDS = {'ensemble_size': [0.5, 'two', True], 'epochs': [0, 1.5, 'x', True], 'method': [3],
                'workdir': ['', 3], 'config': [3, 'configs/default.py'], 'init': [3, 'ens'],
                'keep_optimizer': ['yes', 2], 'keep_freed_memory': ['yes'], 'progress': ['yes', 3]}


def _field_cases():
  for field in sorted(defaults.get_config().keys()):
    yield pytest.param(field, _Opaque(), id=f'{field}=opaque')
    for value in OUT_OF_RANGE.get(field, []):
      yield pytest.param(field, value, id=f'{field}={value!r}')
  for keyword, values in FIT_KEYWORDS.items():
    for value in values:
      yield pytest.param(keyword, value, id=f'{keyword}={value!r}')


@pytest.mark.parametrize('keyword, value', list(_field_cases()))
def test_fit_refuses_a_bad_keyword_in_one_line(keyword, value):
  train, test = problem('classification')
  model, fields = 'mlp', {**FIT, keyword: value}
  if keyword == 'num_epochs':
    del fields['epochs']
  if keyword == 'model':  # fit's first argument
    model = fields.pop('model')
  with compiles() as counts, pytest.raises(ensemble.UsageError) as refused:
    ensemble.fit(model, train, test=test, **fields)
  assert keyword in _one_line(refused) or keyword == 'model' and 'model' in str(refused.value)
  assert not counts, 'refused only after compiling'


@pytest.mark.parametrize('keyword, value', [
    ('temperature', 0.0), ('temperature', -1.0), ('temperature', math.nan), ('temperature', 'x'),
    ('test', 3), ('config', 3), ('workdir', ''), ('init', 3), ('keep_optimizer', 'yes'), ('progress', 'yes'),
    ('epochs', 0), ('learning_rate', -1.0), ('batch_size', 0), ('ensemble_size', 2), ('method', 'bagging'),
    ('heldout_fraction', 0.5), ('task', 'regression')])
def test_distill_refuses_a_bad_keyword_in_one_line(classifier, keyword, value):
  x = problem('classification')[0][0]
  with pytest.raises(ensemble.UsageError) as refused:
    fields = {key: v for key, v in FIT.items() if key != 'ensemble_size'}
    ensemble.distill(classifier, 'mlp', x, **{**fields, keyword: value})
  assert keyword in _one_line(refused)


@pytest.mark.parametrize('keyword, value', [
    ('levels', (90,)), ('levels', (-0.5,)), ('levels', (0.0,)), ('levels', (1.0,)), ('levels', (math.nan,)),
    ('levels', (0.9, 0.9)), ('levels', 'x'), ('levels', 0.9), ('members', 'yes'), ('progress', 'yes')])
def test_predict_refuses_a_bad_keyword_in_one_line(regressor, keyword, value):
  x = problem('regression')[1][0]
  with pytest.raises(ensemble.UsageError) as refused:
    regressor.predict(x, **{keyword: value})
  assert keyword in _one_line(refused)


def test_predict_names_every_interval_by_its_own_level(regressor):
  """Close levels keep apart: 90% and 90.4% are two intervals, each holding its share, lower below upper."""
  x = problem('regression')[1][0]
  result = regressor.predict(x, levels=(0.9, 0.904, 0.5))
  assert {'lower_90', 'upper_90', 'lower_90.4', 'upper_90.4', 'lower_50', 'upper_50'} <= set(result)
  for name in ('90', '90.4', '50'):
    assert (result[f'lower_{name}'] < result[f'upper_{name}']).all()
  assert (result['upper_90.4'] > result['upper_90']).all() and (result['lower_50'] > result['lower_90']).all()


@pytest.mark.parametrize('ensemble_name', ['classifier', 'regressor'])
def test_evaluate_refuses_bad_labels_in_one_line(ensemble_name, request):
  ens = request.getfixturevalue(ensemble_name)
  (x, y) = problem(ens.task.name)[1]
  for inputs, labels in ((x, y[:3]), (x[:, :2], y), (x, np.full(y.shape, np.nan, np.float32)), (x[:0], y[:0])):
    with pytest.raises(ensemble.UsageError) as refused:
      ens.evaluate(inputs, labels)
    _one_line(refused)


def test_distill_trains_on_every_input_it_labels_whatever_the_config():
  """The teacher labels every input given; none is held out, with a config of the programs' defaults too."""
  train, test = problem('classification')
  teacher = ensemble.fit('mlp', train, **FIT)
  for config in (None, defaults.get_config()):
    student = ensemble.distill(teacher, 'mlp', train[0], test=test, config=config, epochs=1, batch_size=16,
                               progress=False)
    assert int(np.asarray(student.state.step).reshape(-1)[0]) == TRAIN_ROWS // 16, config


# --- every kind of input, every kind of source ----------------------------------------------------------------------

class _Tokens(nn.Module):
  vocabulary: int = 12

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.Embed(self.vocabulary, 8)(x).mean(1))


class _Pixels(nn.Module):
  num_classes: int = 2

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(x.reshape(len(x), -1))


def _inputs(kind: str):
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 2, TRAIN_ROWS).astype(np.int64)
  if kind == 'greyscale (H, W) uint8 images':
    return _Pixels(), rng.integers(0, 256, (TRAIN_ROWS, 6, 6), dtype=np.uint8), labels
  if kind == 'float images in [0, 1]':
    return _Pixels(), rng.random((TRAIN_ROWS, 6, 6, 1)).astype(np.float32), labels
  if kind == 'int64 token ids':
    return _Tokens(), rng.integers(0, 12, (TRAIN_ROWS, 5)).astype(np.int64), labels
  if kind == 'float64 features':
    return 'mlp', rng.normal(size=(TRAIN_ROWS, 3)), labels
  raise ValueError(kind)


@pytest.mark.parametrize('kind', ['greyscale (H, W) uint8 images', 'float images in [0, 1]', 'int64 token ids',
                                  'float64 features'])
def test_a_source_trains_the_members_its_arrays_train(kind):
  model, x, y = _inputs(kind)
  arrays = ensemble.fit(model, (x, y), **FIT)
  streamed = ensemble.fit(model, as_source((x, y)), **FIT)
  assert_same_members(streamed, arrays, inputs=x[:8])


def test_the_packages_own_splits_train_as_their_arrays():
  """`data.load`'s splits: {'image', 'label'} in memory, and a converted folder's streamed split."""
  split = mnist_train()
  fields = {**FIT, 'augment': 'none'}
  arrays = ensemble.fit(_Pixels(10), (split['image'], split['label']), **fields)
  assert_same_members(ensemble.fit(_Pixels(10), split, **fields), arrays, inputs=split['image'][:8])


def test_a_converted_folders_streamed_split_trains_as_its_arrays(tmp_path):
  train, test = problem('regression')
  folder = str(tmp_path / 'folder')
  convert.write(data_arrays.from_arrays(train, test, 'features', 'regression'), folder, examples_per_file=20)
  loaded = data.load('', folder, task='regression', streaming='always')
  fields = {**FIT, 'task': 'regression'}
  assert_same_members(ensemble.fit('mlp', loaded.train, test=loaded.test, **fields),
                      ensemble.fit('mlp', train, test=test, **fields))


# --- nothing non-finite returned silently ---------------------------------------------------------------------------

def test_token_ids_beyond_the_embedding_table_are_one_line():
  model, x, y = _inputs('int64 token ids')
  ens = ensemble.fit(model, (x, y), **FIT)
  beyond = np.full((3, 5), 20)
  for call in (lambda: ens.predict(beyond), lambda: ens.evaluate(beyond, np.zeros(3, np.int32))):
    with pytest.raises(ensemble.UsageError) as refused:
      call()
    assert '3 of 3 inputs' in _one_line(refused) and 'embedding' in str(refused.value)
  with pytest.raises(ensemble.UsageError) as refused:
    ensemble.fit(model, (np.concatenate([x, beyond]), np.concatenate([y, [0, 1, 0]])), **FIT)
  assert 'embedding' in _one_line(refused)


class _LogOfInputs(nn.Module):
  """Finite on positive inputs, NaN on negative ones: a model whose outputs can stop being numbers."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(jnp.log(x))


def test_non_finite_outputs_are_one_line_naming_how_many_inputs():
  rng = np.random.default_rng(0)
  x, y = rng.random((TRAIN_ROWS, 3)).astype(np.float32) + 0.5, rng.integers(0, 2, TRAIN_ROWS)
  ens = ensemble.fit(_LogOfInputs(), (x, y), **{**FIT, 'standardize_features': False})
  bad = x[:4].copy()
  bad[1:3] = -1.0
  with pytest.raises(ensemble.UsageError) as refused:
    ens.predict(bad)
  assert '2 of 4 inputs' in _one_line(refused)
  assert np.isfinite(ens.predict(x[:4])['probs']).all()


# --- a refit compiles nothing, whatever the model ------------------------------------------------------------------

class _Widths(nn.Module):
  """A linen model with a list field: unhashable, as a user's often is."""
  widths: list
  num_classes: int = 2

  @nn.compact
  def __call__(self, x):
    for width in self.widths:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


class _NNX(nnx.Module):
  def __init__(self, din: int = 1, width: int = 8, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(din, width, rngs=rngs)
    self.head = nnx.Linear(width, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.hidden(x)))


MODELS = {
    'linen class': lambda features: _Widths((8,)),
    'linen list field': lambda features: _Widths([8, 8]),
    'nnx class': lambda features: _NNX if features == 1 else functools.partial(_NNX, features),
    'nnx partial': lambda features: functools.partial(_NNX, features, 8),
    'nnx lambda': lambda features: (lambda rngs: _NNX(features, 8, rngs=rngs)),
    'built-in mlp': lambda features: 'mlp',
}


@pytest.mark.parametrize('features, with_test', [(1, True), (3, False)], ids=['1 feature, test', '3 features'])
@pytest.mark.parametrize('model', list(MODELS))
def test_a_refit_on_new_data_compiles_nothing(model, features, with_test):
  """A Bayesian-optimisation loop: the same recipe on other rows of the same shapes, each model given afresh."""
  def fit(seed):
    (x, y), test = problem('regression', seed=seed, features=features)
    return ensemble.fit(MODELS[model](features), (x, y[:, 0]), test=(test[0], test[1][:, 0]) if with_test else None,
                        task='regression', **FIT)
  candidates = problem('regression', seed=2, features=features)[1][0]
  fit(0).predict(candidates, levels=())
  with compiles() as counts:
    fit(1).predict(candidates, levels=())
  assert not counts, f'{sum(counts.values())} programs compiled'


# --- a workdir is only ever a workdir -------------------------------------------------------------------------------

@pytest.mark.parametrize('held', [['notes.txt'], ['config.json', 'metrics.jsonl']], ids=['notes', 'another tool'])
def test_a_folder_that_is_not_a_workdir_is_refused_and_left_untouched(tmp_path, held):
  folder = tmp_path / 'mine'
  folder.mkdir()
  for name in held:
    (folder / name).write_text('{"step": 1, "mine": true}\n')
  before = folder_digest(str(folder))
  train, test = problem('classification')
  with pytest.raises(ensemble.UsageError) as refused:
    ensemble.fit('mlp', train, test=test, workdir=str(folder), **FIT)
  assert str(folder) in _one_line(refused)
  assert folder_digest(str(folder)) == before


def test_an_empty_folder_becomes_a_workdir(tmp_path):
  folder = tmp_path / 'empty'
  folder.mkdir()
  train, test = problem('classification')
  ens = ensemble.fit('mlp', train, test=test, workdir=str(folder), **FIT)
  assert ens.workdir == str(folder) and os.path.exists(folder / 'config.json')


# --- a loop's round is a fit ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('pool_path', ['arrays', 'source'])
@pytest.mark.parametrize('task', ['classification', 'regression'])
def test_an_active_learning_round_trains_the_members_fit_trains_on_its_rows(task, pool_path):
  """Whatever path the pool comes by, a round's ensemble is `fit`'s on the seed rows and the rows acquired."""
  (x, y), test = problem(task)
  if task == 'regression':  # one target: the acquisitions score one
    y, test = y[:, 0], (test[0], test[1][:, 0])
  pool = (x[16:], y[16:]) if pool_path == 'arrays' else as_source((x[16:], y[16:]))
  result = ensemble.active_learning('mlp', (x[:16], y[:16]), pool, test, task=task, batch=8, rounds=1,
                                    acquisition='bald' if task == 'classification' else 'epistemic_std', **COMMON)
  rows = np.concatenate([np.arange(16), 16 + result.acquired])
  direct = ensemble.fit('mlp', (x[rows], y[rows]), test=test, task=task, **FIT)
  assert_same_members(result.ensemble, direct, inputs=test[0])
  key = 'accuracy' if task == 'classification' else 'rmse'
  np.testing.assert_allclose(result.curve[-1][key], direct.evaluate(*test)['ensemble'][key], rtol=1e-5)
