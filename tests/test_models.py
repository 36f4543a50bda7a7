import jax
import jax.numpy as jnp

from ensemble import models


def test_cnn_shapes():
  cnn = models.create_model('cnn')
  params = cnn.init(jax.random.key(0), jnp.ones((1, 28, 28, 1)))['params']
  shapes = jax.tree.map(jnp.shape, params)
  assert shapes['Conv_0']['kernel'] == (3, 3, 1, 32)
  assert shapes['Conv_1']['kernel'] == (3, 3, 32, 64)
  assert shapes['Dense_0']['kernel'] == (7 * 7 * 64, 256)
  assert shapes['Dense_1']['kernel'] == (256, 10)
  assert cnn.apply({'params': params}, jnp.ones((5, 28, 28, 1))).shape == (5, 10)


def test_unknown_model_is_a_usage_error():
  import pytest
  from ensemble.errors import UsageError
  with pytest.raises(UsageError, match="unknown model 'resnet'"):
    models.create_model('resnet')
