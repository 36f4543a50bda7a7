"""A task: what a member's outputs mean, and every decision that follows from it, in one object.

The rest of the package asks the task and never compares its name (as scikit-learn's estimator tags decide which
checks apply). A task answers in two halves:

  in the programs   `loss`, `eval_outputs`, `member_output`, `combine_snapshots`, `eval_scores` (traced, per batch)
  on the host       how labels are read, cast, checked and counted (`read_labels`, `labels`, `examples`), how
                    many outputs a model gives (`model_outputs`, `check_outputs`), what the post-hoc chain sees
                    (`view`), what `predict`, `evaluate` and the report return, which post-hoc steps apply
                    (`calibration`, `conformal_scores`, `flags`), what `ensemble.export` serves, what a distilled
                    student learns and what the loops may acquire with

`Task` holds the answers most tasks share; each task's module states only where it differs. A new task is one
module and one line of `ensemble.tasks.TASKS`.
"""

import math
import numbers
from typing import Any, ClassVar, Sequence

import numpy as np

from ensemble import defaults
from ensemble.errors import DataError, UsageError

IGNORED = -1  # a dense task's position without a label, as the data layer hands the labels over


def host_float(values: np.ndarray) -> np.ndarray:
  """`values` as float32, or float64 where float32 would round them (float64, 32- and 64-bit integers): the host
  keeps their precision until the loop has standardised them."""
  exact = values.dtype.itemsize <= 2 or values.dtype == np.float32
  return values.astype(np.float32 if exact else np.float64, copy=False)


def is_number(value: Any) -> bool:
  """A real number, not a bool: what a numeric field of the recipe takes."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != 'bool_'


def positive(value: Any) -> bool:
  return is_number(value) and math.isfinite(value) and value > 0


def count(n: int, noun: tuple[str, str]) -> str:
  return f'{n} {noun[0] if n == 1 else noun[1]}'


# What a task's labels are, as `Task.label_kind` declares them: what the contract's lab draws for it and what
# `check_task` hands its `read_labels` (a new kind joins here and in tests/contract/lab.py's `LABELS`).
LABEL_KINDS = {
    'classes': 'int (N,) class indices 0..C-1',
    'targets': 'float (N, D) real-valued targets',
    'binary': 'int (N, L) labels of 0 and 1',
    'classes_per_position': f'int (N, *positions) class indices 0..C-1, {IGNORED} where a position has no label',
}
# What every task must answer itself (no default could be right): a concrete task (one with a `name`) that lacks
# one is refused when its class is defined, not at its first test pass. Those of a step the task takes, where it
# takes it (`CONFORMAL`, `CALIBRATION`, `LOOPS`).
REQUIRED = ('read_labels', 'member_output', 'loss', 'eval_outputs', 'combine_snapshots', 'summary', 'view',
            'predict', 'evaluate', 'report', 'exported')
TABLE = ('table',)  # where `python -m ensemble.predict` writes the task's own rows: no flags, no maps
CALIBRATION = ('fitted_scale',)
CONFORMAL = ('fit_conformal', 'apply_conformal', 'covered')
LOOPS = ('curve_scores',)


def missing(cls: type) -> list[str]:
  """The methods of the task interface that `cls` must answer and leaves to `Task`'s declaration."""
  needed = REQUIRED + (CALIBRATION if cls.calibration else ()) + (CONFORMAL if cls.conformal_scores else ())
  needed += (LOOPS if cls.acquisitions else ()) + (() if cls.flags or cls.per_position else TABLE)
  return [name for name in needed if getattr(cls, name) is getattr(Task, name)]


