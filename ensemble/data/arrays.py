"""Every array a user passes, checked here for its role: what `ensemble.fit` trains, validates and tests on (a
Dataset), and what an `Ensemble` is asked to calibrate on, score or predict.

Images, feature vectors (tabular data) and integer token ids (sequences) all
come as arrays, with labels where the role has them, checked once, before
anything runs, so that a bad array fails in one line that names its role
('train', 'validation', 'test', 'calibrate', 'conformal', 'flags', 'evaluate',
'predict') instead of inside a jitted step.
"""

from typing import Any

import numpy as np

from ensemble import tasks
from ensemble.data import base


def kind_of(inputs: np.ndarray) -> str:
  """What `inputs` are when the caller does not say: integer ids are tokens, uint8 or 4-D arrays images
  ((N, H, W) uint8 or (N, H, W, C)), other floats features."""
  if np.issubdtype(inputs.dtype, np.integer) and inputs.dtype != np.uint8:
    return 'tokens'
  if inputs.ndim == 4 or (inputs.dtype == np.uint8 and inputs.ndim == 3):
    return 'images'
  return 'features'


def as_array(values: Any, role: str, what: str = 'inputs') -> np.ndarray:
  try:
    return np.asarray(values)
  except ValueError as e:  # a ragged list
    raise base.DataError(f'{role}: {what} cannot be made an array ({base.first_line(e)}); give equally shaped '
                         'examples') from None


