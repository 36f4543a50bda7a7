"""Packed-Ensembles (`method='packed'`, methods/packed.py, models/packed.py): grouped layers whose groups never see each
other's weights and that equal a block-diagonal product, the width rule, the built-in members' sizes, training and
prediction on both backends with the built-in CNN and MLP, a user's linen and NNX models, regression, a workdir that
restores, evaluates, predicts and exports, and bad options refused in one line."""

import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ensemble
import user_models
from conftest import assert_same_training, fitted_once, small_config, toy_features
from ensemble import members, recipe as recipe_lib, data, defaults, export, trainer
from ensemble.errors import UsageError
from ensemble.models import cnn, packed

K = 4
SETTINGS = {'ensemble_size': K, 'epochs': 1, 'batch_size': 16, 'method': 'packed', 'progress': False}


def _images(n: int = 64, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, 256, (n, 8, 8, 1)).astype(np.uint8)
  return x, (x[:, :4].mean((1, 2, 3)) > x[:, 4:].mean((1, 2, 3))).astype(np.int32)


class PackedLinen(nn.Module):
  """A user's packed MLP: widths from `packed.width`, the inner layer grouped, the first and last ones plain."""
  alpha: float = 2.0
  members: int = K
  gamma: int = 2
  num_classes: int = 2

  @nn.compact
  def __call__(self, x):
    hidden = packed.width(32, self.alpha, self.members, self.gamma)
    x = nn.relu(nn.Dense(hidden)(x))
    x = nn.relu(packed.Dense(hidden, self.gamma)(x))
    return nn.Dense(self.num_classes)(x)


class PackedNNX(nnx.Module):
  def __init__(self, din: int = 4, num_classes: int = 2, gamma: int = 2, *, rngs: nnx.Rngs):
    hidden = packed.width(32, 2.0, K, gamma)
    self.first = nnx.Linear(din, hidden, rngs=rngs)
    self.inner = packed.NNXDense(hidden, hidden, gamma, rngs=rngs)
    self.last = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x):
    return self.last(nnx.relu(self.inner(nnx.relu(self.first(x)))))


TRAIN, TEST = toy_features(dims=4), toy_features(16, 1, dims=4)
IMAGES, TEST_IMAGES = _images(), _images(16, 1)
FITS = {
    'cnn': lambda backend: ensemble.fit('cnn', IMAGES, TEST_IMAGES, packed_gamma=2, backend=backend, **SETTINGS),
    'mlp': lambda backend: ensemble.fit('mlp', TRAIN, TEST, packed_gamma=2, backend=backend, **SETTINGS),
    'linen': lambda backend: ensemble.fit(PackedLinen(), TRAIN, TEST, backend=backend, **SETTINGS),
    'nnx': lambda backend: ensemble.fit(PackedNNX, TRAIN, TEST, backend=backend, **SETTINGS),
}


@pytest.fixture(scope='module')
def fits():
  """`fits(model, backend)`: a packed ensemble fitted once per module."""
  return fitted_once(lambda model, backend='pmap': FITS[model](backend))


def _group_gradients(layer, x, groups: int, group_axis: int):
  """|d output group j / d weight block i| summed, (groups, groups): the layer's output split into `groups` along its
  last axis, its weight into `groups` blocks along `group_axis`."""
  params = layer.init(jax.random.key(0), x)['params']

  def group_outputs(kernel):
    y = layer.apply({'params': {**params, packed.KERNEL: kernel}}, x)
    return jnp.stack([part.sum() for part in jnp.split(y, groups, axis=-1)])
  jacobian = jax.jit(jax.jacrev(group_outputs))(params[packed.KERNEL])  # (groups, *kernel)
  blocks = jnp.stack(jnp.split(jnp.abs(jacobian), groups, axis=group_axis % params[packed.KERNEL].ndim + 1), 1)
  return np.asarray(blocks.reshape(groups, groups, -1).sum(-1))


def test_a_group_s_outputs_depend_on_its_own_weights_only():
  groups = 4
  x = jax.random.normal(jax.random.key(1), (3, 5, 5, 8))
  for layer, inputs, axis in ((packed.Dense(12, groups), x.reshape(3, -1)[:, :40], 0),
                              (packed.Conv(12, (3, 3), groups), x, -1)):
    totals = _group_gradients(layer, inputs, groups, axis)
    assert (np.diag(totals) > 0).all()
    np.testing.assert_array_equal(totals - np.diag(np.diag(totals)), 0)  # exactly zero off the diagonal


