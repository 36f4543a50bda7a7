"""What every source returns, and the checks that turn a source's arrays into it.

Kept apart from `ensemble.data` so that the source modules can import it
without importing the package that imports them.
"""

import dataclasses
import math
import zipfile
from typing import BinaryIO

import numpy as np

from ensemble import errors
from ensemble.errors import UsageError
from ensemble.tasks.dense import IGNORED  # a dense label's position without a label, as the programs take it

# {'image': the inputs, 'label': int32 (N,)}. The inputs are uint8 images (N, H, W, C) for every source on disk;
# arrays given to `ensemble.fit` may also be float32 features or int32 token ids of any shape (N, ...).
Split = dict[str, np.ndarray]

# The most absent classes a warning lists by number.
_LISTED_CLASSES = 10
# Float images are converted this many bytes of input at a time, so a large split never needs a second float copy.
_CHUNK_BYTES = 1 << 24


class DataError(UsageError):
  """A data file or dataset that is missing or malformed."""


HOST_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))  # what features and targets may be on the host


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Train and test splits, with what a model needs to know about them.

  Images stay uint8 on the host (a quarter of float32's bytes; CIFAR-10's
  training split is 150 MB so, 600 MB as float32); the device converts and
  normalises each batch.
  """
  train: Split
  test: Split | None  # None: no test set (`ensemble.fit` without one)
  source: str  # what it came from, for logs and reports
  num_classes: int  # for regression: the number of targets D; for multi-label: the number of labels L
  inputs: str = 'images'  # what the inputs are: steps.INPUTS
  # 'regression': labels are float targets (N, D); 'multilabel': 0/1 labels (N, L); 'dense': classes (N, *positions)
  task: str = 'classification'

  def __post_init__(self):
    # A loader that breaks the layout would otherwise fail far away, inside a jitted step.
    # Features and targets may stay float64 until the loop standardises them (ensemble/loop.py): cast first, a
    # target of 1.7e9 +- 30 would keep one distinct value in 512.
    layouts = {'images': ((np.uint8,), 'uint8 (N, H, W, C)'), 'features': (HOST_FLOATS, 'float32/64 (N, ...)'),
               'tokens': ((np.int32,), 'int32 (N, ...)')}
    dtypes, layout = layouts[self.inputs]
    for name, split in (('train', self.train), ('test', self.test)):
      if split is None:
        continue
      images, labels = split['image'], split['label']
      if images.dtype not in dtypes or images.ndim < 2 or (self.inputs == 'images' and images.ndim != 4):
        raise ValueError(f'Dataset.{name}: {self.inputs} must be {layout}, got {images.dtype} {images.shape}')
      if self.task == 'regression':
        if labels.dtype not in HOST_FLOATS or labels.ndim != 2 or labels.shape[0] != len(images):
          raise ValueError(f'Dataset.{name}: targets must be float32/64 ({len(images)}, D), got {labels.dtype} '
                           f'{labels.shape}')
      elif self.task == 'multilabel':
        if labels.dtype not in (np.dtype(np.int32), np.dtype(np.float32)) or labels.shape != (len(images),
                                                                                            self.num_classes):
          raise ValueError(f'Dataset.{name}: labels must be int32 0/1 or float32 probabilities ({len(images)}, '
                           f'{self.num_classes}), got {labels.dtype} {labels.shape}')
      elif self.task == 'dense':
        positions = labels.shape[1:] if labels.dtype == np.int32 else labels.shape[1:-1]
        if (labels.dtype not in (np.dtype(np.int32), np.dtype(np.float32)) or labels.shape[:1] != images.shape[:1]
            or not positions or images.shape[1:1 + len(positions)] != positions):
          raise ValueError(f'Dataset.{name}: dense labels must be int32 (N, *positions) classes or float32 '
                           f'(N, *positions, C) probabilities of inputs (N, *positions, ...), got {labels.dtype} '
                           f'{labels.shape} for inputs {images.shape}')
      elif not ((labels.dtype == np.int32 and labels.shape == images.shape[:1])
                or (labels.dtype == np.float32 and labels.ndim == 2 and labels.shape[0] == len(images))):
        # float32 (N, C): a teacher's probabilities, what ensemble.distill trains a student on
        raise ValueError(f'Dataset.{name}: labels must be int32 ({len(images)},) classes or float32 '
                         f'({len(images)}, C) probabilities, got {labels.dtype} {labels.shape}')
    if self.test is not None and self.train['image'].shape[1:] != self.test['image'].shape[1:]:
      raise ValueError(f'Dataset: train images {self.train["image"].shape[1:]} but test images '
                       f'{self.test["image"].shape[1:]}')

  @property
  def image_shape(self) -> tuple[int, ...]:
    """One input's shape, (H, W, C) for images; the same for both splits."""
    return tuple(int(d) for d in self.train['image'].shape[1:])

  def describe(self) -> str:
    """'10 classes, images 28x28x1' or '1 target, features 3': the start of a run names what the members predict,
    and a regression run has targets, not classes."""
    if self.task in ('regression', 'multilabel'):
      what = 'target' if self.task == 'regression' else 'label'
      predicted = f'{self.num_classes} {what}{"" if self.num_classes == 1 else "s"}'
    else:
      predicted = f'{self.num_classes} classes'
    return f'{predicted}, {self.inputs} {"x".join(map(str, self.image_shape))}'


