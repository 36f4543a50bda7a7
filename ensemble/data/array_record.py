"""Folders of ArrayRecord files, as `python -m ensemble.data.convert` writes them: one source for every kind of data.

A folder holds dataset.json, which says what the records are, and per split
SPLIT-00000-of-0000N.array_record files. A record is one example's fixed-size
bytes: its input (an image or a feature vector) then its label (an int32 class
or float targets), each C-ordered with the shape and dtype dataset.json gives.
Fixed sizes let a reader check every record, and read any example by its
index, without a schema library. A folder is read whole into a Dataset,
through the same checks as every other source, or streamed (`FolderSource`,
ensemble/data/stream.py) when it would not fit in memory.
"""

import json
import math
import os
import threading
from typing import Any

import numpy as np

from ensemble import tasks
from ensemble.data import arrays, base, stream

INFO = 'dataset.json'
FORMAT = 'ensemble.array_record'
VERSION = 1
SPLITS = ('train', 'test')
INPUTS = ('images', 'features')
# group_size:1 puts each record in its own chunk: a later streaming reader reads any one without its neighbours.
WRITER_OPTIONS = 'group_size:1'
FIX = 'convert the source again with python -m ensemble.data.convert'
# What a record's parts may hold: the dtypes the loaders give a Dataset (base.Dataset checks the rest).
_DTYPES = {'image': ('|u1', '<f4', '<f8'), 'label': ('<i4', '<f4', '<f8')}


def is_folder(path: str) -> bool:
  """Whether `path` is a converted folder: it holds dataset.json, which a folder of IDX files never does."""
  return bool(path) and os.path.isfile(os.path.join(path, INFO))


def file_name(split: str, index: int, count: int) -> str:
  return f'{split}-{index:05d}-of-{count:05d}.array_record'


def record_bytes(info: dict[str, Any], part: str) -> int:
  """The bytes one example's `part` ('image' or 'label') takes in a record."""
  return math.prod(info[part]['shape']) * np.dtype(info[part]['dtype']).itemsize


def describe(part: np.ndarray) -> dict[str, Any]:
  """One example's shape and dtype (explicitly little-endian, so a file reads the same on any machine)."""
  return {'shape': [int(d) for d in part.shape[1:]], 'dtype': part.dtype.newbyteorder('<').str}


def read_info(folder: str) -> dict[str, Any]:
  """dataset.json, checked enough that reading the records cannot go wrong on it: a damaged one is one line."""
  path = os.path.join(folder, INFO)
  try:
    with open(path, encoding='utf-8') as f:
      info = json.load(f)
    _check_info(info)
  except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise base.DataError(f'{path}: cannot be read ({base.first_line(e)}); {FIX}') from None
  return info


def _check_info(info: Any):
  """Raises ValueError (KeyError, TypeError) for what a reader cannot use."""
  if not isinstance(info, dict) or info.get('format') != FORMAT:
    raise ValueError(f'not an {FORMAT} description')
  if info['version'] != VERSION:
    raise ValueError(f'format version {info["version"]}, this package reads {VERSION} (upgrade it if newer)')
  if info['task'] not in tasks.NAMES or info['inputs'] not in INPUTS:
    raise ValueError(f'task {info["task"]!r} / inputs {info["inputs"]!r}, expected one of {tasks.NAMES} / {INPUTS}')
  for part, dtypes in _DTYPES.items():
    shape = info[part]['shape']
    if info[part]['dtype'] not in dtypes or not all(isinstance(d, int) and d > 0 for d in shape):
      raise ValueError(f'{part}: shape {shape} of dtype {info[part]["dtype"]!r}, expected positive sizes of one '
                       f'of {dtypes}')
  if tasks.named(info['task']).has_classes and not (isinstance(info['num_classes'], int) and info['num_classes'] > 0):
    raise ValueError(f'num_classes {info["num_classes"]!r}, expected a positive count')
  for split in SPLITS:
    files = info['splits'][split]['files']
    if not files or any(not isinstance(f['name'], str) or os.path.basename(f['name']) != f['name']
                        or not isinstance(f['examples'], int) or f['examples'] < 0 for f in files):
      raise ValueError(f'split {split}: expected a list of {{"name": file in the folder, "examples": count}}')
    if sum(f['examples'] for f in files) != info['splits'][split]['examples']:
      raise ValueError(f'split {split}: its files hold {sum(f["examples"] for f in files)} examples, not the '
                       f'{info["splits"][split]["examples"]} it lists')


