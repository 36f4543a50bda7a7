"""The models: shapes, the class count from the data, BatchNorm state, and refusals."""

import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def _flax_example_cnn() -> nn.Module:
  """The CNN as the Flax guide writes it (nn.Conv, nn.relu, nn.avg_pool, differentiated by JAX): the classic
  recipe's, which the benchmarks compare against."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts', 'reference_recipe.py')
  spec = importlib.util.spec_from_file_location('reference_recipe', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.CNN()


def _loss_and_grads(model, params, images, labels):
  """The cross-entropy, and its gradients with respect to the parameters and the images, as one program."""
  loss = lambda params, images: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({'params': params}, images).astype(jnp.float32), labels).mean()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, images)


# An image's 1 channel (the first layer's kernel gradient from its patches) and 6 (from the convolution's VJP);
# odd sizes, whose pooling drops a row or column.
@pytest.mark.parametrize('shape', [(6, 28, 28, 1), (4, 13, 11, 6)])
def test_the_cnn_is_the_flax_example_s_cnn_with_the_same_parameters_values_and_gradients(shape):
  images = jax.random.normal(jax.random.key(1), shape)
  labels = jnp.arange(shape[0]) % 10
  cnn, plain = models.create(_config(), 10, shape[1:]), _flax_example_cnn()
  params = cnn.init(jax.random.key(0), images)['params']
  plain_params = plain.init(jax.random.key(0), images)['params']
  # The same tree, initialised to the same values: checkpoints and seeds mean what they meant.
  jax.tree.map(np.testing.assert_array_equal, params, plain_params)
  np.testing.assert_array_equal(cnn.apply({'params': params}, images), plain.apply({'params': params}, images))
  (loss, grads), (plain_loss, plain_grads) = (_loss_and_grads(cnn, params, images, labels),
                                              _loss_and_grads(plain, params, images, labels))
  np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
  for grad, plain_grad in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_allclose(grad, plain_grad, rtol=1e-4, atol=1e-5 * float(jnp.abs(plain_grad).max()))


def test_on_cpu_the_cnn_s_gradient_does_without_the_pooling_s_reduce_window():
  """What makes the step faster: no reduce-window (JAX's pooling and its transpose) where the gradient is taken,
  while prediction keeps it (YNNPACK's kernels run it fastest)."""
  images = jnp.ones((2, 28, 28, 1))
  cnn = models.create(_config(), 10, (28, 28, 1))
  params = cnn.init(jax.random.key(0), images)['params']
  lowered = lambda fn, *args: jax.jit(fn).lower(*args).as_text()
  grad = lambda model: jax.grad(lambda params: model.apply({'params': params}, images)[0, 0])
  assert 'reduce_window' in lowered(grad(_flax_example_cnn()), params)
  assert 'reduce_window' not in lowered(grad(cnn), params)
  assert 'reduce_window' in lowered(lambda params: cnn.apply({'params': params}, images), params)


def test_the_cnn_s_bfloat16_gradients_keep_their_dtype_and_follow_float32_s():
  images = jax.random.normal(jax.random.key(1), (32, 28, 28, 1))
  labels = jnp.arange(32) % 10
  cnn = models.create(_config(), 10, (28, 28, 1))
  params = cnn.init(jax.random.key(0), images)['params']
  to_bf16 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
  (_, (exact, _)), (_, (grads, _)) = (_loss_and_grads(cnn, params, images, labels),
                                      _loss_and_grads(cnn, to_bf16(params), to_bf16(images), labels))
  for grad, reference in zip(jax.tree.leaves(grads), jax.tree.leaves(exact)):
    assert grad.dtype == jnp.bfloat16
    error = jnp.linalg.norm(grad.astype(jnp.float32) - reference) / jnp.linalg.norm(reference)
    assert error < 0.1, f'{float(error):.3f} of the float32 gradient\'s norm'


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