def pair(split: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
  if not isinstance(split, (tuple, list)) or len(split) != 2:
    raise base.DataError(f'{name}: give a pair (inputs, labels) of arrays, got {type(split).__name__}')
  inputs, labels = split
  return as_array(inputs, name), as_array(labels, name, 'labels')


def inputs(values: Any, kind: str, role: str, shape: tuple[int, ...], trained_on: str) -> np.ndarray:
  """`values` as (N, *shape) of what members trained on `kind` inputs of `shape` take (`as_inputs`, images by
  `base.as_images`): what an Ensemble is asked about. `trained_on` names the ensemble in the messages."""
  values = as_array(values, role)
  if kind == 'images' and shape[-1] == 1 and values.ndim == len(shape) and values.shape[1:] == shape[:-1]:
    values = values[..., None]  # greyscale (N, H, W)
  if values.ndim != len(shape) + 1 or values.shape[1:] != tuple(shape):
    raise base.DataError(f'{role}: {kind} of shape {values.shape}, but {trained_on} was trained on '
                         f'{"x".join(map(str, shape))} {kind}; give a batch of shape (N, {", ".join(map(str, shape))})')
  if kind == 'images':  # as training saw them: [0, 1] floats rounded to 8 bits
    return base.as_images(values, role)
  return as_inputs(values, kind, role)


def as_inputs(inputs: np.ndarray, kind: str, name: str) -> np.ndarray:
  """Features (float32, or float64 where float32 would round them: `base.host_float`) or int32 token ids (N, ...);
  images go through `base.as_images`."""
  if inputs.ndim < 2:
    raise base.DataError(f'{name}: inputs of shape {inputs.shape}; give one row per example, (N, ...) with at least '
                         'one value each (a single feature as x[:, None])')
  if kind == 'tokens':
    if not np.issubdtype(inputs.dtype, np.integer):
      raise base.DataError(f'{name}: token ids of dtype {inputs.dtype}; give integer ids (x.astype(np.int32)), or '
                           "inputs='features' for float values")
    if inputs.size and (inputs.min() < 0 or inputs.max() > np.iinfo(np.int32).max):
      raise base.DataError(f'{name}: token ids must lie in 0..2**31-1, got [{inputs.min()}, {inputs.max()}]')
    return inputs.astype(np.int32)
  if not (np.issubdtype(inputs.dtype, np.floating) or np.issubdtype(inputs.dtype, np.integer)):
    raise base.DataError(f'{name}: inputs of dtype {inputs.dtype}; give numbers (float features, uint8 images or '
                         'integer token ids)')
  features = base.host_float(inputs)
  if not np.isfinite(features).all():
    raise base.DataError(f'{name}: inputs hold NaN or infinite values (first at example '
                         f'{int(np.argmin(np.isfinite(features).reshape(len(features), -1).all(1)))}); '
                         'impute or drop them first')
  return features


def split(split_: Any, kind: str, name: str, task: str = tasks.DEFAULT, source: str = 'arrays',
          outputs: int | None = None, ignore: int = base.IGNORED) -> base.Split:
  """One (inputs, labels) pair of `fit` as a Split, checked for its role `name` ('train', 'test', 'validation');
  with `outputs`, class labels must lie within those classes, and rows of labels be as wide (a validation split's,
  the training data's)."""
  checked = _split(split_, kind, name, task, source, ignore)
  task_ = tasks.named(task)
  if outputs is not None and task_.has_classes:
    task_.within_classes(checked['label'], outputs, name)
  elif outputs is not None and checked['label'].shape[1] != outputs:
    raise base.DataError(f"{name}: {checked['label'].shape[1]} {task_.noun[1]} per example, but the training data "
                         f'has {outputs}; give every split the same {task_.noun[1]}')
  return checked


def _split(split: Any, kind: str, name: str, task: str = tasks.DEFAULT, source: str = 'arrays',
           ignore: int = base.IGNORED) -> base.Split:
  """One pair's inputs checked for `kind` and its labels read by `task` beside them (`Task.split_labels`)."""
  inputs, labels = pair(split, name)
  if source != 'arrays':
    name = f'{source}: {name}'
  if len(inputs) != len(labels):
    raise base.DataError(f'{name}: {len(inputs)} inputs but {len(labels)} labels; give one label per example')
  base.check_examples(len(inputs), f'{name} inputs')
  if kind == 'images':
    if np.issubdtype(inputs.dtype, np.floating) and not np.isfinite(inputs).all():
      raise base.DataError(f'{name}: images hold NaN or infinite values; give uint8 pixels or floats in [0, 1]')
    return base.make_split(inputs, labels, f'{name} images', f'{name} labels', task, ignore)
  inputs = as_inputs(inputs, kind, name)
  return {'image': inputs, 'label': tasks.named(task).split_labels(labels, inputs, f'{name} labels', ignore)}


def from_arrays(train: Any, test: Any | None, inputs: str = 'auto', task: str = tasks.DEFAULT,
                source: str = 'arrays', ignore: int = base.IGNORED) -> base.Dataset:
  """(x, y) pairs -> a Dataset of `inputs` ('auto': `kind_of` the training inputs) from `source`, its labels
  those of `task` (ensemble/tasks/: class indices, per position for a dense task, `ignore` where a position has
  none; float targets (N,) or (N, D); 0s and 1s (N, L))."""
  kind = kind_of(pair(train, 'train')[0]) if inputs == 'auto' else inputs
  splits = {name: None if split is None else _split(split, kind, name, task, source, ignore)
            for name, split in (('train', train), ('test', test))}
  names = {name: (f'{name} inputs', f'{name} labels') for name in splits}
  if tasks.named(task).has_classes:
    return base.make_dataset(splits['train'], splits['test'], source, names, inputs=kind, task=task)
  return labelled_rows(splits['train'], splits['test'], source, names, kind, task)


def labelled_rows(train: base.Split, test: base.Split, source: str, names: dict[str, tuple[str, str]],
                  inputs: str, task: str) -> base.Dataset:
  """A Dataset of a row of labels per example (targets, 0/1 labels): checks that the splits agree in input shape
  and in the number of targets (labels)."""
  for index, what in ((0, inputs), (1, tasks.named(task).noun[1])):
    key = 'image' if index == 0 else 'label'
    if test is not None and train[key].shape[1:] != test[key].shape[1:]:
      raise base.DataError(f'{names["test"][index]}: {what} of shape {test[key].shape[1:]} per example, but the '
                           f'training {what} have {train[key].shape[1:]}; give both splits the same')
  return base.Dataset(train=train, test=test, source=source, num_classes=train['label'].shape[1], inputs=inputs,
                      task=task)


def feature_stats(features: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-feature mean and standard deviation (flattened, float64 sums), a constant feature's std taken as 1."""
  flat = features.reshape(len(features), -1).astype(np.float64)
  with np.errstate(over='ignore', invalid='ignore'):
    mean, std = flat.mean(0), flat.std(0)
  if not (np.isfinite(mean).all() and np.isfinite(std).all()):
    raise base.DataError(f'features reach {np.abs(flat).max():.3g}: their mean and standard deviation overflow even '
                         'float64, and standardised they would all be 0; rescale them')
  std = np.where(std > 0, std, 1.0)
  return tuple(float(m) for m in mean), tuple(float(s) for s in std)