def test_the_grouped_dense_is_a_block_diagonal_matmul():
  x = jax.random.normal(jax.random.key(0), (5, 12))
  layer = packed.Dense(9, groups=3)
  params = layer.init(jax.random.key(1), x)['params']
  full = jax.scipy.linalg.block_diag(*params[packed.KERNEL])
  assert full.shape == (12, 9)
  np.testing.assert_allclose(layer.apply({'params': params}, x), x @ full + params['bias'], rtol=1e-5, atol=1e-6)


def test_the_grouped_conv_is_each_group_s_own_conv():
  x = jax.random.normal(jax.random.key(0), (2, 6, 6, 6))
  layer = packed.Conv(4, (3, 3), groups=2, strides=2)
  params = layer.init(jax.random.key(1), x)['params']
  kernel = params[packed.KERNEL]
  separate = [nn.Conv(2, (3, 3), strides=2, use_bias=False).apply({'params': {'kernel': kernel[..., 2 * g:2 * g + 2]}},
                                                                  x[..., 3 * g:3 * g + 3]) for g in range(2)]
  np.testing.assert_allclose(layer.apply({'params': params}, x), jnp.concatenate(separate, -1) + params['bias'],
                             rtol=1e-5, atol=1e-5)
  nnx_layer = packed.NNXConv(6, 4, (3, 3), 2, strides=2, rngs=nnx.Rngs(0))  # the NNX layer computes the same
  getattr(nnx_layer, packed.KERNEL)[...], nnx_layer.bias[...] = kernel, params['bias']
  np.testing.assert_allclose(nnx_layer(x), layer.apply({'params': params}, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('features, alpha, members, gamma, expected', [
    (32, 2, 4, 1, 16),  # alpha * features / members
    (64, 2, 4, 2, 32),
    (10, 2, 4, 4, 8),  # 20 / 4 = 5 rounded up to a multiple of 4
    (3, 0.5, 8, 1, 1),  # at least gamma
    (16, 1.5, 3, 2, 8),
    (100, 3, 2, 1, 150),
])
def test_widths_follow_the_rule(features, alpha, members, gamma, expected):
  assert packed.width(features, alpha, members, gamma) == expected


def test_bad_widths_are_refused_in_one_line():
  with pytest.raises(UsageError, match='alpha > 0'):
    packed.width(32, 0, 4, 1)
  with pytest.raises(UsageError, match=re.escape('cannot be split into groups=3 equal groups')) as raised:
    packed.Dense(8, 3).init(jax.random.key(0), jnp.ones((1, 6)))
  assert '\n' not in str(raised.value)


def _cnn_params(widths, groups, classes=2, pixels=2 * 2):
  """The CNN's parameters on 8x8x1 images, layer by layer: a grouped layer has 1 / groups of the weights."""
  w0, w1, w2 = widths
  return ((9 * 1 * w0 + w0) + (9 * w0 * w1 // groups + w1) + (pixels * w1 * w2 // groups + w2)
          + (w2 * classes + classes))


@pytest.mark.parametrize('alpha, gamma', [(2, 1), (2, 2), (3, 4)])
def test_the_built_in_cnn_has_the_packed_member_s_parameters(alpha, gamma):
  config = defaults.get_config()
  config.update(method='packed', model='cnn', ensemble_size=K, packed_alpha=alpha, packed_gamma=gamma)
  member = members.member(config, members.data_info((8, 8, 1), 2, (0.5,), (0.25,)))
  widths = tuple(packed.width(f, alpha, K, gamma) for f in cnn.WIDTHS)
  assert (member.model.widths, member.model.groups) == (widths, gamma)
  params = jax.eval_shape(member.init_variables, jax.random.key(0))['params']
  assert member.method.num_params(params, K) == K * _cnn_params(widths, gamma)
  deep_ensemble = K * _cnn_params(cnn.WIDTHS, 1)
  if (alpha, gamma) == (2, 1):  # the dense layers, most of the weights, shrink as (alpha / K)^2: alpha^2 / K of one
    assert 0.2 < member.method.num_params(params, K) / deep_ensemble < 0.3


def test_the_built_in_resnet_groups_each_block_s_second_convolution_and_projection():
  """As torch-uncertainty's packed ResNet: the stem, each block's first convolution and the head stay ungrouped."""
  config = defaults.get_config()
  config.update(method='packed', model='resnet', resnet_depth=8, ensemble_size=K, packed_gamma=2)
  member = members.member(config, members.data_info((8, 8, 1), 2, (0.5,), (0.25,)))
  assert member.model.widths == (8, 16, 32)  # 2 x (16, 32, 64) / 4
  params = jax.eval_shape(member.init_variables, jax.random.key(0))['params']
  shape = lambda *path: functools.reduce(lambda tree, key: tree[key], path, params)['kernel'].shape
  assert shape('Conv_0') == (3, 3, 1, 8)
  assert shape('BasicBlock_1', 'Conv_0') == (3, 3, 8, 16)  # ungrouped
  assert shape('BasicBlock_1', 'Conv_1') == (3, 3, 8, 16)  # 16 inputs in 2 groups
  assert shape('BasicBlock_1', 'Conv_2') == (1, 1, 4, 16)  # the projection: 8 inputs in 2 groups
  assert shape('Dense_0') == (32, 2)


def _member_probs(ens, x):
  """(K, N, classes): each member's probabilities."""
  return np.asarray(jax.nn.softmax(jax.jit(jax.vmap(ens.member.predict, in_axes=(0, None)))(ens.state, x)))


@pytest.mark.parametrize('model', list(FITS))
def test_members_train_and_predict(fits, model):
  ens = fits(model)
  x = TEST_IMAGES[0] if model == 'cnn' else TEST[0]
  probs = _member_probs(ens, x.astype(np.float32) / 255 if model == 'cnn' else x)
  assert min(np.abs(probs[i] - probs[j]).max() for i in range(K) for j in range(i)) > 1e-4  # K different networks
  result = ens.predict(x.astype(np.float32) / 255 if model == 'cnn' else x)
  np.testing.assert_allclose(result['probs'], probs.mean(0), rtol=1e-4, atol=1e-6)
  assert np.isfinite(ens.summary['test_loss'])
  assert packed.has_packed_layers(ens.state.params)


def test_pmap_and_jit_train_the_same_members(fits):
  assert_same_training(fits('mlp'), fits('mlp', 'jit'))


def test_regression():
  x, _ = TRAIN
  ens = ensemble.fit('mlp', (x, (x[:, 0] - x[:, 2]).astype(np.float32)), task='regression', **SETTINGS)
  assert ens.member.model.widths == (64, 64)  # alpha 2 x 128 / 4 members
  assert ens.predict(x[:8])['epistemic'].min() > 0


def test_a_workdir_restores_evaluates_predicts_and_exports(mnist_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  config = small_config(mnist_dir, model='mlp', method='packed', packed_gamma=2, ensemble_size=2, num_devices=2)
  _, summary = trainer.train_and_evaluate(config, workdir)
  loaded = ensemble.load(workdir)
  assert (loaded.member.model.widths, loaded.member.model.groups) == ((128, 128), 2)  # 2 x 128 / 2 members
  test = data.load(data_dir=mnist_dir).test
  np.testing.assert_allclose(loaded.evaluate(test['image'], test['label'])['ensemble']['nll'], summary['test_loss'],
                             rtol=1e-4)
  images = test['image'][:8].astype(np.float32) / 255
  exported = jax.export.deserialize(export.export(loaded).serialize())
  np.testing.assert_allclose(exported.call(images)['probs'], loaded.predict(images)['probs'], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('model', [user_models.TinyNet(width=16, num_classes=2),
                                   functools.partial(user_models.NNXNet, din=4, num_classes=2, width=16)])
def test_a_model_without_packed_layers_is_refused_in_one_line(model):
  with pytest.raises(UsageError, match=re.escape('method packed needs a model built with packed layers')) as raised:
    ensemble.fit(model, TRAIN, **SETTINGS)
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('field, value, message', [
    ('packed_alpha', 0.0, 'packed_alpha=0.0 must be a positive number'),
    ('packed_alpha', float('inf'), 'packed_alpha=inf must be a positive number'),
    ('packed_gamma', 0, 'packed_gamma=0 must be a positive whole number'),
    ('model', 'classifier', "method packed has packed members of models ['cnn', 'resnet', 'mlp', 'segmenter']"),
])
def test_bad_options_are_refused_in_one_line(make_config, field, value, message):
  with pytest.raises(UsageError, match=re.escape(message)) as raised:
    recipe_lib.resolve(make_config(method='packed', **{field: value}), jax.devices())
  assert '\n' not in str(raised.value)


def test_the_other_methods_keep_the_built_in_models():
  config = defaults.get_config()
  member = members.member(config, members.data_info((8, 8, 1), 3, (0.5,), (0.25,)))
  assert (member.model.widths, member.model.groups) == (cnn.WIDTHS, 1)
  params = jax.eval_shape(member.init_variables, jax.random.key(0))['params']
  assert sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)) == _cnn_params(cnn.WIDTHS, 1, classes=3)
  assert not packed.has_packed_layers(params)