def first_line(error: BaseException) -> str:
  """An exception's message cut to one line: the CLI prints a DataError as a single `error:` line."""
  lines = str(error).strip().splitlines()
  return f'{type(error).__name__}: {lines[0]}' if lines else type(error).__name__


def npy_header(f: BinaryIO) -> tuple[tuple[int, ...], np.dtype]:
  """(shape, dtype) from an .npy stream's header (read from its start; left after it), without reading the array."""
  version = np.lib.format.read_magic(f)
  read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
  shape, _, dtype = read_header(f)
  return shape, dtype


def check_npy_size(f: BinaryIO, size: int, name: str):
  """Refuses an .npy stream (read from its start) whose header asks for more bytes than the `size` bytes of the
  stream hold, before numpy allocates them: a damaged or hostile 128-byte header can ask for any amount of
  memory. Leaves `f` after the header. A header that cannot be parsed raises numpy's ValueError.
  """
  shape, dtype = npy_header(f)
  needed, held = math.prod(shape) * dtype.itemsize, size - f.tell()
  if not dtype.hasobject and needed > held:  # object arrays are pickles, which the loaders refuse anyway
    raise DataError(f'{name}: cut short or damaged: its header describes a {dtype} array of shape {tuple(shape)} '
                    f'({needed:,} bytes) but it holds {held:,}; save it again with numpy')


def check_npz_sizes(path: str, names: list[str]):
  """`check_npy_size` for the arrays `names` of the .npz file at `path`."""
  with zipfile.ZipFile(path) as archive:
    for name in names:
      info = archive.getinfo(name + '.npy')
      with archive.open(info) as f:
        check_npy_size(f, info.file_size, f'{path}: {name}')


def _check_image_layout(images: np.ndarray, name: str):
  if images.ndim not in (3, 4):
    raise DataError(f'{name}: array of shape {images.shape}, expected images (N, H, W) or (N, H, W, C); '
                    'each example must be 2-D or 3-D')
  if images.ndim == 4 and images.shape[1] in (1, 3, 4) and images.shape[3] > 4:
    raise DataError(f'{name}: shape {images.shape} looks channels-first; store images as (N, H, W, C), '
                    'e.g. x.transpose(0, 2, 3, 1)')


