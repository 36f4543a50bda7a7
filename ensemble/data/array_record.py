"""Folders of ArrayRecord files, as `python -m ensemble.data.convert` writes them: one source for every kind of data.

A folder holds dataset.json, which says what the records are, and per split
SPLIT-00000-of-0000N.array_record files. A record is one example's fixed-size
bytes: its input (an image or a feature vector) then its label (an int32 class
or float targets), each C-ordered with the shape and dtype dataset.json gives.
Fixed sizes let a reader check every record, and later stream any example by
its index, without a schema library. Today a folder is read whole into a
Dataset, through the same checks as every other source.
"""

import json
import math
import os
from typing import Any

import numpy as np

from ensemble.data import arrays, base

INFO = 'dataset.json'
FORMAT = 'ensemble.array_record'
VERSION = 1
SPLITS = ('train', 'test')
TASKS = ('classification', 'regression')
INPUTS = ('images', 'features')
# group_size:1 puts each record in its own chunk: a later streaming reader reads any one without its neighbours.
WRITER_OPTIONS = 'group_size:1'
_FIX = 'convert the source again with python -m ensemble.data.convert'
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
    raise base.DataError(f'{path}: cannot be read ({base.first_line(e)}); {_FIX}') from None
  return info


def _check_info(info: Any):
  """Raises ValueError (KeyError, TypeError) for what a reader cannot use."""
  if not isinstance(info, dict) or info.get('format') != FORMAT:
    raise ValueError(f'not an {FORMAT} description')
  if info['version'] != VERSION:
    raise ValueError(f'format version {info["version"]}, this package reads {VERSION} (upgrade it if newer)')
  if info['task'] not in TASKS or info['inputs'] not in INPUTS:
    raise ValueError(f'task {info["task"]!r} / inputs {info["inputs"]!r}, expected one of {TASKS} / {INPUTS}')
  for part, dtypes in _DTYPES.items():
    shape = info[part]['shape']
    if info[part]['dtype'] not in dtypes or not all(isinstance(d, int) and d > 0 for d in shape):
      raise ValueError(f'{part}: shape {shape} of dtype {info[part]["dtype"]!r}, expected positive sizes of one '
                       f'of {dtypes}')
  if info['task'] == 'classification' and not (isinstance(info['num_classes'], int) and info['num_classes'] > 0):
    raise ValueError(f'num_classes {info["num_classes"]!r}, expected a positive count')
  for split in SPLITS:
    files = info['splits'][split]['files']
    if not files or any(not isinstance(f['name'], str) or os.path.basename(f['name']) != f['name']
                        or not isinstance(f['examples'], int) or f['examples'] < 0 for f in files):
      raise ValueError(f'split {split}: expected a list of {{"name": file in the folder, "examples": count}}')
    if sum(f['examples'] for f in files) != info['splits'][split]['examples']:
      raise ValueError(f'split {split}: its files hold {sum(f["examples"] for f in files)} examples, not the '
                       f'{info["splits"][split]["examples"]} it lists')


def _read_file(path: str, expected: int, sizes: tuple[int, int]) -> np.ndarray:
  """The file's records as uint8 (N, record bytes), each checked to be one example long."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  if not os.path.isfile(path):
    raise base.DataError(f'{path}: missing (dataset.json lists it); {_FIX}')
  try:
    reader = array_record_module.ArrayRecordReader(path)
    try:
      # A file cut at a block boundary opens as "not ok" with no records, without an error: count them.
      found = reader.num_records() if reader.ok() else None
      if found != expected:
        held = 'no readable index' if found is None else f'{found} records'
        raise base.DataError(f'{path}: cut short or damaged: dataset.json lists {expected} records but the file has '
                             f'{held}; {_FIX}')
      records = reader.read_all() if expected else []
    finally:
      reader.close()
  except RuntimeError as e:  # Riegeli's report of a damaged chunk or a truncated file
    raise base.DataError(f'{path}: cut short or damaged ({base.first_line(e)}); {_FIX}') from None
  size = sum(sizes)
  wrong = next((i for i, record in enumerate(records) if len(record) != size), None)
  if wrong is not None:
    raise base.DataError(f'{path}: record {wrong} holds {len(records[wrong])} bytes but dataset.json describes '
                         f'{size} ({sizes[0]} input + {sizes[1]} label); {_FIX}')
  return np.frombuffer(b''.join(records), np.uint8).reshape(len(records), size)


def read_split(folder: str, info: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, labels) of `split`, its files in dataset.json's order and each file's records in order."""
  sizes = (record_bytes(info, 'image'), record_bytes(info, 'label'))
  rows = np.concatenate([_read_file(os.path.join(folder, f['name']), f['examples'], sizes)
                         for f in info['splits'][split]['files']])
  parts = []
  for part, (start, stop) in (('image', (0, sizes[0])), ('label', (sizes[0], sum(sizes)))):
    dtype, shape = np.dtype(info[part]['dtype']), info[part]['shape']
    parts.append(np.ascontiguousarray(rows[:, start:stop]).view(dtype).reshape(len(rows), *shape))
  return parts[0], parts[1]


def load(folder: str, task: str = 'classification') -> base.Dataset:
  """Reads every record of both splits; the splits are checked as the other sources' are (`base.make_split`,
  `arrays.from_arrays`), so a converted folder is refused for what its source would have been."""
  info = read_info(folder)
  if info['task'] != task:
    raise base.DataError(f'{folder} holds {info["task"]} data (its {INFO}) but task={task!r}: set '
                         f'--config.task={info["task"]}')
  source = f'{folder} (ArrayRecord)'
  loaded = {split: read_split(folder, info, split) for split in SPLITS}
  if task == 'classification' and info['inputs'] == 'images':
    names = {split: (f'{folder}: {split} images', f'{folder}: {split} labels') for split in SPLITS}
    splits = {split: base.make_split(*loaded[split], *names[split]) for split in SPLITS}
    return base.make_dataset(splits['train'], splits['test'], source, names, num_classes=info['num_classes'])
  return arrays.from_arrays(loaded['train'], loaded['test'], info['inputs'], task, source=source)
