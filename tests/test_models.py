"""The models: shapes, the class count from the data, BatchNorm state, and refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from conftest import make_member
from ensemble import models
from ensemble.errors import UsageError


def _config(**overrides):
  config = default.get_config()
  config.update(overrides)
  return config


def test_cnn_shapes_follow_the_image_and_the_class_count():
  cnn = models.create(_config(), num_classes=7, image_shape=(32, 32, 3))
  params = cnn.init(jax.random.key(0), jnp.ones((1, 32, 32, 3)))['params']
  shapes = jax.tree.map(jnp.shape, params)
  assert shapes['Conv_0']['kernel'] == (3, 3, 3, 32)
  assert shapes['Conv_1']['kernel'] == (3, 3, 32, 64)
  assert shapes['Dense_0']['kernel'] == (8 * 8 * 64, 256)
  assert shapes['Dense_1']['kernel'] == (256, 7)
  assert cnn.apply({'params': params}, jnp.ones((5, 32, 32, 3))).shape == (5, 7)


@pytest.mark.parametrize('depth, blocks', [(8, 1), (20, 3)])
def test_resnet_has_6n_plus_2_layers_and_batch_statistics(depth, blocks):
  resnet = models.create(_config(model='resnet', resnet_depth=depth, resnet_width=2), 100, (32, 32, 3))
  variables = resnet.init(jax.random.key(0), jnp.ones((1, 32, 32, 3)))
  kernels = [k for k in jax.tree_util.tree_leaves_with_path(variables['params']) if 'kernel' in str(k[0])]
  convolutions = [k for k in kernels if k[1].ndim == 4 and k[1].shape[:2] == (3, 3)]
  # The stem and 2 per block, plus the dense head: 6n + 2 layers with weights (1x1 projections aside).
  assert len(convolutions) == 1 + 6 * blocks and len(convolutions) + 1 == depth
  assert variables['params']['Dense_0']['kernel'].shape == (64 * 2, 100)
  assert 'batch_stats' in variables
  logits, updates = resnet.apply(variables, jnp.ones((4, 32, 32, 3)), train=True, mutable=['batch_stats'])
  assert logits.shape == (4, 100)
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), updates['batch_stats'], variables['batch_stats'])
  assert any(jax.tree.leaves(changed)), 'training updates the running averages'


def test_a_member_uses_running_averages_at_test_time_and_batch_statistics_in_training():
  member = make_member(model='resnet', resnet_depth=8)
  state = member.init(jax.random.key(0))
  images = jax.random.uniform(jax.random.key(1), (16, 28, 28, 1))
  labels = jnp.arange(16) % 10
  new_state, _ = jax.jit(member.train_step)(state, images, labels)
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new_state.batch_stats, state.batch_stats)
  assert min(jax.tree.leaves(moved)) >= 0 and max(jax.tree.leaves(moved)) > 0
  # At test time a prediction does not depend on the rest of the batch.
  one = member.predict(new_state, images[:1])
  np.testing.assert_allclose(one, member.predict(new_state, images)[:1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('overrides, message', [
    ({'model': 'vgg'}, "unknown model 'vgg'"),
    ({'model': 'resnet', 'resnet_depth': 21}, 'resnet_depth=21 is not 6n\\+2'),
    ({'model': 'resnet', 'resnet_width': 0}, 'resnet_width=0 must be a positive'),
])
def test_bad_model_options_are_one_line_errors(overrides, message):
  with pytest.raises(UsageError, match=message) as error:
    models.create(_config(**overrides), 10, (28, 28, 1))
  assert '\n' not in str(error.value)


def test_a_model_that_does_not_fit_the_image_size_is_refused():
  with pytest.raises(UsageError, match="model 'cnn' does not fit 3x3 images: .* at least 4x4"):
    models.create(_config(), 10, (3, 3, 1))
