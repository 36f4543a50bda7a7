"""Adversarial training (`adversarial_epsilon`, methods/adversarial.py): FGSM's perturbation and the step's gradients
against `jax.grad` computed here, for images, features and regression; training on both backends; a workdir that
loads and predicts; bad values and inputs refused in one line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ensemble
from ensemble import members, recipe as recipe_lib
from ensemble.errors import UsageError
from ensemble.methods import adversarial

from conftest import assert_same_training, fitted_once, make_member, member_params

EPSILON = 0.05
# Small and fast: K=2 MLPs, one epoch of four steps.
SETTINGS = {'ensemble_size': 2, 'epochs': 1, 'batch_size': 16, 'progress': False, 'standardize_features': True}


def _features(n: int = 64, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(n, 5)) * np.array([1.0, 10.0, 0.1, 1.0, 3.0])).astype(np.float32)
  return x, (x[:, 0] + x[:, 1] / 10 > 0).astype(np.int32)


# (data_info, overrides, inputs as they arrive, labels): uint8 images (standardised per channel on the device), features
# with per-feature statistics (a restored member standardises them itself), and regression on those features.
CASES = {
    'images': (members.data_info((8, 8, 1), 3, (0.3,), (0.2,)), {'model': 'cnn'},
               np.random.default_rng(1).integers(0, 256, (6, 8, 8, 1)).astype(np.uint8), np.array([0, 1, 2, 0, 1, 2])),
    'features': (members.data_info((3,), 3, (1.0, -2.0, 0.5), (2.0, 0.5, 4.0), inputs='features'),
                 {'model': 'mlp'}, np.random.default_rng(2).normal(size=(6, 3)).astype(np.float32),
                 np.array([0, 1, 2, 0, 1, 2])),
    'regression': (members.data_info((3,), 2, (1.0, -2.0, 0.5), (2.0, 0.5, 4.0), inputs='features'),
                   {'model': 'mlp', 'task': 'regression'},
                   np.random.default_rng(3).normal(size=(6, 3)).astype(np.float32),
                   np.random.default_rng(4).normal(size=(6, 1)).astype(np.float32)),
}


@pytest.mark.parametrize('case', list(CASES))
def test_the_step_trains_on_fgsm_examples_computed_as_jax_grad_gives_them(case):
  """x' = x + eps * range * sign(grad_x loss): range 1 for pixels in [0, 1] (eps * 255 in uint8 units), 4 training
  stds per feature; the step's gradients are the mean of the clean and the perturbed loss's, computed here directly."""
  data_info, overrides, inputs, labels = CASES[case]
  member = make_member(data_info=data_info, augment='none', standardize_features=True, adversarial_epsilon=EPSILON,
                       **overrides)
  state = member.init(jax.random.key(0))
  mean, std = np.asarray(data_info['mean'], np.float32), np.asarray(data_info['std'], np.float32)
  unit = inputs.astype(np.float32) / 255 if case == 'images' else inputs  # what eps is a fraction of the range of
  input_range = 1.0 if case == 'images' else 4 * std

  def loss(params, x):
    outputs = member.model.apply({'params': params}, (x - mean) / std, train=True)
    return member.task.loss(outputs, labels)[0]

  direction = np.sign(jax.grad(loss, argnums=1)(state.params, unit))
  expected_inputs = unit + EPSILON * input_range * direction
  np.testing.assert_allclose(member.input_range(jnp.asarray(unit)), input_range)
  np.testing.assert_allclose(adversarial.fgsm(unit, direction, EPSILON * input_range), expected_inputs)
  if case == 'images':  # in the uint8 units the images arrived in: eps * 255 per pixel
    np.testing.assert_allclose(expected_inputs * 255 - inputs, EPSILON * 255 * direction, rtol=1e-4, atol=1e-3)
  assert np.count_nonzero(direction) > direction.size // 2

  grads, _ = member.gradients(state, jnp.asarray(inputs), jnp.asarray(labels))
  clean, perturbed = jax.grad(loss)(state.params, unit), jax.grad(loss)(state.params, expected_inputs)
  expected = jax.tree.map(lambda a, b: (a + b) / 2, clean, perturbed)
  jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6), grads, expected)
  plain, _ = make_member(data_info=data_info, augment='none', standardize_features=True, **overrides).gradients(
      state, jnp.asarray(inputs), jnp.asarray(labels))
  jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6), plain, clean)


@pytest.fixture(scope='module')
def fits():
  """`fits(backend, epsilon)`: an ensemble fitted once per module on the same features."""
  train, test = _features(), _features(32, 1)
  return fitted_once(lambda backend, epsilon: ensemble.fit('mlp', train, test, backend=backend,
                                                           adversarial_epsilon=epsilon, **SETTINGS))


def test_adversarial_training_changes_what_is_trained_and_both_backends_train_it_alike(fits):
  adversarial_params = member_params(fits('pmap', EPSILON))
  distances = jax.tree.map(lambda a, b: np.abs(a - b).max(), adversarial_params, member_params(fits('pmap', 0.0)))
  assert max(jax.tree.leaves(distances)) > 1e-4
  assert_same_training(fits('pmap', EPSILON), fits('jit', EPSILON))


def test_a_regression_workdir_trained_adversarially_loads_and_predicts(tmp_path):
  x, _ = _features()
  y = (x[:, 0] + 0.1 * x[:, 1]).astype(np.float32)
  ens = ensemble.fit('mlp', (x, y), task='regression', adversarial_epsilon=EPSILON, workdir=str(tmp_path / 'run'),
                     **SETTINGS)
  loaded = ensemble.load(str(tmp_path / 'run'))
  assert loaded.config.adversarial_epsilon == EPSILON
  np.testing.assert_allclose(loaded.predict(x[:8])['mean'], ens.predict(x[:8])['mean'], rtol=1e-5)


@pytest.mark.parametrize('epsilon', [-0.01, float('nan'), 1.0, 2.0])
def test_bad_epsilons_are_refused_in_one_line(make_config, epsilon):
  with pytest.raises(UsageError, match=re.escape(f'adversarial_epsilon={epsilon!r} must be a fraction')) as raised:
    recipe_lib.resolve(make_config(adversarial_epsilon=epsilon), jax.devices())
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('inputs, fields, message', [
    ('tokens', {}, 'token ids have none: set adversarial_epsilon=0'),  # fit's terms for --config.adversarial_epsilon
    ('features', {'standardize_features': False}, 'set standardize_features=True'),
])
def test_inputs_without_a_range_are_refused_in_one_line(inputs, fields, message):
  x = np.arange(64 * 4).reshape(64, 4) % 7 if inputs == 'tokens' else _features()[0]
  with pytest.raises(UsageError, match=re.escape(message)) as raised:
    ensemble.fit('mlp', (x, np.arange(64) % 2), **{**SETTINGS, 'adversarial_epsilon': EPSILON, **fields})
  assert '\n' not in str(raised.value)


def test_a_mesh_backend_refuses_adversarial_training():
  from configs import dp  # pylint: disable=g-import-not-at-top
  config = dp.get_config()
  config.adversarial_epsilon = EPSILON
  with pytest.raises(UsageError, match="backend 'dp' trains one model on plain batches: set "
                                       '--config.adversarial_epsilon=0'):
    recipe_lib.resolve(config, jax.devices())
