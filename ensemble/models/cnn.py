"""The small CNN of the Flax examples: the classic deep-ensemble member."""

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from ensemble.models import fused, packed, rank1 as rank1_layers

# The two convolutions' filters and the hidden dense layer's units.
WIDTHS = (32, 64, 256)


class CNN(nn.Module):
  """Two 3x3 convolutions with average pooling, then two dense layers.

  Two 2x2 poolings need images of at least 4x4; the dense layer takes
  whatever size is left, so any image shape and channel count fits. Each
  convolution, its ReLU and its pooling are one `fused.ConvReluPool` (named
  as the convolution was: the parameters are the same), whose backward pass
  XLA:CPU runs faster; BatchEnsemble's rank-1 convolutions are the plain layers.
  With `dropout_rate` (method mc_dropout), dropout before each dense layer in
  training: Gal and Ghahramani's LeNet with dropout at its inner-product layers.
  Method packed's member sets `widths` and splits the inner layers (the second
  convolution, the hidden dense layer) into `groups` (models/packed.py); the
  flattened features are ordered group by group, so that each group of the
  dense layer sees its own group of filters.
  """
  num_classes: int = 10
  rank1: bool = False  # BatchEnsemble's layers (models/rank1.py)
  dropout_rate: float = 0.0
  widths: Sequence[int] = WIDTHS
  groups: int = 1

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    dropout = lambda x: nn.Dropout(self.dropout_rate, deterministic=not train)(x)  # rate 0: the identity
    pool = lambda x: nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
    for i, features in enumerate(self.widths[:2]):
      if self.rank1:
        x = pool(rank1_layers.Conv(features, kernel_size=(3, 3))(x))
      elif i and self.groups > 1:  # the first layer takes the whole input, ungrouped
        x = pool(packed.Conv(features, (3, 3), self.groups, name=f'Conv_{i}')(x))
      else:
        x = fused.ConvReluPool(features, name=f'Conv_{i}')(x)
    if self.groups > 1:  # group by group, each group's pixels together
      n, height, width, channels = x.shape
      x = x.reshape(n, height * width, self.groups, channels // self.groups).swapaxes(1, 2)
    x = x.reshape((x.shape[0], -1))
    dense = rank1_layers.Dense if self.rank1 else nn.Dense
    hidden = packed.Dense(self.widths[2], self.groups) if self.groups > 1 else dense(self.widths[2])
    x = nn.relu(hidden(dropout(x)))
    return dense(features=self.num_classes)(dropout(x))
