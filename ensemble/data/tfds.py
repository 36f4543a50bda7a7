"""Any tensorflow-datasets image-classification dataset: fixed-size uint8 'image' and a ClassLabel 'label'.

tensorflow_datasets is imported inside the functions: importing `ensemble.data`
stays cheap, and IDX or .npz runs never load it. A dataset prepared as ArrayRecord
is read through `tfds.data_source` without TensorFlow, which the core install
does not have; TFRecord files and preparing a dataset need it (the `[tfds]` extra).
"""

import difflib
import socket
import urllib.parse

import numpy as np

from ensemble.data import base

_DATA_DIR_FIX = 'or set --config.data_dir to a folder of IDX files or a .npz file (x_train, y_train, x_test, y_test)'
_FALLBACK_HOST = ('storage.googleapis.com', 443)  # where tfds keeps its own files, when a dataset names no URL
_READ_BATCH = 1 << 14  # examples per tf.data batch; the batches are copied into one preallocated array


class UnknownDataset(base.DataError):
  """No tensorflow-datasets dataset has this name; `close` are the names that look like it."""

  def __init__(self, message: str, close: list[str]):
    super().__init__(message)
    self.close = close


def _builder(tfds, name: str):
  try:
    return tfds.builder(name)
  except tfds.core.DatasetNotFoundError:
    close = difflib.get_close_matches(name.split('/')[0].split(':')[0].lower(),
                                      tfds.list_builders(with_community_datasets=False), n=3, cutoff=0.6)
    hint = f' (did you mean {", ".join(close)}?)' if close else ''
    raise UnknownDataset(f'--config.dataset={name}: no such tensorflow-datasets dataset{hint}; name one from '
                         f'https://www.tensorflow.org/datasets/catalog/overview, {_DATA_DIR_FIX}', close) from None
  except (ValueError, AssertionError) as e:  # a bad config, version or name syntax
    raise base.DataError(f'--config.dataset={name}: tensorflow-datasets cannot build it ({base.first_line(e)}); '
                         f'use NAME[/CONFIG][:VERSION], {_DATA_DIR_FIX}') from None


def _check_features(builder, name: str):
  """Refuses, before any download, what cannot become uint8 (N, H, W, C) images with class labels."""
  features = builder.info.features
  keys = set(features.keys()) if hasattr(features, 'keys') else set()
  image, label = (features[key] if key in keys else None for key in ('image', 'label'))
  if image is None or label is None or not hasattr(label, 'num_classes'):
    raise base.DataError(f'--config.dataset={name}: not an image-classification dataset (features: '
                         f'{", ".join(sorted(keys)) or "none"}; needed: image, and label with classes); '
                         f'pick one that has them, {_DATA_DIR_FIX}')
  shape = tuple(image.shape)
  if len(shape) != 3 or None in shape:
    raise base.DataError(f'--config.dataset={name}: images of shape {shape}, not one fixed (H, W, C) to stack; '
                         'resize them to one size and save them as a .npz file for --config.data_dir')
  if np.dtype(image.np_dtype) != np.uint8:
    raise base.DataError(f'--config.dataset={name}: {np.dtype(image.np_dtype)} images, this pipeline reads uint8; '
                         f'convert them to uint8 and save a .npz file for --config.data_dir')


def _check_splits(builder, name: str, splits: dict[str, str]):
  """Checks split names and slices once tfds knows the dataset's splits (after preparation)."""
  known = builder.info.splits
  if not known:
    return
  for role, split in splits.items():
    try:
      num_examples = known[split].num_examples
    except (KeyError, ValueError) as e:
      raise base.DataError(f'--config.{role}_split={split}: not a split of {name} ({base.first_line(e)}); '
                           f'its splits are {", ".join(known)}, which may be sliced as in "train[:90%]"') from None
    if not num_examples:
      raise base.DataError(f'--config.{role}_split={split}: selects no examples of {name}; widen the slice')


def _reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
  """Whether `host` answers: offline, tfds retries a download for minutes before it fails."""
  try:
    socket.create_connection((host, port), timeout=timeout_s).close()
    return True
  except OSError:
    return False


def _download_hosts(builder) -> list[tuple[str, int]]:
  """The hosts a dataset downloads from, from its checksums file (cheap: no network)."""
  try:
    urls = list(builder.url_infos or ())
  except Exception:  # pylint: disable=broad-except
    urls = []  # only a hint for failing fast: a dataset without a checksums file is probed on the fallback host
  hosts = {}
  for url in urls:
    parsed = urllib.parse.urlparse(url)
    if parsed.hostname:
      hosts[(parsed.hostname, parsed.port or (80 if parsed.scheme == 'http' else 443))] = None
  return list(hosts) or [_FALLBACK_HOST]


def _prepare(builder, name: str):
  fix = (f'prepare it where there is internet (`tfds build {name}`) and copy it into {builder.data_dir_root}, '
         f'{_DATA_DIR_FIX}')
  for host, port in _download_hosts(builder):
    if not _reachable(host, port):
      raise base.DataError(f'tfds {name}: not prepared in {builder.data_dir_root} and {host} cannot be reached '
                           f'to download it; {fix}')
  try:
    builder.download_and_prepare()
  except Exception as e:  # pylint: disable=broad-except
    raise base.DataError(f'tfds {name}: download and preparation failed ({base.first_line(e)}); {fix}') from e


def has_tensorflow() -> bool:
  """Whether TensorFlow imports: the core install has none (`pip install -e '.[tfds]'` adds it), and tfds reads
  TFRecord files and prepares datasets with it."""
  try:
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import  # noqa: F401
  except ImportError:
    return False
  return True


