"""MC dropout (`method='mc_dropout'`, methods/mc_dropout.py): members that stay one network, each predicting a dropout
pass of it (against the model's own train-mode pass computed here), on both backends, with the built-in MLP, a user's
linen and NNX models, classification and regression; a workdir that loads and predicts; models without dropout and
bad rates refused in one line."""

import functools
import re

import jax
import numpy as np
import pytest

import ensemble
import user_models
from conftest import assert_one_network, assert_same_training, fitted_once, small_config, toy_features
from ensemble import members, recipe as recipe_lib, data, defaults, export, methods, trainer
from ensemble.errors import UsageError
from ensemble.methods import mc_dropout

K = 4
# Small and fast: K=4 members, one epoch of four steps.
SETTINGS = {'ensemble_size': K, 'epochs': 1, 'batch_size': 16, 'method': 'mc_dropout', 'progress': False}


TRAIN, TEST = toy_features(), toy_features(16, 1)
MODELS = {
    'mlp': 'mlp',
    'linen': user_models.TinyNet(width=16, num_classes=2),  # Dense, BatchNorm, ReLU, nn.Dropout(0.25)
    'nnx': functools.partial(user_models.NNXNet, din=5, num_classes=2, width=16),  # the same with nnx.Dropout
}


@pytest.fixture(scope='module')
def fits():
  """`fits(model, backend)`: an MC dropout ensemble fitted once per module."""
  return fitted_once(lambda model, backend='pmap': ensemble.fit(MODELS[model], TRAIN, TEST, backend=backend,
                                                                **SETTINGS))


def _member_probs(ens, x):
  """(K, N, classes): each member's probabilities."""
  return np.exp(np.asarray(jax.nn.log_softmax(jax.jit(jax.vmap(ens.member.predict, in_axes=(0, None)))(ens.state, x))))


@pytest.mark.parametrize('model', list(MODELS))
def test_members_stay_one_network_and_predict_with_their_own_dropout(fits, model):
  ens = fits(model)
  assert_one_network(ens)
  probs = _member_probs(ens, TEST[0])
  assert min(np.abs(probs[i] - probs[j]).max() for i in range(K) for j in range(i)) > 1e-4  # K different passes
  np.testing.assert_array_equal(probs, _member_probs(ens, TEST[0]))  # each member's masks are its own and fixed
  result = ens.predict(TEST[0])
  np.testing.assert_allclose(result['probs'], probs.mean(0), rtol=1e-5)
  assert result['mutual_information'].max() > 0
  first = jax.tree.map(lambda leaf: leaf[0], ens.state)
  assert np.abs(ens.member.predict(first, TEST[0]) - ens.member.logits(first, TEST[0])).max() > 1e-4  # dropout on
  assert ens.member.method.num_params(jax.tree.map(lambda x: x[0], ens.state.params), K) == sum(
      leaf[0].size for leaf in jax.tree.leaves(ens.state.params))


def test_a_member_predicts_the_model_s_train_mode_pass_under_its_own_key(fits):
  """The built-in MLP has no BatchNorm: a member's prediction is its dropout pass in training, computed here."""
  ens = fits('mlp')
  x = TEST[0]
  for i in range(K):
    key = jax.random.fold_in(jax.random.wrap_key_data(ens.state.key[i]), mc_dropout.PREDICTION_KEY)
    params = jax.tree.map(lambda leaf, i=i: leaf[i], ens.state.params)
    expected = ens.member.model.apply({'params': params}, x, train=True, rngs={'dropout': key})
    np.testing.assert_allclose(ens.member.predict(jax.tree.map(lambda leaf, i=i: leaf[i], ens.state), x),
                               expected, rtol=1e-5, atol=1e-6)
  assert ens.member.model.dropout_rate == 0.1


def test_pmap_and_jit_train_the_same_network(fits):
  assert_one_network(fits('mlp', 'jit'))
  assert_same_training(fits('mlp', 'pmap'), fits('mlp', 'jit'))


def test_regression_samples_the_network():
  x, _ = TRAIN
  ens = ensemble.fit('mlp', (x, (x[:, 0] - x[:, 2]).astype(np.float32)), task='regression', **SETTINGS)
  assert_one_network(ens)
  assert ens.predict(x[:8])['epistemic'].min() > 0  # the K dropout passes disagree


def test_a_workdir_restores_evaluates_predicts_and_exports(mnist_dir, tmp_path):
  """What python -m ensemble.train writes (its trainer, in this process), read back by ensemble.load: the same dropout
  passes as the trainer's test pass scored, and the same in the exported artifact."""
  workdir = str(tmp_path / 'run')
  config = small_config(mnist_dir, model='mlp', method='mc_dropout', ensemble_size=2, num_devices=2)
  _, summary = trainer.train_and_evaluate(config, workdir)
  loaded = ensemble.load(workdir)
  assert loaded.member.model.dropout_rate == 0.1
  test = data.load(data_dir=mnist_dir).test
  np.testing.assert_allclose(loaded.evaluate(test['image'], test['label'])['ensemble']['nll'], summary['test_loss'],
                             rtol=1e-4)
  images = test['image'][:8].astype(np.float32) / 255  # the artifact takes pixels in [0, 1]
  exported = jax.export.deserialize(export.export(loaded).serialize())
  np.testing.assert_allclose(exported.call(images)['probs'], loaded.predict(images)['probs'], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('model', [user_models.NoTrainArgument(num_classes=2),
                                   functools.partial(user_models.ScaledNNX, din=5, num_classes=2)])
def test_a_model_without_dropout_is_refused_in_one_line(model):
  with pytest.raises(UsageError, match=re.escape('method mc_dropout samples the model with its dropout on, and this '
                                                 'model has no dropout layer')) as raised:
    ensemble.fit(model, TRAIN, **SETTINGS)
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('rate, rule', [(0.0, '(0, 1) for method mc_dropout'), (1.0, '[0, 1)'), (-0.1, '[0, 1)'),
                                        (float('nan'), '[0, 1)')])
def test_bad_dropout_rates_are_refused_in_one_line(make_config, rate, rule):
  with pytest.raises(UsageError, match=re.escape(f'dropout_rate={rate!r} must be in {rule}')) as raised:
    recipe_lib.resolve(make_config(method='mc_dropout', dropout_rate=rate), jax.devices())
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('model', ['cnn', 'resnet'])
def test_only_mc_dropout_gives_the_built_in_models_dropout(model):
  """The image models too: a member's prediction is then not its deterministic pass."""
  for method, rate in (('independent', 0.0), ('mc_dropout', 0.3)):
    config = defaults.get_config()
    config.update(method=method, dropout_rate=0.3, model=model, resnet_depth=8)
    member = members.member(config, members.data_info((8, 8, 1), 3, (0.5,), (0.25,)))
    assert member.model.dropout_rate == rate
  state, images = member.init(jax.random.key(0)), np.random.default_rng(0).integers(0, 256, (4, 8, 8, 1))
  assert np.abs(member.predict(state, images) - member.logits(state, images)).max() > 1e-4
  assert 'mc_dropout' in methods.NAMES
