"""IDX folders: MNIST, Fashion-MNIST and KMNIST all ship as the same four files, of any image size."""

import gzip
import math
import os
import struct

import numpy as np

from ensemble.data import base

FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801  # unsigned bytes; 3 dimensions (N, H, W) or 1 (N,)


def _find(data_dir: str, name: str) -> str:
  for candidate in (name + '.gz', name):
    path = os.path.join(data_dir, candidate)
    if os.path.exists(path):
      return path
  raise base.DataError(f'{os.path.join(data_dir, name)}[.gz]: missing file; data_dir must hold the four IDX files '
                       f'({", ".join(sum(FILES.values(), ()))}), gzipped or not')


def read_idx(path: str, magic: int) -> np.ndarray:
  """Reads one IDX file (gzipped or not) and checks its header against its size."""
  opener = gzip.open if path.endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      raw = f.read()
  except (OSError, EOFError) as e:
    raise base.DataError(f'{path}: cannot be read ({e}); replace it with an intact copy') from e
  if len(raw) < 4 or struct.unpack('>I', raw[:4])[0] != magic:
    found = f'0x{struct.unpack(">I", raw[:4])[0]:08x}' if len(raw) >= 4 else 'nothing'
    raise base.DataError(f'{path}: wrong magic number {found}, expected 0x{magic:08x}; '
                         'is this the right IDX file (images vs labels)?')
  ndim = magic & 0xFF
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise base.DataError(f'{path}: truncated file, the header alone needs {header} bytes; replace it')
  dims = struct.unpack(f'>{ndim}I', raw[4:header])
  expected = header + math.prod(dims)  # exact: np.prod wraps around at 2**63, and a wrapped size can match
  if len(raw) != expected:
    problem = 'truncated file' if len(raw) < expected else 'trailing bytes after the data'
    raise base.DataError(f'{path}: {problem}, header {dims} needs {expected} bytes but the file has {len(raw)}; '
                         'replace it with an intact copy')
  # A read-only view of the bytes read: uint8 as the file stores them, no copy.
  return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load(data_dir: str) -> base.Dataset:
  """Reads the train and test splits from the four IDX files in `data_dir`."""
  if not os.path.isdir(data_dir):
    raise base.DataError(f'{data_dir}: not a folder; data_dir must name a folder of IDX files')
  splits, names = {}, {}
  for split, (images_file, labels_file) in FILES.items():
    images_path, labels_path = _find(data_dir, images_file), _find(data_dir, labels_file)
    names[split] = (images_path, labels_path)
    splits[split] = base.make_split(read_idx(images_path, IMAGES_MAGIC), read_idx(labels_path, LABELS_MAGIC),
                                    images_path, labels_path)
  return base.make_dataset(splits['train'], splits['test'], f'{data_dir} (IDX)', names)
