"""The small CNN of the Flax examples: the classic deep-ensemble member."""

import flax.linen as nn
import jax.numpy as jnp


class CNN(nn.Module):
  """Two 3x3 convolutions with average pooling, then two dense layers.

  Two 2x2 poolings need images of at least 4x4; the dense layer takes
  whatever size is left, so any image shape and channel count fits.
  """
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    del train  # no dropout or batch statistics
    x = nn.relu(nn.Conv(features=32, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(features=64, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(features=256)(x))
    return nn.Dense(features=self.num_classes)(x)
