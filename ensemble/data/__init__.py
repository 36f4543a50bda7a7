"""Data as numpy arrays on the host: the bundled MNIST, tensorflow-datasets, a folder of ArrayRecord files
(`python -m ensemble.data.convert`), IDX, .npz, or a .csv for regression.

`load` picks the source from the dataset name and `data_dir`; `batches` turns a
split into the batches every backend reads.
"""

import dataclasses
import os
from typing import Callable

import numpy as np

from ensemble import tasks
from ensemble.data import array_record, arrays, bundled, csv, idx, npz, stream, tfds
from ensemble.data.base import IGNORED, DataError, Dataset, Split
from ensemble.data.batches import (bucket_rows, epoch_indices, eval_batches, heldout_count, hold_out, steps_per_epoch,
                                   train_batch_indices, train_batches)

__all__ = ['DataError', 'Dataset', 'Split', 'SOURCES', 'arrays', 'stream', 'bucket_rows', 'channel_stats', 'load',
           'epoch_indices', 'eval_batches', 'heldout_count', 'hold_out', 'steps_per_epoch', 'train_batch_indices',
           'train_batches']

_STATS_CHUNK_BYTES = 1 << 24
# The dataset name a run records when `ensemble.fit` was given arrays: no source can load it again by name.
ARRAYS = 'arrays'

@dataclasses.dataclass(frozen=True)
class Source:
  # Both are given (dataset, data_dir, train_split, test_split); `load` also config.streaming (`stream.wanted`),
  # which only the sources that `streams` look at.
  accepts: Callable[[str, str, str, str], bool]
  load: Callable[[str, str, str, str, str], Dataset]
  streams: bool = False


# Tried in order: the first whose `accepts` holds loads the data. The bundled copy comes before tfds, so that
# the default dataset needs neither a network nor TensorFlow; a converted folder (it holds dataset.json) before
# the IDX reader, which takes any folder.
SOURCES = {
    'bundled': Source(bundled.accepts, lambda dataset, *_: bundled.load(dataset)),
    'tfds': Source(lambda _, data_dir, *__: not data_dir,
                   lambda dataset, _, train, test, streaming: tfds.load(dataset, train, test, streaming), streams=True),
    'array_record': Source(lambda _, data_dir, *__: array_record.is_folder(data_dir),
                           lambda _, data_dir, _train, _test, streaming: array_record.load(data_dir,
                                                                                          streaming=streaming),
                           streams=True),
    'idx': Source(lambda _, data_dir, *__: os.path.isdir(data_dir), lambda _, data_dir, *__: idx.load(data_dir)),
    'npz': Source(lambda _, data_dir, *__: data_dir.endswith('.npz'), lambda _, data_dir, *__: npz.load(data_dir)),
}


def load(dataset: str = 'mnist', data_dir: str = '', train_split: str = 'train',
         test_split: str = 'test', *, task: str = tasks.DEFAULT, target: str = '',
         streaming: str = 'never', ignore: int = IGNORED) -> Dataset:
  """Loads a dataset: the bundled or tensorflow-datasets' `dataset` when `data_dir` is empty, else what it names.

  A task whose labels image datasets do not hold (ensemble/tasks/: regression, multi-label, dense, quantile)
  reads an .npz file of its labels, a converted folder of them, or (a task that reads tables) a .csv file whose
  `target` columns are its targets (labels); a dense task's `ignore` marks a position without a label.
  `streaming` (config.streaming, `stream.wanted`) leaves a converted folder or a tfds dataset prepared as
  ArrayRecord on disk, its splits read as training asks.
  """
  data_dir = os.path.expanduser(data_dir or '')
  stream.check_mode(streaming)
  if not tasks.named(task).image_datasets:
    return _load_rows(task, dataset, data_dir, target, streaming, ignore)
  if dataset == ARRAYS and not data_dir:
    raise DataError('the run was trained on arrays in memory (ensemble.fit), which no file holds: give --data_dir '
                    'a folder of IDX files or an .npz file of the same data, or score it from Python with '
                    'ensemble.load(workdir).evaluate(x, y)')
  if data_dir and (train_split, test_split) != ('train', 'test'):
    # A folder or file has one fixed train and test part; ignoring the split names would train on the wrong data.
    raise DataError(f'--config.train_split={train_split} / --config.test_split={test_split}: split names apply to '
                    f'tensorflow-datasets only, {data_dir} has fixed train and test parts; leave them at train, test')
  for name, source in SOURCES.items():
    if source.accepts(dataset, data_dir, train_split, test_split):
      if streaming == 'always' and not source.streams:
        raise stream.cannot_stream(f'{data_dir or dataset} ({name})')
      return source.load(dataset, data_dir, train_split, test_split, streaming)
  problem = 'neither a folder nor a .npz file' if os.path.exists(data_dir) else 'no such folder or .npz file'
  raise DataError(f'{data_dir}: {problem}; data_dir must name a folder of IDX files or a .npz file '
                  '(x_train, y_train, x_test, y_test), or be empty for tensorflow-datasets')


