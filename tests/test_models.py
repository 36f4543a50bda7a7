"""The models: shapes, the class count from the data, BatchNorm state and a model's other variables, the fused
layer under JAX's transformations, and refusals."""

import functools
import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ensemble
import user_models
from configs import default
from conftest import make_member
from ensemble import models, recipe as recipe_lib, steps
from ensemble.errors import UsageError
from ensemble.models import fused, user


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
  while prediction keeps it beyond an image's layer (YNNPACK's kernels run it fastest)."""
  images = jnp.ones((2, 28, 28, 1))
  cnn = models.create(_config(), 10, (28, 28, 1))
  params = cnn.init(jax.random.key(0), images)['params']
  lowered = lambda fn, *args: jax.jit(fn).lower(*args).as_text()
  grad = lambda model: jax.grad(lambda params: model.apply({'params': params}, images)[0, 0])
  assert 'reduce_window' in lowered(grad(_flax_example_cnn()), params)
  assert 'reduce_window' not in lowered(grad(cnn), params)
  assert 'reduce_window' in lowered(lambda params: cnn.apply({'params': params}, images), params)


def test_on_cpu_the_cnn_s_prediction_computes_an_image_s_layer_of_few_filters_from_its_2x2_blocks():
  """What makes the test pass of a CNN with 16 filters faster: no full-size output of its first convolution (2 x
  28 x 28 x 16), but a 2x2 convolution of the image's blocks (2 x 15 x 15 x 4 after the padding). With 32 filters,
  which XLA:CPU convolves fast, the plain layer."""
  images = jnp.ones((2, 28, 28, 1))
  for filters, blocks in ((16, True), (32, False)):
    cnn = models.cnn.CNN(num_classes=10, widths=(filters, 32, 64))
    params = cnn.init(jax.random.key(0), images)['params']
    lowered = jax.jit(lambda params, cnn=cnn: cnn.apply({'params': params}, images)).lower(params).as_text()
    assert (f'tensor<2x28x28x{filters}xf32>' not in lowered) == blocks
    assert ('tensor<2x15x15x4xf32>' in lowered) == blocks


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


def _close(actual, expected):
  """Equal to float32 rounding, relative to the largest value."""
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * max(float(jnp.abs(e).max()), 1.0))


# An image's channel count (the layer's patches) and more (the convolution itself); odd sizes.
@pytest.mark.parametrize('channels', [1, 6])
def test_every_transformation_of_the_fused_layer_agrees_with_the_plain_layers(channels):
  """Its custom backward pass takes no transformation away: forward mode, reverse mode, and the two nested; its
  forward pass alone (evaluation's, from an image's 2x2 blocks) is the plain layers' too."""
  keys = jax.random.split(jax.random.key(0), 6)
  shapes = ((2, 5, 7, channels), (3, 3, channels, 3), (3,))
  args = tuple(jax.random.normal(key, shape) for key, shape in zip(keys[:3], shapes))
  tangents = tuple(jax.random.normal(key, shape) for key, shape in zip(keys[3:], shapes))
  layers = {'fused': fused.conv_relu_pool, 'plain': fused._plain}  # pylint: disable=protected-access
  squared = {name: lambda *args, layer=layer: jnp.sum(layer(*args) ** 2) for name, layer in layers.items()}
  transformed = lambda name: (layers[name](*args), jax.jvp(layers[name], args, tangents),
                               jax.jacfwd(layers[name], argnums=(0, 1, 2))(*args),
                               jax.grad(squared[name], argnums=(0, 1, 2))(*args),
                               jax.hessian(squared[name], argnums=(1, 2))(*args))
  _close(jax.jit(transformed, static_argnums=0)('fused'), jax.jit(transformed, static_argnums=0)('plain'))


