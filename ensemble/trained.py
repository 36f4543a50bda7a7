"""A trained ensemble as one immutable value: the recipe, the members' state at one checkpoint, and the ordered chain
of post-hoc steps fitted after training (ensemble/posthoc.py).

What `ensemble.fit` and `ensemble.load` return. Its verbs answer about new inputs (`predict`, `evaluate`,
`member_outputs`, `apply`) or return a new value (`calibrate`, `conformal`, `flags`: the same members, one more
post-hoc step); `save` writes exactly the value (ensemble/manifest.py), which `load` reads back whole. Nothing
changes an ensemble once made: a chain's step was fitted on what the steps before it give, and stays so.
"""

import dataclasses
import functools
import numbers
import os
from typing import Any, Sequence

import jax
import numpy as np

from ensemble import console, data, features, members, posthoc, predictor, scoring, standardise, steps
from ensemble import recipe as recipe_lib
from ensemble.data import arrays
from ensemble.errors import UsageError
from ensemble.tasks import mixture
from ensemble.uncertainty import conformal

# What a predicted input that the members give NaN or infinity for most likely is, by the kind of inputs.
_NONFINITE_CAUSES = {
    'tokens': 'token ids the model cannot embed, or a model that is not finite on them',
    'features': 'inputs far outside the range the members were trained on, or a model that is not finite there (a '
                'log or a division of its inputs); check those inputs',
    'images': 'a model that is not finite on these images; check them',
}


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


def check_flag(name: str, value: Any, none: bool = False):
  if not (isinstance(value, bool) or (none and value is None)):
    raise UsageError(f'{name}={value!r} must be True or False' + (' (or None)' if none else ''))


@functools.lru_cache(maxsize=64)
def _output_shape(member: steps.Member) -> tuple[int, ...]:
  """A member's outputs' shape for one input, traced once per member: the ensembles of a loop of fits share it."""
  state = jax.eval_shape(member.init, jax.random.key(0))
  return tuple(int(d) for d in jax.eval_shape(member.predict, state, member.example_input()).shape[1:])


def _output_width(member: steps.Member) -> int:
  return _output_shape(member)[-1]