def _load_rows(task: str, dataset: str, data_dir: str, target: str, streaming: str,
               ignore: int = IGNORED) -> Dataset:
  """The data of a task that image datasets do not hold: its labels per example, from a file."""
  if dataset == ARRAYS and not data_dir:
    raise DataError('the run was trained on arrays in memory (ensemble.fit), which no file holds: give --data_dir '
                    'an .npz or .csv file of the same data, or score it from Python with '
                    'ensemble.load(workdir).evaluate(x, y)')
  if array_record.is_folder(data_dir):
    return array_record.load(data_dir, task, streaming)
  if streaming == 'always':
    raise stream.cannot_stream(data_dir or 'an empty data_dir')
  if data_dir.endswith('.npz'):
    return npz.load(data_dir, task, ignore)
  reads_tables = tasks.named(task).tables
  if data_dir.endswith('.csv') and reads_tables:
    return csv.load(data_dir, target, task)
  raise DataError(f'{data_dir or "an empty data_dir"}: task={task} reads an .npz file (x_train, y_train of its '
                  'labels, x_test, y_test)' + (', a .csv file with --config.target' if reads_tables else '') +
                  ' or a folder from ensemble.data.convert; set --config.data_dir to one')


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-channel mean and standard deviation of uint8 images in [0, 1] units (x / 255), or of float32 images in
  [0, 1] as they are.

  The device normalises every batch with them. Counting each channel's 256
  values chunk by chunk makes both exact for uint8 (float64 on 256 counts only) and
  never copies a whole split to float: CIFAR-10's training split would be
  1.2 GB as float64. Float images are summed chunk by chunk in float64.
  """
  if images.dtype not in (np.uint8, np.float32) or images.ndim != 4 or not len(images):
    raise ValueError(f'channel_stats needs uint8 or float32 images (N, H, W, C) with N > 0, got {images.dtype} '
                     f'{images.shape}')
  channels = images.shape[-1]
  rows = max(1, _STATS_CHUNK_BYTES // images[:1].nbytes)
  if images.dtype == np.uint8:
    counts = np.zeros((channels, 256), np.int64)
    for start in range(0, len(images), rows):
      chunk = images[start:start + rows]
      for c in range(channels):
        counts[c] += np.bincount(chunk[..., c].ravel(), minlength=256)
    values = np.arange(256, dtype=np.float64) / 255.0
    total = counts.sum(axis=1)
    mean = counts @ values / total
    var = (counts * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / total
  else:
    sums, squares = np.zeros(channels), np.zeros(channels)
    for start in range(0, len(images), rows):
      chunk = images[start:start + rows].reshape(-1, channels).astype(np.float64)
      sums, squares = sums + chunk.sum(0), squares + (chunk ** 2).sum(0)
    count = images.size // channels
    mean = sums / count
    var = np.maximum(squares / count - mean ** 2, 0.0)
  # A channel with one value throughout (blank images, a constant border channel) has nothing to scale: 1, as a
  # constant feature's or target's, where 0 made every prediction NaN and the run "diverge".
  return tuple(float(m) for m in mean), tuple(float(s) if s > 0 else 1.0 for s in np.sqrt(var))
