"""Model definitions, chosen by `config.model`."""

import flax.linen as nn
import jax.numpy as jnp

from ensemble.errors import UsageError


class CNN(nn.Module):
  """The small MNIST CNN of the Flax examples: each ensemble member is one."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    x = nn.relu(nn.Conv(features=32, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(features=64, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(features=256)(x))
    return nn.Dense(features=self.num_classes)(x)


MODELS = {'cnn': CNN}


def create_model(name: str) -> nn.Module:
  if name not in MODELS:
    raise UsageError(f'unknown model {name!r}: set --config.model to one of {sorted(MODELS)}')
  return MODELS[name]()
