"""Features and targets standardised on the host, in float64, by the training split's statistics: what keeps a
loop of fits on the same compiled programs (they compute in standardised units, whatever the data's). A loaded
ensemble does the same (`api.read`); a member the command-line tools restore does it on the device instead (its
data description records the statistics).

  train, test, data_info, program_info = standardise.splits(dataset, train, recipe)   # ensemble/loop.py
"""

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from ensemble import data, members, tasks
from ensemble.defaults import Recipe
from ensemble.errors import UsageError


def input_stats(inputs: np.ndarray, kind: str,
                standardize_features: bool = False) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """(mean, std) that `steps.Member.prepare` standardises with: per channel for images, per feature for features
  when asked, and (0,), (1,), which leave them as they are, otherwise."""
  if kind == 'images':
    return data.channel_stats(inputs)
  if kind == 'features' and standardize_features:
    return data.arrays.feature_stats(inputs)
  return (0.0,), (1.0,)


def splits(dataset: data.Dataset, train: data.Split, recipe: Recipe):
  """(train, test, data_info, program_info): the splits as the programs take them, and two descriptions of the data.

  Regression targets, and features when `standardize_features` asks, are
  standardised here on the host in float64 by the training split's mean and
  standard deviation (a constant one's taken as 1), then cast: `data_info`
  records those statistics for checkpoints (`load` standardises by them on the
  host, a member the command-line tools restore on the device), while
  `program_info` leaves them out, so that the programs do not change when the
  data does: they compute in standardised units, for as many targets as the
  data has. Images are normalised by their per-channel
  statistics on the device, after augmentation, as data of the programs
  (each member's `TrainState.inputs`, which the run sets), not constants.
  """
  test, sample = dataset.test, data.stream.sample(train)
  target_stats, task = None, tasks.create(recipe)  # the recipe's: a quantile task's outputs depend on its levels
  if task.standardises_targets:
    # Per target, the labels' last axis (a quantile student's (N, Q, D) hold a row of targets per level).
    targets = sample['label'].astype(np.float64).reshape(-1, sample['label'].shape[-1])
    with np.errstate(over='ignore', invalid='ignore'):  # beyond float64: refused just below
      target_mean, target_std = targets.mean(0), targets.std(0)
    target_std = np.where(target_std > 0, target_std, 1.0)
    in_float32(np.concatenate([target_mean, target_std]), "the targets' mean and standard deviation")
    target_stats = (target_mean, target_std)
    train = data.stream.transformed(train, label=functools.partial(_standardised, target_stats,
                                                                   'the training targets, standardised'))
    if test is not None:
      test = data.stream.transformed(test, label=functools.partial(_standardised, target_stats,
                                                                   'the test targets, standardised'))
  mean, std = input_stats(sample['image'], dataset.inputs, recipe.standardize_features)
  outputs = task.model_outputs(dataset.num_classes)
  positions = ()
  if task.per_position:  # the labels' shape per input (a teacher's probabilities have their classes after it)
    labels = sample['label']
    positions = labels.shape[1:-1] if np.issubdtype(labels.dtype, np.floating) else labels.shape[1:]
  data_info = members.data_info(dataset.image_shape, outputs, mean, std, inputs=dataset.inputs,
                                target_stats=target_stats, positions=positions)
  program_info = {k: v for k, v in data_info.items() if not k.startswith('target_')}
  if dataset.inputs == 'features':  # standardised here, if at all: the programs take the features as they come
    program_info.update(mean=[0.0], std=[1.0])
    transform = feature_transform(data_info)
    features = lambda name: functools.partial(_features, transform, f'the {name} features')
    train = data.stream.transformed(train, image=features('training'))
    test = data.stream.transformed(test, image=features('test')) if test is not None else None
  return train, test, data_info, program_info


def _standardised(stats: tuple[np.ndarray, np.ndarray], what: str, targets: np.ndarray) -> np.ndarray:
  mean, std = stats
  return in_float32((targets.astype(np.float64) - mean) / std, what)


def _features(transform, what: str, features: np.ndarray) -> np.ndarray:
  return in_float32(transform(features) if transform else features, what)


def in_float32(values: np.ndarray, what: str) -> np.ndarray:
  """`values` as the float32 the programs compute in; a value beyond its range (3.4e38) is a one-line error, where
  training would only report divergence."""
  with np.errstate(over='ignore'):
    cast = values.astype(np.float32)
  if not np.isfinite(cast).all():
    fix = 'set standardize_features=True, or rescale them' if 'features' in what else 'rescale them'
    raise UsageError(f'{what} reach {np.abs(values).max():.3g}, beyond float32 (3.4e38) that the members compute in; '
                     f'{fix}')
  return cast


def feature_transform(data_info: dict[str, Any], xp=np):
  """The host's standardisation of features by `data_info`'s per-feature statistics (in float64), or None where
  the features are not standardised (their statistics are 0 and 1: they pass as they are). With xp=jnp, the same
  traced (in float32), for `Ensemble.apply`."""
  if data_info.get('inputs') != 'features':
    return None
  if all(m == 0.0 for m in data_info['mean']) and all(s == 1.0 for s in data_info['std']):
    return None
  dtype = np.float64 if xp is np else jnp.float32
  mean, std = xp.asarray(data_info['mean'], dtype), xp.asarray(data_info['std'], dtype)
  return lambda features: features_by(features, mean, std)


def features_by(features: Any, mean: Any, std: Any) -> Any:
  """(N, ...) features standardised per feature by `mean` and `std` (F,), in their dtype: on the host, or traced
  where the statistics are arguments of a program (`Ensemble.apply_variables`)."""
  flat = features.reshape(-1, mean.shape[-1]).astype(mean.dtype)  # -1: a symbolic batch too (ensemble.export)
  return ((flat - mean) / std).reshape(features.shape)