def test_forward_mode_autodiff_goes_through_the_cnn():
  images = jax.random.normal(jax.random.key(1), (1, 8, 8, 1))
  cnn, plain = models.create(_config(), 10, (8, 8, 1)), _flax_example_cnn()
  params = cnn.init(jax.random.key(0), images)['params']
  direction = jax.random.normal(jax.random.key(2), images.shape)

  @functools.partial(jax.jit, static_argnums=0)
  def transformed(model):
    output = lambda x: model.apply({'params': params}, x)
    step = 1e-2  # large enough for float32, small enough for the ReLUs' kinks
    difference = (output(images + step * direction) - output(images - step * direction)) / (2 * step)
    return jax.jvp(output, (images,), (direction,)), jax.jacfwd(output)(images), difference

  (value, tangent), jacobian, difference = transformed(cnn)
  (plain_value, plain_tangent), plain_jacobian, _ = transformed(plain)
  _close((value, tangent, jacobian), (plain_value, plain_tangent, plain_jacobian))
  np.testing.assert_allclose(tangent, difference, rtol=0.05, atol=0.05 * float(jnp.abs(tangent).max()))


def _scaled_data():
  """Features and two classes: what ScaledNNX and Scaled fit."""
  x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
  return x, (x[:, 0] > 0).astype(np.int64)


def _leaf(tree, name: str) -> np.ndarray:
  """The leaf of `tree` whose path ends in `name`."""
  [leaf] = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jax.tree_util.keystr(path).endswith(f"['{name}']")]
  return np.asarray(leaf)


@pytest.mark.parametrize('model, backend, checkpointed', [
    (functools.partial(user_models.ScaledNNX, din=4, num_classes=2, scale=10.0), 'jit', False),
    (user_models.Scaled(scale=10.0, num_classes=2), 'pmap', True),
], ids=['nnx-jit', 'linen-pmap-checkpointed'])
def test_a_model_s_variables_besides_its_parameters_travel_with_its_members(model, backend, checkpointed, tmp_path):
  """A constant keeps its value, in training and prediction; a count of train calls grows by one a step. The linen
  model's are collections of their own, restored here from its workdir's checkpoint; the NNX model's nnx.Variables."""
  x, y = _scaled_data()
  ens = ensemble.fit(model, (x, y), ensemble_size=2, epochs=1, batch_size=16, backend=backend, progress=False,
                     workdir=str(tmp_path / 'run') if checkpointed else None)
  others = ens.state.batch_stats
  np.testing.assert_array_equal(_leaf(others, 'scale'), np.full((2, 4), 10.0))
  np.testing.assert_array_equal(_leaf(others, 'calls'), np.asarray(ens.state.step))
  assert (_leaf(others, 'calls') == 4).all()  # 64 rows in batches of 16
  # Each member's output is its linear layer of the inputs times 10: not of zeros, the same for every input.
  kernel, bias = _leaf(ens.params, 'kernel'), _leaf(ens.params, 'bias')
  expected = jax.nn.log_softmax(np.einsum('nf,kfc->knc', x * 10.0, kernel) + bias[:, None])
  np.testing.assert_allclose(ens.apply(ens.params, x), expected, rtol=1e-5, atol=1e-5)


def test_an_nnx_model_that_creates_variables_when_called_is_refused_before_anything_is_written(tmp_path):
  with pytest.raises(UsageError, match=r'^the NNX model creates variables when it is called \(calls\): create them '
                                       'in __init__') as error:
    ensemble.fit(functools.partial(user_models.LazyNNX, din=4, num_classes=2), _scaled_data(), ensemble_size=2,
                 epochs=1, batch_size=16, progress=False, workdir=str(tmp_path / 'run'))
  assert '\n' not in str(error.value)
  assert not os.path.exists(tmp_path / 'run')


def test_a_constant_keeps_its_float32_value_when_the_forward_pass_runs_in_bfloat16():
  member = steps.Member(user.wrap(user_models.Scaled(scale=1.1, num_classes=2)), optax.sgd(0.1), (4,),
                        inputs='features', dtype='bfloat16')
  x, y = _scaled_data()
  state, _ = jax.jit(member.train_step)(member.init(jax.random.key(0)), x[:8], y[:8])
  assert float(jnp.bfloat16(1.1)) != np.float32(1.1)
  np.testing.assert_array_equal(state.batch_stats['constants']['scale'], np.full(4, 1.1, np.float32))
  assert state.batch_stats['counter']['calls'] == 1


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
    recipe_lib.of(_config(**overrides))
  assert '\n' not in str(error.value)


def test_a_model_that_does_not_fit_the_image_size_is_refused():
  with pytest.raises(UsageError, match="model 'cnn' does not fit 3x3 images: .* at least 4x4"):
    models.check_inputs('cnn', (3, 3, 1))
