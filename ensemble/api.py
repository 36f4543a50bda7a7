"""The library: `fit` an ensemble of your own Flax model on your own arrays, `load` one, ask it with `Ensemble`.

  import ensemble
  ensemble.cpu_devices(8)                        # on a CPU, before JAX starts: 8 simulated devices
  ens = ensemble.fit(MyModel(), (x_train, y_train), test=(x_test, y_test), ensemble_size=8, epochs=10)
                                                 # in memory: nothing is written unless workdir= is given
  ens.predict(x)                                 # probabilities, class, entropy, mutual information, ...
  ens.evaluate(x_test, y_test)                   # accuracy, NLL, Brier, ECE: ensemble and mean member
  ens.save('/tmp/run')                           # python -m ensemble.evaluate / predict / export read it

Nothing here defines flags, sets up logging, changes JAX's settings or exits: the programs
(`ensemble.train`, `.evaluate`, `.predict`, `.export`) are shells over these
calls and `ensemble.loop`'s, and turn `UsageError` into one `error:` line.
Every mistake a caller can make raises `UsageError`, a ValueError, and its
message names `fit`'s keywords (`learning_rate=`), not the programs' flags.
"""

import functools
import hashlib
import json
import math
import numbers
import os
import re
import shutil
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from ensemble import calibration, console, data, defaults, files, host_memory, loop, members, optim, predictor
from ensemble import recipe as recipe_lib, steps
from ensemble.data import arrays
from ensemble.errors import UsageError
from ensemble.tasks import regression
from ensemble import sharing
from ensemble.uncertainty import conformal, decomposition, selective

DEFAULT_FLAG_RISK = 0.01
# The flag is two tests. The total predictive entropy counts both kinds of doubt, a blurred digit (aleatoric) and a
# shape no member has seen (epistemic), and its threshold keeps the error rate of the unflagged held-out images at
# the target risk; but an accurate ensemble meets a 1% risk with every image unflagged, and flags nothing. So an
# input is also flagged when the members disagree on it (mutual information) more than on all but
# DEFAULT_FLAG_OOD_RATE of the held-out images: on MNIST (K=8, 3 epochs) that flags 95% of uniform-noise images and
# 75% of digits rotated by 90 degrees, and 2.0% of the test set (docs/predict-and-export.md).
FLAG_SCORE = 'entropy'
OOD_SCORE = 'mutual_information'
DEFAULT_FLAG_OOD_RATE = 0.02


def flagged(result: dict[str, np.ndarray], fitted: dict[str, Any]) -> np.ndarray:
  """(N,) bool: which of `predict`'s results to refer, by the thresholds `Ensemble.flag_threshold` fitted."""
  return (result[FLAG_SCORE] > fitted['threshold']) | (result[OOD_SCORE] > fitted['ood_threshold'])


def _evaluation():
  """ensemble.evaluation, imported where a workdir is read or a test set scored: it brings orbax, scipy's
  optimizers and matplotlib, which a fit in memory and its predictions do without."""
  from ensemble import evaluation  # pylint: disable=g-import-not-at-top
  return evaluation


def bucket(n: int, batch_size: int) -> int:
  """The batch size `n` images are padded to: the next power of two, at most `batch_size`.

  Each bucket compiles once, so any number of images costs at most
  log2(batch_size) + 1 programs, and padding at most doubles the work of a small batch.
  """
  return min(batch_size, data.bucket_rows(n))


def _fitted_temperature(workdir: str, config: recipe_lib.Recipe, epoch: int) -> float | None:
  """The temperature `ensemble.evaluate` fitted (in WORKDIR/eval/metrics.json; for a regression workdir its
  variance scale, regression's temperature), if it was fitted for this checkpoint and on the held-out slice of the
  data this run was trained on; None, with a warning that says why, if not."""
  path = os.path.join(workdir, 'eval', 'metrics.json')
  try:
    with open(path, encoding='utf-8') as f:
      results = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    logging.warning('%s cannot be read (%s): predicting without temperature scaling.', path, e)
    return None
  temperature = results.get('temperature_scaling', {}).get('temperature',
                                                          results.get('variance_scaling', {}).get('scale'))
  if temperature is None:
    return None
  fitted_on, trained_on = (recipe_lib.data_location(results.get('data_dir', '')),
                           recipe_lib.data_location(config.data_dir))
  if results.get('epoch') != epoch:
    problem = f'was fitted for epoch {results.get("epoch")}, not {epoch}'
  elif results.get('checkpoint') != _evaluation().checkpoint_id(workdir, epoch):
    problem = (f'was fitted for another checkpoint of epoch {epoch} (the run was trained again since)'
               if results.get('checkpoint') else 'does not record the checkpoint it was fitted for (an older version)')
  elif config.dataset != data.ARRAYS and fitted_on != trained_on:  # arrays in memory: --data_dir names them
    problem = (f'was fitted on the held-out slice of {fitted_on or "the named dataset"}, not of the data the run was '
               f'trained on ({trained_on or config.dataset})')
  else:
    return temperature
  logging.warning('The temperature in %s %s: predicting without temperature scaling; run python -m '
                  'ensemble.evaluate --workdir=%s --step=%d to fit one.', path, problem, workdir, epoch)
  return None


def _in_fit_terms(fn):
  """`fn`'s UsageError in the terms of `fit`'s keywords: `--config.FIELD` becomes `FIELD=`, `--workdir` `workdir=`;
  and the caller's root logger as it was (`console.root_logging_kept`)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    try:
      with console.root_logging_kept():
        return fn(*args, **kwargs)
    except UsageError as e:
      message = re.sub(r'--config\.(\w+)(=?)', r'\1=', str(e))
      e.args = (re.sub(r'--(workdir|step)\b', r'\1=', message),)
      raise
  return wrapped


@functools.lru_cache(maxsize=64)
def _output_width(member: steps.Member) -> int:
  """A member's number of outputs, traced once per member: the ensembles of a loop of fits share theirs."""
  state = jax.eval_shape(member.init, jax.random.key(0))
  return int(jax.eval_shape(member.predict, state, member.example_input()).shape[-1])


