"""BatchEnsemble's rank-1 layers (Wen et al. 2020): a shared weight, modulated by a member's own fast factors.

y = ((x * r) W) * s + b, with W shared by all members and r, s, b the member's
own: each member is a full-rank network for the price of two vectors per
layer. Drop-in replacements for `nn.Conv` and `nn.Dense`; the shared weight is
the parameter named 'kernel', as in those layers (methods/batchensemble.py
keeps it identical across members). The fast factors start as random signs,
as in uncertainty-baselines, so members differ from the first step.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def random_signs(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  return jnp.where(jax.random.bernoulli(key, 0.5, shape), 1.0, -1.0).astype(dtype)


class _Rank1(nn.Module):
  """Wraps the shared layer `layer(features, use_bias=False)` in the member's input and output factors."""
  features: int
  layer: Any
  use_bias: bool = True
  options: tuple = ()

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    fast_in = self.param('fast_in', random_signs, (x.shape[-1],))
    fast_out = self.param('fast_out', random_signs, (self.features,))
    y = self.layer(self.features, use_bias=False, name='shared', **dict(self.options))(x * fast_in) * fast_out
    if self.use_bias:
      y = y + self.param('bias', nn.initializers.zeros_init(), (self.features,))
    return y


def Dense(features: int, use_bias: bool = True, **options) -> nn.Module:  # pylint: disable=invalid-name
  return _Rank1(features, nn.Dense, use_bias, tuple(options.items()))


def Conv(features: int, kernel_size, strides=1, use_bias: bool = True, **options) -> nn.Module:  # pylint: disable=invalid-name
  return _Rank1(features, nn.Conv, use_bias, (('kernel_size', tuple(kernel_size)), ('strides', strides),
                                               *options.items()))
