"""Splits read by index as training asks for them, never whole: data larger than host memory, streamed with grain.

A `Records` split holds no examples. It looks like the in-memory `Split` to
whatever only asks its shape (`split['image'].shape`, `len(split['label'])`),
and `take(rows)` reads those rows from its source: a folder of ArrayRecord
files (`array_record.FolderSource`), a tfds dataset prepared as
ArrayRecord (`tfds.data_source`), or any random-access source given to
`ensemble.fit` (a `grain.MapDataset`, a list of pairs). `batches` reads each
step's rows in grain's threads, a few steps ahead of the devices.

The order of the examples stays the loop's own (`batches.train_batch_indices`,
a function of the seed, the epoch and the member): a streamed run trains the
same members as an in-memory one, bagging is the same index sampling, and a
resumed run starts at the same batch of its epoch. Each process reads only its
own rows of every batch (`distributed.process_block`), so across hosts each
reads its share of the set and no host holds all of it.
"""

import dataclasses
import math
import os
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ensemble import tasks
from ensemble.data import base

# grain threads that read batches, and how many batches they may read ahead of the devices.
THREADS = 4
PREFETCH_STEPS = 8
# A streamed split's statistics come from this many of its rows (`sample`): reading all would be a pass over the set.
SAMPLE_ROWS = 1 << 14
# What is read into memory (`in_memory`: the sample, a test split) is read this many rows at a time into arrays
# allocated once: a source's read holds a few copies of what it reads (the records, their bytes joined, the
# decoded arrays), and the programs keep their peak heap (ensemble/host_memory.py).
READ_ROWS = 1024
# config.streaming: 'auto' streams a source that can be streamed once its training split would take more than
# AUTO_FRACTION of the host's memory (in memory is faster where it fits); 'always' streams it, and refuses a source
# that cannot be streamed; 'never' reads every source whole.
MODES = ('auto', 'always', 'never')
AUTO_FRACTION = 0.25
_SOURCES = 'a folder of ArrayRecord files (python -m ensemble.data.convert) or a tfds dataset prepared as ArrayRecord'


def check_mode(streaming: str):
  if streaming not in MODES:
    raise base.DataError(f'streaming={streaming!r}: set --config.streaming to one of {list(MODES)}')


def wanted(streaming: str, train_bytes: int) -> bool:
  """Whether a source that can be streamed is, under config.streaming, for a training split of `train_bytes`."""
  check_mode(streaming)
  if streaming != 'auto':
    return streaming == 'always'
  return train_bytes > AUTO_FRACTION * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def cannot_stream(what: str) -> base.DataError:
  return base.DataError(f'streaming=always: {what} is read whole; streaming reads {_SOURCES}. Convert it with '
                        'python -m ensemble.data.convert and train on the folder, or set --config.streaming=auto')


@dataclasses.dataclass(frozen=True)
class Spec:
  """One example's part ('image' or 'label'): its shape and dtype."""
  shape: tuple[int, ...]
  dtype: np.dtype


class Source:
  """Where a streamed split's rows come from: `read(rows)` returns (inputs, labels) of those rows, in order, and
  counts them in `rows_read` (`_count`: grain's threads read at once)."""
  name: str
  image: Spec
  label: Spec
  inputs: str = 'images'  # what the inputs are: steps.INPUTS
  rows_read: int = 0
  _counting = threading.Lock()

  def _count(self, rows: int):
    with self._counting:
      self.rows_read += rows

  def __len__(self) -> int:
    raise NotImplementedError

  def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError


class Column:
  """One part of a `Records` split, as the in-memory split's array would answer for its shape and dtype, without
  reading; its rows are read with the other part's (`take`), never alone."""

  def __init__(self, records: 'Records', part: str):
    spec = getattr(records.source, part)
    self.shape, self.dtype = (len(records), *spec.shape), spec.dtype
    self.ndim = len(self.shape)

  def __len__(self) -> int:
    return self.shape[0]