class Ensemble:
  """A trained ensemble, on the devices at hand, that answers about new inputs: one immutable value.

  `epoch` is the members' checkpoint (an epoch, or a step where the run
  checkpointed by step), `posthoc` the chain of post-hoc steps in the order
  they were fitted, `summary` the training summary with what the chain
  amounts to. `workdir` is where it was read from or saved to (None: in
  memory), and `batch_size` how many inputs a device program takes: neither
  changes what it answers.
  """

  def __init__(self, workdir: str | None, config: recipe_lib.Recipe, member: steps.Member,
               state: steps.TrainState, devices: Sequence[jax.Device], epoch: int, batch_size: int = 1000, *,
               task: Any = None, data_info: dict[str, Any] | None = None, summary: dict[str, float] | None = None,
               chain: Sequence[posthoc.Step] = (), distillation: Any = None):
    """`data_info` describes the members' data as their checkpoint records it (`save` writes it); the members take
    features standardised by its statistics, on the host, as `fit`'s programs do (ensemble/loop.py; `load` builds
    a restored member so too). `distillation`: a student's report of what it kept of its teacher
    (`ensemble.distill`), None for any other ensemble."""
    set_ = functools.partial(object.__setattr__, self)
    set_('workdir', workdir)
    set_('config', config)
    set_('member', member)
    set_('state', state)
    set_('devices', list(devices))
    set_('epoch', int(epoch))
    set_('task', member.task if task is None else task)  # what the outputs mean: ensemble/tasks/
    set_('_data_info', data_info)
    set_('_summary', dict(summary or {}))
    set_('_transform', standardise.feature_transform(data_info) if data_info else None)
    set_('_predictors', {})
    set_('posthoc', tuple(chain))
    set_('distillation', distillation)
    self.batch_size = batch_size

  def __setattr__(self, name: str, value: Any):
    if name != 'batch_size':
      raise UsageError(f'an Ensemble is immutable: {name} cannot be set; calibrate(), conformal() and flags() return '
                       'a new one, and ensemble.load(workdir, step=...) another checkpoint')
    object.__setattr__(self, name, value)

  def _replace(self, **changes) -> 'Ensemble':
    """A new value with `changes` (chain, workdir, summary, distillation): the members shared, and their compiled
    programs."""
    fields = {'workdir': self.workdir, 'chain': self.posthoc, 'summary': self._summary,
              'distillation': self.distillation, **changes}
    copy = Ensemble(fields['workdir'], self.config, self.member, self.state, self.devices, self.epoch,
                    batch_size=self.batch_size, task=self.task, data_info=self._data_info, summary=fields['summary'],
                    chain=fields['chain'], distillation=fields['distillation'])
    object.__setattr__(copy, '_predictors', self._predictors)  # the same members' programs
    return copy

  @property
  def _name(self) -> str:
    return self.workdir or 'the ensemble'

  @property
  def summary(self) -> dict[str, float]:
    """The training summary (the last epoch's, or early stopping's best) with what the post-hoc chain amounts to:
    'temperature' (a regression's 'variance_scale') and 'conformal_alpha'. A copy."""
    trained = {k: v for k, v in self._summary.items() if k not in ('temperature', 'variance_scale', 'conformal_alpha')}
    return {**trained, **posthoc.summary(self.posthoc)}

  @property
  def temperature(self) -> float:
    """What the chain's temperatures (a regression ensemble's variance scales) amount to: 1 without any."""
    return posthoc.product(self.posthoc, self.task.calibration) if self.task.calibration else 1.0

  @property
  def conformal_calibration(self) -> dict[str, Any] | None:
    """The last conformal step: {'alpha', 'score', 'quantile', 'examples'}; a class-conditional one's also
    'class_conditional', 'class_examples' and the 'pooled' classes (`conformal`); None without one."""
    step = posthoc.last(self.posthoc, 'conformal')
    if step is None:
      return None
    return {**dict(step.settings), 'examples': step.fitted_on.examples}

  def __repr__(self) -> str:
    predicts = self.task.describe(self.task.width(self.num_classes))
    where = f'workdir={self.workdir!r}' if self.workdir else 'in memory'
    chain = f', {posthoc.describe(self.posthoc)}' if self.posthoc else ''
    return (f'Ensemble({console.count(self.size, "member")} of {self.config.model}, {self.task.name} of '
            f'{predicts} from {"x".join(map(str, self.input_shape))} {self.member.inputs}, '
            f'{self.config.checkpoint_unit} {self.epoch}{chain}, {where})')

  # --- post-hoc steps: each a new value ----------------------------------------------------------------------------

  def _fit_step(self, kind: str, role: str, inputs: Any, labels: Any, **settings) -> 'Ensemble':
    """A new value with a step of `kind` fitted on labelled rows, counted (a conformal step's alpha needs enough of
    them) before anything is predicted."""
    inputs, labels = self._labelled_pair(inputs, labels, role, settings.get('alpha'))
    step = posthoc.fit(kind, self.posthoc, self._member_view(inputs, role=role), labels, inputs, self.epoch,
                       self.task, **settings)
    return self._replace(chain=(*self.posthoc, step))

  def calibrate(self, inputs: Any, labels: Any, *, per_label: bool = False) -> 'Ensemble':
    """A new ensemble calibrated on labelled data the members did not train on: a classification ensemble's
    temperature, a multi-label ensemble's (one, or with `per_label` one per label, each label's logits over it), a
    regression ensemble's variance scale (every component's variance times it), each the value that minimises the
    NLL of the outputs as the chain so far gives them (`calibration.fit_temperature`,
    `uncertainty.multilabel.fit_temperature`, `regression.scale_variances`). Its `predict`, `evaluate`
    ('temperature_scaled' / 'variance_scaled' scores beside the members' own), `save` and `export` use it; a
    conformal step fitted before it keeps its sets."""
    check_flag('per_label', per_label)
    if why := self.task.refuses('calibrate'):
      raise UsageError(f'calibrate: a {self.task.name} ensemble {why}')
    if per_label and self.task.calibration != 'label_temperature':
      raise UsageError(f'{self._name} holds a {self.task.name} ensemble; per_label=True is for multilabel ensembles')
    return self._fit_step(self.task.calibration, 'calibrate', inputs, labels,
                          **({'per_label': True} if per_label else {}))

  def conformal(self, inputs: Any, labels: Any, alpha: float = 0.1, score: str | None = None, *,
                class_conditional: bool = False) -> 'Ensemble':
    """A new ensemble whose `predict` also returns split-conformal prediction sets (classification: 'set', (N, C)
    booleans) or intervals (regression: 'conformal_lower', 'conformal_upper', the mixture's mean +/- q times its
    std), calibrated on these labelled examples, which the members must not have trained on.

    For an input exchangeable with them, the set holds its class (the interval its target) with probability at least
    1 - alpha, whatever the members (ensemble/uncertainty/conformal.py). `score`: 'thr' (the default: the smallest
    sets on average) or 'aps' (adaptive sets, larger where the members are unsure; not randomised, so that an
    input's set is a function of it, and so conservative); regression's one score, 'normalised', is |y - mean| /
    std. A multi-label ensemble's sets are per label ('set' (N, L, 2): which of 0 and 1 each label's set holds), each
    label covered with probability at least 1 - alpha; its one score, 'label', is 1 - p(the label's value). The sets
    are of the outputs as the chain so far gives them (after a `calibrate` before it; one after it leaves them).

    That 1 - alpha is on average over the classes: a hard class can be covered far less, hidden by easy ones.
    `class_conditional=True` (Mondrian conformal) fits a quantile per class on that class's examples (a dense
    ensemble's labelled positions), class c in a set where its score is at most class c's: each class is covered
    at 1 - alpha. A multi-label ensemble's is per label and value, (L, 2): a label's rare positives are covered as
    its negatives are. A class (value) too rare for `alpha` is pooled: given the marginal quantile (a multi-label
    value its label's), named by a hint and `conformal_calibration['pooled']`. Not for regression or quantile.
    """
    settings = posthoc.conformal_settings(self.task, alpha, score, class_conditional)
    return self._fit_step('conformal', 'conformal', inputs, labels, **settings)

  def flags(self, inputs: Any, labels: Any, target_risk: float = posthoc.DEFAULT_FLAG_RISK,
            ood_rate: float = posthoc.DEFAULT_FLAG_OOD_RATE) -> 'Ensemble':
    """A new ensemble whose `predict` also returns 'flag' (N,): the inputs to refer to a person, fitted on these
    labelled examples: those whose predictive entropy exceeds the largest threshold that keeps the error rate of
    the unflagged examples within `target_risk`, and those the members disagree on (mutual information) more than
    on all but `ood_rate` of the examples (ensemble/posthoc.py)."""
    self._require(self.task.flags, 'flags')
    posthoc.check_rates(target_risk, ood_rate)
    return self._fit_step('flags', 'flags', inputs, labels, target_risk=target_risk, ood_rate=ood_rate)

  def distance(self, inputs: Any, labels: Any = None) -> 'Ensemble':
    """A new ensemble whose `predict` also returns 'distance' (N,): each input's Mahalanobis distance, in the
    members' penultimate-layer features, to the nearest of the Gaussians fitted on these rows, one per class of
    a classifier's `labels` (one for any other task), averaged over the members (ensemble/uncertainty/distance.py).
    Fit on the training rows: far from them the members agree and are confident, and only the distance grows."""
    features.check(self.member)
    if labels is None and self.task.has_classes and not self.task.per_position:
      raise UsageError("distance: a classifier's Gaussians are per class; give the rows' labels: ens.distance(x, y)")
    if labels is None:  # one Gaussian: the rows alone
      inputs = self._labelled(inputs, 'distance')
      labels = np.zeros(len(inputs), np.int32)
    else:
      inputs, labels = self._labelled_pair(inputs, labels, 'distance')
    view = self._member_view(inputs, role='distance', with_features=True)
    step = posthoc.fit('distance', self.posthoc, view, labels, inputs, self.epoch, self.task)
    return self._replace(chain=(*self.posthoc, step))

  # --- inputs and labels, checked for their role --------------------------------------------------------------------

  def check(self, inputs: Any, role: str = 'predict') -> np.ndarray:
    """`inputs` as (N, *input_shape) of what the members take, checked and converted as `fit` does its training
    arrays (`data.arrays.inputs`); anything else is a one-line UsageError that names `role`.

    Images: uint8, or float in [0, 1] (kept as float32, as training kept them). Features: finite numbers. Tokens:
    integer ids.
    """
    inputs = arrays.inputs(inputs, self.member.inputs, role, self.input_shape, self._name)
    return members.ids_checked(self.member, inputs, role) if self.member.inputs == 'tokens' else inputs

  def _labelled(self, inputs: Any, role: str) -> np.ndarray:
    """`check`ed inputs to score or fit on: at least one, as a mean over none is no score."""
    inputs = self.check(inputs, role)
    if not len(inputs):
      raise UsageError(f'{role} got 0 inputs; give at least one labelled example')
    return inputs

  def _labels(self, labels: Any, count: int, role: str) -> np.ndarray:
    """Labels for `count` inputs as the task reads them for this ensemble (`Task.labels`): int32 classes the
    members predict, a multi-label ensemble's (N, L) int32 0s and 1s, a dense one's per position, or (N, D) float64
    targets."""
    return self.task.labels(labels, role, count, self.task.width(self.num_classes), self.positions,
                            self.config.ignore_label)

  def _labelled_pair(self, inputs: Any, labels: Any, role: str,
                     alpha: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Checked inputs and their labels, holding at least one labelled example (a dense task's labelled position),
    and with `alpha` as many as a conformal quantile at it needs: a score or a fit over fewer would be NaN, or no
    promise at all."""
    inputs = self._labelled(inputs, role)
    labels = self._labels(labels, len(inputs), role)
    examples = self.task.examples(labels)
    if not examples:
      raise UsageError(f'{role}: none of the {len(inputs)} inputs carries a label (every position is the ignored '
                       'label); give labelled positions')
    what = 'labelled positions' if self.task.per_position else 'calibration examples'
    if alpha is not None and examples < conformal.rows_needed(alpha):
      raise UsageError(f'{role}: alpha={alpha:g} needs at least {conformal.rows_needed(alpha)} {what} (the '
                       f'ceil((n + 1)(1 - alpha))-th smallest score must exist), and {examples} were given; give '
                       'more, or raise alpha')
    return inputs, labels

  def _require(self, ok: bool, what: str):
    if not ok:
      raise UsageError(f'{self._name} holds a {self.task.name} ensemble; {what} is for classification ensembles')

  # --- what the members answer -----------------------------------------------------------------------------------

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

    Classification: (K, N, C) log-probabilities. Multi-label: (K, N, L) logits. Regression: (means, variances),
    each (K M, N, D) in the targets' units (M = 1 component per member, or a snapshot member's snapshots); the
    mixture's mean is `means.mean(0)`.
    The members' other state (BatchNorm's averages) is the trained one; no post-hoc step is applied. A program
    of it holds this ensemble's other arrays as constants; `apply_variables` takes them as arguments.
    """
    return self.apply_variables(self.variables, params, inputs)

  @property
  def variables(self) -> dict[str, Any]:
    """Every array `apply` reads besides the parameters: the members' state (its leaves) and the statistics that
    inputs and targets are standardised by ('input_mean', 'input_std', 'target_mean', 'target_std', where they
    are)."""
    statistics = {}
    if self._transform is not None:
      statistics['input_mean'], statistics['input_std'] = (np.asarray(self._data_info[key], np.float32)
                                                           for key in ('mean', 'std'))
    if self.task.standardises_targets:
      statistics['target_mean'], statistics['target_std'] = (np.asarray(getattr(self.task, key), np.float32)
                                                             for key in ('target_mean', 'target_std'))
    return {'state': jax.tree.leaves(self.state), 'statistics': statistics}

  def apply_variables(self, variables: dict[str, Any], params: Any, inputs: jax.Array) -> Any:
    """`apply` of any ensemble of this one's model, method, task and shapes, given its `variables` and `params`:
    a program of it is a function of them, and compiles once for every such ensemble (a loop's fits, each on
    other rows), where a program of `apply` compiles again for each."""
    statistics = variables['statistics']
    inputs = jax.numpy.asarray(inputs)
    if 'input_mean' in statistics:
      inputs = standardise.features_by(inputs, statistics['input_mean'], statistics['input_std'])
    task = self.task
    if 'target_mean' in statistics:
      task = dataclasses.replace(task, target_mean=statistics['target_mean'], target_std=statistics['target_std'])
    state = jax.tree.unflatten(jax.tree.structure(self.state), variables['state'])
    state = self.member.method.with_params(state, params)
    member_output = lambda state: self.member.task.member_output(self.member.predict(state, inputs))
    return task.apply_outputs(jax.vmap(member_output)(state), xp=jax.numpy)

  @property
  def batch_size(self) -> int:
    """Inputs per device program; checked whenever it is set, as a batch size below 1 would predict nothing."""
    return self._batch_size

  @batch_size.setter
  def batch_size(self, value: int):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise UsageError(f'batch_size={value!r} must be a positive number of inputs per device program')
    object.__setattr__(self, '_batch_size', int(value))

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
  def positions(self) -> tuple[int, ...]:
    """The positions of a dense ensemble's class per position, (H, W) of a segmentation's images; () for the other
    tasks."""
    return _output_shape(self.member)[:-1] if self.task.per_position else ()

  @property
  def num_classes(self) -> int:
    """The members' number of logits, read off their forward pass (without computing it)."""
    return _output_width(self.member)

  def member_outputs(self, images: Any, *, progress: bool = False, role: str = 'predict') -> np.ndarray:
    """(K, N, W) float64: every member's output (log-probabilities; a multi-label member's logits; a regression
    member's raw outputs),
    `batch_size` inputs at a time, the last batch bucketed. Outputs that are not finite are never returned: they
    are one UsageError that says for how many inputs, and the likely cause."""
    check_flag('progress', progress)
    return self._member_outputs(self.check(images, role), progress, role)

  def _member_outputs(self, images: np.ndarray, progress: bool = False, role: str = 'predict',
                      what: str = 'log_probs') -> np.ndarray:
    """`member_outputs` of `check`ed inputs; with what='features', the members' penultimate features (K, N, F)."""
    images = self.standardise(images)
    if self.member.inputs == 'features':  # what the members compute in: a value beyond float32 is refused
      images = standardise.in_float32(images, f"{role}: the inputs' features")
    starts = range(0, len(images), self.batch_size)
    if progress and len(starts) > 1:
      starts = console.track(starts, 'predicting', unit='batch', items_per_step=self.batch_size, items='images')
    width = (*self.positions, self.num_classes) if what == 'log_probs' else (features.width(self.member),)
    batches = [np.zeros((self.size, 0, *width))]
    for start in starts:
      chunk = images[start:start + self.batch_size]
      if self.member.inputs == 'images' and chunk.dtype == np.uint8:  # in [0, 1] as the device would make it
        chunk = chunk.astype(np.float32) / 255.0
      split = {'image': chunk, 'label': np.zeros(len(chunk), np.int32)}
      batches.append(getattr(self._predictor(bucket(len(chunk), self.batch_size)), what)(split))
    outputs = np.concatenate(batches, axis=1)
    finite = np.isfinite(outputs).all(axis=(0, *range(2, outputs.ndim)))
    if not finite.all():
      cause = _NONFINITE_CAUSES[self.member.inputs]
      raise UsageError(f'{role}: {int((~finite).sum())} of {len(finite)} inputs give the members non-finite outputs '
                       f'(NaN or infinity; the first is input {int(np.argmin(finite))}): {cause}')
    return outputs

  def member_probs(self, images: Any, *, progress: bool = False) -> np.ndarray:
    """(K, N, C) float64: every member's probabilities, `batch_size` images at a time, the last batch bucketed; a
    multi-label ensemble's per label, (K, N, L), a dense one's per position, (K, N, *positions, C)."""
    return self.task.member_probs(self.member_outputs(images, progress=progress))

  def components(self, inputs: Any, *, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Regression: the mixture's components' (means, variances), each (K M, N, D) in the targets' units: M = 1
    Gaussian per member, or the snapshot_cycles snapshots of a snapshot member."""
    return self.task.components(self.member_outputs(inputs, progress=progress))

  def standardise(self, inputs: Any, xp=np) -> Any:
    """Inputs as the members take them: features standardised by the training data's statistics where it has them
    (on the host, in float64; traced with `xp=jnp`, in float32), as a fit's and a loaded ensemble's members take
    them; other inputs as they are."""
    if self._transform is None:
      return inputs
    return self._transform(inputs) if xp is np else standardise.feature_transform(self._data_info, xp=xp)(inputs)

  def _member_view(self, inputs: np.ndarray, progress: bool = False, role: str = 'predict',
                   with_features: bool = False) -> dict[str, np.ndarray]:
    """The members' outputs as the post-hoc chain takes them (ensemble/posthoc.py), for checked inputs; with their
    penultimate 'features' where the chain (or a step to fit: `with_features`) reads them."""
    view = self._view(self._member_outputs(inputs, progress, role))
    if with_features or posthoc.needs_features(self.posthoc):
      view['features'] = self._member_outputs(inputs, progress, role, what='features')
    return view

  def _view(self, outputs: np.ndarray) -> dict[str, np.ndarray]:
    """(K, N, W) member outputs as the post-hoc chain takes them (`Task.view`)."""
    return self.task.view(outputs)

  def _outputs(self, inputs: Any, role: str, progress: bool = False) -> dict[str, np.ndarray]:
    """The outputs after the whole chain."""
    return posthoc.apply(self.posthoc, self._member_view(self.check(inputs, role), progress, role))

  def _predictor(self, batch_size: int) -> predictor.Predictor:
    if batch_size not in self._predictors:
      self._predictors[batch_size] = predictor.Predictor(self.member, self.state, self.devices, batch_size)
    return self._predictors[batch_size]

  def predict(self, images: Any, *, members: bool = False, progress: bool = False,
              levels: Sequence[float] = mixture.LEVELS, threshold: float = 0.5) -> dict[str, np.ndarray]:
    """Per image: 'probs' (N, C), the members' mean after the post-hoc chain (its temperature); 'class' (N,); and,
    in nats, 'entropy' (total predictive), 'aleatoric' (expected member entropy), 'mutual_information' (epistemic:
    their difference) and 'disagreement' (share of member pairs voting differently); the chain's 'set' and 'flag'
    where it has a conformal or a flags step. 'member_probs' (K, N, C) with `members`. A regression ensemble
    returns the mixture's mean, std, aleatoric and epistemic variance and its central intervals holding each of
    `levels` instead (`levels=()`: none, for a loop that needs only the mean and std: the
    intervals cost most of a small prediction). A multi-label ensemble returns per label (N, L): 'probs', 'labels'
    (1 where 'probs' exceeds `threshold`), 'entropy', 'aleatoric' and 'mutual_information'; the conformal step's
    'set' (N, L, 2); 'member_probs' (K, N, L) with `members`. A quantile ensemble returns its 'quantiles', the
    outermost pair's 'lower' and 'upper' and the members' 'epistemic_std' (tasks/quantile.py).

    The uncertainty is split on the members' own probabilities, where total =
    aleatoric + epistemic holds; a temperature only rescales 'probs' (and
    leaves 'class' as it is).
    """
    check_flag('members', members)
    check_flag('progress', progress)
    self.task.check_predict_options(levels, threshold)
    outputs = self._outputs(images, 'predict', progress)
    result = self.task.predict(outputs, members=members, levels=levels, threshold=threshold)
    return {**result, 'distance': outputs['distance']} if 'distance' in outputs else result

  def evaluate(self, inputs: Any, labels: Any) -> dict[str, Any]:
    """The report's scores on labelled inputs: 'ensemble' and 'mean_member' accuracy, NLL, Brier and ECE, and
    'members', 'best_member', the gains and the ensemble-size curve (`scoring.score_test_set`); with a
    temperature in the chain, 'temperature_scaled' scores of the chain's probabilities.

    The NLL comes from the members' log-probabilities, so a confident mistake
    keeps its cost; the temperature is not applied to the members' scores. A
    regression ensemble takes float targets and returns RMSE, NLL, CRPS and
    interval coverage ('variance_scaled' with a variance scale in the chain); a multi-label ensemble 0/1 labels
    (N, L) and per-label scores (`tasks.multilabel.scores`).
    """
    inputs, labels = self._labelled_pair(inputs, labels, 'evaluate')
    return self.task.evaluate(self._member_outputs(inputs, role='evaluate'), self.task.host_labels(labels),
                              self.posthoc, self.size)

  def report(self, inputs: Any, labels: Any, *, calibration: Any = None, ood: dict[str, Any] | None = None,
             angles: Sequence[int] | None = None, noise: bool | None = None,
             alphas: Sequence[float] = scoring.DEFAULT_ALPHAS, output_dir: str | None = None,
             progress: bool = True) -> dict[str, Any]:
    """The full report of `python -m ensemble.evaluate`, for this ensemble on labelled `inputs` (a test set), as one
    nested dict (what its metrics.json holds); with `output_dir`, its report.md and plots written there too. The
    same implementation (`Task.report`): the same numbers for the same examples.

    Always: the scores of every member, their mean, the best and the ensemble,
    the gains, the ensemble-size curve and risk-coverage (a regression's RMSE,
    NLL, CRPS, interval coverage and selective RMSE). With `calibration=(x, y)`,
    examples the members did not train on: the temperature (a regression's
    variance scale), split-conformal sets (intervals) at each of `alphas` with
    their coverage, its 99% bounds and their sizes (widths), and the flag
    thresholds. Images: the test set rotated by `angles` (default 0 to 180 by
    15 degrees; () for none) and with Gaussian noise at five severities
    (`noise`, default True); out-of-distribution detection (AUROC, AUPR, FPR95)
    against `ood`, {name: inputs} or one set of inputs (images by default: uniform noise and the
    test images' pixels permuted; {} for none).

    `progress` (True by default, as `ensemble.fit`'s, so that a report of
    minutes is never silent) writes a line to stderr as each stage ends (the
    test pass, the shifts, the temperature, the conformal sets, the OOD sets,
    ...) with its seconds, and a bar over a shift's passes on a terminal;
    False, none. The numbers are the same either way.
    """
    check_flag('progress', progress)
    if output_dir is not None:
      _check_report_folder(output_dir)
    inputs, labels = self._labelled_pair(inputs, labels, 'report')
    test = {'image': inputs, 'label': labels}
    heldout = None
    if calibration is not None:
      x, y = self._labelled_pair(*arrays.pair(calibration, 'report: calibration'), 'report: calibration')
      heldout = {'image': x, 'label': y}
    images = self.member.inputs == 'images' and self.task.shifts  # what the shifts score
    if ood is None:
      ood = ({name: make(inputs) for name, make in scoring.OOD_BUILTINS.items()}
             if self.member.inputs == 'images' and self.task.detects_ood else {})
    elif not isinstance(ood, dict):  # one set of inputs
      ood = {'ood': ood}
    by_distance = bool(ood) and not self.task.detects_ood  # the chain's distance step is the one score there
    if by_distance and posthoc.last(self.posthoc, 'distance') is None:
      raise UsageError(f'report: ood= detects unfamiliar inputs by the members\' probabilities, and this is a '
                       f'{self.task.name} ensemble: fit a distance step first (ens.distance(x_train)), or leave '
                       'ood= out')
    ood = {name: self.check(x, f'report: ood {name}') for name, x in ood.items()}
    with console.stages_shown(progress):
      scores = self.task.report(predictor.Forward(self), test, heldout, False, size=self.size,
                                angles=(scoring.DEFAULT_ANGLES if angles is None else angles) if images else (),
                                noise=(True if noise is None else noise) and images,
                                ood_sets=None if by_distance else ood, alphas=alphas)
      if by_distance:
        with console.stage(f'out-of-distribution sets ({len(ood)})'):
          scores['ood'] = scoring.score_distance_ood(predictor.Forward(self).distance, test, ood)
    results = {'workdir': self.workdir or 'an ensemble in memory', 'epoch': self.epoch,
               'checkpoint_unit': self.config.checkpoint_unit, 'ensemble_size': self.size, 'task': self.task.name,
               'data': 'the examples given', 'calibration': 'given' if heldout is not None else None, **scores}
    if posthoc.last(self.posthoc, 'conformal') is not None:  # judged on the test set, class by class where it can
      with console.stages_shown(progress), console.stage("the chain's conformal sets"):
        chained = scoring.score_chain_conformal(self.task, self.posthoc, predictor.Forward(self), test)
      results.update({'posthoc_conformal': chained} if chained else {})
    if output_dir is not None:
      self.task.write_report(results, output_dir)
    return results

  @console.root_logging_kept()
  def save(self, path: str) -> 'Ensemble':
    """Writes exactly this value at `path`, which must not exist: its recipe, its members at its one checkpoint,
    and its post-hoc chain (ensemble/manifest.py); returns it as saved there. `ensemble.load(path)` reads it back
    whole, and `python -m ensemble.evaluate / predict / export` read it as a workdir.

    Written beside `path` and renamed into place when complete: a failed save leaves nothing at `path`.
    """
    from ensemble import manifest  # pylint: disable=g-import-not-at-top  # orbax: only where files are written
    return self._replace(workdir=manifest.write(self, path))

  # --- the command line's flags, fitted on a workdir's held-out slice ------------------------------------------------

  def flag_threshold(self, target_risk: float = posthoc.DEFAULT_FLAG_RISK, data_dir: str | None = None,
                     ood_rate: float = posthoc.DEFAULT_FLAG_OOD_RATE) -> dict[str, Any]:
    """The two thresholds `posthoc.flagged` applies, fitted on the slice of the training split that the trainer
    held out (`ensemble.evaluation.heldout_split`), read from `data_dir` (default: the data the run was trained
    with): what `python -m ensemble.predict` flags by, where the chain has no flags step. As a flags step
    (`flags`) fits them on given rows: 'threshold', with the held-out 'coverage' and 'risk' at it, and
    'ood_threshold'. Kept in the workdir by checkpoint and settings, so that a prediction costs its start-up.
    """
    posthoc.check_rates(target_risk, ood_rate)
    self._require(self.task.flags, 'flag_threshold')
    if self.workdir is None:
      raise UsageError('flag_threshold reads the held-out slice of the data a workdir was trained on, and this '
                       'ensemble is in memory; fit flags on held-out rows with ens.flags(x, y), or ens = '
                       'ens.save(path) first')
    from ensemble import manifest  # pylint: disable=g-import-not-at-top
    data_dir = self.config.data_dir if data_dir is None else data_dir
    kept = manifest.kept_flag_thresholds(self.workdir, self.epoch, target_risk, ood_rate, data_dir, self.temperature)
    if kept is not None:  # fitted for this checkpoint and these settings before: a prediction costs its start-up
      return kept
    fitted = _evaluation().fit_flag_threshold(self, target_risk, data_dir, ood_rate)
    manifest.keep_flag_thresholds(self.workdir, self.epoch, fitted, self.temperature, data_dir)
    return fitted


def _check_report_folder(output_dir: str):
  """Refuses a run's own eval folder: `python -m ensemble.evaluate` keeps there the temperature (variance scale)
  that `ensemble.load` applies to the run, and another report in its place would change what `load` returns."""
  folder = os.path.abspath(os.path.expanduser(output_dir))
  run = os.path.dirname(folder)
  if os.path.basename(folder) == 'eval' and os.path.isfile(os.path.join(run, 'config.json')):
    raise UsageError(f'report: output_dir={output_dir} is the eval folder of the run in {run}, where python -m '
                     'ensemble.evaluate keeps the temperature ensemble.load applies to it; write the report to '
                     'another folder')
