"""A 3x3 convolution, its ReLU and 2x2 average pooling as one layer, with a backward pass written for XLA:CPU.

Differentiated by JAX, `avg_pool(relu(conv(x) + bias))` costs XLA:CPU a
dozen passes over the convolution's full-size output (12.8 MB per member for
the CNN's first layer at batch 128): the bias and ReLU, the pooling's
reduce-window and its transpose, the ReLU's mask, the bias gradient's
reduction and the transposes that the kernel gradient wants.
`conv_relu_pool` computes the same function with a VJP of its own:

- forward: the convolution, then one fusion of the bias, the ReLU and the
  pooling as a reshape and a mean (XLA:CPU ran JAX's reduce-window pooling
  2x slower); the pre-activation is kept for the backward pass;
- backward: the pooled gradient spread over each window where the ReLU was
  active, in one fusion; the bias gradient as a product with a vector of
  ones (10x faster than XLA:CPU's reduction); the input and kernel gradients
  from the convolution's own VJP.

With few input channels (an image's) the convolution is a matrix product
with the input's 3x3 patches, 9C rows and a row of ones for the bias, small
next to the output: one product gives the pre-activation, one more the
kernel and bias gradients together, without the transposes.

It is the same function: the plain layers' values and gradients to float32
rounding, and their forward pass wherever nothing is differentiated
(evaluation and prediction, where YNNPACK runs JAX's pooling fastest). The
CNN's train step takes about 0.83 of the plain layers' time on the default
recipe (docs/benchmarks.md). Other platforms keep the plain layers, whose
gradients their own kernels serve (`lax.platform_dependent`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

_CONV_DIMENSIONS = ('NHWC', 'HWIO', 'NHWC')
# The largest input channel count whose patches (9C + 1 rows) are used as a matrix product: an image's.
MAX_PATCH_CHANNELS = 4


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


def _unpool(g: jnp.ndarray, shape) -> jnp.ndarray:
  """The gradient of `_pool` at an input of `shape`: each pooled gradient spread over its window, / 4."""
  n, h, w, c = shape
  spread = jnp.broadcast_to((g / 4)[:, :, None, :, None, :], (n, h // 2, 2, w // 2, 2, c))
  spread = spread.reshape(n, h // 2 * 2, w // 2 * 2, c)
  return jnp.pad(spread, ((0, 0), (0, h - spread.shape[1]), (0, w - spread.shape[2]), (0, 0)))


def _patches(x: jnp.ndarray) -> jnp.ndarray:
  """(9C + 1, N*H*W): row (i*3 + j)*C + c holds channel c shifted by (i-1, j-1), as a 3x3 'SAME' kernel sees
  it (the order of an HWIO kernel's rows); the last row is ones, the bias's."""
  n, h, w, c = x.shape
  padded = jnp.pad(jnp.moveaxis(x, -1, 0), ((0, 0), (0, 0), (1, 1), (1, 1)))
  rows = [padded[:, :, i:i + h, j:j + w] for i in range(3) for j in range(3)] + [jnp.ones((1, n, h, w), x.dtype)]
  return jnp.concatenate(rows, 0).reshape(9 * c + 1, n * h * w)


def _sum_rows(x: jnp.ndarray) -> jnp.ndarray:
  """The sum over all but the last axis, as a product with ones: the bias gradient."""
  rows = x.reshape(-1, x.shape[-1])
  return jnp.dot(jnp.ones((rows.shape[0],), x.dtype), rows, preferred_element_type=jnp.float32).astype(x.dtype)


@jax.custom_vjp
def _fused(x, kernel, bias):
  return _plain(x, kernel, bias)


def _fused_forward(x, kernel, bias):
  channels = x.shape[-1]
  if channels > MAX_PATCH_CHANNELS:
    pre_activation = _conv(x, kernel) + bias
    return _pool(nn.relu(pre_activation)), (x, kernel, pre_activation, None)
  patches = _patches(x)
  weights = jnp.concatenate([kernel.reshape(9 * channels, -1), bias[None]], 0)
  pre_activation = lax.dot_general(patches, weights, (((0,), (0,)), ((), ()))).reshape(*x.shape[:3], -1)
  return _pool(nn.relu(pre_activation)), (x, kernel, pre_activation, patches)


def _fused_backward(residuals, g):
  x, kernel, pre_activation, patches = residuals
  grad = jnp.where(pre_activation > 0, _unpool(g, pre_activation.shape), 0)
  _, conv_vjp = jax.vjp(_conv, x, kernel)
  if patches is None:
    return (*conv_vjp(grad), _sum_rows(grad))
  # The input's gradient from the convolution's VJP, which XLA drops when nothing uses it (a first layer).
  dx = conv_vjp(grad)[0]
  kernel_and_bias = jnp.dot(patches, grad.reshape(patches.shape[1], -1), preferred_element_type=jnp.float32)
  kernel_and_bias = kernel_and_bias.astype(kernel.dtype)
  return dx, kernel_and_bias[:-1].reshape(kernel.shape), kernel_and_bias[-1]


_fused.defvjp(_fused_forward, _fused_backward)


def conv_relu_pool(x: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray) -> jnp.ndarray:
  """avg_pool(relu(conv(x, kernel) + bias)), 2x2 pooling after a 3x3 'SAME' convolution: on CPU with the
  backward pass above, elsewhere as the plain layers."""
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
