"""Batches of a split: the training order (drawn with jax.random, on the devices or for the host) and the
evaluation's batches in order.

The data order depends only on the seed, the epoch and the member, never on the
backend or the device count, so member i sees the same batches however the
ensemble is placed. Nothing here looks at the images' dtype or shape.
"""

import functools
import math
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ensemble.data import stream
from ensemble.data.base import DataError, Split


def heldout_count(num_examples: int, fraction: float) -> int:
  """How many of `num_examples` the held-out slice of `fraction` holds (`hold_out`)."""
  return int(round(fraction * num_examples))


def hold_out(split: Split, fraction: float) -> tuple[Split, Split]:
  """(the rest, the last `fraction` of the examples): a fixed slice, the same for training and evaluation.

  A `heldout_fraction` that rounds to no rows, or to all of them, is refused
  here, where every caller slices: an empty slice would otherwise fail far
  away (numpy's reductions over no rows, NaN scores) or train on nothing.
  """
  num_examples = len(split['label'])
  count = heldout_count(num_examples, fraction)
  if fraction and num_examples and not count:
    raise DataError(f'heldout_fraction={fraction} of the {num_examples} training examples holds out none; set '
                    f'--config.heldout_fraction to at least {1 / num_examples:.2g}, or to 0 to hold out nothing')
  if num_examples and count == num_examples:
    most = math.floor(100 * (num_examples - 1) / num_examples) / 100  # holds out at most all but one
    raise DataError(f'heldout_fraction={fraction} of the {num_examples} training examples holds out all of them, '
                    'leaving none to train on; lower it: --config.heldout_fraction='
                    + (f'{most:g} or less, or 0 to hold out nothing' if most else '0, to hold out nothing'))
  start = num_examples - count
  if stream.is_streamed(split):
    return split.view(0, start), split.view(start, num_examples)
  return {k: v[:start] for k, v in split.items()}, {k: v[start:] for k, v in split.items()}


# fold_in tag of a member's bootstrap resample (drawn once for the run), apart from its epochs' orders.
_BOOTSTRAP = 0xB007


def bucket_rows(n: int) -> int:
  """The next power of two: the rows a resident training set is padded to (`padded_rows`), so that a set that
  grows by a few rows keeps its programs; it changes bucket once per doubling, at most twice its memory."""
  return 1 << max(n - 1, 0).bit_length()


def padded_rows(split: Split) -> Split:
  """`split` with zero rows appended up to its size bucket (`bucket_rows`): the programs that take it stay the
  same while a training set grows by a few rows. The padded rows are never drawn into a batch."""
  n = len(split['label'])
  pad = bucket_rows(n) - n
  if not pad:
    return split
  return {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) for k, v in split.items()}


def _order(key: jax.Array, num_examples: jax.Array, rows: int) -> jax.Array:
  """A uniformly random order of positions 0..num_examples-1, followed by the rest of `rows` (padding): random bits
  per position, the padding's the largest, sorted stably."""
  bits = jax.random.bits(key, (rows,), jnp.uint32)
  bits = jnp.where(jnp.arange(rows) < num_examples, bits, jnp.uint32(jnp.iinfo(jnp.uint32).max))
  return jnp.argsort(bits, stable=True).astype(jnp.int32)


def epoch_indices(seed: jax.Array, epoch: jax.Array, num_examples: jax.Array, members: jax.Array | None, *,
                  rows: int, steps: int, batch_size: int, bootstrap: bool = False) -> jax.Array:
  """One epoch's example indices, traceable: (steps, batch) that all members share (`members` None), else
  (len(members), steps, batch), member i's own order (of its bootstrap resample, with `bootstrap`).

  A function of (seed, epoch, member) and the examples' count alone, never of the ensemble's size, the backend or
  the devices, so member i sees the same batches however it is placed; `rows` (at least `num_examples`, a static
  size) is the padded set's, which the draw never reaches into. Training on a resident set draws here, inside its
  program (no host work per epoch); other paths call `train_batch_indices`, the same draw on the host's behalf.
  The last partial batch is dropped, so every step has the same shape.
  """
  base = jax.random.key(seed)
  key = jax.random.fold_in(base, epoch)
  take = steps * batch_size
  if members is None:
    return _order(key, num_examples, rows)[:take].reshape(steps, batch_size)

  def member_order(member):
    order = _order(jax.random.fold_in(key, member), num_examples, rows)
    if bootstrap:
      resample = jax.random.randint(jax.random.fold_in(jax.random.fold_in(base, _BOOTSTRAP), member), (rows,), 0,
                                    num_examples, jnp.int32)
      order = resample[order]
    return order[:take].reshape(steps, batch_size)
  return jax.vmap(member_order)(members)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  return num_examples // batch_size


@functools.partial(jax.jit, static_argnames=('rows', 'ensemble_size', 'member_data'))
def _orders(seed, epoch, num_examples, *, rows, ensemble_size, member_data):
  """`epoch_indices`' whole orders, (rows,) or (K, 1, rows): one program per set size and ensemble size, whatever
  the batch (the host slices the batches off)."""
  members = None if member_data == 'shared' else jnp.arange(ensemble_size)
  return epoch_indices(seed, epoch, num_examples, members, rows=rows, steps=1, batch_size=rows,
                       bootstrap=member_data == 'bootstrap')


def train_batch_indices(num_examples: int, batch_size: int, seed: int, epoch: int,
                        ensemble_size: int, member_data: str) -> np.ndarray:
  """`epoch_indices` as numpy, (steps, batch) when members share batches, else (steps, K, batch): 'shuffled', each
  member its own order of the split; 'bootstrap', its own order of its bootstrap resample, `num_examples` indices
  drawn with replacement once for the run from (seed, member) alone (about 63% of the examples appear in it)."""
  orders = np.asarray(_orders(np.uint32(seed), np.int32(epoch), np.int32(num_examples),
                              rows=bucket_rows(num_examples), ensemble_size=ensemble_size, member_data=member_data))
  steps = steps_per_epoch(num_examples, batch_size)
  orders = orders.reshape(-1, orders.shape[-1])[:, :steps * batch_size].reshape(-1, steps, batch_size)
  return orders[0] if member_data == 'shared' else orders.transpose(1, 0, 2)


def train_batches(split: Split, batch_size: int, seed: int, epoch: int, ensemble_size: int,
                  member_data: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  indices = train_batch_indices(len(split['label']), batch_size, seed, epoch, ensemble_size, member_data)
  for idx in indices:
    yield stream.take(split, idx)


def eval_batches(split: Split, batch_size: int,
                 rows: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """The whole split once, in order; the last batch is padded and `mask` marks real examples.

  With `rows`, the images and labels are only those rows of each batch (a
  process's share), while `mask` still covers the whole batch: every member
  predicts every example.
  """
  n = len(split['label'])
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size)
    mask = idx < n
    idx = np.where(mask, idx, 0)
    idx = idx if rows is None else idx[rows]
    yield *stream.take(split, idx), mask