def _needs_tensorflow(name: str, what: str) -> base.DataError:
  return base.DataError(f'tfds {name}: {what} needs TensorFlow, which this install has not: pip install -e '
                        "'.[tfds]' (or tensorflow-cpu), or prepare it as ArrayRecord elsewhere (`tfds build "
                        f'{name} --file_format=array_record`), which reads without it; {_DATA_DIR_FIX}')


def _read(tfds, builder, name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  """A whole split as images and labels: from ArrayRecord files by `tfds.data_source`'s random access, which
  needs no TensorFlow, else from TFRecord files by tf.data."""
  if builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD or not has_tensorflow():
    return _read_source(builder, name, split)
  dataset = builder.as_dataset(split=split, shuffle_files=False)
  count = int(dataset.cardinality())  # tfds knows it; negative means unknown
  batches = tfds.as_numpy(dataset.map(lambda example: (example['image'], example['label'])).batch(_READ_BATCH))
  if count < 0:
    batches = list(batches)
    count = sum(len(batch_labels) for _, batch_labels in batches)
  if not count:
    raise base.DataError(f'tfds {name} {split}: no examples; pick a split (or slice) that has some')
  images = labels = None
  filled = 0
  for batch_images, batch_labels in batches:
    if images is None:
      images = np.empty((count, *batch_images.shape[1:]), batch_images.dtype)
      labels = np.empty((count,), batch_labels.dtype)
    images[filled:filled + len(batch_images)] = batch_images
    labels[filled:filled + len(batch_labels)] = batch_labels
    filled += len(batch_images)
  return images[:filled], labels[:filled]


def _read_source(builder, name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  """A whole split read through `builder.as_data_source` (ArrayRecord, decoded by tfds without TensorFlow), example
  by example into arrays allocated once."""
  try:
    source = builder.as_data_source(split=split)
  except Exception:  # pylint: disable=broad-except  # not prepared, or TFRecord files: no random access
    if has_tensorflow():
      raise
    if not builder.is_prepared():
      raise _needs_tensorflow(name, f'downloading and preparing it (not prepared in {builder.data_dir_root})') from None
    raise _needs_tensorflow(name, f'reading its {builder.info.file_format.value} files') from None
  count = len(source)
  if not count:
    raise base.DataError(f'tfds {name} {split}: no examples; pick a split (or slice) that has some')
  first = source[0]
  images = np.empty((count, *np.shape(first['image'])), np.asarray(first['image']).dtype)
  labels = np.empty((count,), np.asarray(first['label']).dtype)
  for i in range(count):
    example = source[i]
    images[i], labels[i] = example['image'], example['label']
  return images, labels


def _streamed(tfds, builder, name: str, splits: dict[str, str], streaming: str) -> base.Dataset | None:
  """The splits as `stream.Records` over `tfds.data_source` when streaming is wanted; None to read them whole."""
  from ensemble.data import stream  # pylint: disable=g-import-not-at-top

  known = builder.info.splits
  examples = known[splits['train']].num_examples if known else 0
  image_bytes = int(np.prod(builder.info.features['image'].shape))
  if not stream.wanted(streaming, examples * image_bytes):
    return None
  if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
    raise stream.cannot_stream(f'tfds {name}, prepared as {builder.info.file_format.value} files,')
  records = {}
  for role, split in splits.items():
    source = f'tfds {name} {split}'
    records[role] = stream.Records(stream.RandomAccessSource(builder.as_data_source(split=split), source,
                                                             inputs='images'))
  return base.Dataset(records['train'], records['test'], f'tfds {name}, streamed',
                      builder.info.features['label'].num_classes)


def load(name: str, train_split: str = 'train', test_split: str = 'test', streaming: str = 'never') -> base.Dataset:
  """Loads `name`'s two splits (any tfds split string), downloading and preparing it first if need be. Streamed
  (`stream.wanted`; prepared as ArrayRecord), reads nothing yet: the splits read through `tfds.data_source` as
  training asks."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # a declared dependency, missing from a trimmed install (a GPU host's, say)
    raise base.DataError(
        f'dataset {name!r} is read with tensorflow-datasets, which does not import here ({e}): '
        'pip install tensorflow-datasets, or give a folder of IDX files or an .npz file as data_dir') from e
  builder = _builder(tfds, name)
  _check_features(builder, name)
  splits = {'train': train_split, 'test': test_split}
  _check_splits(builder, name, splits)
  streamed = _streamed(tfds, builder, name, splits, streaming)
  if streamed is not None:
    return streamed
  read = lambda: {role: _read(tfds, builder, name, split) for role, split in splits.items()}
  try:
    # Reading before checking is_prepared() lets tfds.testing.mock_data, which fakes reading but not
    # preparation, run offline.
    arrays = read()
  except AssertionError:  # tfds's "could not find data in ...": not prepared yet
    if builder.is_prepared():
      raise
    _prepare(builder, name)
    _check_splits(builder, name, splits)
    arrays = read()
  names = {role: (f'tfds {name} {split} images', f'tfds {name} {split} labels') for role, split in splits.items()}
  made = {role: base.make_split(*arrays[role], *names[role]) for role in splits}
  default_splits = (train_split, test_split) == ('train', 'test')
  source = f'tfds {name}' if default_splits else f'tfds {name} ({train_split}, {test_split})'
  return base.make_dataset(made['train'], made['test'], source, names,
                           num_classes=builder.info.features['label'].num_classes)