def float_to_uint8(images: np.ndarray, name: str) -> np.ndarray:
  """Rounds x*255 chunk by chunk: floats are accepted in [0, 1] only, where this is lossless for 8-bit sources."""
  if not images.size:
    return images.astype(np.uint8)
  low, high = float(images.min()), float(images.max())  # NaN propagates into both
  if np.isnan(low) or np.isnan(high):
    raise DataError(f'{name}: float images contain NaN; store uint8 (0..255) or float in [0, 1]')
  if low < 0.0 or high > 1.0:
    raise DataError(f'{name}: float images must lie in [0, 1] but span [{low:g}, {high:g}]; '
                    'scale them to [0, 1] (x / 255 for 0..255 values) or store uint8')
  out = np.empty(images.shape, np.uint8)
  rows = max(1, _CHUNK_BYTES // max(1, images[:1].nbytes))
  for start in range(0, len(images), rows):
    out[start:start + rows] = np.rint(images[start:start + rows] * 255)
  return out


def as_images(images: np.ndarray, name: str) -> np.ndarray:
  """uint8 (N, H, W, C): (N, H, W) gains C=1 (a view), uint8 is kept as is, [0, 1] floats are rounded (for
  training and prediction alike: the members see the same pixels)."""
  images = images[..., None] if images.ndim == 3 else images
  if images.dtype == np.uint8:
    return images
  if np.issubdtype(images.dtype, np.floating):
    return float_to_uint8(images, name)
  raise DataError(f'{name}: images of dtype {images.dtype}; store them as uint8 (0..255) or as float in [0, 1]')


def as_labels(labels: np.ndarray, name: str) -> np.ndarray:
  """int32 (N,) class indices; (N, 1), as Keras's CIFAR arrays come, is flattened."""
  if labels.ndim == 2 and labels.shape[1] == 1:
    labels = labels[:, 0]
  if labels.ndim != 1:
    raise DataError(f'{name}: labels of shape {labels.shape}, expected (N,) integer class indices '
                    '(for one-hot labels store y.argmax(-1))')
  if not np.issubdtype(labels.dtype, np.integer):
    raise DataError(f'{name}: labels of dtype {labels.dtype}, expected integers 0..C-1; '
                    'store class indices, e.g. y.astype(np.int32)')
  if len(labels) and labels.min() < 0:
    raise DataError(f'{name}: negative label {labels.min()}; labels must be class indices 0..C-1')
  if len(labels) and labels.max() > np.iinfo(np.int32).max:
    raise DataError(f'{name}: label {labels.max()} does not fit int32; labels must be class indices 0..C-1')
  return labels.astype(np.int32, copy=False)


def as_multilabels(labels: np.ndarray, name: str) -> np.ndarray:
  """(N, L) int32 multi-label labels from (N,) (one label: binary classification) or (N, L) 0s and 1s, of any
  number type or bool."""
  if labels.dtype == bool:
    labels = labels.astype(np.int32)
  if not np.issubdtype(labels.dtype, np.number) or labels.ndim not in (1, 2):
    raise DataError(f"{name}: labels of shape {labels.shape} and dtype {labels.dtype}; task='multilabel' takes (N, L) "
                    'labels of 0 and 1, one column per label')
  labels = labels.reshape(len(labels), -1)
  if labels.size and not np.isin(labels, (0, 1)).all():
    bad = labels[~np.isin(labels, (0, 1))].flat[0]
    raise DataError(f"{name}: a label of {bad:g}; task='multilabel' takes 0 or 1 per label (class indices: "
                    "task='classification'; a teacher's probabilities: ensemble.distill)")
  return labels.astype(np.int32)




def as_dense_labels(labels: np.ndarray, name: str, ignore: int = IGNORED) -> np.ndarray:
  """int32 (N, *positions) class indices of a dense task, `IGNORED` where a position has the label `ignore`."""
  if labels.ndim < 2 or not np.issubdtype(labels.dtype, np.integer):
    raise DataError(f"{name}: labels of shape {labels.shape} and dtype {labels.dtype}; task='dense' takes integer "
                    'class indices per position, (N, *positions): (N, H, W) for images (N, H, W, C), (N, T) for '
                    'sequences (N, T, F)')
  unlabelled = labels == ignore
  if labels.size and (labels[~unlabelled] < 0).any():
    raise DataError(f'{name}: a label of {labels[~unlabelled].min()}, neither a class 0..C-1 nor the ignored label '
                    f'{ignore}; set ignore_label={labels[~unlabelled].min()} if it marks positions without a label')
  if labels.size and labels.max() > np.iinfo(np.int32).max:
    raise DataError(f'{name}: label {labels.max()} does not fit int32; labels must be class indices 0..C-1')
  return np.where(unlabelled, IGNORED, labels).astype(np.int32)


def host_float(values: np.ndarray) -> np.ndarray:
  """`values` as float32, or float64 where float32 would round them (float64, 32- and 64-bit integers): the host
  keeps their precision until the loop has standardised them."""
  exact = values.dtype.itemsize <= 2 or values.dtype == np.float32
  return values.astype(np.float32 if exact else np.float64, copy=False)


def as_targets(targets: np.ndarray, name: str) -> np.ndarray:
  """(N, D) regression targets from (N,) or (N, D) finite floats, float64 kept (`host_float`)."""
  if not np.issubdtype(targets.dtype, np.floating):
    raise DataError(f'{name}: targets of dtype {targets.dtype}; regression needs float targets (y.astype(np.float32)), '
                    "or task='classification' for class indices")
  if targets.ndim not in (1, 2):
    raise DataError(f'{name}: targets of shape {targets.shape}; give (N,) or (N, D) float targets')
  targets = targets.reshape(len(targets), -1)
  finite = np.isfinite(targets).all(1)
  if not finite.all():
    raise DataError(f'{name}: targets hold NaN or infinite values (first at example {int(np.argmin(finite))}); '
                    'drop those examples first')
  return host_float(targets)


def check_examples(count: int, name: str):
  """Refuses an empty split where a source's arrays become one (`make_split`, `arrays.from_arrays`): past here,
  zero rows fail far from their cause, in numpy's reductions (which have no identity) or as NaN scores."""
  if not count:
    raise DataError(f'{name}: no examples, the split is empty; give it at least one example')


def make_split(images: np.ndarray, labels: np.ndarray, images_name: str, labels_name: str) -> Split:
  """Checks one split's arrays and brings them to the Split layout.

  `images_name` and `labels_name` say where the arrays came from (a file, or a
  file and a field): every error names them.
  """
  _check_image_layout(images, images_name)
  if len(images) != len(labels):
    raise DataError(f'{images_name} / {labels_name}: {len(images)} images but {len(labels)} labels; '
                    'images and labels must come from the same split, in the same order')
  check_examples(len(images), images_name)
  labels = as_labels(labels, labels_name)
  return {'image': as_images(images, images_name), 'label': labels}


def make_dataset(train: Split, test: Split, source: str, names: dict[str, tuple[str, str]],
                 num_classes: int | None = None, inputs: str = 'images') -> Dataset:
  """Checks that the splits agree; without `num_classes`, it is the largest training label + 1.

  `names` maps 'train' and 'test' to their (images, labels) names, for the errors.
  """
  train_shape = train['image'].shape[1:]
  test_shape = train_shape if test is None else test['image'].shape[1:]
  if train_shape != test_shape:
    raise DataError(f'{names["train"][0]} holds {"x".join(map(str, train_shape))} {inputs} but {names["test"][0]} '
                    f'holds {"x".join(map(str, test_shape))}; train and test {inputs} must have the same shape')
  if num_classes is None:
    # The user's class ids are kept: C is the largest training label + 1, so a class may be absent from training
    # (warned below), but none may lie above the largest one trained on, which no output would stand for.
    num_classes = int(train['label'].max()) + 1
    if num_classes <= 0:  # dense labels, every position ignored
      raise DataError(f'{names["train"][1]}: no position carries a label (every one is the ignored label); give '
                      'labelled positions to train on')
    where, rule, absent_fix = ('C = the largest training label + 1', ', and the largest class must appear in training',
                               'relabel to 0..C-1')
  else:
    where, rule, absent_fix = f'{source} has {num_classes} classes', '', 'train on a split that holds every class'
  for split_name, split in (('train', train), ('test', test)):
    if split is None:
      continue
    largest = int(split['label'].max())
    if largest >= num_classes:
      raise DataError(f'{names[split_name][1]}: label {largest} is outside 0..{num_classes - 1} ({where}); '
                      f'labels must be class indices 0..C-1{rule}')
  _warn_absent_classes(train['label'], num_classes, absent_fix)
  dense = train['label'].ndim > 1 and np.issubdtype(train['label'].dtype, np.integer)  # a class per position
  return Dataset(train=train, test=test, source=source, num_classes=num_classes, inputs=inputs,
                 task='dense' if dense else 'classification')


def _warn_absent_classes(labels: np.ndarray, num_classes: int, fix: str):
  """Training goes on without some classes (labels {1, 2, 3} train 4 outputs), but says so (`errors.hint`): the
  members learn to give an absent class no probability, which is rarely what was meant."""
  labels = labels[labels != IGNORED]  # dense labels' positions without one
  absent = np.flatnonzero(np.bincount(labels, minlength=num_classes) == 0)
  if not len(absent):
    return
  listed = ', '.join(map(str, absent[:_LISTED_CLASSES])) + (', ...' if len(absent) > _LISTED_CLASSES else '')
  what, appear, them = ('class', 'appears', 'it') if len(absent) == 1 else (f'{len(absent)} classes', 'appear', 'them')
  errors.hint(f'{what} {listed} never {appear} in the training labels: the members will never predict {them}; {fix} '
              'if that is not meant')
