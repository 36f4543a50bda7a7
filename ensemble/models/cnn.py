"""The small CNN of the Flax examples: the classic deep-ensemble member."""

import flax.linen as nn
import jax.numpy as jnp

from ensemble.models import fused, rank1 as rank1_layers


class CNN(nn.Module):
  """Two 3x3 convolutions with average pooling, then two dense layers.

  Two 2x2 poolings need images of at least 4x4; the dense layer takes
  whatever size is left, so any image shape and channel count fits. Each
  convolution, its ReLU and its pooling are one `fused.ConvReluPool` (named
  as the convolution was: the parameters are the same), whose backward pass
  XLA:CPU runs faster; BatchEnsemble's rank-1 convolutions are the plain layers.
  With `dropout_rate` (method mc_dropout), dropout before each dense layer in
  training: Gal and Ghahramani's LeNet with dropout at its inner-product layers.
  """
  num_classes: int = 10
  rank1: bool = False  # BatchEnsemble's layers (models/rank1.py)
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    dropout = lambda x: nn.Dropout(self.dropout_rate, deterministic=not train)(x)  # rate 0: the identity
    for i, features in enumerate((32, 64)):
      if self.rank1:
        x = nn.avg_pool(nn.relu(rank1_layers.Conv(features, kernel_size=(3, 3))(x)), (2, 2), strides=(2, 2))
      else:
        x = fused.ConvReluPool(features, name=f'Conv_{i}')(x)
    x = x.reshape((x.shape[0], -1))
    dense = rank1_layers.Dense if self.rank1 else nn.Dense
    x = nn.relu(dense(features=256)(dropout(x)))
    return dense(features=self.num_classes)(dropout(x))