class Ensemble:
  """A trained ensemble, restored onto the devices at hand, that answers about new inputs.

  What `fit` and `load` return. `temperature` scales the mean probabilities
  (1: left as averaged), or for regression every component's variance (the
  variance scale); `load` takes it from `ensemble.evaluate`'s report when
  there is one.
  """

  def __init__(self, workdir: str | None, config: recipe_lib.Recipe, member: steps.Member,
               state: steps.TrainState, devices: Sequence[jax.Device], epoch: int, temperature: float = 1.0,
               batch_size: int = 1000, *, task: Any = None, data_info: dict[str, Any] | None = None,
               summary: dict[str, float] | None = None):
    self.workdir, self.config, self.member, self.state = workdir, config, member, state
    self.devices, self.epoch, self.temperature, self.batch_size = list(devices), epoch, temperature, batch_size
    self.task = member.task if task is None else task  # ensemble/tasks/: task.name is 'classification' or 'regression'
    # An ensemble in memory (`fit`) keeps its data's description for `save`, and standardises features on the host
    # by it, as its programs were trained (ensemble/loop.py); a restored member does that on the device.
    self._data_info, self.summary = data_info, summary or {}
    self._transform = loop.feature_transform(data_info) if data_info else None
    self._predictors: dict[int, predictor.Predictor] = {}
    # Split-conformal calibration (`conformal`): {'alpha', 'score', 'quantile', 'examples'}, or None.
    self.conformal_calibration: dict[str, Any] | None = None

  @property
  def _name(self) -> str:
    return self.workdir or 'the ensemble'

  def __repr__(self) -> str:
    if self.task.name == 'regression':
      predicts = console.count(self.task.targets, 'target')
    else:
      predicts = console.count(self.num_classes, 'class', 'classes')
    where = f'workdir={self.workdir!r}' if self.workdir else 'in memory'
    calibrated = ''.join(f', {name} {value:.4g}' for name, value in self._calibration().items())
    return (f'Ensemble({console.count(self.size, "member")} of {self.config.model}, {self.task.name} of '
            f'{predicts} from {"x".join(map(str, self.input_shape))} {self.member.inputs}, '
            f'{self.config.checkpoint_unit} {self.epoch}{calibrated}, '
            f'{where})')

  def _calibration(self) -> dict[str, float]:
    """What calibrates the predictions, as `repr` and `summary` name it: the temperature (a regression ensemble's
    variance scale), and the conformal sets' or intervals' miscoverage alpha."""
    found = {}
    if self.temperature != 1.0:
      found['variance_scale' if self.task.name == 'regression' else 'temperature'] = float(self.temperature)
    if self.conformal_calibration:
      found['conformal_alpha'] = float(self.conformal_calibration['alpha'])
    return found

  def _calibrated(self, **changes) -> 'Ensemble':
    """A copy of this ensemble (its members shared, not copied) with `changes`, its summary saying them."""
    copy = Ensemble(self.workdir, self.config, self.member, self.state, self.devices, self.epoch, self.temperature,
                    self.batch_size, task=self.task, data_info=self._data_info, summary=dict(self.summary))
    copy.conformal_calibration = self.conformal_calibration
    for name, value in changes.items():
      setattr(copy, name, value)
    copy._predictors = self._predictors  # pylint: disable=protected-access  # the same members' programs
    copy.summary = {**{k: v for k, v in copy.summary.items()
                       if k not in ('temperature', 'variance_scale', 'conformal_alpha')}, **copy._calibration()}  # pylint: disable=protected-access
    return copy

  def calibrate(self, inputs: Any, labels: Any) -> 'Ensemble':
    """A copy calibrated on labelled data the members did not train on: a classification ensemble's temperature,
    a regression ensemble's variance scale (every component's variance times it), each the value that minimises
    the NLL there (`calibration.fit_temperature`, `regression.scale_variances`). Its `predict`, `evaluate`
    ('temperature_scaled' / 'variance_scaled' scores beside the members' own), `save` and `export` use it."""
    inputs = self._labelled(inputs)
    if self.task.name == 'regression':
      targets = self._targets(labels, len(inputs))
      means, variances = self.components(inputs)
      return self._calibrated(temperature=regression.scale_variances(means, variances, targets))
    labels = self._classes(labels, len(inputs))
    return self._calibrated(temperature=calibration.fit_temperature(self.member_probs(inputs).mean(0), labels))

  def conformal(self, inputs: Any, labels: Any, alpha: float = 0.1, score: str = 'thr') -> 'Ensemble':
    """A copy whose `predict` also returns split-conformal prediction sets (classification: 'set', (N, C)
    booleans) or intervals (regression: 'conformal_lower', 'conformal_upper', the mixture's mean +/- q times its
    std), calibrated on these labelled examples, which the members must not have trained on.

    For an input exchangeable with them, the set holds its class (the interval
    its target) with probability at least 1 - alpha, whatever the members
    (ensemble/uncertainty/conformal.py). `score`: 'thr' (the smallest sets on
    average) or 'aps' (adaptive sets, larger where the members are unsure; not
    randomised, so that an input's set is a function of it, and so
    conservative); regression's score is |y - mean| / std. The sets use the ensemble's
    probabilities as `predict` gives them (after a `calibrate` temperature).
    """
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < 1:
      raise UsageError(f'alpha={alpha!r} must be in (0, 1), the miscoverage: e.g. alpha=0.1 for 90% sets')
    inputs = self._labelled(inputs)
    needed = conformal.rows_needed(alpha)
    if len(inputs) < needed:
      raise UsageError(f'alpha={alpha:g} needs at least {needed} calibration examples (the '
                       f'ceil((n + 1)(1 - alpha))-th smallest score must exist), and {len(inputs)} were given; give '
                       'more, or raise alpha')
    if self.task.name == 'regression':
      targets = self._targets(labels, len(inputs))
      moments = self.predict(inputs, levels=())
      mean, std = (moments[k].reshape(len(inputs), -1) for k in ('mean', 'std'))
      q = regression.conformal_quantile(mean, std, targets, alpha)
      found = {'alpha': float(alpha), 'score': 'normalised', 'quantile': [float(v) for v in q],
               'examples': len(inputs)}
    else:
      if score not in conformal.SCORES:
        raise UsageError(f'score={score!r}: give one of {sorted(conformal.SCORES)}')
      labels = self._classes(labels, len(inputs))
      q = conformal.calibrated_quantile(self.predict(inputs)['probs'], labels, alpha, score)
      found = {'alpha': float(alpha), 'score': score, 'quantile': q, 'examples': len(inputs)}
    return self._calibrated(conformal_calibration=found)

  def _targets(self, targets: Any, count: int) -> np.ndarray:
    """A regression ensemble's targets for `count` inputs, (N, D) float64, checked."""
    targets = np.asarray(targets)
    if targets.shape[:1] != (count,):
      raise UsageError(f'targets of shape {targets.shape}; give {count} targets, one row per input')
    targets = data.base.as_targets(targets, 'targets').astype(np.float64)
    if targets.shape[1] != self.task.targets:
      raise UsageError(f'{targets.shape[1]} targets per input, but {self._name} predicts {self.task.targets}')
    return targets

  def _classes(self, labels: Any, count: int) -> np.ndarray:
    """A classification ensemble's labels for `count` inputs, as int32 class indices, checked."""
    labels = np.asarray(labels)
    if labels.shape != (count,) or not np.issubdtype(labels.dtype, np.integer):
      raise UsageError(f'labels of shape {labels.shape} and dtype {labels.dtype}; give {count} integer class '
                       f'indices, one per input')
    if len(labels) and not 0 <= labels.min() <= labels.max() < self.num_classes:
      raise UsageError(f'labels span [{labels.min()}, {labels.max()}], outside the {self.num_classes} classes '
                       f'0..{self.num_classes - 1} the members predict')
    return labels.astype(np.int32)

  @property
  def params(self) -> Any:
    """What the members predict with, each leaf (K, ...): what `apply` takes. Their parameters; for methods that
    predict with what they kept, a dict of the parameters and that (snapshot: 'params', 'snapshots'; multiswag:
    'params' and the SWAG moments 'mean', 'variance', 'deviations'), so that `apply` is a function of all of it."""
    return self.member.method.params_of(self.state)

  def apply(self, params: Any, inputs: jax.Array) -> Any:
    """Every member's output for a batch of `inputs`, as a pure JAX function of `params` (what `params` gives, each
    leaf (K, ...)): it runs under `jax.jit`, `jax.grad` and `jax.vmap`, so that an acquisition function or the
    predictive mean can be differentiated with respect to the inputs or the parameters.

    Classification: (K, N, C) log-probabilities. Regression: (means, variances), each (K M, N, D) in the targets'
    units (M = 1 component per member, or a snapshot member's snapshots); the mixture's mean is `means.mean(0)`.
    The members' other state (BatchNorm's averages) is the trained one; no temperature is applied.
    """
    inputs = jax.numpy.asarray(inputs)
    if self._transform is not None:
      inputs = loop.feature_transform(self._data_info, xp=jax.numpy)(inputs)
    state = self.member.method.with_params(self.state, params)
    member_output = lambda state: self.member.task.member_output(self.member.predict(state, inputs))
    outputs = jax.vmap(member_output)(state)
    if self.task.name == 'regression':
      return self.task.components(outputs, xp=jax.numpy)
    return outputs

  @property
  def batch_size(self) -> int:
    """Inputs per device program; checked whenever it is set, as a batch size below 1 would predict nothing."""
    return self._batch_size

  @batch_size.setter
  def batch_size(self, value: int):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise UsageError(f'batch_size={value!r} must be a positive number of inputs per device program')
    self._batch_size = int(value)

  @property
  def size(self) -> int:
    return self.config.ensemble_size

  @property
  def image_shape(self) -> tuple[int, ...]:
    return self.member.image_shape

  @property
  def input_shape(self) -> tuple[int, ...]:
    """One input's shape: (H, W, C) for images."""
    return self.member.image_shape

  @property
  def num_classes(self) -> int:
    """The members' number of logits, read off their forward pass (without computing it)."""
    return _output_width(self.member)

  def check(self, images: Any) -> np.ndarray:
    """`images` as (N, *input_shape) of what the members take, checked and converted as `fit` does its training
    arrays; anything else is a one-line UsageError.

    Images: uint8, or float in [0, 1] (rounded to uint8). Features: finite numbers. Tokens: integer ids.
    """
    try:
      images = np.asarray(images)
    except ValueError as e:  # a ragged list
      raise UsageError(f'inputs cannot be made an array ({e}); give equally shaped examples') from None
    shape, expected = self.input_shape, 'x'.join(map(str, self.input_shape))
    kind = self.member.inputs
    if kind == 'images' and shape[-1] == 1 and images.ndim == len(shape) and images.shape[1:] == shape[:-1]:
      images = images[..., None]  # greyscale (N, H, W)
    if images.ndim != len(shape) + 1 or images.shape[1:] != shape:
      raise UsageError(f'{kind} of shape {images.shape}, but {self._name} was trained on {expected} {kind}; '
                       f'give a batch of shape (N, {", ".join(map(str, shape))})')
    if kind == 'images':  # as training saw them: [0, 1] floats rounded to 8 bits
      return data.base.as_images(images, 'inputs')
    inputs = arrays.as_inputs(images, kind, 'inputs')  # the checks fit makes: ids in int32's range, finite features
    return members.ids_checked(self.member, inputs, 'inputs')

  def _labelled(self, inputs: Any) -> np.ndarray:
    """`check`ed inputs to score: at least one, as a mean over none is no score."""
    inputs = self.check(inputs)
    if not len(inputs):
      raise UsageError('evaluate got 0 inputs; give at least one labelled example to score')
    return inputs

  def _require_task(self, task: str, what: str):
    if self.task.name != task:
      raise UsageError(f'{self._name} holds a {self.task.name} ensemble; {what} is for {task} ensembles')

  def member_outputs(self, images: Any, *, progress: bool = False) -> np.ndarray:
    """(K, N, W) float64: every member's output (log-probabilities; a regression member's raw outputs),
    `batch_size` inputs at a time, the last batch bucketed. Outputs that are not finite are never returned: they
    are one UsageError that says for how many inputs, and the likely cause."""
    _check_flag('progress', progress)
    images = self.check(images)
    if self._transform is not None:
      images = self._transform(images)
    if self.member.inputs == 'features':  # what the members compute in: a value beyond float32 is refused
      images = loop.in_float32(images, "the inputs' features")
    starts = range(0, len(images), self.batch_size)
    if progress and len(starts) > 1:
      starts = console.track(starts, 'predicting', unit='batch', items_per_step=self.batch_size, items='images')
    batches = [np.zeros((self.size, 0, self.num_classes))]
    for start in starts:
      chunk = images[start:start + self.batch_size]
      if self.member.inputs == 'images':  # in [0, 1] as the device would make it
        chunk = chunk.astype(np.float32) / 255.0
      split = {'image': chunk, 'label': np.zeros(len(chunk), np.int32)}
      batches.append(self._predictor(bucket(len(chunk), self.batch_size)).log_probs(split))
    outputs = np.concatenate(batches, axis=1)
    finite = np.isfinite(outputs).all(axis=(0, 2))
    if not finite.all():
      cause = _NONFINITE_CAUSES[self.member.inputs]
      raise UsageError(f'{int((~finite).sum())} of {len(finite)} inputs give the members non-finite outputs (NaN '
                       f'or infinity; the first is input {int(np.argmin(finite))}): {cause}')
    return outputs

  def member_probs(self, images: Any, *, progress: bool = False) -> np.ndarray:
    """(K, N, C) float64: every member's probabilities, `batch_size` images at a time, the last batch bucketed."""
    self._require_task('classification', 'member_probs')
    return np.exp(self.member_outputs(images, progress=progress))

  def components(self, inputs: Any, *, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Regression: the mixture's components' (means, variances), each (K M, N, D) in the targets' units: M = 1
    Gaussian per member, or the snapshot_cycles snapshots of a snapshot member."""
    self._require_task('regression', 'components')
    return self.task.components(self.member_outputs(inputs, progress=progress))

  def _predictor(self, batch_size: int) -> predictor.Predictor:
    if batch_size not in self._predictors:
      self._predictors[batch_size] = predictor.Predictor(self.member, self.state, self.devices, batch_size)
    return self._predictors[batch_size]

  def predict(self, images: Any, *, members: bool = False, progress: bool = False,
              levels: Sequence[float] = regression.LEVELS) -> dict[str, np.ndarray]:
    """Per image: 'probs' (N, C), the members' mean, temperature-scaled; 'class' (N,); and, in nats, 'entropy'
    (total predictive), 'aleatoric' (expected member entropy), 'mutual_information' (epistemic: their
    difference) and 'disagreement' (share of member pairs voting differently). 'member_probs' (K, N, C) with
    `members`. A regression ensemble returns the mixture's mean, std, aleatoric and epistemic variance and
    its central intervals holding each of `levels` instead (`_predict_regression`; `levels=()`: none, for a loop
    that needs only the mean and std: the intervals cost most of a small prediction).

    The uncertainty is split on the members' own probabilities, where total =
    aleatoric + epistemic holds; the temperature only rescales 'probs' (and
    leaves 'class' as it is).
    """
    _check_flag('members', members)
    if self.task.name == 'regression':
      return self._predict_regression(images, members=members, progress=progress, levels=levels)
    member_probs = self.member_probs(images, progress=progress)
    probs = member_probs.mean(0)
    if self.temperature != 1.0:
      probs = calibration.temperature_scale(probs, self.temperature)
    result = {'probs': probs, 'class': np.argmax(probs, -1), **decomposition.decompose(member_probs)}
    if self.conformal_calibration:  # the classes whose score is within the calibrated threshold
      found = self.conformal_calibration
      result['set'] = conformal.prediction_sets(probs, found['quantile'], found['score'])
    if members:
      result['member_probs'] = member_probs
    return result

  def _predict_regression(self, inputs: Any, *, members: bool, progress: bool,
                          levels: Sequence[float] = regression.LEVELS) -> dict[str, np.ndarray]:
    """Regression's `predict`: the mixture's 'mean', 'std', 'variance' = 'aleatoric' + 'epistemic', and the
    central intervals 'lower_P', 'upper_P' holding P% of it (exact mixture quantiles); each (N, D), or (N,)
    for one target; the components' variances times the variance scale (`temperature`). 'member_means' and
    'member_variances' (K M, N, D) with `members`."""
    levels = regression.checked_levels(levels)
    means, variances = self.components(inputs, progress=progress)
    variances = variances * self.temperature  # the variance scale ensemble.evaluate fitted (1 without one)
    result = regression.predictive(means, variances, levels)
    if self.conformal_calibration:  # the mixture's mean +/- q std, q per target
      result['conformal_lower'], result['conformal_upper'] = regression.conformal_interval(
          result['mean'], result['std'], self.conformal_calibration['quantile'])
    if self.task.targets == 1:
      result = {k: v[:, 0] for k, v in result.items()}
    if members:
      result['member_means'], result['member_variances'] = means, variances
    return result

  def _evaluate_regression(self, inputs: Any, targets: Any) -> dict[str, Any]:
    """Regression's `evaluate`: `regression.score` of the mixture ('ensemble'), of each member ('members') and
    their mean ('mean_member')."""
    inputs = self._labelled(inputs)
    targets = self._targets(targets, len(inputs))
    means, variances = self.components(inputs)
    per_member = len(means) // self.size
    members = [regression.score(means[k * per_member:(k + 1) * per_member],
                                variances[k * per_member:(k + 1) * per_member], targets) for k in range(self.size)]
    scores = {'ensemble': regression.score(means, variances, targets), 'members': members,
              'mean_member': {key: float(np.mean([m[key] for m in members])) for key in members[0]}}
    if self.temperature != 1.0:
      scores['variance_scaled'] = regression.score(means, variances * self.temperature, targets)
    return scores

  def evaluate(self, inputs: Any, labels: Any) -> dict[str, Any]:
    """The report's scores on labelled inputs: 'ensemble' and 'mean_member' accuracy, NLL, Brier and ECE, and
    'members', 'best_member', the gains and the ensemble-size curve (`evaluation.score_test_set`).

    The NLL comes from the members' log-probabilities, so a confident mistake
    keeps its cost; the temperature is not applied (the scores are the members').
    A regression ensemble takes float targets and returns RMSE, NLL, CRPS and
    interval coverage (`_evaluate_regression`).
    """
    if self.task.name == 'regression':
      return self._evaluate_regression(inputs, labels)
    inputs = self._labelled(inputs)
    labels = self._classes(labels, len(inputs))
    member_log_probs = self.member_outputs(inputs)
    scores = _evaluation().score_test_set(member_log_probs, labels)
    if self.temperature != 1.0:
      probs = calibration.temperature_scale(np.exp(member_log_probs).mean(0), self.temperature)
      scores['temperature_scaled'] = calibration.scores(probs, labels)
    return scores

  @console.root_logging_kept()
  def save(self, path: str) -> 'Ensemble':
    """Writes the ensemble as a workdir at `path`, which must not exist, and uses it from now: `ensemble.load(path)`
    and `python -m ensemble.evaluate / predict / export` read it. An ensemble read from a workdir is copied.

    Written beside `path` and renamed into place when complete: a failed save leaves nothing at `path`.
    """
    from ensemble import checkpoint  # pylint: disable=g-import-not-at-top  # orbax: only where files are written
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
      raise UsageError(f'{path} exists; save to a new path (a workdir is never overwritten)')
    if not os.path.isdir(os.path.dirname(path)):
      raise UsageError(f'no folder {os.path.dirname(path)}; create it first')
    partial = files.partial_folder(path)
    try:
      if self.workdir is not None:
        shutil.copytree(self.workdir, partial, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(checkpoint.LOCK_FILE))
      else:
        files.write_atomically(os.path.join(partial, 'config.json'),
                               json.dumps(self.config.to_dict(), indent=2, sort_keys=True))  # with the data's hash
        meta = {'model': self.config.model, 'ensemble_size': self.size, 'data': self._data_info}
        step = int(np.asarray(self.state.step).reshape(-1)[0])
        ckpt = checkpoint.Checkpointer(partial, method=self.member.method)
        try:
          ckpt.save(self.epoch, self.state, meta, summary=(step, self.summary))
        finally:
          ckpt.close()
        line = {'step': step, **self.summary}
        files.write_atomically(os.path.join(partial, 'metrics.jsonl'), json.dumps(line) + '\n')
      if self._calibration():
        files.write_atomically(os.path.join(partial, CALIBRATION_FILE), json.dumps(
            {'epoch': self.epoch, 'temperature': self.temperature, 'conformal': self.conformal_calibration},
            indent=2))
      os.replace(partial, path)
    except BaseException:
      shutil.rmtree(partial, ignore_errors=True)
      raise
    self.workdir = path
    return self

  def flag_threshold(self, target_risk: float = DEFAULT_FLAG_RISK, data_dir: str | None = None,
                     ood_rate: float = DEFAULT_FLAG_OOD_RATE) -> dict[str, Any]:
    """The two thresholds `flagged` applies: the predictive entropy above which to flag an image, the largest
    that keeps the error rate of the unflagged held-out images within `target_risk`
    (`selective.threshold_for_risk`; 'threshold', with the held-out 'coverage' and 'risk' at it), and the mutual
    information that only `ood_rate` of the held-out images exceed ('ood_threshold'): inputs the members
    disagree on more than on the data they know.

    Fitted on the slice of the training split that the trainer held out
    (`ensemble.evaluation.heldout_split`), read from `data_dir` (default: the
    data the run was trained with).
    """
    if not 0 <= ood_rate < 1:
      raise UsageError(f'ood_rate={ood_rate} must be a share of the held-out images in [0, 1)')
    self._require_task('classification', 'flag_threshold')
    if self.workdir is None:
      raise UsageError('flag_threshold reads the held-out slice of the data a workdir was trained on, and this '
                       'ensemble is in memory; give the held-out inputs to predict() and threshold their '
                       f"'{FLAG_SCORE}' with ensemble.uncertainty.selective, or save() it first")
    location = recipe_lib.data_location(self.config.data_dir if data_dir is None else data_dir)
    key = json.dumps([_evaluation().checkpoint_id(self.workdir, self.epoch), target_risk, ood_rate, location,
                      self.temperature])
    path = os.path.join(self.workdir, FLAG_THRESHOLDS_FILE)
    kept = _read_json(path)
    if key in kept:  # fitted for this checkpoint and these settings before: a prediction costs its start-up
      return kept[key]
    fitted = self._fit_flag_threshold(target_risk, data_dir, ood_rate)
    try:
      files.write_atomically(path, json.dumps({**kept, key: fitted}, indent=2))
    except OSError as e:  # a workdir this process may not write: fitted again next time
      logging.warning('The flag thresholds cannot be kept in %s (%s): each prediction fits them again.', path, e)
    return fitted

  def _fit_flag_threshold(self, target_risk: float, data_dir: str | None, ood_rate: float) -> dict[str, Any]:
    """`flag_threshold`'s fit on the held-out slice."""
    dataset = data.load(self.config.dataset, self.config.data_dir if data_dir is None else data_dir,
                        self.config.train_split, self.config.test_split, streaming=self.config.streaming)
    if tuple(dataset.image_shape) != self.image_shape:
      raise UsageError(f'{dataset.source} holds {"x".join(map(str, dataset.image_shape))} images but '
                       f'{self.workdir} was trained on {"x".join(map(str, self.image_shape))}; give --data_dir the '
                       'data it was trained on')
    heldout, seen_in_training = _evaluation().heldout_split(dataset.train, self.config)
    if seen_in_training:
      logging.warning('%s held out no training examples (heldout_fraction=0): the flag threshold is fitted on '
                      'examples the members were trained on and flags too few images.', self.workdir)
    result = self.predict(heldout['image'])
    curve = selective.risk_coverage(result[FLAG_SCORE], result['class'] == heldout['label'])
    ood_threshold = float(np.quantile(result[OOD_SCORE], 1 - ood_rate, method='higher'))
    return {**selective.threshold_for_risk(curve, target_risk), 'target_risk': target_risk,
            'ood_threshold': ood_threshold, 'ood_rate': ood_rate, 'examples': len(heldout['label']),
            'seen_in_training': seen_in_training}


@console.root_logging_kept()
def load(workdir: str, step: int | None = None, *, model: Any = None, batch_size: int | None = None,
         temperature: float | None = None) -> Ensemble:
  """The ensemble saved in `workdir` at epoch `step` (default: the latest), on as many of the available devices
  as divide its members.

  `model` is needed only for a model that config.json cannot rebuild (one
  defined in a script's `__main__`): the same model `fit` was given.
  `temperature` defaults to the one `ensemble.evaluate` fitted for that
  checkpoint (1 when there is none); `batch_size` to the run's eval_batch_size.
  """
  evaluation = _evaluation()
  config = evaluation.load_run_config(workdir)
  evaluation.refuse_single_model(config, workdir)
  devices = predictor.evaluation_devices(config.ensemble_size)
  member, state, epoch = evaluation.restore(workdir, config, step, devices, model)
  from ensemble import checkpoint  # pylint: disable=g-import-not-at-top  # orbax: only where files are read
  summary = (checkpoint.read_record(workdir, epoch).get('summary') or {}).get('scalars', {})
  saved = _saved_calibration(workdir, epoch)
  if temperature is None:
    temperature = saved.get('temperature') or _fitted_temperature(workdir, config, epoch) or 1.0
  if not temperature > 0:
    raise UsageError(f'temperature={temperature} must be positive')
  batch_size = config.eval_batch_size if batch_size is None else batch_size
  logging.info('Restored %s %d of %s: %s on %s; %s %.4g.', config.checkpoint_unit, epoch, workdir,
               console.count(config.ensemble_size, 'member'), console.count(len(devices), 'device'),
               'variance scale' if config.task == 'regression' else 'temperature', temperature)
  ens = Ensemble(workdir, config, member, state, devices, epoch, temperature, batch_size, summary=summary)
  return ens._calibrated(conformal_calibration=saved.get('conformal'))  # pylint: disable=protected-access


def keep_flag_threshold(workdir: str):
  """Fits the flag thresholds that `python -m ensemble.predict` applies by default (for the latest checkpoint, at
  its temperature) and keeps them in the workdir: what the end of training and `python -m ensemble.evaluate` (which
  fits a new temperature) run, so that a prediction reads them and costs its start-up. Where they cannot be fitted
  now (regression, no held-out slice, one model on a mesh, several processes), the first prediction that flags fits
  them, or says why not."""
  from ensemble import backends  # pylint: disable=g-import-not-at-top
  config = _evaluation().load_run_config(workdir)
  if (jax.process_count() > 1 or config.task != 'classification' or not config.heldout_fraction
      or config.backend in backends.MESH_MODELS):
    return
  started = time.perf_counter()
  fitted = load(workdir).flag_threshold()
  logging.info('Flag thresholds kept in %s (entropy > %.4g, mutual information > %.4g; fitted on %d held-out images in '
               '%.1f s).', os.path.join(workdir, FLAG_THRESHOLDS_FILE), fitted['threshold'], fitted['ood_threshold'],
               fitted['examples'], time.perf_counter() - started)


# What `Ensemble.save` writes of a `calibrate`d or `conformal` ensemble, beside its checkpoint.
CALIBRATION_FILE = 'calibration.json'
# The flag thresholds `Ensemble.flag_threshold` fitted, by checkpoint and settings: `python -m ensemble.predict`
# fits them once (6,000 held-out images), not at every call.
FLAG_THRESHOLDS_FILE = 'flag_thresholds.json'


def _read_json(path: str) -> dict[str, Any]:
  """A JSON object kept in a workdir, {} when it is not there or cannot be read (it is fitted again)."""
  try:
    with open(path, encoding='utf-8') as f:
      found = json.load(f)
  except (OSError, ValueError):
    return {}
  return found if isinstance(found, dict) else {}


def _saved_calibration(workdir: str, epoch: int) -> dict[str, Any]:
  """The calibration `Ensemble.save` wrote for checkpoint `epoch` ({} if none: a later checkpoint is not it)."""
  try:
    with open(os.path.join(workdir, CALIBRATION_FILE), encoding='utf-8') as f:
      saved = json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    raise UsageError(f'{os.path.join(workdir, CALIBRATION_FILE)} cannot be read ({e}); remove it to load the '
                     'ensemble uncalibrated') from None
  return saved if saved.get('epoch') == epoch else {}


# Where `fit` departs from ensemble/defaults.py (a program's recipe): no held-out slice and one test pass at the end
# unless asked, and no persistent compilation cache unless asked (it is a setting of the caller's whole process).
FIT_DEFAULTS = {'heldout_fraction': 0.0, 'eval_every': 0, 'compilation_cache': '',
                'steps_per_dispatch': loop.AUTO_DISPATCH}
# What a predicted input that the members give NaN or infinity for most likely is, by the kind of inputs.
_NONFINITE_CAUSES = {
    'tokens': 'token ids the model cannot embed, or a model that is not finite on them',
    'features': 'inputs far outside the range the members were trained on, or a model that is not finite there (a '
                'log or a division of its inputs); check those inputs',
    'images': 'a model that is not finite on these images; check them',
}


def fit_defaults(task: str | None) -> dict[str, Any]:
  """Where `fit` (and `distill`) start from other values than ensemble/defaults.py's, for `task` (None: the
  default's): `FIT_DEFAULTS`, and for regression `defaults.REGRESSION`."""
  return {**FIT_DEFAULTS, **(defaults.REGRESSION if task == 'regression' else {})}


def _check_flag(name: str, value: Any, none: bool = False):
  if not (isinstance(value, bool) or (none and value is None)):
    raise UsageError(f'{name}={value!r} must be True or False' + (' (or None)' if none else ''))


def fit_recipe(config: Any, fields: dict[str, Any]) -> recipe_lib.Recipe:
  """`fit`'s keywords as a recipe, each field checked alone (ensemble/recipe.py): on `config` (a ConfigDict, a dict
  or a Recipe) when given, else on ensemble/defaults.py's recipe with `fit_defaults` for the task."""
  if 'epochs' in fields:
    if 'num_epochs' in fields:
      raise UsageError('epochs= and num_epochs= are one setting: give one of them')
    fields['num_epochs'] = fields.pop('epochs')
  fields = {key: value for key, value in fields.items() if value is not None}
  if config is None:
    task = fields.get('task')
    base = recipe_lib.of(fit_defaults(task if isinstance(task, str) else None))
  else:
    base = recipe_lib.of(config)
  return recipe_lib.of(fields, base=base)


@_in_fit_terms
def fit(model: Any, train: Any, test: Any = None, *, ensemble_size: int | None = None, epochs: int | None = None,
        method: str | None = None, workdir: str | None = None, config: Any = None, init: 'Ensemble | None' = None,
        keep_optimizer: bool = False, keep_freed_memory: bool = False, progress: bool = True,
        validation: Any = None, early_stopping: int = 0, init_params: Any = None, **fields) -> Ensemble:
  """Trains an ensemble of `model` on arrays, its members in parallel on the devices there are; returns it.

  `model`: a `flax.linen.Module` mapping a batch of inputs to logits (it gets
  `train=True` in training if its `__call__` takes `train`, so BatchNorm and
  Dropout work); a function of `nnx.Rngs` that builds a Flax NNX model (each
  member builds its own); or a model name of ensemble/defaults.py ('cnn',
  'resnet', 'package.module:Name'). `train` and `test` are (inputs, labels)
  pairs of arrays: images, feature vectors or token ids (`inputs`:
  ensemble/defaults.py says how they are told apart), labels integer classes
  (float targets for task='regression'); or a split of `ensemble.data.load`
  ({'image', 'label'} arrays, or a streamed one); or any random-access source
  of (input, label) pairs (a list, a `grain.MapDataset`), streamed. `test` is
  optional: its scores go to `Ensemble.summary` after the last epoch (and
  every `eval_every` epochs). `fields` are ensemble/defaults.py's fields
  (learning_rate, optimizer, augment, member_data, backend, seed, ...),
  starting from its values (but `fit_defaults`: for task='regression', Adam at
  0.01 on standardised features) or from `config`. Unless `num_devices` is
  given, the members go on the devices as `python -m ensemble.train` places
  them (ensemble/recipe.py: all of them where they divide the members, else as
  many as do).

  `workdir=None` trains in memory and writes nothing anywhere; the
  `Ensemble` holds the members (`save` writes a workdir). A loop of fits of
  the same model and recipe compiles once (ensemble/loop.py), and `init=ens`
  starts every member from `ens`'s (same model and size; the optimizer starts
  afresh unless `keep_optimizer`, which keeps its moments and restarts its
  schedule). With `workdir`, the run writes checkpoints, metrics and event
  files there, and an existing workdir resumes by the rules of
  `python -m ensemble.train` if it was trained on the same arrays; a folder
  that is not a workdir is refused. `progress` shows a bar and a line per
  epoch. `keep_freed_memory=True` makes glibc keep the memory XLA:CPU frees,
  as `python -m ensemble.train` does (`ensemble/host_memory.py`;
  convolutional members trained 1.44x faster): a setting of the whole
  process, never undone, so only if asked.

  `shared='backbone'` (a module path, a tuple of them, or a predicate of a
  parameter's path such as 'backbone/Dense_0/kernel') makes those
  parameters one copy that every member trains (K heads on one backbone),
  `frozen=` keeps the parameters it names out of training (no optimizer
  state, no backward pass through them), and `init_params` (one model's
  parameters: a pretrained checkpoint's, or `ens.params` of a 1-member fit)
  starts every member from those it holds (ensemble/sharing.py).

  `early_stopping=N` with `validation=(x_val, y_val)` (rows the members do
  not train on; or, without it, the held-out slice of `heldout_fraction`)
  scores the validation NLL after every epoch, stops once N epochs pass
  without a lower one, and returns the members of the best epoch; `summary`
  says which ('best_epoch', 'validation_loss', 'epochs_trained'). A workdir
  checkpoints only the epochs that lower it, so its last checkpoint is the
  best.
  """
  for name, value in (('keep_optimizer', keep_optimizer), ('keep_freed_memory', keep_freed_memory)):
    _check_flag(name, value)
  _check_flag('progress', progress, none=True)
  validation = _validation(validation, early_stopping, fields)
  predicates = {key: fields.pop(key) for key in ('shared', 'frozen') if callable(fields.get(key))}
  for key in ('shared', 'frozen'):
    if fields.get(key) is not None:
      fields[key] = sharing.as_filters(fields[key], key)
  settings = fit_recipe(config, {'ensemble_size': ensemble_size, 'epochs': epochs, 'method': method,
                                 'early_stopping': early_stopping or None, **fields})
  dataset = _dataset(train, test, settings)
  if predicates:
    settings = recipe_lib.of(_accepted_paths(model, dataset, settings, predicates), base=settings)
  validation = _validation_split(validation, dataset, settings)
  if dataset.inputs != 'images' and settings.augment != 'none' and 'augment' in fields:  # else the recipe sets it
    raise UsageError(f'augment={settings.augment!r} transforms images, and these inputs are {dataset.inputs}: '
                     "leave augment out, or set it to 'none'")
  return fit_dataset(model, dataset, settings, workdir=workdir, init=init, keep_optimizer=keep_optimizer,
                     keep_freed_memory=keep_freed_memory, progress=progress, validation=validation,
                     init_params=init_params)


def _accepted_paths(model: Any, dataset: data.Dataset, settings: recipe_lib.Recipe,
                    predicates: dict[str, Any]) -> dict[str, tuple[str, ...]]:
  """`shared=` or `frozen=` given as a predicate of a parameter's path ('backbone/Dense_0/kernel') -> the paths of
  the model's parameters it accepts: what config.json records, and a resume or `load` reads."""
  outputs = 2 * dataset.num_classes if dataset.task == 'regression' else dataset.num_classes
  info = members.data_info(dataset.image_shape, outputs, [0.0], [1.0], inputs=dataset.inputs)
  recipe = settings.replace(shared=(), frozen=(), adapter_rank=0)
  if isinstance(model, str):
    recipe, model = recipe.replace(model=model), None
  member = members.member(recipe, info, model=model)
  params = jax.eval_shape(member.init_variables, jax.random.key(0))['params']
  paths = ['/'.join(sharing.names(path)) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  accepted = {}
  for key, predicate in predicates.items():
    accepted[key] = tuple(path for path in paths if predicate(path))
    if not accepted[key]:
      raise UsageError(f'{key}={getattr(predicate, "__name__", predicate)} accepts none of the model\'s parameter '
                       f'paths ({", ".join(paths[:4])}{", ..." if len(paths) > 4 else ""}): it is called with each '
                       'of them, a string such as those')
  return accepted


def _validation(validation: Any, early_stopping: Any, fields: dict[str, Any]) -> Any:
  """`validation=`, checked with `early_stopping=`, which it serves, before anything else is read."""
  if isinstance(early_stopping, bool) or not isinstance(early_stopping, numbers.Integral) or early_stopping < 0:
    raise UsageError(f'early_stopping={early_stopping!r} must be a whole number of epochs >= 0 (0: train every '
                     'epoch), the epochs without a lower validation NLL after which training stops')
  if not early_stopping and validation is not None:
    raise UsageError('validation= is what early_stopping=N scores after every epoch: give early_stopping too, or '
                     'leave validation out (test= scores a test set)')
  if early_stopping and validation is None and not fields.get('heldout_fraction'):
    raise UsageError(f'early_stopping={early_stopping} needs validation=(x_val, y_val): rows the members do not '
                     'train on, scored after every epoch (or heldout_fraction=0.1 to hold out the last tenth of the '
                     'training rows)')
  return validation


def _validation_split(validation: Any, dataset: data.Dataset, settings: recipe_lib.Recipe) -> data.Split | None:
  """`validation=` as a split of the training data's kind."""
  if validation is None:
    return None
  if _is_source(validation) or data.stream.is_streamed(validation):
    raise UsageError('validation= is a source of examples; give it as (inputs, labels) arrays')
  inputs, labels = _as_pair(validation, 'validation')
  split = arrays.from_arrays((inputs, labels), None, dataset.inputs, settings.task).train
  if split['image'].shape[1:] != dataset.image_shape or split['label'].shape[1:] != dataset.train['label'].shape[1:]:
    raise UsageError(f'validation= holds inputs {split["image"].shape[1:]} and labels {split["label"].shape[1:]}, '
                     f'the training data {dataset.image_shape} and {dataset.train["label"].shape[1:]}; give rows of '
                     'the same kind')
  return split


def fit_dataset(model: Any, dataset: data.Dataset, settings: recipe_lib.Recipe, *, workdir: str | None = None,
                init: 'Ensemble | None' = None, keep_optimizer: bool = False, keep_freed_memory: bool = False,
                progress: bool | None = True, validation: data.Split | None = None,
                init_params: Any = None) -> Ensemble:
  """`fit` once its arrays are a checked `dataset` and its keywords a recipe: what `ensemble.distill` trains its
  student with, on labels that no array of `fit` carries (the teacher's probabilities)."""
  model_object = None
  if isinstance(model, str):
    settings = recipe_lib.of({'model': model}, base=settings)
  else:
    model_object = model
  if workdir is not None and not (isinstance(workdir, (str, os.PathLike)) and str(workdir).strip()):
    raise UsageError(f'workdir={workdir!r} names no folder; give the folder to write the run in, or leave workdir= '
                     'out to train in memory')
  if init is not None and not isinstance(init, Ensemble):
    raise UsageError(f'init={type(init).__name__}: give an Ensemble (what fit or load returned) to start from')
  if init is not None and init_params is not None:
    raise UsageError('init= starts every member from an ensemble\'s members, init_params= from one model\'s '
                     'parameters: give one of them')
  if workdir is not None and init is not None:
    raise UsageError('init= starts a fit in memory, and a workdir resumes from its own checkpoints: leave out one of '
                     'init= and workdir=')
  settings = settings.replace(dataset=data.ARRAYS, data_dir='', data_fingerprint=_fingerprint(dataset))
  settings = _batch_within_rows(settings, dataset)
  recipe, devices = recipe_lib.resolve(settings, jax.devices(), model=model_object, dataset=dataset)
  if init is not None:
    recipe_lib.check_warm_start(recipe, init.config, keep_optimizer)
  if keep_freed_memory:  # once the arguments are checked
    host_memory.keep_freed_memory_on_cpu()
  if workdir is not None:
    from ensemble import trainer  # pylint: disable=g-import-not-at-top  # only here: its writers import TensorFlow
    workdir = os.path.abspath(os.path.expanduser(workdir))
    trainer.train_and_evaluate(recipe, workdir, dataset=dataset, model=model_object, progress=progress,
                               devices=devices, validation=validation, init_params=init_params)
    return load(workdir, model=model_object)
  run = loop.prepare(recipe, devices, dataset, model_object, validation=validation)
  state = run.init() if init is None else _warm_start(run, init, keep_optimizer)
  if init_params is None and recipe.init_from and init is None:
    init_params = _evaluation().first_member_params(recipe.init_from, recipe.shared)
  if init_params is not None:
    state = loop.with_init_params(run, state, init_params)
  state, summary = loop.train(run, state, progress=progress)
  devices = predictor.evaluation_devices(recipe.ensemble_size)
  if devices != run.devices:  # members spread over several devices each (backend jit): one device's worth each
    from ensemble import backends  # pylint: disable=g-import-not-at-top
    state = jax.device_put(state, backends.member_sharding(devices))
  return Ensemble(None, recipe, run.member, state, devices, summary['epoch'], batch_size=recipe.eval_batch_size,
                  task=run.task, data_info=run.data_info, summary=summary)


def _batch_within_rows(settings: recipe_lib.Recipe, dataset: data.Dataset) -> recipe_lib.Recipe:
  """A batch of the whole training set where `batch_size` exceeds it: a Bayesian-optimisation or active-learning
  loop starts from fewer rows than the batch it will grow into (Keras takes the whole set alike). The CLI, whose
  data is the run's, refuses instead (ensemble/recipe.py)."""
  rows = len(dataset.train['label'])
  num_train = rows - data.heldout_count(rows, settings.heldout_fraction)
  if not 0 < num_train < settings.batch_size:
    return settings
  logging.info('batch_size=%d exceeds the %d training rows: each step takes all of them.', settings.batch_size,
               num_train)
  return settings.replace(batch_size=num_train)


def _warm_start(run: loop.Run, init: Ensemble, keep_optimizer: bool) -> Any:
  """A fresh state of `run`'s members with `init`'s parameters and other model state (and optimizer state, if
  `keep_optimizer`: its moments kept, its schedule restarted, so that the new fit trains for its own epochs),
  copied: the steps donate what they train, and `init` stays usable."""
  fresh = run.backend.to_canonical(run.init())
  parts = ('params', 'batch_stats') + (('opt_state',) if keep_optimizer else ())
  for part in parts:
    target, source = getattr(fresh, part), getattr(init.state, part)
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    if jax.tree.structure(target) != jax.tree.structure(source) or shapes(target) != shapes(source):
      raise UsageError(f'init=: its members\' {part} do not match this fit\'s ({init.size} members of '
                       f'{init.config.model}, method {init.config.method}; now {run.recipe.ensemble_size} of '
                       f'{run.recipe.model}, method {run.recipe.method}); start from an ensemble of the same model, '
                       'size and data shapes, or leave init= out')
  def copied(part):
    """`init`'s part in new buffers laid out as this fit's. Where the layout changes (members spread over more
    devices, backend jit), `device_put(..., may_alias=False)` kept the buffers of the shards that stay on their
    device, and the steps donated them: those are copied where they are first (one program)."""
    target, source = getattr(fresh, part), getattr(init.state, part)
    same = jax.tree.leaves(jax.tree.map(lambda t, s: s.sharding.is_equivalent_to(t.sharding, t.ndim), target, source))
    source = source if all(same) else loop.copied(source)
    return jax.tree.map(lambda t, s: jax.device_put(s, t.sharding, may_alias=False), target, source)
  state = fresh.replace(**{part: copied(part) for part in parts})
  if keep_optimizer:
    state = state.replace(opt_state=optim.restart_schedule(state.opt_state))
  return run.backend.from_canonical(state)


def _fingerprint(dataset: data.Dataset) -> str:
  """The arrays' shapes and dtypes and a hash of their bytes: what a workdir records to refuse other arrays. A
  source read as training asks is not read whole for it: its shapes and length."""
  digest, shapes = hashlib.sha256(), []
  for name, split in (('train', dataset.train), ('test', dataset.test)):
    if split is None:
      continue
    for key in ('image', 'label'):
      column = split[key]
      shapes.append(f'{name} {"x".join(map(str, column.shape))} {column.dtype}')
      if not data.stream.is_streamed(split):
        digest.update(memoryview(np.ascontiguousarray(column)).cast('B'))
  return f'{", ".join(shapes)}; sha256 {digest.hexdigest()[:16]}'


def _is_source(split: Any) -> bool:
  """Whether `split` is a random-access source of examples (a `grain.MapDataset`, a `tfds.data_source`, a list of
  pairs), not a pair of arrays nor one of `data.load`'s splits."""
  return (hasattr(split, '__len__') and hasattr(split, '__getitem__') and not isinstance(split, (np.ndarray, dict))
          and not data.stream.is_streamed(split)
          and not (isinstance(split, (tuple, list)) and len(split) == 2 and not isinstance(split[0], tuple)))


def _as_pair(split: Any, name: str) -> Any:
  """One of `data.load`'s in-memory splits ({'image', 'label'} arrays) as the pair of arrays it holds; any other
  dict is refused in one line."""
  if not isinstance(split, dict):
    return split
  if set(split) != {'image', 'label'}:
    raise UsageError(f'{name}= is a dict of {sorted(split)}; give (inputs, labels) arrays, a split of '
                     "ensemble.data.load ({'image': inputs, 'label': labels}), or a source of (input, label) pairs")
  return split['image'], split['label']


def _dataset(train: Any, test: Any, settings: recipe_lib.Recipe) -> data.Dataset:
  """The arrays (or sources, streamed) as a Dataset; without `test`, the held-out slice of `train` tests (the loop
  holds it out too), or nothing when no slice is held out."""
  train, test = _as_pair(train, 'train'), _as_pair(test, 'test')
  if _is_source(train) or data.stream.is_streamed(train):
    return _streamed(train, test, settings)
  if test is not None and (_is_source(test) or data.stream.is_streamed(test)):
    raise UsageError(f'test= is a source of examples ({type(test).__name__}) and train= is not: give train= as a '
                     'source too, or both as (inputs, labels) arrays')
  if test is None and settings.heldout_fraction:
    inputs, labels = arrays.pair(train, 'train')
    _, heldout = data.hold_out({'image': inputs, 'label': labels}, settings.heldout_fraction)
    test = (heldout['image'], heldout['label'])
  return arrays.from_arrays(train, test, settings.inputs, settings.task)


def _streamed(train: Any, test: Any, settings: recipe_lib.Recipe) -> data.Dataset:
  """Random-access sources (or `data.load`'s streamed splits) as streamed splits (`data.stream`): read a batch at a
  time, in grain's threads, as the arrays they hold would be read."""
  if test is not None and not (_is_source(test) or data.stream.is_streamed(test)):
    raise UsageError(f'train= is a source of examples ({type(train).__name__}) and test= is not: give test= as a '
                     'source too, or both as (inputs, labels) arrays')

  def records(split, name):
    if split is None or data.stream.is_streamed(split):
      return split
    return data.stream.Records(data.stream.RandomAccessSource(split, f'{name}= source', settings.task,
                                                              settings.inputs))
  splits = {'train': records(train, 'train'), 'test': records(test, 'test')}
  if splits['test'] is None and settings.heldout_fraction:
    _, splits['test'] = data.hold_out(splits['train'], settings.heldout_fraction)
  first = splits['train'].source
  inputs = first.inputs
  # Classes from a sample of the labels; the loop checks every label it reads against the model's outputs.
  outputs = (math.prod(first.label.shape) if settings.task == 'regression'
             else int(data.stream.sample(splits['train'])['label'].max()) + 1)
  return data.Dataset(splits['train'], splits['test'], f'{type(train).__name__} source, streamed', outputs,
                      inputs=inputs, task=settings.task)
