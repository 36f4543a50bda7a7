"""What every source returns, and the checks that turn a source's arrays into it.

Kept apart from `ensemble.data` so that the source modules can import it
without importing the package that imports them.
"""

import dataclasses
import math
import zipfile
from typing import BinaryIO

import numpy as np

from ensemble import errors, tasks
from ensemble.tasks import IGNORED  # noqa: F401  # a dense label's position without a label, as programs take it
from ensemble.tasks.base import host_float  # noqa: F401  # features and targets on the host, as the sources read them

# {'image': the inputs, 'label': int32 (N,)}. The inputs are uint8 images (N, H, W, C) for every source on disk;
# arrays given to `ensemble.fit` may also be float32 features or int32 token ids of any shape (N, ...).
Split = dict[str, np.ndarray]

# The most absent classes a warning lists by number.
_LISTED_CLASSES = 10


DataError = errors.DataError  # a data file or dataset that is missing or malformed


HOST_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))  # what features and targets may be on the host
# What images are on the host: 8-bit pixels, or float32 in [0, 1] where they came as floats (a 16-bit scan rescaled,
# a render), kept at their precision: rounded to 8 bits, a class that lives below one 8-bit step is lost.
IMAGE_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32))


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
  num_classes: int  # what the task's labels count (`Task.noun`): classes, targets D, labels L
  inputs: str = 'images'  # what the inputs are: steps.INPUTS
  task: str = tasks.DEFAULT  # the labels' task (ensemble/tasks/), which reads and checks them

  def __post_init__(self):
    # A loader that breaks the layout would otherwise fail far away, inside a jitted step.
    # Features and targets may stay float64 until the loop standardises them (ensemble/loop.py): cast first, a
    # target of 1.7e9 +- 30 would keep one distinct value in 512.
    layouts = {'images': (IMAGE_DTYPES, 'uint8 or float32 (N, H, W, C)'),
               'features': (HOST_FLOATS, 'float32/64 (N, ...)'), 'tokens': ((np.int32,), 'int32 (N, ...)')}
    dtypes, layout = layouts[self.inputs]
    for name, split in (('train', self.train), ('test', self.test)):
      if split is None:
        continue
      images, labels = split['image'], split['label']
      if images.dtype not in dtypes or images.ndim < 2 or (self.inputs == 'images' and images.ndim != 4):
        raise ValueError(f'Dataset.{name}: {self.inputs} must be {layout}, got {images.dtype} {images.shape}')
      problem = self.kind.layout_error(labels, images, self.num_classes)
      if problem or labels.shape[:1] != images.shape[:1]:
        raise ValueError(f'Dataset.{name}: {problem or f"{len(labels)} labels for {len(images)} inputs"}')
    if self.test is not None and self.train['image'].shape[1:] != self.test['image'].shape[1:]:
      raise ValueError(f'Dataset: train images {self.train["image"].shape[1:]} but test images '
                       f'{self.test["image"].shape[1:]}')

  @property
  def kind(self) -> tasks.Task:
    """The task whose labels these are: what reads, checks and counts them."""
    return tasks.named(self.task)

  @property
  def image_shape(self) -> tuple[int, ...]:
    """One input's shape, (H, W, C) for images; the same for both splits."""
    return tuple(int(d) for d in self.train['image'].shape[1:])

  def describe(self) -> str:
    """'10 classes, images 28x28x1' or '1 target, features 3': the start of a run names what the members predict,
    and a regression run has targets, not classes."""
    return f'{self.kind.describe(self.num_classes)}, {self.inputs} {"x".join(map(str, self.image_shape))}'


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


