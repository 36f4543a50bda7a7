"""A member whose training loss or parameters stop being finite ends the run: nothing of that epoch may be kept,
and the one line that says so names the step and the settings to lower.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ensemble import distributed
from ensemble.defaults import Recipe
from ensemble.errors import UsageError


class Diverged(UsageError):
  """A member's loss or parameters stopped being finite in `epoch`: nothing of that epoch may be kept."""

  def __init__(self, message: str, epoch: int):
    super().__init__(message)
    self.epoch = epoch


@functools.partial(jax.jit, static_argnums=1)
def _finite_rows(x: jax.Array, ensemble_size: int) -> jax.Array:
  """(K,) whether each member's slice of a leaf is finite: a program per leaf's shape, which the leaves of other
  recipes' states share (one program for a whole state would be compiled again for every state's structure)."""
  return jnp.isfinite(x).reshape(ensemble_size, -1).all(1)


def nonfinite_members(state: Any, ensemble_size: int) -> list[int]:
  """The members whose state holds a NaN or an infinity: such a state must never be kept.

  `state` is canonical, (K, ...) per leaf; a one-model state (the mesh backends, K = 1) has no member axis,
  which the reshape to (1, -1) covers alike.
  """
  leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
  finite = np.stack(distributed.to_numpy([_finite_rows(x, ensemble_size) for x in leaves]))
  return np.flatnonzero(~finite.all(0)).tolist()


def stop_if_diverged(losses: np.ndarray, config: Recipe, epoch: int, step: int):
  """Ends the run once a member's training loss is NaN or infinite: its state must not be kept.

  `losses` is (K, S): the S steps that ended at `step`, as every process sees them.
  """
  finite = np.isfinite(losses.reshape(config.ensemble_size, -1))
  if finite.all():
    return
  first = step - finite.shape[1] + 1 + int(np.argmin(finite.all(0)))
  members = np.flatnonzero(~finite.all(1)).tolist()
  diverged(config, epoch, first, f'members {members} have a non-finite training loss')


def diverged(config: Recipe, epoch: int, step: int, what: str):
  raise Diverged(f'training diverged in epoch {epoch} at step {step}: {what}; lower --config.learning_rate '
                 f'(now {config.learning_rate}) or --config.momentum (now {config.momentum})', epoch)
