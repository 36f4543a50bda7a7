"""MNIST as numpy arrays, from IDX files or tensorflow-datasets, and its batches.

Everything here is plain numpy on the host: the data order depends only on the
seed, the epoch and the member, never on the backend or the device count, so
member i sees the same batches however the ensemble is placed.
"""

import gzip
import os
import socket
import struct
import sys
import urllib.parse
from typing import Iterator

import numpy as np

from ensemble.errors import UsageError

IMAGE_SHAPE = (28, 28)
IDX_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
_IMAGES_MAGIC, _LABELS_MAGIC = 0x00000803, 0x00000801

Split = dict[str, np.ndarray]  # {'image': float32 (N, 28, 28, 1) in [0, 1], 'label': int32 (N,)}


class DataError(UsageError):
  """A data file that is missing or malformed."""


def _find(data_dir: str, name: str) -> str:
  for candidate in (name + '.gz', name):
    path = os.path.join(data_dir, candidate)
    if os.path.exists(path):
      return path
  raise DataError(f'{os.path.join(data_dir, name)}[.gz]: missing file; '
                  f'data_dir must hold the four MNIST IDX files ({", ".join(sum(IDX_FILES.values(), ()))})')


def read_idx(path: str, magic: int) -> np.ndarray:
  """Reads one IDX file (gzipped or not) and checks its header against its size."""
  opener = gzip.open if path.endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      raw = f.read()
  except (OSError, EOFError) as e:
    raise DataError(f'{path}: cannot be read ({e}); replace it with an intact copy') from e
  if len(raw) < 4 or struct.unpack('>I', raw[:4])[0] != magic:
    found = f'0x{struct.unpack(">I", raw[:4])[0]:08x}' if len(raw) >= 4 else 'nothing'
    raise DataError(f'{path}: wrong magic number {found}, expected 0x{magic:08x}; '
                    'is this the right IDX file (images vs labels)?')
  ndim = magic & 0xFF
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise DataError(f'{path}: truncated file, the header alone needs {header} bytes; replace it')
  dims = struct.unpack(f'>{ndim}I', raw[4:header])
  expected = header + int(np.prod(dims))
  if len(raw) != expected:
    problem = 'truncated file' if len(raw) < expected else 'trailing bytes after the data'
    raise DataError(f'{path}: {problem}, header {dims} needs {expected} bytes but the file has {len(raw)}; '
                    'replace it with an intact copy')
  return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _as_split(images: np.ndarray, labels: np.ndarray, source: str) -> Split:
  if images.shape[1:3] != IMAGE_SHAPE:
    raise DataError(f'{source}: wrong image size {images.shape[1:]}, expected {IMAGE_SHAPE}; '
                    'this pipeline reads 28x28 MNIST')
  if len(images) != len(labels):
    raise DataError(f'{source}: {len(images)} images but {len(labels)} labels; '
                    'the image and label files must come from the same split')
  return {'image': images.reshape((-1, *IMAGE_SHAPE, 1)),
          'label': labels.reshape(-1).astype(np.int32)}


def load_idx(data_dir: str) -> dict[str, Split]:
  """Reads train and test splits from the four IDX files in `data_dir`."""
  if not os.path.isdir(data_dir):
    raise DataError(f'{data_dir}: not a folder; --config.data_dir must name a folder of MNIST IDX files')
  splits = {}
  for split, (images_name, labels_name) in IDX_FILES.items():
    images_path, labels_path = _find(data_dir, images_name), _find(data_dir, labels_name)
    images = read_idx(images_path, _IMAGES_MAGIC)
    labels = read_idx(labels_path, _LABELS_MAGIC)
    splits[split] = _as_split(images, labels, f'{images_path} / {labels_path}')
  return splits


def _reachable(url: str, timeout_s: float = 5.0) -> bool:
  """Whether `url`'s host answers: tfds retries an offline download for minutes before failing."""
  parsed = urllib.parse.urlparse(url)
  try:
    socket.create_connection((parsed.hostname, parsed.port or 443), timeout=timeout_s).close()
    return True
  except OSError:
    return False