class Task:
  """The decisions every task makes; the defaults are those of a task whose labels are one row of values per
  example (targets, or 0/1 labels), which `Classification` and its dense variant override."""
  name: ClassVar[str] = ''
  # What its labels are (`LABEL_KINDS`).
  label_kind: ClassVar[str] = ''
  # What a dataset's `num_classes` counts, singular and plural: its classes, targets or labels.
  noun: ClassVar[tuple[str, str]] = ('class', 'classes')
  # Labels are class indices 0..C-1 (a model output each), rather than a row of values per example.
  has_classes: ClassVar[bool] = False
  # A label at each position of an input (a pixel, a token) rather than one per input.
  per_position: ClassVar[bool] = False
  # Read by the sources that hold one class per image: the bundled MNIST, tensorflow-datasets, IDX folders.
  image_datasets: ClassVar[bool] = False
  # Read from a .csv file's columns (`--config.target` names them).
  tables: ClassVar[bool] = False
  # Labels standardised on the host by the training split's mean and std (ensemble/standardise.py).
  standardises_targets: ClassVar[bool] = False
  # The recipe's fields the task reads (ensemble/defaults.py): programs of other tasks do not depend on them.
  fields: ClassVar[tuple[str, ...]] = ()
  # Where `fit` starts from other settings than ensemble/defaults.py's for this task (ensemble/api.py).
  fit_defaults: ClassVar[dict[str, Any]] = {}
  # The built-in model the default CNN gives way to on images, if any.
  images_model: ClassVar[str | None] = None
  # The post-hoc step `Ensemble.calibrate` fits (ensemble/posthoc.py), None where it has none.
  calibration: ClassVar[str | None] = None
  # The conformal scores `Ensemble.conformal` takes, the first the default.
  conformal_scores: ClassVar[tuple[str, ...]] = ()
  # Whether `Ensemble.conformal(class_conditional=True)` applies: a quantile per class (label and value).
  class_conditional: ClassVar[bool] = False
  # Whether a flags step applies (an input referred by its entropy and the members' disagreement).
  flags: ClassVar[bool] = False
  # Whether the report scores rotated and noisy test images, and detects unfamiliar inputs by probabilities.
  shifts: ClassVar[bool] = False
  detects_ood: ClassVar[bool] = False
  # The metrics of a test pass (ensemble/metrics.py): each name's mean of the eval outputs ensemble_<suffix>, and
  # member_<name> of member_<suffix>, one per member.
  eval_scores: ClassVar[dict[str, str]] = {'loss': 'loss', 'accuracy': 'correct'}
  # The score of `evaluate` that the summary's losses are (the test and validation loss): a negative log-likelihood.
  loss_score: ClassVar[str] = 'nll'
  # The module that writes this task's report.md and plots.
  report_writer: ClassVar[str] = 'ensemble.report'
  # Whether members still at chance after the first epochs are worth a hint (a loss of log C at chance).
  chance_hint: ClassVar[bool] = False

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if not cls.name:  # a family of tasks (`Targets`), not one a recipe names
      return
    if cls.label_kind not in LABEL_KINDS:
      raise UsageError(f'task {cls.name!r} declares label_kind={cls.label_kind!r}; declare one of '
                      f'{", ".join(LABEL_KINDS)} (ensemble/tasks/base.py: LABEL_KINDS)')
    lacking = missing(cls)
    if lacking:
      raise UsageError(f'task {cls.name!r} does not answer {", ".join(lacking)}: each is declared in '
                      'ensemble/tasks/base.py, with what it takes and returns')

  @classmethod
  def field_error(cls, name: str, value: Any) -> str | None:
    """What is wrong with `value` for the recipe's field `name`, one of `fields`, as a one-line error that names the
    field and the fix; None where it is right (ensemble/recipe.py asks it of each field alone)."""
    del name, value
    return None

  @classmethod
  def of(cls, config: Any, data_info: dict[str, Any] | None = None) -> 'Task':
    """The task a recipe names, for data described by `data_info` (None: what the programs are built for)."""
    del config, data_info
    return cls()

  # --- labels ----------------------------------------------------------------------------------------------------

  def read_labels(self, labels: np.ndarray, name: str, ignore: int = IGNORED) -> np.ndarray:
    """A split's labels from any source, cast to what the programs take and checked; anything else is one
    DataError that names `name`."""
    raise NotImplementedError

  def split_labels(self, labels: np.ndarray, inputs: np.ndarray, name: str, ignore: int = IGNORED) -> np.ndarray:
    """`read_labels` of labels beside their (checked) inputs: where their shapes must agree, refused otherwise."""
    del inputs
    return self.read_labels(labels, name, ignore)

  def layout_error(self, labels: np.ndarray, images: np.ndarray, num_classes: int) -> str | None:
    """What is wrong with a Dataset split's labels as a loader made them, or None (a loader's bug, not a user's)."""
    del images
    if labels.dtype not in (np.dtype(np.float32), np.dtype(np.float64)) or labels.ndim != 2:
      return f'labels must be float32/64 (N, {num_classes}), got {labels.dtype} {labels.shape}'
    return None

  def num_outputs(self, labels: np.ndarray) -> int:
    """A dataset's `num_classes` from its training labels: here the row's width."""
    return int(labels.shape[1])

  def labelled(self, labels: np.ndarray) -> np.ndarray:
    """The labels that carry one: all of them but a dense task's ignored positions."""
    return labels

  def examples(self, labels: np.ndarray) -> int:
    """How many labelled examples `labels` hold: rows, or a dense task's labelled positions. What a post-hoc step is
    fitted on and records, and what it needs enough of."""
    return int(len(labels))

  def labels(self, values: Any, role: str, count: int, outputs: int, positions: tuple[int, ...] = (),
             ignore: int = IGNORED) -> np.ndarray:
    """Labels for `count` inputs of `role` ('calibrate', 'evaluate', ...) for an ensemble of `outputs` (classes,
    targets, labels): `read_labels`, shaped as the ensemble predicts them, in one line that names `role`."""
    del positions
    values = _as_array(values, role)
    what = self.noun[1]
    if values.shape[:1] != (count,):
      raise DataError(f'{role}: {what} of shape {values.shape}; give {count} rows of {what}, one per input')
    checked = self.read_labels(values, role, ignore)
    if checked.shape[1] != outputs:
      raise DataError(f'{role}: {checked.shape[1]} {what} per input, but the ensemble predicts {outputs}')
    return checked

  def host_labels(self, labels: np.ndarray) -> np.ndarray:
    """Checked labels as the host scores them (a regression's in float64)."""
    return labels

  # --- in the programs (traced, per batch) -----------------------------------------------------------------------

  def member_output(self, outputs: Any) -> Any:
    """What prediction keeps of a member's model outputs (N, ..., W): log-probabilities, logits or raw outputs, as
    `Ensemble.member_outputs` returns them."""
    raise NotImplementedError

  def loss(self, outputs: Any, labels: Any) -> tuple[Any, dict[str, Any]]:
    """(a scalar the optimizer minimises, the step's metrics: scalars `metrics.py` averages over an epoch) for a
    batch's model outputs (N, ..., W) and labels as the programs take them (a `Targets` task's standardised)."""
    raise NotImplementedError

  def eval_outputs(self, outputs: Any, labels: Any, *, axis_name: Any) -> dict[str, Any]:
    """Per input (N,), one member's and the ensemble's scores, in standardised units: member_<s> and ensemble_<s>
    for each suffix s of `eval_scores`; the ensemble's reduced over the members by collectives over `axis_name`."""
    raise NotImplementedError

  def combine_snapshots(self, outputs: Any, count: Any, current: Any) -> Any:
    """A snapshot member's output (N, ..., W') from its kept snapshots' outputs (C, N, ..., W), `count` of them
    kept so far, and the current parameters' outputs `current` (N, ..., W): snapshot and MultiSWAG members."""
    raise NotImplementedError

  # --- the training loop's figures (on the host) ------------------------------------------------------------------

  # What the progress bar shows as the running loss: (the training metric's name, or {name: weight} of several, an
  # offset in nats), as `summary`'s train_loss is reported.
  reported_loss: ClassVar[tuple[Any, float]] = ('loss', 0.0)

  def in_data_units(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A test pass's per-input outputs (`eval_outputs`, standardised) in the data's units; here as they are."""
    return outputs

  def summary(self, train: dict[str, float] | None, test: dict[str, Any] | None = None) -> dict[str, float]:
    """The task's part of an epoch's metrics.jsonl line: train_<name> of the training metrics (None: none),
    test_<name> and member_test_<name>/i of a test pass, every loss in the data's units (`with_test_scores`)."""
    raise NotImplementedError

  # --- the model's outputs -----------------------------------------------------------------------------------------

  def model_outputs(self, width: int) -> int:
    """How many numbers per input (per position) the model gives for data of `width` classes, targets or labels."""
    return width

  def width(self, outputs: int) -> int:
    """The classes, targets or labels of a model of `outputs` numbers per input: `model_outputs`' inverse."""
    return outputs

  def output_error(self, shape: tuple[int, ...] | None, width: int, positions: tuple[int, ...]) -> str | None:
    """Why a model whose outputs for one input have `shape` (with its batch axis; None: not an array) cannot be
    this task's member for data of `width`, as 'not to (...): fix' ; None where it can."""
    del positions
    outputs = self.model_outputs(width)
    if shape is None or len(shape) != 2 or shape[1] != outputs:
      return (f'not to (batch, {outputs}) outputs, {self.noun[0]} by {self.noun[0]}: give its last layer {outputs} '
              'outputs')
    return None

  def describe(self, width: int) -> str:
    """'10 classes', '1 target': what an ensemble of `width` predicts."""
    return count(width, self.noun)

  # --- what an ensemble answers ------------------------------------------------------------------------------------

  def apply_outputs(self, outputs: Any, xp=np) -> Any:
    """`Ensemble.apply`'s answer from the members' outputs (K, N, ...), traced."""
    del xp
    return outputs

  def components(self, member_outputs: np.ndarray, xp=np) -> tuple[np.ndarray, np.ndarray]:
    """A Gaussian mixture's components (means, variances) from the members' outputs: regression's alone."""
    raise UsageError(f'this is a {self.name} ensemble; components is for regression ensembles (a Gaussian '
                     "mixture's); use predict")

  def member_probs(self, outputs: np.ndarray) -> np.ndarray:
    raise UsageError(f'this is a {self.name} ensemble; member_probs is for classification ensembles (and dense and '
                     'multilabel ones), which give probabilities: use predict')

  def view(self, outputs: Any, xp=np) -> dict[str, Any]:
    """The members' outputs (K, N, ...) as the post-hoc chain takes them (ensemble/posthoc.py): numpy on the host,
    or traced (xp=jnp) by `ensemble.export`."""
    raise NotImplementedError

  def labelled_view(self, view: dict[str, Any], labels: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """A view and its labels cut to the labelled examples, each one row: what a post-hoc step is fitted on."""
    return view, labels

  def predict(self, outputs: dict[str, Any], *, members: bool, levels: Sequence[float], threshold: float
              ) -> dict[str, np.ndarray]:
    """`Ensemble.predict`'s answer from the outputs after the chain."""
    raise NotImplementedError

  def refuses(self, step: str) -> str | None:
    """Why this task takes no post-hoc `step` ('calibrate', 'conformal'), as the end of a one-line error naming the
    task; None where it takes it. What it declares decides (`calibration`, `conformal_scores`): a task without a
    conformal score refuses `conformal` in one line, where its first score would be an IndexError."""
    if step == 'calibrate' and self.calibration is None:
      other = (f'; its intervals are calibrated by conformal(x, y, alpha) ({self.conformal_scores[0]})'
               if self.conformal_scores else '')
      return f'has no temperature or scale to fit{other}'
    if step == 'conformal' and not self.conformal_scores:
      return 'has no conformal score to fit sets or intervals by (Task.conformal_scores)'
    return None

  def check_predict_options(self, levels: Any, threshold: Any):
    """Refuses an option of `predict` that this task does not read, where it was changed from its default."""
    if threshold != 0.5:
      raise UsageError(f'threshold={threshold!r} decides the labels of a multilabel ensemble, and this is a '
                       f'{self.name} ensemble; leave it out')

  def evaluate(self, outputs: np.ndarray, labels: np.ndarray, chain: Sequence[Any], size: int) -> dict[str, Any]:
    """`Ensemble.evaluate`'s scores of the members' outputs (K, N, ...) against checked labels, with the chain's
    scaled figures where it has a calibration step."""
    raise NotImplementedError

  def report(self, forward: Any, test: dict, heldout: dict | None, seen_in_training: bool, *, size: int,
             angles: Sequence[int], noise: bool, ood_sets: dict[str, np.ndarray] | None,
             alphas: Sequence[float]) -> dict[str, Any]:
    """The report's numbers (ensemble/scoring.py): `forward.log_probs(split)` gives a split's member outputs."""
    raise NotImplementedError

  def exported(self, outputs: Any, chain: Sequence[Any], xp) -> dict[str, Any]:
    """What `ensemble.export`'s artifact returns for the members' outputs (K, N, ...), traced, after the chain."""
    raise NotImplementedError

  def fitted_scale(self, view: dict[str, Any], labels: np.ndarray, **settings) -> dict[str, Any]:
    """The settings of the calibration step (`calibration`) fitted on a labelled view."""
    raise NotImplementedError

  def fit_conformal(self, view: dict[str, Any], labels: np.ndarray, alpha: float, score: str,
                    **options) -> dict[str, Any]:
    """A conformal step's fitted settings (its quantile) on a labelled view; `options`: class_conditional=True where
    the task has it (`class_conditional`)."""
    raise NotImplementedError

  def apply_conformal(self, step: Any, view: dict[str, Any], xp) -> dict[str, Any]:
    raise NotImplementedError

  def coverage_regions(self, labels: np.ndarray) -> dict[str, np.ndarray]:
    """Named masks over `covered`'s entries for `labels` (a dense task's boundary and interior positions), whose
    coverage the report gives beside the marginal one; here none."""
    del labels
    return {}

  def covered(self, result: dict[str, np.ndarray], labels: np.ndarray) -> np.ndarray:
    """Whether each label lies in the conformal set (interval) `predict` gave for it, one entry per labelled
    example (a multi-label's per label)."""
    raise NotImplementedError

  def write_report(self, results: dict[str, Any], output_dir: str):
    """report.md, metrics.json and the plots of `report`'s results in `output_dir`."""
    import importlib  # pylint: disable=g-import-not-at-top
    importlib.import_module(self.report_writer).write(results, output_dir)

  def table(self, names: Sequence[str], result: dict[str, np.ndarray]) -> tuple[list[str], list[dict]]:
    """`python -m ensemble.predict`'s columns and rows for `predict`'s answer; a dense task writes maps instead."""
    raise NotImplementedError

  # --- distillation and the loops --------------------------------------------------------------------------------

  def student_settings(self, teacher: Any, temperature: float) -> dict[str, Any]:
    """The recipe's fields of this task a distilled student trains with, from the teacher's recipe and `distill`'s
    `temperature`: here none (the defaults')."""
    del teacher, temperature
    return {}

  def student_labels(self, ens: Any, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) a distilled student trains on, the teacher's predictive at `inputs`: here the members' mean
    probabilities as float32, (N, C) (a dense task's per position, a multi-label task's per label), without the
    calibration temperature, which scales only `predict`'s 'probs'."""
    return inputs, ens.member_probs(inputs).mean(0).astype(np.float32)

  # What the loops may acquire with: name -> f(outputs, key, best) -> per-input scores, and the batch acquisitions.
  acquisitions: ClassVar[dict[str, Any]] = {}
  batch_acquisitions: ClassVar[dict[str, Any]] = {}

  def acquisition_outputs(self, ens: Any, outputs: np.ndarray) -> Any:
    """What an acquisition function takes from the members' outputs of the candidates."""
    return outputs

  def best(self, labels: np.ndarray) -> float:
    """What an improvement acquisition improves on: the best label so far (0 where it has no meaning)."""
    del labels
    return 0.0

  def curve_scores(self, ens: Any, inputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """A loop's curve entry for a test set: the few scores a round is judged by."""
    raise NotImplementedError


def with_test_scores(summary: dict[str, float], test: dict[str, Any] | None,
                     scores: dict[str, tuple[str, Any]]) -> dict[str, float]:
  """`summary` with a test pass's figures where there was one: for each name -> (the collection's metric, a
  conversion), test_<name> of the ensemble's and member_test_<name>/i of member i's (ensemble/metrics.py)."""
  if test is None:
    return summary
  for name, (metric, convert) in scores.items():
    summary[f'test_{name}'] = convert(test[metric])
    for i, value in enumerate(test[f'member_{metric}']):
      summary[f'member_test_{name}/{i}'] = convert(value)
  return summary


def target_table(names: Sequence[str], parts: dict[str, np.ndarray], result: dict[str, np.ndarray]
                 ) -> tuple[list[str], Any]:
  """`python -m ensemble.predict`'s (columns, rows) of per-target figures (`parts`: name -> (N,) or (N, D)), and the
  chain's conformal interval where `result` (what `predict` returned) has one: a column per figure, with a suffix _d
  per target when there are several; 6 significant digits."""
  parts = {**parts, **{key: result[key] for key in ('conformal_lower', 'conformal_upper') if key in result}}
  figure = lambda x: float(f'{x:.6g}')
  first = next(iter(parts.values()))
  targets = 1 if first.ndim == 1 else first.shape[1]
  columns = [name if targets == 1 else f'{name}_{d}' for d in range(targets) for name in parts]
  flat = {name: values.reshape(len(names), targets) for name, values in parts.items()}

  def rows():
    for i, name in enumerate(names):
      row = {'name': name}
      for d in range(targets):
        for part, values in flat.items():
          row[part if targets == 1 else f'{part}_{d}'] = figure(values[i, d])
      yield row
  return ['name', *columns], rows()


def _as_array(values: Any, role: str) -> np.ndarray:
  try:
    return np.asarray(values)
  except ValueError as e:  # a ragged list
    lines = str(e).strip().splitlines()
    raise DataError(f'{role}: labels cannot be made an array ({lines[0] if lines else type(e).__name__}); give '
                    'equally shaped examples') from None


def nonfinite_error(values: np.ndarray, name: str, what: str) -> str | None:
  finite = np.isfinite(values).reshape(len(values), -1).all(1)
  if finite.all():
    return None
  return (f'{name}: {what} hold NaN or infinite values (first at example {int(np.argmin(finite))}); drop those '
          'examples first')


class Targets(Task):
  """Real-valued targets (N, D): what regression and quantile regression share. They are standardised on the host
  by the training split's statistics, read from tables as well as arrays, and scored in their own units."""
  noun = ('target', 'targets')
  tables = True
  standardises_targets = True
  eval_scores = {'loss': 'loss', 'squared_error': 'squared_error'}
  report_writer = 'ensemble.regression_report'
  fit_defaults = defaults.REGRESSION

  @property
  def targets(self) -> int:
    return len(self.target_std)

  def standardise(self, y: np.ndarray) -> np.ndarray:
    return ((y - np.asarray(self.target_mean)) / np.asarray(self.target_std)).astype(np.float32)

  def read_labels(self, labels: np.ndarray, name: str, ignore: int = IGNORED) -> np.ndarray:
    """(N, D) targets from (N,) or (N, D) finite floats, float64 kept (`host_float`)."""
    del ignore
    if not np.issubdtype(labels.dtype, np.floating):
      raise DataError(f"{name}: targets of dtype {labels.dtype}; {self.name} needs float targets "
                      "(y.astype(np.float32)), or task='classification' for class indices")
    if labels.ndim not in (1, 2):
      raise DataError(f'{name}: targets of shape {labels.shape}; give (N,) or (N, D) float targets')
    labels = labels.reshape(len(labels), -1)
    problem = nonfinite_error(labels, name, 'targets')
    if problem:
      raise DataError(problem)
    return host_float(labels)

  def host_labels(self, labels: np.ndarray) -> np.ndarray:
    return np.asarray(labels, np.float64)

  def width(self, outputs: int) -> int:
    """The targets, whatever the outputs (a snapshot member's hold a set per snapshot)."""
    del outputs
    return self.targets

  def labels(self, values, role, count, outputs, positions=(), ignore=IGNORED):
    return super().labels(values, role, count, outputs, positions, ignore).astype(np.float64)

  def best(self, labels: np.ndarray) -> float:
    return float(np.max(labels))
