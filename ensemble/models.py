"""Model definitions, chosen by `config.model`."""

import flax.linen as nn
import jax.numpy as jnp

from ensemble.errors import UsageError
from ensemble.parallel import fsdp, mlp


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


MODELS = {'cnn': CNN, 'mlp': mlp.MLP, 'classifier': fsdp.Classifier}


def create_model(name: str, config=None) -> nn.Module:
  """The model `name`; the MLP and the classifier take their sizes from `config`."""
  if name not in MODELS:
    raise UsageError(f'unknown model {name!r}: set --config.model to one of {sorted(MODELS)}')
  if name == 'mlp':
    return mlp.MLP(config.num_layers, config.depth, use_scan=config.use_scan, logical=config.logical)
  if name == 'classifier':
    return fsdp.Classifier(config.num_layers, config.depth, dropout_rate=config.dropout_rate)
  return MODELS[name]()