def open_reader(path: str, expected: int):
  """An ArrayRecordReader of `path`, once the file is found to hold the `expected` records dataset.json lists."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  if not os.path.isfile(path):
    raise base.DataError(f'{path}: missing (dataset.json lists it); {FIX}')
  try:
    reader = array_record_module.ArrayRecordReader(path)
  except RuntimeError as e:  # Riegeli's report of a damaged or truncated file
    raise base.DataError(f'{path}: cut short or damaged ({base.first_line(e)}); {FIX}') from None
  # A file cut at a block boundary opens as "not ok" with no records, without an error: count them.
  found = reader.num_records() if reader.ok() else None
  if found != expected:
    try:
      reader.close()
    except RuntimeError:  # a reader that is not ok reports its damage again as it closes
      pass
    held = 'no readable index' if found is None else f'{found} records'
    raise base.DataError(f'{path}: cut short or damaged: dataset.json lists {expected} records but the file has '
                         f'{held}; {FIX}')
  return reader


def decode(records: list[bytes], info: dict[str, Any], name: str) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, labels) of `records`, each checked to be one example long (and a class label to be one of the
  classes): a record that disagrees is one line naming `name`, where it was read."""
  sizes = (record_bytes(info, 'image'), record_bytes(info, 'label'))
  size = sum(sizes)
  wrong = next((i for i, record in enumerate(records) if len(record) != size), None)
  if wrong is not None:
    raise base.DataError(f'{name}: record {wrong} holds {len(records[wrong])} bytes but dataset.json describes '
                         f'{size} ({sizes[0]} input + {sizes[1]} label); {FIX}')
  rows = np.frombuffer(b''.join(records), np.uint8).reshape(len(records), size)
  parts = []
  for part, (start, stop) in (('image', (0, sizes[0])), ('label', (sizes[0], size))):
    dtype, shape = np.dtype(info[part]['dtype']), info[part]['shape']
    parts.append(np.ascontiguousarray(rows[:, start:stop]).view(dtype).reshape(len(rows), *shape))
  labels = parts[1]
  kind = tasks.named(info['task'])
  labelled = kind.labelled(labels)  # a dense label's positions that carry one
  if kind.has_classes and len(labelled) and not 0 <= labelled.min() <= labelled.max() < info['num_classes']:
    labels = labelled
    raise base.DataError(f'{name}: labels reach [{labels.min()}, {labels.max()}] but dataset.json gives '
                         f'{info["num_classes"]} classes; {FIX}')
  return parts[0], labels


