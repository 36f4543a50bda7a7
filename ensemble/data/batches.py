"""Batches of a split, as numpy indices on the host.

The data order depends only on the seed, the epoch and the member, never on the
backend or the device count, so member i sees the same batches however the
ensemble is placed. Nothing here looks at the images' dtype or shape.
"""

import math
from typing import Iterator

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


def epoch_order(num_examples: int, seed: int, epoch: int, member: int | None = None) -> np.ndarray:
  """A permutation that is a function of (seed, epoch[, member]) alone."""
  entropy = [seed, epoch] if member is None else [seed, epoch, member]
  return np.random.default_rng(entropy).permutation(num_examples)


def bootstrap(num_examples: int, seed: int, member: int) -> np.ndarray:
  """Member `member`'s bootstrap resample for bagging: `num_examples` indices drawn with replacement.

  Drawn once for the run from (seed, member) alone, so it does not depend on the
  ensemble size, the backend or the devices; about 63% of the examples appear in it.
  """
  return np.random.default_rng([seed, member, 0xB007]).integers(0, num_examples, num_examples)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  return num_examples // batch_size


def train_batch_indices(num_examples: int, batch_size: int, seed: int, epoch: int,
                        ensemble_size: int, member_data: str) -> np.ndarray:
  """Example indices of one epoch, (steps, batch) when members share batches, else (steps, K, batch).

  'shuffled': each member its own order of the split; 'bootstrap': its own
  order of its bootstrap resample (`bootstrap`). The last partial batch is
  dropped, so every step has the same shape (one compilation).
  """
  steps = steps_per_epoch(num_examples, batch_size)
  if member_data == 'shared':
    return epoch_order(num_examples, seed, epoch)[:steps * batch_size].reshape(steps, batch_size)

  def member_order(member):
    permutation = epoch_order(num_examples, seed, epoch, member)
    return bootstrap(num_examples, seed, member)[permutation] if member_data == 'bootstrap' else permutation
  orders = np.stack([member_order(member)[:steps * batch_size] for member in range(ensemble_size)])
  return orders.reshape(ensemble_size, steps, batch_size).transpose(1, 0, 2)


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
