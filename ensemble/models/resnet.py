"""The CIFAR ResNet of He et al. (2016, section 4.2), with an optional width multiplier.

Depth 6n + 2: a 3x3 stem, three stages of n basic blocks with 16, 32 and 64
filters (times `width`; the first block of stages 2 and 3 halves the
resolution), global average pooling and a dense head. ResNet-20 is n = 3.
BatchNorm's statistics are per member: each member is its own network.
Method packed's member sets the stages' `widths` and `groups` (models/packed.py):
as in torch-uncertainty's packed ResNet, the stem, each block's first
convolution and the head stay ungrouped, each block's second convolution and
its projection are grouped.
"""

import functools
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from ensemble.models import rank1 as rank1_layers

STAGE_FILTERS = (16, 32, 64)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions and a shortcut; a 1x1 projection where the shape changes."""
  filters: int
  strides: int = 1
  rank1: bool = False
  groups: int = 1

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    conv = functools.partial(rank1_layers.Conv if self.rank1 else nn.Conv, use_bias=False,
                             kernel_init=nn.initializers.he_normal())
    y = nn.relu(norm()(conv(self.filters, (3, 3), strides=self.strides)(x)))
    # A zero-initialised last scale makes each block start as the identity (Goyal et al. 2017).
    y = norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3), feature_group_count=self.groups)(y))
    if x.shape != y.shape:
      x = norm()(conv(self.filters, (1, 1), strides=self.strides, feature_group_count=self.groups)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  depth: int = 20
  width: int = 1
  num_classes: int = 10
  rank1: bool = False  # BatchEnsemble's layers (models/rank1.py)
  dropout_rate: float = 0.0  # before the dense head, in training (method mc_dropout)
  widths: Sequence[int] = ()  # the three stages' filters (the stem's: the first stage's); () for STAGE_FILTERS x width
  groups: int = 1  # in each block's second convolution and projection (method packed)

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    conv, dense = (rank1_layers.Conv, rank1_layers.Dense) if self.rank1 else (nn.Conv, nn.Dense)
    blocks_per_stage = (self.depth - 2) // 6
    widths = self.widths or tuple(filters * self.width for filters in STAGE_FILTERS)
    x = conv(widths[0], (3, 3), use_bias=False, kernel_init=nn.initializers.he_normal())(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x))
    for stage, filters in enumerate(widths):
      for block in range(blocks_per_stage):
        strides = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(filters, strides, self.rank1, self.groups)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return dense(self.num_classes)(nn.Dropout(self.dropout_rate, deterministic=not train)(x))
