"""Models of a user's own, importable by path (`user_models:TinyNet`) in the tests' processes."""

import flax.linen as nn
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


NOT_A_MODEL = 3.0


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
