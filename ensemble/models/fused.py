"""A 3x3 convolution, its ReLU and 2x2 average pooling as one layer, with a backward pass written for XLA:CPU.

Differentiated by JAX, `avg_pool(relu(conv(x) + bias))` costs XLA:CPU a
dozen passes over the convolution's full-size output (12.8 MB per member for
the CNN's first layer at batch 128): the bias and ReLU, the pooling's
reduce-window and its transpose, the ReLU's mask, the bias gradient's
reduction and the transposes that the kernel gradient wants.
`conv_relu_pool` computes the same function with a JVP of its own, whose
linear pieces are chosen for what JAX transposes them into (a custom VJP,
as the layer was first written, ran no faster and refused forward mode:
`jax.jvp`, `jacfwd`, `hessian`):

- forward: the convolution, then one fusion of the bias, the ReLU and the
  pooling as a reshape and a mean (XLA:CPU ran JAX's reduce-window pooling
  2x slower); the ReLU's mask is kept for the backward pass;
- backward, the tangent transposed: the pooled gradient spread over each
  window where the ReLU was active, in one fusion; the bias gradient as a
  product with a vector of ones (the tangent adds the bias as a product with
  a column of ones; 10x faster than XLA:CPU's reduction); the input and
  kernel gradients as the convolution's transposes.

With few input channels (an image's) the convolution is a matrix product
with the input's 3x3 patches, 9C rows and a row of ones for the bias, small
next to the output: one product gives the pre-activation, one more the
kernel and bias gradients together, without the transposes.

It is the same function: the plain layers' values and gradients to float32
rounding. Where nothing is differentiated (evaluation and prediction), an
image's layer of few filters runs from the image's 2x2 blocks
(`_from_blocks`), the others as the plain layers. The
CNN's train step takes about 0.83 of the plain layers' time on the default
recipe (docs/benchmarks.md). Other platforms keep the plain layers, whose
gradients their own kernels serve (`lax.platform_dependent`).
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

_CONV_DIMENSIONS = ('NHWC', 'HWIO', 'NHWC')
# The largest input channel count whose patches (9C + 1 rows) are used as a matrix product: an image's.
MAX_PATCH_CHANNELS = 4
# The most filters of such a layer whose forward pass runs from the input's 2x2 blocks (`_from_blocks`): XLA:CPU's
# convolution of an image into 8 or 16 filters took 3-5x the time of one into 32; from blocks, 0.22-0.63 of the
# plain layer's time at 8 and 16 filters, 1.25-6x more from 24 (docs/benchmarks.md).
MAX_BLOCK_FILTERS = 16


def _conv(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
  """`nn.Conv`'s 3x3 convolution: stride 1, 'SAME' padding."""
  return lax.conv_general_dilated(x, kernel, (1, 1), 'SAME', dimension_numbers=_CONV_DIMENSIONS)


def _plain(x, kernel, bias):
  """The layer as `nn.Conv`, `nn.relu` and `nn.avg_pool` compute it."""
  return nn.avg_pool(nn.relu(_conv(x, kernel) + bias), window_shape=(2, 2), strides=(2, 2))


