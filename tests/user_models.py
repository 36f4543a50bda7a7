"""Models of a user's own, importable by path (`user_models:TinyNet`) in the tests' processes."""

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from ensemble.models import rank1


class TinyNet(nn.Module):
  """Flattened inputs -> Dense, BatchNorm, ReLU, Dropout -> logits: both modes matter, as in a real model."""
  width: int = 32
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(self.width)(x)))
    x = nn.Dropout(0.25, deterministic=not train)(x)
    return nn.Dense(self.num_classes)(x)


class NoTrainArgument(nn.Module):
  """A model whose `__call__` takes no `train`: it gets none."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))


class WrongInputSize(nn.Module):
  """Expects 100 values per example, whatever it is given."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(x.reshape((x.shape[0], 100)))


class NNXNet(nnx.Module):
  """The NNX counterpart of TinyNet: every member builds one from its own `rngs`."""

  def __init__(self, din: int, num_classes: int = 10, width: int = 32, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(din, width, rngs=rngs)
    self.norm = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return self.head(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


class ScaledNNX(nnx.Module):
  """One linear layer on its inputs times a constant of its own (an nnx.Variable: state, not a parameter), counting
  its train calls in another: each member must carry both, the constant as it was built, the count as it grows."""

  def __init__(self, din: int, num_classes: int = 10, scale: float = 10.0, *, rngs: nnx.Rngs):
    self.scale = nnx.Variable(jnp.full((din,), scale))
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
    self.linear = nnx.Linear(din, num_classes, rngs=rngs)

  def __call__(self, x, train: bool = False):
    if train:
      self.calls[...] += 1
    return self.linear(x.reshape((x.shape[0], -1)) * self.scale[...])


class LazyNNX(ScaledNNX):
  """ScaledNNX, but its count is a variable that its first call creates: no member could carry it."""

  def __init__(self, din: int, num_classes: int = 10, *, rngs: nnx.Rngs):
    super().__init__(din, num_classes, rngs=rngs)
    del self.calls

  def __call__(self, x, train: bool = False):
    if not hasattr(self, 'calls'):
      self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
    return super().__call__(x, train)


class Scaled(nn.Module):
  """ScaledNNX in linen: the constant in a collection of its own ('constants'), the count in a mutable one
  ('counter'), neither of them 'params' or 'batch_stats'."""
  scale: float = 10.0
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape((x.shape[0], -1))
    scale = self.variable('constants', 'scale', jnp.full, x.shape[1:], self.scale)
    calls = self.variable('counter', 'calls', jnp.zeros, (), jnp.int32)
    if train:
      calls.value += 1
    return nn.Dense(self.num_classes)(x * scale.value)


NOT_A_MODEL = 3.0


def plain_function(images):
  """A function of the inputs, not a model: given as one, it is called with nnx.Rngs and fails on them."""
  return images.reshape(len(images), -1) * 2.0


class Regressor(nn.Module):
  """Features -> two tanh layers -> `num_classes` outputs: for regression, a mean and a raw scale per target.

  With `rank1`, its layers are BatchEnsemble's (method batchensemble needs them).
  """
  width: int = 32
  num_classes: int = 2
  rank1: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    dense = rank1.Dense if self.rank1 else nn.Dense
    x = x.reshape((x.shape[0], -1))
    x = nn.tanh(dense(self.width)(x))
    x = nn.tanh(dense(self.width)(x))
    return dense(self.num_classes)(x)


class Annotated(nn.Module):
  """An MLP whose hidden units carry a logical axis name of its own, 'mlp': member_sharding=model splits them."""
  width: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    x = nn.Dense(self.width, kernel_init=nn.with_logical_partitioning(init, ('pixels', 'mlp')))(
        x.reshape((x.shape[0], -1)))
    return nn.Dense(self.num_classes, kernel_init=nn.with_logical_partitioning(init, ('mlp', None)))(nn.relu(x))
