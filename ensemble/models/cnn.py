"""The small CNN of the Flax examples: the classic deep-ensemble member."""

import functools

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
    # The same numbers either way; each is the form XLA:CPU runs faster in that program (docs/speed.md).
    pool = average_pool_2x2 if train else functools.partial(nn.avg_pool, window_shape=(2, 2), strides=(2, 2))
    conv, dense = (rank1_layers.Conv, rank1_layers.Dense) if self.rank1 else (nn.Conv, nn.Dense)
    x = pool(nn.relu(conv(features=32, kernel_size=(3, 3))(x)))
    x = pool(nn.relu(conv(features=64, kernel_size=(3, 3))(x)))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(dense(features=256)(x))
    return dense(features=self.num_classes)(x)


def average_pool_2x2(x: jnp.ndarray) -> jnp.ndarray:
  """`nn.avg_pool(x, (2, 2), strides=(2, 2))` (an odd last row or column dropped, as there) as a reshape and a mean.

  The same numbers. With XLA's own CPU kernels, which the train steps use
  (`backends.train_program`), the mean and its gradient (a broadcast) run 1.1x
  faster than the window and its transpose; with YNNPACK's, which the test
  pass uses, the window runs 2x faster.
  """
  n, height, width, channels = x.shape
  x = x[:, :height // 2 * 2, :width // 2 * 2]
  return x.reshape(n, height // 2, 2, width // 2, 2, channels).mean(axis=(2, 4))
