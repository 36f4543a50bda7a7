"""MIMO (`method='mimo'`, methods/mimo.py, models/mimo.py): the training batch's grouping into composite examples,
the heads' mean loss and its gradients, and each member's head, against direct computations; members that stay one
network, with the built-in CNN, a user's linen and NNX models through the wrapper, on both backends, for
classification and regression; a workdir that loads, evaluates, predicts and exports; refusals in one line."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensemble
import user_models
from conftest import assert_one_network, assert_same_training, fitted_once, small_config, toy_features
from ensemble import members, recipe as recipe_lib, data, defaults, export, keys, methods, steps, trainer
from ensemble.errors import UsageError
from ensemble.models import mimo as mimo_models
from ensemble.tasks.classification import cross_entropy

K = 4
# Small and fast: K=4 heads, two epochs of four steps of 16 rows (4 composite examples of 4 slots per member).
SETTINGS = {'ensemble_size': K, 'epochs': 2, 'batch_size': 16, 'method': 'mimo', 'progress': False}


def _images(n: int, seed: int):
  """8x8 grey images whose class is whether their top half is brighter than their bottom half."""
  x = np.random.default_rng(seed).integers(0, 256, (n, 8, 8, 1)).astype(np.uint8)
  return x, (x[:, :4].mean((1, 2, 3)) > x[:, 4:].mean((1, 2, 3))).astype(np.int32)


IMAGES, IMAGES_TEST = _images(64, 0), _images(16, 1)
FEATURES, FEATURES_TEST = toy_features(), toy_features(16, 1)
FITS = {
    'cnn': ('cnn', IMAGES, IMAGES_TEST),
    'linen': (mimo_models.MIMO(user_models.TinyNet(width=16, num_classes=2 * K), heads=K), FEATURES, FEATURES_TEST),
    'nnx': (mimo_models.nnx_mimo(functools.partial(user_models.NNXNet, din=5 * K, num_classes=2 * K, width=16),
                                 heads=K), FEATURES, FEATURES_TEST),
}


@pytest.fixture(scope='module')
def fits():
  """`fits(model, backend)`: a MIMO ensemble fitted once per module."""
  return fitted_once(lambda model, backend='pmap': ensemble.fit(*FITS[model], backend=backend, **SETTINGS))


def _mlp_member(**overrides):
  """The built-in MLP of method mimo for 5 features and 2 classes, K heads."""
  config = defaults.get_config()
  config.update(method='mimo', model='mlp', ensemble_size=K, **overrides)
  return members.member(config, members.data_info((5,), 2, (0.0,), (1.0,), inputs='features'))


def _member_state(states, i):
  return jax.tree.map(lambda leaf: leaf[i], states)


def test_composite_examples_loss_and_gradients_against_a_direct_computation():
  """Slot j of composite example r is row j B/M + r; the loss is the mean of the heads' mean cross-entropies on their
  slots' labels, and the member's gradients are those of that mean."""
  member = _mlp_member()
  batch, groups = 8, 8 // K
  x, y = toy_features(batch, 2)
  inputs, labels = member.method.training_batch(jnp.asarray(x), jnp.asarray(y))
  assert inputs.shape == (groups, K, 5) and labels.shape == (groups, K)
  rows = np.array([[j * groups + r for j in range(K)] for r in range(groups)])
  np.testing.assert_array_equal(inputs, x[rows])
  np.testing.assert_array_equal(labels, y[rows])

  state = jax.jit(member.init)(steps.member_keys(0, K)[1])

  def direct_loss(params):
    outputs = member.model.apply({'params': params}, x[rows], train=True)  # (groups, K heads, 2 classes)
    return sum(cross_entropy(outputs[:, j], y[rows][:, j]).mean() for j in range(K)) / K
  grads, (_, metrics) = jax.jit(member.gradients)(state, x, y)
  loss, expected = jax.jit(jax.value_and_grad(direct_loss))(state.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, expected)
  np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-5)


def test_member_i_predicts_with_head_i_on_its_input_repeated():
  member = _mlp_member()  # the seed is an argument of `init`: its key, which the members' keys are split from
  states = jax.jit(jax.vmap(member.init, in_axes=(0, None)))(steps.member_keys(3, K), keys.seed_key(3))
  np.testing.assert_array_equal(states.snapshots['head'], np.arange(K))
  x = FEATURES_TEST[0]
  outputs = member.model.apply({'params': _member_state(states, 0).params}, np.repeat(x[:, None], K, axis=1))
  assert outputs.shape == (len(x), K, 2)
  predictions = jax.jit(jax.vmap(member.predict, in_axes=(0, None)))(states, x)
  for i in range(K):
    np.testing.assert_allclose(predictions[i], outputs[:, i], rtol=1e-5, atol=1e-6)
  assert member.method.num_params(_member_state(states, 0).params, K) == sum(
      leaf[0].size for leaf in jax.tree.leaves(states.params))


def test_the_network_concatenates_the_slots_and_splits_the_heads():
  """Slot j's input is the j-th block of the inner model's inputs; head j the j-th block of its outputs."""
  x = np.arange(2 * 3 * 4 * 4 * 2, dtype=np.float32).reshape(2, 3, 4, 4, 2)  # (batch, 3 slots, 4x4 images, 2 ch)
  joined = mimo_models.concatenate_slots(x)
  np.testing.assert_array_equal(joined, np.concatenate([x[:, j] for j in range(3)], axis=-1))
  outputs = np.arange(2 * 6, dtype=np.float32).reshape(2, 6)
  np.testing.assert_array_equal(mimo_models.split_heads(outputs, 3)[:, 1], outputs[:, 2:4])


@pytest.mark.parametrize('model', list(FITS))
def test_members_stay_one_network_and_the_ensemble_is_the_heads_mean(fits, model):
  ens = fits(model)
  assert_one_network(ens)
  np.testing.assert_array_equal(ens.state.snapshots['head'], np.arange(K))
  x = FITS[model][2][0]
  member_logits = jax.jit(jax.vmap(ens.member.predict, in_axes=(0, None)))(ens.state, x)
  probs = np.exp(np.asarray(jax.nn.log_softmax(member_logits)))
  assert min(np.abs(probs[i] - probs[j]).max() for i in range(K) for j in range(i)) > 1e-4  # K different heads
  np.testing.assert_allclose(ens.predict(x)['probs'], probs.mean(0), rtol=1e-5, atol=1e-6)
  assert np.isfinite(ens.summary['test_loss'])


def test_pmap_and_jit_train_the_same_network(fits):
  assert_one_network(fits('cnn', 'jit'))
  assert_same_training(fits('cnn', 'pmap'), fits('cnn', 'jit'))


def test_regression_trains_one_network_of_k_gaussian_heads():
  x, _ = FEATURES
  ens = ensemble.fit('mlp', (x, (x[:, 0] - x[:, 2]).astype(np.float32)), task='regression', **SETTINGS)
  assert_one_network(ens)
  assert ens.member.model.inner.num_classes == 2 * K  # a mean and a raw scale per head
  assert ens.predict(x[:8])['epistemic'].min() > 0  # the K heads disagree


def test_a_workdir_restores_evaluates_predicts_and_exports(mnist_dir, tmp_path):
  """What python -m ensemble.train writes (its trainer, in this process), read back by ensemble.load: the heads the
  trainer's test pass scored, and the same in the exported artifact."""
  workdir = str(tmp_path / 'run')
  config = small_config(mnist_dir, model='mlp', method='mimo', ensemble_size=2, num_devices=2)
  _, summary = trainer.train_and_evaluate(config, workdir)
  loaded = ensemble.load(workdir)
  np.testing.assert_array_equal(loaded.state.snapshots['head'], [0, 1])
  test = data.load(data_dir=mnist_dir).test
  np.testing.assert_allclose(loaded.evaluate(test['image'], test['label'])['ensemble']['nll'], summary['test_loss'],
                             rtol=1e-4)
  images = test['image'][:8].astype(np.float32) / 255  # the artifact takes pixels in [0, 1]
  exported = jax.export.deserialize(export.export(loaded).serialize())
  np.testing.assert_allclose(exported.call(images)['probs'], loaded.predict(images)['probs'], rtol=1e-5, atol=1e-6)
  assert 'mimo' in methods.NAMES


