"""MIMO's network (Havasi et al. 2021): M inputs in, M heads out, around a model of one input and M x outputs.

Method mimo (methods/mimo.py) trains one network on M independent examples at
once and predicts with one input repeated in all M slots. The network is any
model whose last layer gives M times the outputs of one head, wrapped here: the
M inputs (batch, M, *input_shape) are concatenated along their last axis (an
image's channels, a feature vector's features: the paper's wider input layer,
channels x M), the model runs once, and its outputs are split into the M heads,
(batch, M, outputs per head), head j's outputs being the j-th block of them.

The built-in models are wrapped for method mimo by `models.create`. A model of
your own is wrapped by you, given M times the outputs of one member:

  linen: `ensemble.models.mimo.MIMO(MyNet(num_classes=10 * M), heads=M)`
  NNX:   `ensemble.models.mimo.nnx_mimo(functools.partial(MyNNXNet, num_classes=10 * M), heads=M)`
"""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from ensemble.errors import UsageError
from ensemble.models import user


def concatenate_slots(x: jnp.ndarray) -> jnp.ndarray:
  """(batch, M, *shape) -> (batch, *shape[:-1], M x shape[-1]): slot j's values are the j-th block of the last axis."""
  x = jnp.moveaxis(x, 1, -2)
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def split_heads(outputs: jnp.ndarray, heads: int) -> jnp.ndarray:
  """(batch, ..., M x outputs) -> (batch, M, ..., outputs) (the positions of a dense task's outputs between);
  refuses outputs that are not M blocks."""
  if outputs.ndim < 2 or outputs.shape[-1] % heads:
    raise UsageError(f'the model inside the MIMO wrapper gives outputs of shape {tuple(outputs.shape)}, not (batch, '
                     f'{heads} x outputs per head): give its last layer {heads} times the outputs of one member')
  split = outputs.reshape(*outputs.shape[:-1], heads, outputs.shape[-1] // heads)
  return jnp.moveaxis(split, -2, 1)


def _call(inner, x: jnp.ndarray, train: bool) -> jnp.ndarray:
  """`inner(x)`, with `train` when its `__call__` takes it (BatchNorm, Dropout)."""
  return inner(x, train=train) if user._takes_train(inner.__call__) else inner(x)  # pylint: disable=protected-access


class MIMO(nn.Module):
  """A linen model of M inputs and M heads around `inner`, a linen model of one input and M x outputs per head."""
  inner: nn.Module
  heads: int

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    return split_heads(_call(self.inner, concatenate_slots(x), train), self.heads)


def nnx_mimo(build: Callable[..., Any], heads: int) -> Callable[..., Any]:
  """An NNX model of M = `heads` inputs and heads, as a function of `rngs` (what `ensemble.fit` takes for an NNX
  model): `build(rngs)` makes the model of one input and M x outputs per head. A partial, so that config.json says
  that it cannot record it (`models.user.describe`) and `ensemble.load` asks for it."""
  return functools.partial(_build_nnx, build=build, heads=heads)


def _build_nnx(*, build: Callable[..., Any], heads: int, rngs):  # pylint: disable=redefined-outer-name
  return _nnx_heads()(user._build(build, rngs), heads)  # pylint: disable=protected-access


@functools.cache
def _nnx_heads():
  """The NNX module class, defined on first use: flax.nnx is imported only by those who use it (as models.user)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class NNXHeads(nnx.Module):
    """`nnx_mimo`'s model: the inner NNX model between the slots' concatenation and the heads' split."""

    def __init__(self, inner, heads: int):
      self.inner, self.heads = inner, heads

    def __call__(self, x, train: bool = False):
      return split_heads(_call(self.inner, concatenate_slots(x), train), self.heads)
  return NNXHeads


def heads(model: Any) -> int | None:
  """The number of heads of a MIMO-wrapped model (itself, or inside `models.user`'s Linen or NNX wrapper); None for
  a model that is not wrapped."""
  model = getattr(model, 'module', model)  # models.user.Linen
  if isinstance(model, MIMO):
    return model.heads
  build = getattr(model, 'build', None)  # models.user.NNX
  return build.keywords['heads'] if isinstance(build, functools.partial) and build.func is _build_nnx else None
