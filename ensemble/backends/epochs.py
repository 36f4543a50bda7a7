"""A whole in-memory fit as one program: every epoch's order drawn inside it, every step of the padded set's
scanned and those past the set's own skipped, the divergence check on its outputs. What a loop of fits (Bayesian
optimisation, active learning on features) runs, one dispatch and one host sync a fit; the jit and pmap backends
build theirs from `train_epochs_function` (ensemble/backends/jit.py, pmap.py).
"""

import functools
from typing import Any

import jax
import numpy as np

from ensemble.data import batches


def train_epochs_function(many, member_data: str, num_epochs: int, steps: int, batch_size: int, bootstrap: bool):
  """`num_epochs` epochs of the members a device holds in one program, each epoch's order drawn inside it
  (`data.epoch_indices`): a whole in-memory fit as one dispatch and one host sync.

  `many` is `train_functions`' second; the result takes (state, images, labels,
  member ids (the device's members' indices among all), seed, first epoch,
  number of examples) and gives (state, metrics (M, num_epochs, steps) per
  name, whether each member's state is finite (M,)): the divergence check
  rides on the dispatch's own outputs. `bootstrap` draws from each member's
  resample (bagging): the programs' key leaves the method out, so the run says.
  `steps` is the most an epoch of the padded set can take (its rows // batch_size): an epoch trains the first
  number of examples // batch_size of them and skips the rest (a `lax.cond` outside the members' map, so nothing
  runs; their metrics are zeros), so that fits on sets that differ by a few rows (a loop's) share one program.
  """
  def run(state, images, labels, member_ids, seed, first_epoch, num_examples):
    members = None if member_data == 'shared' else member_ids
    draw = functools.partial(batches.epoch_indices, rows=images.shape[0], steps=steps, batch_size=batch_size,
                             bootstrap=bootstrap)
    trained = num_examples // batch_size
    one_step = lambda state, batch: many(state, images, labels, batch[None] if members is None else batch[:, None])

    def epoch(state, number):
      indices = draw(seed, number, num_examples, members)
      by_step = indices if members is None else jax.numpy.moveaxis(indices, 1, 0)  # (steps, ...)
      skipped = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype),
                             jax.eval_shape(one_step, state, by_step[0])[1])

      def step(state, numbered):
        i, batch = numbered
        return jax.lax.cond(i < trained, one_step, lambda state, _: (state, skipped), state, batch)
      state, metrics = jax.lax.scan(step, state, (jax.numpy.arange(steps), by_step))  # (steps, M, 1) per name
      return state, jax.tree.map(lambda x: jax.numpy.moveaxis(x[..., 0], 0, 1), metrics)
    state, metrics = jax.lax.scan(epoch, state, first_epoch + jax.numpy.arange(num_epochs))
    return state, jax.tree.map(lambda x: jax.numpy.moveaxis(x, 0, 1), metrics), finite_members(state, len(member_ids))
  return run


class EpochPrograms:
  """A backend's whole-fit programs (`train_epochs_function`), one per (epochs, most steps an epoch of the padded
  set takes, batch size, bootstrap): `build(*that)` makes one, the backend's jit or pmap of it. `member_ids` are the
  members' indices laid out as the backend lays out members, placed once."""

  def __init__(self, build, member_ids: jax.Array):
    self._build, self._member_ids, self._programs = build, member_ids, {}

  def __call__(self, state, dataset, seed: int, first_epoch: int, num_epochs: int, num_examples: int,
               steps_per_epoch: int, batch_size: int, bootstrap: bool):
    """(state, metrics (M, num_epochs, steps) per name, finite (M,)): the steps past `steps_per_epoch` skipped."""
    del steps_per_epoch  # num_examples // batch_size, which the program computes
    shape = (num_epochs, batches.bucket_rows(num_examples) // batch_size, batch_size, bootstrap)
    if shape not in self._programs:
      self._programs[shape] = self._build(*shape)
    return self._programs[shape](state, *dataset, self._member_ids, np.uint32(seed), np.int32(first_epoch),
                                 np.int32(num_examples))


def finite_members(state: Any, size: int) -> jax.Array:
  """(size,) whether each of a device's members' state is finite, in the backends' layout (a shared leaf's one
  copy counts for all)."""
  flags = [jax.numpy.broadcast_to(jax.numpy.isfinite(x).reshape(x.shape[0], -1).all(1), (size,))
           for x in jax.tree.leaves(state) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]
  return jax.numpy.stack(flags).all(0)
