"""The optimizer recipe: schedules, decoupled weight decay on kernels only, and refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from ensemble import optim, recipe as recipe_lib
from ensemble.errors import UsageError


def _config(**overrides):
  config = default.get_config()
  config.schedule, config.weight_decay = 'constant', 0.0  # each test names the parts it checks
  config.update(overrides)
  return config


def _learning_rates(config, steps_per_epoch, num_steps):
  """The step sizes the optimizer takes: updates of a unit gradient on one parameter, with momentum off."""
  tx = optim.create(config, steps_per_epoch)
  params = {'bias': jnp.zeros(())}
  state, rates = tx.init(params), []
  for _ in range(num_steps):
    updates, state = tx.update({'bias': jnp.ones(())}, state, params)
    rates.append(-float(updates['bias']))
  return np.array(rates)


def test_schedules_span_the_run():
  rates = _learning_rates(_config(momentum=0.0, schedule='cosine', num_epochs=2), 5, 10)
  np.testing.assert_allclose(rates[0], 0.1, rtol=1e-6)
  assert np.all(np.diff(rates) < 0) and rates[-1] < 0.01
  warm = _learning_rates(_config(momentum=0.0, schedule='warmup_cosine', warmup_epochs=1, num_epochs=2), 5, 10)
  np.testing.assert_allclose(warm[:6], [0.0, 0.02, 0.04, 0.06, 0.08, 0.1], rtol=1e-5, atol=1e-7)
  assert np.all(np.diff(warm[5:]) < 0)
  np.testing.assert_allclose(_learning_rates(_config(momentum=0.0), 5, 4), 0.1, rtol=1e-6)


@pytest.mark.parametrize('optimizer', ['sgd', 'adamw'])
def test_weight_decay_is_decoupled_and_spares_biases(optimizer):
  config = _config(optimizer=optimizer, weight_decay=0.5, learning_rate=0.1)
  tx = optim.create(config, 10)
  params = {'kernel': jnp.full((2, 2), 2.0), 'bias': jnp.full((2,), 2.0)}
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)
  # With a zero gradient only the decay moves the kernel: -lr * wd * w; the bias stays.
  np.testing.assert_allclose(updates['kernel'], -0.1 * 0.5 * 2.0, rtol=1e-6)
  np.testing.assert_allclose(updates['bias'], 0.0)


def test_adamw_matches_optax_adamw_on_kernels():
  config = _config(optimizer='adamw', weight_decay=0.01, learning_rate=1e-3)
  params = {'kernel': jnp.arange(4.0).reshape(2, 2)}
  grads = {'kernel': jnp.array([[0.1, -0.2], [0.3, 0.0]])}
  ours, _ = optim.create(config, 10).update(grads, optim.create(config, 10).init(params), params)
  reference = optax.adamw(1e-3, weight_decay=0.01)
  theirs, _ = reference.update(grads, reference.init(params), params)
  np.testing.assert_allclose(ours['kernel'], theirs['kernel'], rtol=1e-5)


@pytest.mark.parametrize('overrides, message', [
    ({'optimizer': 'rmsprop'}, "unknown optimizer 'rmsprop': set --config.optimizer to one of"),
    ({'schedule': 'step'}, "unknown schedule 'step'"),
    ({'weight_decay': -1.0}, 'weight_decay=-1.0 must be 0 or positive'),
    ({'schedule': 'warmup_cosine', 'warmup_epochs': 10}, 'warmup_epochs=10 must be in \\[0, num_epochs=10\\)'),
    ({'warmup_epochs': 1}, 'warmup_epochs=1 needs --config.schedule=warmup_cosine'),
    ({'learning_rate': 0.0}, 'learning_rate=0.0 must be positive and finite'),
])
def test_bad_optimizer_options_are_one_line_errors(overrides, message):
  with pytest.raises(UsageError, match=message) as error:
    recipe_lib.resolve(_config(**overrides), jax.devices())
  assert '\n' not in str(error.value)
