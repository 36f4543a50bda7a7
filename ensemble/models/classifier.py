"""The data-parallel classifier that `dp` and `fsdp` train (backends/sharded.py)."""

import flax.linen as nn
import jax.numpy as jnp

from ensemble.parallel import fsdp


class Classifier(nn.Module):
  """Flattened pixels -> `num_layers` x (Dense, SiLU, dropout) -> `num_classes`.

  With `fsdp_axis` set, every Dense layer stores its weights sharded over
  that axis; the parameter tree (names, shapes, initial values) is the same
  either way, so DP and FSDP checkpoints are interchangeable.
  """
  num_layers: int = 1
  depth: int = 512
  dropout_rate: float = 0.0
  num_classes: int = 10
  fsdp_axis: str | None = None
  min_weight_size: int = 2**18

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    dense = nn.Dense
    if self.fsdp_axis is not None:
      dense = fsdp.shard_module_params(nn.Dense, self.fsdp_axis, self.min_weight_size)
    x = x.reshape((x.shape[0], -1))
    for i in range(self.num_layers):
      x = nn.silu(dense(self.depth, name=f'hidden_{i}')(x))
      x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    return dense(self.num_classes, name='head')(x)
