"""A small encoder-decoder for a class per pixel (task='dense'): a U-Net in miniature (Ronneberger et al. 2015)."""

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from ensemble.models import packed, rank1 as rank1_layers

# The filters at full resolution, at a half and at a quarter of it.
WIDTHS = (16, 32, 64)


class Segmenter(nn.Module):
  """3x3 convolutions down to a quarter of the image, what the whole image says added at every position there, and
  back up, each step up joined by the step down's features at its resolution, then a 1x1 convolution to the
  logits of each pixel, (N, H, W, num_classes).

  The convolutions see a pixel's neighbourhood (about 23 pixels across), the context layer the whole image: a
  pixel of a digit needs both to know where the stroke is and which digit it belongs to. Any image size fits (each
  step up is resized to the step down's size; the context layer is sized for the first images it sees). With
  `rank1`, BatchEnsemble's layers; with `dropout_rate` (method mc_dropout), dropout on the bottleneck and before
  the last layer in training; with `groups` (method packed), the inner layers are grouped and sized by `widths`
  (models/packed.py).
  """
  num_classes: int = 10
  rank1: bool = False
  dropout_rate: float = 0.0
  widths: Sequence[int] = WIDTHS
  groups: int = 1

  def _conv(self, features: int, index: int, strides: int = 1, kernel: int = 3, grouped: bool = True) -> nn.Module:
    name = f'Conv_{index}'
    if self.rank1:
      return rank1_layers.Conv(features, (kernel, kernel), strides=strides, name=name)
    if grouped and index and self.groups > 1:  # the first layer takes the whole input, ungrouped
      return packed.Conv(features, (kernel, kernel), self.groups, strides=strides, name=name)
    return nn.Conv(features, (kernel, kernel), strides=strides, name=name)

  def _context(self, x: jnp.ndarray) -> jnp.ndarray:
    """What the whole image says, the same at every position (N, 1, 1, channels): a dense layer of all of `x`'s
    features, as a classifier's hidden layer sees them. Which digit a stroke belongs to is the image's, not its
    neighbourhood's (the global context of ParseNet, Liu et al. 2015, learned rather than averaged)."""
    n, height, width, channels = x.shape
    if self.groups > 1:  # group by group, each group's pixels together, as models/cnn.py orders them
      features = x.reshape(n, height * width, self.groups, channels // self.groups).swapaxes(1, 2)
      layer = packed.Dense(channels, self.groups, name='Context')
    else:
      features, layer = x, (rank1_layers.Dense if self.rank1 else nn.Dense)(channels, name='Context')
    return nn.relu(layer(features.reshape(n, -1)))[:, None, None, :]

  def _join(self, x: jnp.ndarray, skip: jnp.ndarray) -> jnp.ndarray:
    """The channels of both, group by group where the layers are grouped: each group of the next layer sees its
    own group of each."""
    if self.groups == 1:
      return jnp.concatenate([x, skip], -1)
    grouped = lambda a: a.reshape(*a.shape[:-1], self.groups, -1)
    return jnp.concatenate([grouped(x), grouped(skip)], -1).reshape(*x.shape[:-1], -1)

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    dropout = lambda x: nn.Dropout(self.dropout_rate, deterministic=not train)(x)  # rate 0: the identity
    full, half, quarter = self.widths
    down = [nn.relu(self._conv(full, 0)(x))]
    down.append(nn.relu(self._conv(half, 1, strides=2)(down[0])))
    x = nn.relu(self._conv(quarter, 2, strides=2)(down[1]))
    x = nn.relu(self._conv(quarter, 3)(x))
    x = dropout(x + self._context(x))
    for index, skip in zip((4, 5), reversed(down)):
      x = jax.image.resize(x, (*skip.shape[:3], x.shape[-1]), 'nearest')
      x = nn.relu(self._conv(skip.shape[-1], index)(self._join(x, skip)))
    return self._conv(self.num_classes, 6, kernel=1, grouped=False)(dropout(x))