@pytest.mark.parametrize('model, message', [
    (user_models.TinyNet(width=16, num_classes=2), 'this model is not one: wrap a model of one input'),
    (mimo_models.MIMO(user_models.TinyNet(width=16, num_classes=4), heads=2), 'this model has 2 heads: wrap'),
    (functools.partial(user_models.NNXNet, din=5, num_classes=2), 'this model is not one: wrap'),
    (mimo_models.MIMO(user_models.TinyNet(width=16, num_classes=2 * K + 1), heads=K),
     'the model inside the MIMO wrapper gives outputs of shape (1, 9), not (batch, 4 x outputs per head)'),
])
def test_a_model_that_is_not_a_k_head_network_is_refused_in_one_line(model, message):
  with pytest.raises(UsageError, match=re.escape(message)) as raised:
    ensemble.fit(model, FEATURES, **SETTINGS)
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('overrides, message', [
    ({'batch_size': 30}, 'batch_size=30 must be a multiple of ensemble_size=4 for method mimo, which groups '
                       "each member's batch into examples of 4 inputs: set e.g. --config.batch_size=28"),
    ({'ensemble_size': 1}, '1 head is a single network: set e.g. --config.ensemble_size=4'),
])
def test_bad_settings_are_refused_in_one_line(make_config, overrides, message):
  with pytest.raises(UsageError, match=re.escape(message)) as raised:
    recipe_lib.resolve(make_config(**{'method': 'mimo', 'ensemble_size': K, **overrides}), jax.devices())
  assert '\n' not in str(raised.value)


def test_a_mesh_backend_refuses_mimo():
  from configs import dp  # pylint: disable=g-import-not-at-top
  config = dp.get_config()
  config.update(method='mimo', batch_size=config.batch_size)
  with pytest.raises(UsageError, match="backend 'dp' trains one model, not an ensemble") as raised:
    recipe_lib.resolve(config, jax.devices())
  assert '\n' not in str(raised.value)