def float_images(images: np.ndarray, name: str) -> np.ndarray:
  """Float images as float32, checked chunk by chunk to lie in [0, 1] (what the device takes as the pixel range)."""
  if not images.size:
    return images.astype(np.float32)
  low, high = float(images.min()), float(images.max())  # NaN propagates into both
  if np.isnan(low) or np.isnan(high):
    raise DataError(f'{name}: float images contain NaN; store uint8 (0..255) or float in [0, 1]')
  if low < 0.0 or high > 1.0:
    raise DataError(f'{name}: float images must lie in [0, 1] but span [{low:g}, {high:g}]; scale them to [0, 1] '
                    "(x / 255 for 0..255 values), or give standardised values as features (inputs='features')")
  return images.astype(np.float32, copy=False)


def as_images(images: np.ndarray, name: str) -> np.ndarray:
  """(N, H, W, C) uint8 or float32 in [0, 1]: (N, H, W) gains C=1 (a view), uint8 is kept as is, floats keep
  their precision as float32 (for training and prediction alike: the members see the same pixels)."""
  images = images[..., None] if images.ndim == 3 else images
  if images.dtype == np.uint8:
    return images
  if np.issubdtype(images.dtype, np.floating):
    return float_images(images, name)
  raise DataError(f'{name}: images of dtype {images.dtype}; store them as uint8 (0..255) or as float in [0, 1]')


def check_examples(count: int, name: str):
  """Refuses an empty split where a source's arrays become one (`make_split`, `arrays.from_arrays`): past here,
  zero rows fail far from their cause, in numpy's reductions (which have no identity) or as NaN scores."""
  if not count:
    raise DataError(f'{name}: no examples, the split is empty; give it at least one example')


def make_split(images: np.ndarray, labels: np.ndarray, images_name: str, labels_name: str,
               task: str = tasks.DEFAULT, ignore: int = IGNORED) -> Split:
  """Checks one split's images and their labels (as `task` reads them) and brings them to the Split layout.

  `images_name` and `labels_name` say where the arrays came from (a file, or a
  file and a field): every error names them.
  """
  _check_image_layout(images, images_name)
  if len(images) != len(labels):
    raise DataError(f'{images_name} / {labels_name}: {len(images)} images but {len(labels)} labels; '
                    'images and labels must come from the same split, in the same order')
  check_examples(len(images), images_name)
  images = as_images(images, images_name)
  return {'image': images, 'label': tasks.named(task).split_labels(labels, images, labels_name, ignore)}


def make_dataset(train: Split, test: Split, source: str, names: dict[str, tuple[str, str]],
                 num_classes: int | None = None, inputs: str = 'images', task: str = tasks.DEFAULT) -> Dataset:
  """Checks that the splits of class labels (of `task`: a class per input, or per position) agree; without
  `num_classes`, it is the largest training label + 1.

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
    kind = tasks.named(task)
    num_classes = kind.num_outputs(train['label'])
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
    largest = int(tasks.named(task).labelled(split['label']).max(initial=-1))
    if largest >= num_classes:
      raise DataError(f'{names[split_name][1]}: label {largest} is outside 0..{num_classes - 1} ({where}); '
                      f'labels must be class indices 0..C-1{rule}')
  _warn_absent_classes(tasks.named(task).labelled(train['label']), num_classes, absent_fix)
  return Dataset(train=train, test=test, source=source, num_classes=num_classes, inputs=inputs, task=task)


def _warn_absent_classes(labels: np.ndarray, num_classes: int, fix: str):
  """Training goes on without some classes (labels {1, 2, 3} train 4 outputs), but says so (`errors.hint`): the
  members learn to give an absent class no probability, which is rarely what was meant."""
  absent = np.flatnonzero(np.bincount(labels, minlength=num_classes) == 0)
  if not len(absent):
    return
  listed = ', '.join(map(str, absent[:_LISTED_CLASSES])) + (', ...' if len(absent) > _LISTED_CLASSES else '')
  what, appear, them = ('class', 'appears', 'it') if len(absent) == 1 else (f'{len(absent)} classes', 'appear', 'them')
  errors.hint(f'{what} {listed} never {appear} in the training labels: the members will never predict {them}; {fix} '
              'if that is not meant')