def _read_file(path: str, expected: int, info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
  reader = open_reader(path, expected)
  try:
    records = reader.read_all() if expected else []
  except RuntimeError as e:  # Riegeli's report of a damaged chunk
    raise base.DataError(f'{path}: cut short or damaged ({base.first_line(e)}); {FIX}') from None
  finally:
    reader.close()
  return decode(records, info, path)


def read_split(folder: str, info: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, labels) of `split`, its files in dataset.json's order and each file's records in order, each file
  decoded into arrays allocated once for the split: the split's bytes plus one file's at a time, not twice the
  split's (a concatenation of the files' arrays)."""
  count = info['splits'][split]['examples']
  parts = [np.empty((count, *info[part]['shape']), np.dtype(info[part]['dtype'])) for part in ('image', 'label')]
  start = 0
  for f in info['splits'][split]['files']:
    images, labels = _read_file(os.path.join(folder, f['name']), f['examples'], info)
    parts[0][start:start + len(images)], parts[1][start:start + len(labels)] = images, labels
    start += len(images)
  return parts[0], parts[1]


class FolderSource(stream.Source):
  """A split of a converted folder: its files' records, each read with a reader per thread (readers are not
  shared across threads), and checked against dataset.json as it is read."""

  def __init__(self, folder: str, info: dict[str, Any], split: str):
    self._info, self.name, self.inputs = info, f'{folder} {split}', info['inputs']
    files = info['splits'][split]['files']
    self._paths = [f'{folder}/{f["name"]}' for f in files]
    self._ends = np.cumsum([f['examples'] for f in files])
    self.image = stream.Spec(tuple(info['image']['shape']), np.dtype(info['image']['dtype']))
    self.label = stream.Spec(tuple(info['label']['shape']), np.dtype(info['label']['dtype']))
    self._local = threading.local()
    for path, f in zip(self._paths, files):  # a missing or truncated file is refused before training starts
      open_reader(path, f['examples']).close()

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def _reader(self, index: int):
    readers = self._local.__dict__.setdefault('readers', {})
    if index not in readers:
      first = self._ends[index - 1] if index else 0
      readers[index] = open_reader(self._paths[index], int(self._ends[index] - first))
    return readers[index]

  def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    files = np.searchsorted(self._ends, rows, side='right')
    images = np.empty((len(rows), *self.image.shape), self.image.dtype)
    labels = np.empty((len(rows), *self.label.shape), self.label.dtype)
    for index in np.unique(files):
      where = np.flatnonzero(files == index)
      path = self._paths[index]
      try:
        records = self._reader(index).read((rows[where] - (self._ends[index - 1] if index else 0)).tolist())
      except RuntimeError as e:  # Riegeli's report of a damaged chunk, or a file changed under the reader
        raise base.DataError(f'{path}: cut short or damaged ({base.first_line(e)}); {FIX}') from None
      images[where], labels[where] = decode(records, self._info, path)
    self._count(len(rows))
    return images, labels


def load(folder: str, task: str = tasks.DEFAULT, streaming: str = 'never') -> base.Dataset:
  """Reads every record of both splits; the splits are checked as the other sources' are (`base.make_split`,
  `arrays.from_arrays`), so a converted folder is refused for what its source would have been. Streamed
  (`stream.wanted`), reads nothing yet: the splits are `stream.Records`, read a batch at a time as training asks,
  each record checked as it is read."""
  info = read_info(folder)
  if info['task'] != task:
    raise base.DataError(f'{folder} holds {info["task"]} data (its {INFO}) but task={task!r}: set '
                         f'--config.task={info["task"]}')
  source = f'{folder} (ArrayRecord)'
  train_bytes = info['splits']['train']['examples'] * (record_bytes(info, 'image') + record_bytes(info, 'label'))
  if stream.wanted(streaming, train_bytes):
    splits = {split: stream.Records(FolderSource(folder, info, split)) for split in SPLITS}
    outputs = info['num_classes'] if tasks.named(task).has_classes else math.prod(info['label']['shape'])
    return base.Dataset(splits['train'], splits['test'], f'{source}, streamed', outputs, inputs=info['inputs'],
                        task=task)
  loaded = {split: read_split(folder, info, split) for split in SPLITS}
  if tasks.named(task).image_datasets and info['inputs'] == 'images':
    names = {split: (f'{folder}: {split} images', f'{folder}: {split} labels') for split in SPLITS}
    splits = {split: base.make_split(*loaded[split], *names[split]) for split in SPLITS}
    return base.make_dataset(splits['train'], splits['test'], source, names, num_classes=info['num_classes'])
  return arrays.from_arrays(loaded['train'], loaded['test'], info['inputs'], task, source=source)
