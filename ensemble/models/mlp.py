"""The MLPs: one split over a ('data', 'model') mesh by sharding annotations (Flax's scale-up guide), and a plain
one, the ensemble member for feature vectors (`Plain`).

Every weight says how each of its dimensions is split, and the activations
between layers are constrained the same way; `jax.jit` turns the annotations
into `NamedSharding`s and XLA's SPMD partitioner inserts the collectives.

The annotations come in two spellings, chosen by `logical`:
- mesh axes, written into the model (`nn.with_partitioning`,
  `jax.lax.with_sharding_constraint`): the least indirection;
- logical axes ('batch', 'hidden', ...; `nn.with_logical_partitioning`,
  `nn.with_logical_constraint`) that `logical_axis_rules` map onto the mesh:
  another layout is a config change, not a model change.
Under `parallel.logical.DEFAULT_RULES` the two give the same shardings.
"""

import functools
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ensemble.models import packed, rank1 as rank1_layers
from ensemble.parallel import DATA_AXIS, MODEL_AXIS

Names = Sequence[str | None]


def _partitioned(init, logical: bool, logical_names: Names, mesh_names: Names):
  if logical:
    return nn.with_logical_partitioning(init, tuple(logical_names))
  return nn.with_partitioning(init, tuple(mesh_names))


def _constrain(x: jnp.ndarray, logical: bool, logical_names: Names, mesh_names: Names) -> jnp.ndarray:
  if logical:
    return nn.with_logical_constraint(x, tuple(logical_names))
  return jax.lax.with_sharding_constraint(x, P(*mesh_names))


class DotReluDot(nn.Module):
  """relu(x W1) W2 with W1 split by columns and W2 by rows over 'model'.

  Each device computes its slice of the hidden units and a partial product;
  one all-reduce over 'model' sums those into z. Returns (z, None) so that
  `nn.scan` can stack the layers.
  """
  depth: int
  logical: bool = False
  dense_init: nn.initializers.Initializer = nn.initializers.xavier_normal()

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> tuple[jnp.ndarray, None]:
    w1_init = _partitioned(self.dense_init, self.logical, ('embed', 'hidden'), (None, MODEL_AXIS))
    y = nn.Dense(self.depth, use_bias=False, kernel_init=w1_init)(x)
    y = _constrain(jax.nn.relu(y), self.logical, ('batch', 'hidden'), (DATA_AXIS, MODEL_AXIS))
    w2_init = _partitioned(self.dense_init, self.logical, ('hidden', 'embed'), (MODEL_AXIS, None))
    w2 = self.param('W2', w2_init, (self.depth, x.shape[-1]))
    z = _constrain(jnp.dot(y, w2), self.logical, ('batch', 'embed'), (DATA_AXIS, None))
    return z, None


class MLP(nn.Module):
  """Flattened pixels -> depth, `num_layers` DotReluDot blocks of width `depth`, -> `num_classes`.

  The input projection and the head are small and stay replicated; the blocks
  hold most of the weights and are split over 'model'. With `use_scan` the
  blocks are one `nn.scan` (one compiled layer, weights stacked on a leading
  'layer' axis that stays unsplit).
  """
  num_layers: int
  depth: int
  use_scan: bool = False
  logical: bool = False
  num_classes: int = 10

  def _dense(self, features: int, logical_names: Names, name: str) -> nn.Dense:
    return nn.Dense(
        features, name=name,
        kernel_init=_partitioned(nn.initializers.lecun_normal(), self.logical, logical_names, (None, None)),
        bias_init=_partitioned(nn.initializers.zeros_init(), self.logical, logical_names[1:], (None,)))

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    del train  # no dropout or batch statistics
    x = x.reshape((x.shape[0], -1))
    x = _constrain(x, self.logical, ('batch', 'pixels'), (DATA_AXIS, None))
    x = self._dense(self.depth, ('pixels', 'embed'), 'input')(x)
    if self.use_scan:
      blocks = nn.scan(DotReluDot, length=self.num_layers, variable_axes={'params': 0},
                       split_rngs={'params': True},
                       metadata_params={nn.PARTITION_NAME: 'layer' if self.logical else None})
      x, _ = blocks(self.depth, self.logical, name='blocks')(x)
    else:
      for i in range(self.num_layers):
        x, _ = DotReluDot(self.depth, self.logical, name=f'block_{i}')(x)
    return self._dense(self.num_classes, ('embed', 'classes'), 'head')(x)


class Plain(nn.Module):
  """Flattened inputs -> hidden ReLU layers of `widths` units -> `num_classes`: the built-in member for feature
  vectors (a table's rows), which the default config's CNN cannot take.

  No annotations: each member is one small model, whatever the backend; no
  batch statistics, and no dropout unless `dropout_rate` (method mc_dropout:
  after each hidden layer, in training), so a run on tabular data needs no
  other setting. With `rank1`, BatchEnsemble's layers (models/rank1.py).
  With `groups` (method packed), the hidden layers after the first are grouped. With `per_position` (a dense
  task), the inputs keep their positions, (N, *positions, features): the layers act on each position's features.
  `activation` and `bias_init` (zeros by default) are the hidden layers' nonlinearity and the plain layers' initial
  biases: Bayesian optimisation's surrogate draws its biases at random (ensemble/loops/bayesian_optimization.py).
  """
  num_classes: int = 10
  widths: Sequence[int] = (128, 128)
  rank1: bool = False
  dropout_rate: float = 0.0
  groups: int = 1
  per_position: bool = False
  activation: Callable[[jnp.ndarray], jnp.ndarray] = nn.relu
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    dense = rank1_layers.Dense if self.rank1 else functools.partial(nn.Dense, bias_init=self.bias_init)
    if not self.per_position:
      x = x.reshape((x.shape[0], -1))
    for i, width in enumerate(self.widths):
      layer = packed.Dense(width, self.groups) if i and self.groups > 1 else dense(width)
      x = nn.Dropout(self.dropout_rate, deterministic=not train)(self.activation(layer(x)))
    return dense(self.num_classes)(x)
