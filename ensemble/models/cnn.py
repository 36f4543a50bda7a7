"""The small CNN of the Flax examples: the classic deep-ensemble member."""

import flax.linen as nn
import jax.numpy as jnp

from ensemble.models import rank1 as rank1_layers


class CNN(nn.Module):
  """Two 3x3 convolutions with average pooling, then two dense layers.

  Two 2x2 poolings need images of at least 4x4; the dense layer takes
  whatever size is left, so any image shape and channel count fits.
  """
  num_classes: int = 10
  rank1: bool = False  # BatchEnsemble's layers (models/rank1.py)

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    del train  # no dropout or batch statistics
    conv, dense = (rank1_layers.Conv, rank1_layers.Dense) if self.rank1 else (nn.Conv, nn.Dense)
    x = nn.relu(conv(features=32, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.relu(conv(features=64, kernel_size=(3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(dense(features=256)(x))
    return dense(features=self.num_classes)(x)