def _pool(y: jnp.ndarray) -> jnp.ndarray:
  """2x2 average pooling, stride 2, an odd last row or column dropped ('VALID'), as a reshape and a mean."""
  n, h, w, c = y.shape
  return y[:, :h // 2 * 2, :w // 2 * 2].reshape(n, h // 2, 2, w // 2, 2, c).mean((2, 4))


def _patches(x: jnp.ndarray) -> jnp.ndarray:
  """(9C + 1, N*H*W): row (i*3 + j)*C + c holds channel c shifted by (i-1, j-1), as a 3x3 'SAME' kernel sees
  it (the order of an HWIO kernel's rows); the last row is ones, the bias's."""
  n, h, w, c = x.shape
  padded = jnp.pad(jnp.moveaxis(x, -1, 0), ((0, 0), (0, 0), (1, 1), (1, 1)))
  rows = [padded[:, :, i:i + h, j:j + w] for i in range(3) for j in range(3)] + [jnp.ones((1, n, h, w), x.dtype)]
  return jnp.concatenate(rows, 0).reshape(9 * c + 1, n * h * w)


def _product(a: jnp.ndarray, b: jnp.ndarray, contracting: int, shape) -> jnp.ndarray:
  """`a`'s axis `contracting` times `b`'s first, summed in float32, reshaped to `shape[:-1]` and `b`'s columns.

  Differentiated, its transpose is the same kind of product: `b`'s gradient is `a` times the output's, summed over
  every pixel in float32 (bfloat16's sums drifted 7-18% from float32's), in one pass instead of XLA:CPU's slower
  reduction and the transposes that a kernel gradient wants.
  """
  product = lax.dot_general(a, b, (((contracting,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return product.astype(b.dtype).reshape(*shape[:-1], b.shape[-1])


def _with_patches(patches: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray, shape) -> jnp.ndarray:
  """The convolution of the input whose `patches` they are with `kernel`, plus `bias`: one product."""
  weights = jnp.concatenate([kernel.reshape(-1, kernel.shape[-1]), bias[None]], 0)
  return _product(patches, weights, 0, shape)


def _with_bias(bias: jnp.ndarray, shape) -> jnp.ndarray:
  """`bias` at every pixel of an output of `shape`, as a product with a column of ones (its transpose sums the
  gradient's pixels with a vector of ones, 10x faster than XLA:CPU's reduction)."""
  return _product(jnp.ones((math.prod(shape[:-1]), 1), bias.dtype), bias[None], 1, shape)


def _pre_activation(x: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray):
  """(conv(x, kernel) + bias, the input's patches, or None where the convolution computes it)."""
  if x.shape[-1] > MAX_PATCH_CHANNELS:
    return _conv(x, kernel) + bias, None
  patches = _patches(x)
  return _with_patches(patches, kernel, bias, (*x.shape[:-1], kernel.shape[-1])), patches


def _blocks_kernel(kernel: jnp.ndarray) -> jnp.ndarray:
  """A 3x3 kernel (3, 3, C, O) as the 2x2 kernel (2, 2, 4C, 4O) of `_from_blocks`: input channel (i, j, c) is
  channel c at row i, column j of a 2x2 block of the padded input; output channel (di, dj, o) is filter o at row
  di, column dj of a pooling window. Each of the four outputs sees a 4x4 window of the padded input, its 3x3 kernel
  at an offset of (di, dj) and zeros elsewhere."""
  c, o = kernel.shape[2:]
  window = jnp.zeros((4, 4, c, 2, 2, o), kernel.dtype)
  for di in range(2):
    for dj in range(2):
      window = window.at[di:di + 3, dj:dj + 3, :, di, dj, :].set(kernel)
  return window.reshape(2, 2, 2, 2, c, 2, 2, o).transpose(0, 2, 1, 3, 4, 5, 6, 7).reshape(2, 2, 4 * c, 4 * o)


def _from_blocks(x: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray) -> jnp.ndarray:
  """The layer, for an input of few channels, as a 2x2 'VALID' convolution of its 2x2 blocks whose outputs are
  each pooling window's four pre-activations, then one ReLU and a mean over the four.

  It is the forward pass of `_plain` to float32 rounding, at 16/9 of its multiply-adds: 4 channels in and 4x the
  filters out at a quarter of the pixels, a shape XLA:CPU runs well where it runs an image's few filters slowly
  (`MAX_BLOCK_FILTERS`).
  """
  n, h, w, c = x.shape
  height, width = h // 2 * 2 + 2, w // 2 * 2 + 2  # 'SAME' padding of 1, the odd last row or column dropped
  padded = jnp.pad(x, ((0, 0), (1, height - h - 1), (1, width - w - 1), (0, 0)))
  blocks = padded.reshape(n, height // 2, 2, width // 2, 2, c).transpose(0, 1, 3, 2, 4, 5)
  blocks = blocks.reshape(n, height // 2, width // 2, 4 * c)
  pre_activation = lax.conv_general_dilated(blocks, _blocks_kernel(kernel), (1, 1), 'VALID',
                                            dimension_numbers=_CONV_DIMENSIONS) + jnp.tile(bias, 4)
  return jax.nn.relu(pre_activation).reshape(*pre_activation.shape[:3], 4, kernel.shape[-1]).mean(3)


@jax.custom_jvp
def _fused(x, kernel, bias):
  if x.shape[-1] <= MAX_PATCH_CHANNELS and kernel.shape[-1] <= MAX_BLOCK_FILTERS:
    return _from_blocks(x, kernel, bias)
  return _plain(x, kernel, bias)


@functools.partial(_fused.defjvp, symbolic_zeros=True)
def _fused_jvp(primals, tangents):
  """The value as `_pre_activation` computes it, and the tangent from linear pieces that transpose well.

  Reverse mode transposes the tangent's pieces into the backward pass that the module's docstring describes.
  Tangents known to be zero (the images', in training) are left out: their pieces cost nothing either way.
  """
  x, kernel, bias = primals
  dx, dkernel, dbias = (None if isinstance(t, SymbolicZero) else t for t in tangents)
  pre_activation, patches = _pre_activation(x, kernel, bias)
  terms = [] if dx is None else [_conv(dx, kernel)]
  if patches is not None and (dkernel is not None or dbias is not None):
    zeros_if_none = lambda tangent, like: jnp.zeros_like(like) if tangent is None else tangent
    terms.append(_with_patches(patches, zeros_if_none(dkernel, kernel), zeros_if_none(dbias, bias),
                               pre_activation.shape))
  elif patches is None:
    terms += [] if dkernel is None else [_conv(x, dkernel)]
    terms += [] if dbias is None else [_with_bias(dbias, pre_activation.shape)]
  active = pre_activation > 0
  tangent = functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(pre_activation)
  return _pool(jnp.where(active, pre_activation, 0)), _pool(jnp.where(active, tangent, 0))


def conv_relu_pool(x: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray) -> jnp.ndarray:
  """avg_pool(relu(conv(x, kernel) + bias)), 2x2 pooling after a 3x3 'SAME' convolution: on CPU with the
  derivatives above, elsewhere as the plain layers."""
  return lax.platform_dependent(x, kernel, bias, cpu=_fused, default=_plain)


class ConvReluPool(nn.Module):
  """`nn.Conv(features, (3, 3))`, `nn.relu` and `nn.avg_pool(window (2, 2), strides (2, 2))` as one layer.

  Its parameters are `nn.Conv`'s ('kernel', 'bias', with its initialisers),
  so a model that names it as it named the convolution keeps its parameter
  tree, its initial values and its checkpoints.
  """
  features: int

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    kernel = self.param('kernel', nn.initializers.lecun_normal(), (3, 3, x.shape[-1], self.features))
    bias = self.param('bias', nn.initializers.zeros_init(), (self.features,))
    dtype = jnp.result_type(x, kernel)  # what nn.Conv computes in (its dtype=None)
    return conv_relu_pool(x.astype(dtype), kernel.astype(dtype), bias.astype(dtype))