class Records:
  """Rows `start` to `stop` of `source`, with the loop's standardisation applied as they are read."""

  def __init__(self, source: Source, start: int = 0, stop: int | None = None,
               transforms: tuple[Callable | None, Callable | None] = (None, None)):
    self.source, self._start = source, start
    self._stop = len(source) if stop is None else stop
    self._transforms = transforms

  def __len__(self) -> int:
    return self._stop - self._start

  def __getitem__(self, part: str) -> Column:
    if part not in ('image', 'label'):
      raise KeyError(part)
    return Column(self, part)

  def keys(self):
    return ('image', 'label')

  def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of `rows` (any shape of indices into this split), read and transformed."""
    rows = np.asarray(rows)
    images, labels = self.source.read(rows.ravel() + self._start)
    image_fn, label_fn = self._transforms
    images, labels = (image_fn(images) if image_fn else images), (label_fn(labels) if label_fn else labels)
    return images.reshape(rows.shape + images.shape[1:]), labels.reshape(rows.shape + labels.shape[1:])

  def view(self, start: int, stop: int) -> 'Records':
    """Rows `start` to `stop` of this split: the held-out slice and the rest (`batches.hold_out`)."""
    return Records(self.source, self._start + start, self._start + stop, self._transforms)

  def transformed(self, image: Callable | None = None, label: Callable | None = None) -> 'Records':
    """The same rows, with `image` and `label` applied to what is read (after this split's own)."""
    compose = lambda first, then: then if first is None else first if then is None else lambda x: then(first(x))
    transforms = (compose(self._transforms[0], image), compose(self._transforms[1], label))
    return Records(self.source, self._start, self._stop, transforms)


def is_streamed(split: Any) -> bool:
  return isinstance(split, Records)


def transformed(split: Any, image: Callable | None = None, label: Callable | None = None) -> Any:
  """`split` with `image` and `label` applied to its parts: now for a split in memory, as rows are read for a
  streamed one."""
  if is_streamed(split):
    return split.transformed(image, label)
  return {'image': image(split['image']) if image else split['image'],
          'label': label(split['label']) if label else split['label']}


def with_classes_checked(split: Any, num_classes: int) -> Any:
  """A streamed split whose every batch of class labels is checked to lie in 0..num_classes-1 as it is read (a
  split in memory was checked whole as it was loaded): a label the model has no output for is one line, not a
  silent zero one-hot."""
  if not is_streamed(split):
    return split

  def check(labels):
    labelled = labels[labels != base.IGNORED] if labels.ndim > 1 else labels  # a dense task's labelled positions
    if labelled.size and not 0 <= labelled.min() <= labelled.max() < num_classes:
      wrong = labelled.max() if labelled.max() >= num_classes else labelled.min()
      raise base.DataError(f'{split.source.name}: a label of {wrong} but the model has {num_classes} class outputs; '
                           f'give labels 0..{num_classes - 1}, or a model with more outputs')
    return labels
  return split.transformed(label=check)


def sample(split: Any) -> Any:
  """What a split's statistics (per-channel or per-feature mean and std, the targets') are computed on: a split in
  memory itself; of a streamed one, `SAMPLE_ROWS` rows evenly spaced over it (all of a smaller one), read once. Every
  process reads the same sample, so all standardise alike."""
  if not is_streamed(split):
    return split
  return in_memory(split, np.unique(np.linspace(0, len(split) - 1, min(len(split), SAMPLE_ROWS)).astype(np.int64)))


def in_memory(split: Any, rows: np.ndarray | None = None) -> Any:
  """A streamed split read into memory, whole (for what is read whole anyway: a test split that is rotated and
  noised to score) or its `rows`; a split in memory as it is, or its `rows`. A slice that is only predicted is read
  in `chunks`."""
  if not is_streamed(split):
    return split if rows is None else {key: value[rows] for key, value in split.items()}
  rows = np.arange(len(split)) if rows is None else np.asarray(rows)
  parts = None
  for start in range(0, len(rows), READ_ROWS):
    read = split.take(rows[start:start + READ_ROWS])
    if parts is None:
      parts = [np.empty((len(rows), *part.shape[1:]), part.dtype) for part in read]
    for whole, part in zip(parts, read):
      whole[start:start + len(part)] = part
  images, labels = parts or split.take(rows)
  return {'image': images, 'label': labels}


def take(split: Any, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, labels) of `rows`, from a split in memory or streamed."""
  if is_streamed(split):
    return split.take(rows)
  return split['image'][rows], split['label'][rows]


def chunks(split: Any, rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """(inputs, labels) of the split's examples in order, `rows` at a time (the last chunk shorter): how a slice that
  is scored rather than trained on (held out, validation, test) is read, so that a streamed one is never read whole
  and memory stays flat in the data's size."""
  count = len(split['label'])
  for start in range(0, count, rows):
    yield take(split, np.arange(start, min(start + rows, count)))


def labels(split: Any, rows: int) -> np.ndarray:
  """The split's labels: of a split in memory, its array; of a streamed one, read `rows` examples at a time (a
  source reads an example's input with its label) and only the labels kept."""
  if not is_streamed(split):
    return split['label']
  read = [batch for _, batch in chunks(split, rows)]
  return np.concatenate(read) if read else np.empty((0, *split.source.label.shape), split.source.label.dtype)


class _Steps:
  """A sequence of one epoch's steps, each read when grain asks: this process's rows of the step's batch."""

  def __init__(self, split: Records, blocks: Sequence[np.ndarray]):
    self._split, self._blocks = split, blocks

  def __len__(self) -> int:
    return len(self._blocks)

  def __getitem__(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    try:
      return self._split.take(self._blocks[step])
    except base.DataError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # a source's own failure, in a worker thread: one line
      raise base.DataError(f'{self._split.source.name}: reading the rows of step {step} of the epoch failed '
                           f'({base.first_line(e)}); check the source') from None


def batches(split: Any, blocks: Sequence[np.ndarray], state: dict[str, Any] | None = None) -> Iterator:
  """The (inputs, labels) of each of an epoch's `blocks` of row indices, in order.

  A streamed split is read by grain's threads, `PREFETCH_STEPS` steps ahead;
  the iterator's `get_state()` is where it stands, and `state` (one it
  returned) starts a new one there: a checkpoint records it, and the resumed
  run reads on from the same batch. In memory, the rows are gathered as asked.
  """
  if not is_streamed(split):
    start = state['next_index'] if state else 0
    return (take(split, block) for block in blocks[start:])
  import grain  # pylint: disable=g-import-not-at-top  # only where data is streamed

  options = grain.ReadOptions(num_threads=THREADS, prefetch_buffer_size=PREFETCH_STEPS)
  iterator = iter(grain.MapDataset.source(_Steps(split, blocks)).to_iter_dataset(options))
  if state:
    iterator.set_state(state)
  return iterator


def stream_position(iterator: Iterator, steps_done: int) -> dict[str, Any]:
  """Where an epoch's batches stand after `steps_done` of them: grain's own state for a streamed split's iterator,
  the same form for one in memory."""
  get_state = getattr(iterator, 'get_state', None)
  return dict(get_state()) if get_state else {'next_index': steps_done}


class RandomAccessSource(Source):
  """Any object with `len()` and indexing whose examples are (input, label) pairs or {'image', 'label'} dicts:
  a `grain.MapDataset`, a `tfds.data_source`, a list. `__getitems__`, where it has one, reads a batch at once.

  Every batch read is what `fit`'s arrays of the same examples become (`arrays.from_arrays`), checked alike:
  images as uint8 (N, H, W, C) (greyscale (H, W) examples gain their channel, floats in [0, 1] are rounded to
  pixels), token ids as int32, features and targets as host floats; so a source trains the members its arrays
  train. `inputs` is what the examples are ('auto': told from the first, as for arrays).
  """

  def __init__(self, source: Any, name: str, task: str = tasks.DEFAULT, inputs: str = 'auto',
               ignore: int = base.IGNORED):
    from ensemble.data import arrays  # pylint: disable=g-import-not-at-top  # arrays imports what imports this
    self._source, self.name, self._task, self._ignore = source, name, tasks.named(task), ignore
    if not len(source):
      raise base.DataError(f'{name}: no examples; give a source that holds some')
    image, label = self._pair(source[0])
    self._example_shape = image.shape
    self.inputs = arrays.kind_of(np.empty((1, *image.shape), image.dtype)) if inputs == 'auto' else inputs
    if self.inputs == 'images':
      shape = (*image.shape, 1) if image.ndim == 2 else image.shape
      if len(shape) != 3:
        raise base.DataError(f'{name}: example 0 is an image of shape {image.shape}; give (H, W) or (H, W, C) images')
      self.image = Spec(shape, base.as_images(image[None], name).dtype)
    else:
      dtype = np.int32 if self.inputs == 'tokens' else base.host_float(np.empty(0, image.dtype)).dtype
      self.image = Spec(image.shape, np.dtype(dtype))
    # What every other source gives, as the task reads it: int32 classes (a dense task's per position), float
    # targets (D,) per example, int32 0/1 labels (L,).
    if self._task.has_classes and not self._task.per_position and (
        not np.issubdtype(label.dtype, np.integer) or label.shape):
      raise base.DataError(f'{name}: example 0 has a label of dtype {label.dtype} and shape {label.shape}; give '
                           'one integer class per example')
    first = self._task.read_labels(label[None], f'{name}: example 0', ignore)
    self.label = Spec(first.shape[1:], first.dtype)

  def __len__(self) -> int:
    return len(self._source)

  def _pair(self, example: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(example, dict) and {'image', 'label'} <= set(example):
      example = example['image'], example['label']
    if not isinstance(example, (tuple, list)) or len(example) != 2:
      raise base.DataError(f'{self.name}: an example is a {type(example).__name__}; give (input, label) pairs or '
                           "{'image': ..., 'label': ...} dicts")
    return np.asarray(example[0]), np.asarray(example[1])

  def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from ensemble.data import arrays  # pylint: disable=g-import-not-at-top
    indices = rows.tolist()
    getitems = getattr(self._source, '__getitems__', None)
    examples = getitems(indices) if getitems else [self._source[i] for i in indices]
    pairs = [self._pair(example) for example in examples]
    for i, (image, label) in zip(indices, pairs):
      if image.shape != self._example_shape or label.size != math.prod(self.label.shape):
        raise base.DataError(f'{self.name}: example {i} is {image.shape} with label {label.shape}, but example 0 '
                             f'is {self._example_shape} with {self.label.shape}; give examples of one shape')
    self._count(len(rows))
    if not pairs:
      return (np.empty((0, *self.image.shape), self.image.dtype), np.empty((0, *self.label.shape), self.label.dtype))
    images, labels = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
    labels = labels.reshape(len(labels), *self.label.shape)
    if self.inputs == 'images':
      images = base.as_images(images, self.name)
    else:
      images = arrays.as_inputs(images, self.inputs, self.name)
    return images, self._task.read_labels(labels, self.name, self._ignore).astype(self.label.dtype, copy=False)
