"""The CIFAR ResNet of He et al. (2016, section 4.2), with an optional width multiplier.

Depth 6n + 2: a 3x3 stem, three stages of n basic blocks with 16, 32 and 64
filters (times `width`; the first block of stages 2 and 3 halves the
resolution), global average pooling and a dense head. ResNet-20 is n = 3.
BatchNorm's statistics are per member: each member is its own network.
"""

import functools

import flax.linen as nn
import jax.numpy as jnp

from ensemble.models import rank1 as rank1_layers

STAGE_FILTERS = (16, 32, 64)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions and a shortcut; a 1x1 projection where the shape changes."""
  filters: int
  strides: int = 1
  rank1: bool = False

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    conv = functools.partial(rank1_layers.Conv if self.rank1 else nn.Conv, use_bias=False,
                             kernel_init=nn.initializers.he_normal())
    y = nn.relu(norm()(conv(self.filters, (3, 3), strides=self.strides)(x)))
    # A zero-initialised last scale makes each block start as the identity (Goyal et al. 2017).
    y = norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3))(y))
    if x.shape != y.shape:
      x = norm()(conv(self.filters, (1, 1), strides=self.strides)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  depth: int = 20
  width: int = 1
  num_classes: int = 10
  rank1: bool = False  # BatchEnsemble's layers (models/rank1.py)
  dropout_rate: float = 0.0  # before the dense head, in training (method mc_dropout)

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    conv, dense = (rank1_layers.Conv, rank1_layers.Dense) if self.rank1 else (nn.Conv, nn.Dense)
    blocks_per_stage = (self.depth - 2) // 6
    x = conv(16 * self.width, (3, 3), use_bias=False, kernel_init=nn.initializers.he_normal())(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x))
    for stage, filters in enumerate(STAGE_FILTERS):
      for block in range(blocks_per_stage):
        strides = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(filters * self.width, strides, self.rank1)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return dense(self.num_classes)(nn.Dropout(self.dropout_rate, deterministic=not train)(x))