def load_tfds() -> dict[str, Split]:
  """Loads MNIST through tensorflow-datasets, downloading it once if it is not prepared yet."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  offline_fix = ('point --config.data_dir at a folder with the four MNIST IDX files '
                 '(train-images-idx3-ubyte.gz, ...)')

  def load(download: bool):
    # One batch holds a whole split (MNIST's largest has 60,000 examples).
    splits = tfds.load('mnist', split=['train', 'test'], download=download)
    return [next(iter(tfds.as_numpy(split.batch(1 << 20)))) for split in splits]

  try:
    splits = load(download=False)
  except Exception:  # pylint: disable=broad-except
    # Not prepared yet. Offline, tfds would retry the download for minutes: fail fast instead.
    module = sys.modules.get(type(tfds.builder('mnist')).__module__)
    download_url = getattr(module, '_MNIST_URL', None)
    if download_url and not _reachable(download_url):
      raise DataError(f'MNIST is not prepared for tensorflow-datasets and {download_url} cannot be '
                      f'reached to download it; {offline_fix}') from None
    try:
      splits = load(download=True)
    except Exception as e:  # pylint: disable=broad-except
      first_line = str(e).splitlines()[0] if str(e) else ''
      raise DataError(f'MNIST could not be downloaded through tensorflow-datasets '
                      f'({type(e).__name__}: {first_line}); {offline_fix}') from e
  return {name: _as_split(split['image'], split['label'], f'tfds mnist/{name}')
          for name, split in zip(['train', 'test'], splits)}


import dataclasses
@dataclasses.dataclass(frozen=True)
class Dataset:
  train: Split
  test: Split
  source: str
  num_classes: int
  @property
  def image_shape(self):
    return self.train['image'].shape[1:]


def load(dataset='mnist', data_dir='', train_split='train', test_split='test') -> Dataset:
  splits = load_idx(data_dir) if data_dir else load_tfds()
  return Dataset(splits['train'], splits['test'], data_dir, 10)


def channel_stats(images):
  x = images.astype(np.float64) / 255
  return tuple(x.mean((0, 1, 2))), tuple(x.std((0, 1, 2)))


def hold_out(split: Split, fraction: float) -> tuple[Split, Split]:
  """(the rest, the last `fraction` of the examples): a fixed slice, the same for training and evaluation."""
  start = len(split['label']) - int(round(fraction * len(split['label'])))
  return {k: v[:start] for k, v in split.items()}, {k: v[start:] for k, v in split.items()}


def epoch_order(num_examples: int, seed: int, epoch: int, member: int | None = None) -> np.ndarray:
  """A permutation that is a function of (seed, epoch[, member]) alone."""
  entropy = [seed, epoch] if member is None else [seed, epoch, member]
  return np.random.default_rng(entropy).permutation(num_examples)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  return num_examples // batch_size


def train_batch_indices(num_examples: int, batch_size: int, seed: int, epoch: int,
                        ensemble_size: int, member_data: str) -> np.ndarray:
  """Example indices of one epoch, (steps, batch) when members share batches, else (steps, K, batch).

  The last partial batch is dropped, so every step has the same shape (one compilation).
  """
  steps = steps_per_epoch(num_examples, batch_size)
  if member_data == 'shared':
    return epoch_order(num_examples, seed, epoch)[:steps * batch_size].reshape(steps, batch_size)
  orders = np.stack([epoch_order(num_examples, seed, epoch, member)[:steps * batch_size]
                     for member in range(ensemble_size)])
  return orders.reshape(ensemble_size, steps, batch_size).transpose(1, 0, 2)


def train_batches(split: Split, batch_size: int, seed: int, epoch: int, ensemble_size: int,
                  member_data: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  indices = train_batch_indices(len(split['label']), batch_size, seed, epoch, ensemble_size, member_data)
  for idx in indices:
    yield split['image'][idx], split['label'][idx]


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
    yield split['image'][idx], split['label'][idx], mask
