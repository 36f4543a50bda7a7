"""Packed-Ensembles' layers (Laurent et al. 2023): grouped dense and convolution layers, and a subnetwork's width.

A packed ensemble of M members is one network whose layers are M-group
convolutions; each member is the base network at `alpha / M` of its width,
whose inner layers are split again into `gamma` groups. Here the M groups are
the ensemble's member axis (methods/packed.py), so a member needs only the
`gamma` groups: a layer whose weight is block-diagonal, `groups` blocks that
each map their slice of the input features to their slice of the outputs.

A model of your own, for `method='packed'`, sizes each layer with
`width(features, alpha, members, gamma)` and uses `Dense` / `Conv` (linen) or
`NNXDense` / `NNXConv` (NNX) with `groups=gamma` for its inner layers; its
first layer (the whole input) and its last (the outputs) stay ordinary ones.
Their weights are named `packed_kernel`, which is how `members.check_model`
tells a packed model from one that would silently ignore alpha and gamma.
"""

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ensemble.errors import UsageError

# The name of every packed layer's weight: what marks a model as built of packed layers (`has_packed_layers`).
KERNEL = 'packed_kernel'


def width(features: int, alpha: float, members: int, gamma: int = 1) -> int:
  """A member's width for a layer of `features` in the base network: alpha * features / members, rounded up to a
  multiple of gamma (at least gamma) so that its groups are equal, as torch-uncertainty's packed layers widen
  int(alpha * features) to a multiple of their members x gamma groups."""
  if not (isinstance(features, int) and features >= 1 and isinstance(members, int) and members >= 1
          and isinstance(gamma, int) and gamma >= 1 and alpha > 0):
    raise UsageError(f'packed width of features={features!r}, alpha={alpha!r}, members={members!r}, '
                     f'gamma={gamma!r}: features, members and gamma must be positive integers and alpha > 0')
  return gamma * max(1, math.ceil(int(features * alpha) / (members * gamma)))


def _check_groups(layer: str, inputs: int, outputs: int, groups: int):
  if not (isinstance(groups, int) and groups >= 1 and inputs % groups == 0 and outputs % groups == 0):
    raise UsageError(f'packed {layer} with {inputs} inputs and {outputs} outputs cannot be split into '
                     f'groups={groups!r} equal groups: size the layers with '
                     'ensemble.models.packed.width(features, alpha, members, gamma), which gives multiples of gamma')


def grouped_dense(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  """x (..., in) times the block-diagonal matrix whose blocks are `kernel` (groups, in / groups, out / groups): each
  group of outputs sees only its own group of inputs, without the zeros of the full matrix."""
  groups, _, group_outputs = kernel.shape
  y = jnp.einsum('...gi,gio->...go', x.reshape(*x.shape[:-1], groups, -1), kernel)
  return y.reshape(*x.shape[:-1], groups * group_outputs)


def grouped_conv(x: jnp.ndarray, kernel: jnp.ndarray, groups: int, strides: Sequence[int],
                 padding: Any) -> jnp.ndarray:
  """`nn.Conv`'s convolution of channels-last `x` with a (*window, in / groups, out) `kernel` in `groups` groups."""
  spatial = 'HWDXYZ'[:kernel.ndim - 2]
  return lax.conv_general_dilated(x, kernel, tuple(strides), padding, feature_group_count=groups,
                                  dimension_numbers=(f'N{spatial}C', f'{spatial}IO', f'N{spatial}C'))


def _dense_shape(inputs: int, features: int, groups: int) -> tuple[int, int, int]:
  _check_groups('Dense', inputs, features, groups)
  return groups, inputs // groups, features // groups


def _conv_shape(inputs: int, features: int, kernel_size: Sequence[int], groups: int) -> tuple[int, ...]:
  _check_groups('Conv', inputs, features, groups)
  return *kernel_size, inputs // groups, features


# Each group's fan-in is its own inputs: the blocks are initialised as `groups` separate layers.
DENSE_INIT = nn.initializers.lecun_normal(batch_axis=(0,))
CONV_INIT = nn.initializers.lecun_normal()


class Dense(nn.Module):
  """A dense layer in `groups` groups: block-diagonal, `groups` times fewer weights and products than nn.Dense."""
  features: int
  groups: int = 1
  use_bias: bool = True

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    kernel = self.param(KERNEL, DENSE_INIT, _dense_shape(x.shape[-1], self.features, self.groups))
    y = grouped_dense(x, kernel)
    return y + self.param('bias', nn.initializers.zeros_init(), (self.features,)) if self.use_bias else y


class Conv(nn.Module):
  """nn.Conv(features, kernel_size, strides, padding, feature_group_count=groups), its weight named `KERNEL`."""
  features: int
  kernel_size: Sequence[int]
  groups: int = 1
  strides: int | Sequence[int] = 1
  padding: Any = 'SAME'
  use_bias: bool = True
  kernel_init: Any = CONV_INIT

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    kernel_size = tuple(self.kernel_size)
    kernel = self.param(KERNEL, self.kernel_init, _conv_shape(x.shape[-1], self.features, kernel_size, self.groups))
    strides = (self.strides,) * len(kernel_size) if isinstance(self.strides, int) else self.strides
    y = grouped_conv(x, kernel, self.groups, strides, self.padding)
    return y + self.param('bias', nn.initializers.zeros_init(), (self.features,)) if self.use_bias else y


def has_packed_layers(variables) -> bool:
  """Whether a model's variables hold a packed layer's weight (`KERNEL`), linen or NNX."""
  return any(getattr(key, 'key', None) == KERNEL for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0]
             for key in path)


@functools.cache
def _nnx_layers() -> dict[str, type]:
  """The NNX layers, made on first use: importing flax.nnx costs every program half a second."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class NNXDense(nnx.Module):
    """`Dense` for NNX models: NNXDense(in_features, out_features, groups, rngs=...)."""

    def __init__(self, in_features: int, out_features: int, groups: int = 1, *, use_bias: bool = True,
                 rngs: nnx.Rngs):
      shape = _dense_shape(in_features, out_features, groups)
      setattr(self, KERNEL, nnx.Param(DENSE_INIT(rngs.params(), shape)))
      self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
      y = grouped_dense(x, getattr(self, KERNEL)[...])
      return y if self.bias is None else y + self.bias[...]

  class NNXConv(nnx.Module):
    """`Conv` for NNX models: NNXConv(in_features, out_features, kernel_size, groups, strides, padding, rngs=...)."""

    def __init__(self, in_features: int, out_features: int, kernel_size: Sequence[int], groups: int = 1,
                 strides: int | Sequence[int] = 1, padding: Any = 'SAME', *, use_bias: bool = True, rngs: nnx.Rngs):
      kernel_size = tuple(kernel_size)
      shape = _conv_shape(in_features, out_features, kernel_size, groups)
      setattr(self, KERNEL, nnx.Param(CONV_INIT(rngs.params(), shape)))
      self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None
      self.groups, self.padding = groups, padding
      self.strides = (strides,) * len(kernel_size) if isinstance(strides, int) else tuple(strides)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
      y = grouped_conv(x, getattr(self, KERNEL)[...], self.groups, self.strides, self.padding)
      return y if self.bias is None else y + self.bias[...]

  return {'NNXDense': NNXDense, 'NNXConv': NNXConv}


def __getattr__(name: str):
  if name in ('NNXDense', 'NNXConv'):
    return _nnx_layers()[name]
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
