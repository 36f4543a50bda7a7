"""Post-hoc steps: what is fitted after training, on labelled rows the members did not train on, as small transforms
of the ensemble's outputs composed in the order they were fitted (as optax composes transforms of updates).

The outputs flow through the chain as a dict: a classification ensemble's 'member_probs' (K, N, C) and 'probs'
(N, C), their mean; a multi-label ensemble's 'member_label_probs' (K, N, L) and 'label_probs' (N, L); a regression
ensemble's mixture components 'means' and 'variances' (K M, N, D). A step reads them as the steps before it left
them, and changes them (a temperature: 'probs' or 'label_probs'; a variance scale: 'variances') or adds its own
answer (conformal: 'set', or 'conformal_lower' and 'conformal_upper'; flags: 'flag'; distance: 'distance', from the
members' penultimate 'features' (K, N, F), which the outputs carry where the chain has a distance step):

  step = posthoc.fit('temperature', chain, outputs, labels, inputs, epoch)  # fitted on `apply(chain, outputs)`
  outputs = posthoc.apply(chain + (step,), outputs)                         # numpy, or traced with xp=jnp

A step fitted on the outputs at its place in the chain applies to exactly those outputs: a step fitted later never
changes what an earlier one was fitted on. `conformal` then `calibrate` keeps its sets' coverage (they are sets of
the probabilities its quantile was fitted on) and returns temperature-scaled probabilities; `calibrate` then
`conformal` calibrates the sets of the scaled ones. Each step records what it was fitted on (`FittedOn`: the
members' checkpoint, the steps before it, the examples' count and hash), so that a chain is never applied to other
members or after other steps (`check`).
"""

import dataclasses
import hashlib
import json
import math
import numbers
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ensemble import calibration
from ensemble.errors import UsageError, hint
from ensemble.uncertainty import conformal, decomposition, distance, multilabel, selective

# The flag (`flags`) is two tests. The total predictive entropy counts both kinds of doubt, a blurred digit
# (aleatoric) and a shape no member has seen (epistemic), and its threshold keeps the error rate of the unflagged
# calibration rows at the target risk; but an accurate ensemble meets a 1% risk with every row unflagged, and flags
# nothing. So an input is also flagged when the members disagree on it (mutual information) more than on all but
# `ood_rate` of the calibration rows: on MNIST (K=8, 3 epochs) that flags 95% of uniform-noise images and 75% of
# digits rotated by 90 degrees, and 2.0% of the test set (docs/predict-and-export.md).
DEFAULT_FLAG_RISK = 0.01
DEFAULT_FLAG_OOD_RATE = 0.02
FLAG_SCORE = 'entropy'
OOD_SCORE = 'mutual_information'


class FittedOn(NamedTuple):
  """What a step was fitted on: the members' checkpoint (`Ensemble.epoch`), the ids of the steps before it, and
  the calibration examples' count and hash (`digest`)."""
  epoch: int
  after: tuple[str, ...]
  examples: int
  sha256: str


@dataclasses.dataclass(frozen=True)
class Step:
  """One fitted post-hoc step: its kind (`KINDS`), its fitted settings and what it was fitted on, and the task
  whose outputs it reads. A step carries its task as an optax transform carries its state: a conformal step's sets
  are its own task's (`Task.apply_conformal`), whatever its score is called. The task is not saved (the ensemble's
  is) and not compared."""
  kind: str
  settings: tuple[tuple[str, Any], ...]
  fitted_on: FittedOn
  task: Any = dataclasses.field(compare=False, repr=False)

  def __getitem__(self, name: str) -> Any:
    return dict(self.settings)[name]

  def to_dict(self) -> dict[str, Any]:
    """The step as the manifest (ensemble.json) holds it."""
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings}
    fitted_on = {**self.fitted_on._asdict(), 'after': list(self.fitted_on.after)}
    return {'kind': self.kind, **settings, 'fitted_on': fitted_on}

  @property
  def id(self) -> str:
    """What a later step records of this one: a hash of the step, so that it names these fitted values."""
    return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

  def apply(self, outputs: dict[str, Any], xp=np) -> dict[str, Any]:
    return KINDS[self.kind].apply(self, outputs, xp)

  def describe(self) -> str:
    return KINDS[self.kind].describe(self)


def _settings(values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
  return tuple(sorted((k, _frozen(v)) for k, v in values.items()))


def _frozen(value: Any) -> Any:
  """A fitted setting as a step holds it, comparable and the same whether fitted or read from JSON: arrays and
  lists as (nested) tuples."""
  if isinstance(value, np.ndarray):
    value = value.tolist()
  return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def digest(inputs: np.ndarray, labels: np.ndarray) -> str:
  """A short hash of the examples a step was fitted on: their shapes, dtypes and bytes."""
  h = hashlib.sha256()
  for array in (inputs, labels):
    array = np.ascontiguousarray(array)
    h.update(f'{array.shape} {array.dtype};'.encode())
    h.update(memoryview(array).cast('B'))
  return h.hexdigest()[:16]


# --- the kinds: each a fit (outputs at its place, labels, the task -> its settings), an apply and a name -------------
# A task says which of them it takes (`Task.calibration`, `conformal_scores`, `flags`) and fits what differs
# between tasks (`Task.fitted_scale`, `Task.fit_conformal`), on its labelled examples (`Task.labelled_view`).

def _fit_scale(outputs, labels, task, **settings):
  return task.fitted_scale(outputs, labels, **settings)


def _apply_temperature(step, outputs, xp):
  return {**outputs, 'probs': calibration.temperature_scale(outputs['probs'], step['value'], xp=xp)}


def _apply_label_temperature(step, outputs, xp):
  value = step['value']
  value = xp.asarray(value) if isinstance(value, tuple) else value
  return {**outputs, 'label_probs': multilabel.temperature_scale(outputs['label_probs'], value, xp=xp)}


def _apply_variance_scale(step, outputs, xp):
  del xp
  return {**outputs, 'variances': outputs['variances'] * step['value']}


def check_alpha(alpha: Any):
  if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < 1:
    raise UsageError(f'alpha={alpha!r} must be in (0, 1), the miscoverage: e.g. alpha=0.1 for 90% sets')


def check_rates(target_risk: Any, ood_rate: Any):
  if isinstance(target_risk, bool) or not isinstance(target_risk, numbers.Real) or not target_risk == target_risk:
    raise UsageError(f'target_risk={target_risk!r} must be a number: the error rate the unflagged inputs may have')
  if isinstance(ood_rate, bool) or not isinstance(ood_rate, numbers.Real) or not 0 <= ood_rate < 1:
    raise UsageError(f'ood_rate={ood_rate!r} must be a share of the calibration examples in [0, 1)')


def conformal_settings(task: Any, alpha: Any, score: Any, class_conditional: Any) -> dict[str, Any]:
  """A conformal step's settings for `task`, checked: `score` None is the task's first; class_conditional only
  where it is True (a marginal step records what it always did)."""
  if why := task.refuses('conformal'):
    raise UsageError(f'conformal: a {task.name} ensemble {why}')
  check_alpha(alpha)
  scores = task.conformal_scores
  score = scores[0] if score is None else score
  if score not in scores:
    raise UsageError(f'score={score!r}: give one of {list(scores)}, the conformal scores of a {task.name} ensemble')
  if not isinstance(class_conditional, bool):
    raise UsageError(f'class_conditional={class_conditional!r} must be True or False')
  if class_conditional and not task.class_conditional:
    raise UsageError(f'class_conditional=True: a {task.name} ensemble has no classes to condition on; leave it out '
                     '(its intervals cover 1 - alpha of the targets)')
  return {'alpha': alpha, 'score': score, **({'class_conditional': True} if class_conditional else {})}


def _fit_conformal(outputs, labels, task, alpha, score, **options):
  """The task's quantile(s); a class-conditional step's classes too rare for `alpha` are pooled, and said so."""
  fitted = task.fit_conformal(outputs, labels, alpha, score, **options)
  if fitted.get('pooled'):
    pooled = ', '.join(f'label {g[0]} = {g[1]}' if isinstance(g, list) else f'class {g}' for g in fitted['pooled'])
    hint(f'conformal(class_conditional=True): fewer calibration examples than alpha={alpha:g} needs '
         f'({conformal.rows_needed(alpha)}) of {pooled}: their sets use the marginal quantile (covered on average, '
         'not on their own); give more examples of them, or raise alpha')
  return fitted


def _describe_conformal(step):
  by_class = ' per class' if dict(step.settings).get('class_conditional') else ''
  return f'conformal {step["score"]} alpha {step["alpha"]:g}{by_class}'


def _apply_conformal(step, outputs, xp):
  return step.task.apply_conformal(step, outputs, xp)


def _doubts(member_probs, xp=np):
  """(total predictive entropy, mutual information) per input, as `decomposition.decompose` splits them."""
  total = decomposition.entropy(member_probs.mean(0), xp=xp)
  return total, xp.maximum(total - decomposition.entropy(member_probs, xp=xp).mean(0), 0.0)


def flag_thresholds(entropy: np.ndarray, mutual_information: np.ndarray, correct: np.ndarray, target_risk: float,
                    ood_rate: float) -> dict[str, float]:
  """The two thresholds `flagged` applies, fitted on labelled examples' predictive entropy, mutual information and
  whether the ensemble's class was right: the largest entropy that keeps the error rate of the unflagged ones
  within `target_risk` ('threshold', with their 'coverage' and 'risk' at it), and the mutual information that
  only `ood_rate` of them exceed ('ood_threshold')."""
  curve = selective.risk_coverage(entropy, correct)
  return {**selective.threshold_for_risk(curve, target_risk), 'target_risk': float(target_risk),
          'ood_threshold': float(np.quantile(mutual_information, 1 - ood_rate, method='higher')),
          'ood_rate': float(ood_rate)}


def _fit_flags(outputs, labels, task, target_risk, ood_rate):
  del task
  entropy, mutual_information = _doubts(outputs['member_probs'])
  return flag_thresholds(entropy, mutual_information, np.argmax(outputs['probs'], -1) == labels, target_risk,
                         ood_rate)


def flagged(result: dict[str, Any], fitted: Any) -> Any:
  """(N,) bool: which inputs to refer, by `predict`'s 'entropy' and 'mutual_information' and the thresholds a
  flags step (or `Ensemble.flag_threshold`) fitted."""
  return (result[FLAG_SCORE] > fitted['threshold']) | (result[OOD_SCORE] > fitted['ood_threshold'])


def _apply_flags(step, outputs, xp):
  entropy, mutual_information = _doubts(outputs['member_probs'], xp)
  return {**outputs, 'flag': flagged({FLAG_SCORE: entropy, OOD_SCORE: mutual_information}, step)}


def _fit_distance(outputs, labels, task):
  """Gaussians on the members' penultimate features ('features', (K, N, F)): one per class of a classifier, one
  for any other task (ensemble/uncertainty/distance.py)."""
  per_class = task.has_classes and not task.per_position
  fitted = distance.fit(outputs['features'], labels if per_class else None,
                        outputs['member_probs'].shape[-1] if per_class else 1)
  return {**fitted, 'classes': int(fitted['means'].shape[1]), 'features': int(fitted['means'].shape[2])}


def _apply_distance(step, outputs, xp):
  return {**outputs, 'distance': distance.score(step['means'], step['whitening'], outputs['features'], xp=xp)}


def of_outputs(chain: Sequence[Step]) -> tuple[Step, ...]:
  """The chain's steps that read the members' outputs alone: what a score of its probabilities, sets or intervals
  applies to outputs without the penultimate features. A distance step adds its 'distance' and changes nothing a
  later step reads, so leaving it out changes no other answer."""
  return tuple(step for step in chain if not KINDS[step.kind].per_input)


def needs_features(chain: Sequence[Step]) -> bool:
  """Whether the chain reads the members' penultimate features (a distance step), besides their outputs."""
  return any(KINDS[step.kind].per_input for step in chain)


class Kind(NamedTuple):
  """A kind of step: its fit, its apply, and its name in a repr. `per_input`: fitted on the inputs' features,
  one row each whatever the task's labels (a dense task's unlabelled positions too), rather than on the labelled
  outputs."""
  fit: Callable[..., dict[str, Any]]
  apply: Callable[[Step, dict, Any], dict]
  describe: Callable[[Step], str]
  per_input: bool = False


KINDS = {
    'temperature': Kind(_fit_scale, _apply_temperature, lambda s: f'temperature {s["value"]:.4g}'),
    'label_temperature': Kind(_fit_scale, _apply_label_temperature, lambda s: f'temperature {_values(s["value"])}'),
    'variance_scale': Kind(_fit_scale, _apply_variance_scale, lambda s: f'variance_scale {s["value"]:.4g}'),
    'conformal': Kind(_fit_conformal, _apply_conformal, _describe_conformal),
    'flags': Kind(_fit_flags, _apply_flags, lambda s: f'flags risk {s["target_risk"]:g} ood_rate {s["ood_rate"]:g}'),
    'distance': Kind(_fit_distance, _apply_distance,
                     lambda s: f'distance {s["classes"]} Gaussians of {s["features"]} features', per_input=True),
}


# --- a chain -------------------------------------------------------------------------------------------------------

def fit(kind: str, chain: Sequence[Step], outputs: dict[str, Any], labels: np.ndarray, inputs: np.ndarray,
        epoch: int, task: Any, **settings) -> Step:
  """A step of `kind` fitted on `outputs` as `chain` leaves them (`apply`), for labelled `inputs`: on the `task`'s
  labelled examples (a dense task's labelled positions), whose count it records."""
  per_input = KINDS[kind].per_input
  view, labelled = (apply(chain, outputs), labels) if per_input else task.labelled_view(apply(chain, outputs), labels)
  fitted = KINDS[kind].fit(view, labelled, task, **settings)
  examples = len(inputs) if per_input else task.examples(labels)
  return Step(kind, _settings(fitted),
              FittedOn(int(epoch), tuple(step.id for step in chain), examples, digest(inputs, labels)), task)


def given(kind: str, chain: Sequence[Step], epoch: int, task: Any, **settings) -> Step:
  """A step of `task`'s given rather than fitted, after `chain`: a temperature set by hand (`ensemble.load(...,
  temperature=T)`), or read from a workdir of an earlier version, which recorded no examples."""
  return Step(kind, _settings(settings), FittedOn(int(epoch), tuple(step.id for step in chain), 0, ''), task)


def given_temperature(task: Any, value: float, epoch: int, chain: Sequence[Step]) -> Step:
  """A temperature (variance scale) given rather than fitted (`ensemble.load(..., temperature=T)`, a workdir's
  `ensemble.evaluate` report), after `chain`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float('inf'):
    raise UsageError(f'temperature={value!r} must be a positive number')
  if task.calibration is None:
    raise UsageError(f'temperature={value!r}: a {task.name} ensemble has no temperature or scale; leave it out')
  return given(task.calibration, chain, epoch, task, value=float(value))


def replaced(chain: Sequence[Step], kind: str, step: Step) -> tuple[Step, ...]:
  """`chain` with its steps of `kind` replaced by `step`, at its end; refused where a step was fitted after one of
  them (on the outputs it changed)."""
  kept = [s for s in chain if s.kind != kind]
  first = next((i for i, s in enumerate(chain) if s.kind == kind), len(chain))
  if any(s.kind != kind for s in chain[first:]):
    raise UsageError(f'temperature={step["value"]:g} would replace the {describe(chain[first:first + 1])} that the '
                     f'{describe([s for s in chain[first:] if s.kind != kind][:1])} after it was fitted on; leave '
                     'temperature= out, or fit the chain again')
  return (*kept, Step(step.kind, step.settings, step.fitted_on._replace(after=tuple(s.id for s in kept)), step.task))


def apply(chain: Sequence[Step], outputs: dict[str, Any], xp=np) -> dict[str, Any]:
  """The outputs after every step of `chain`, in order."""
  for step in chain:
    outputs = step.apply(outputs, xp)
  return outputs


def describe(chain: Sequence[Step]) -> str:
  """'temperature 1.3 -> conformal thr alpha 0.1': the chain in order, as a repr shows it."""
  return ' -> '.join(step.describe() for step in chain)


def _values(value) -> str:
  """A temperature, or one per label, as a repr shows it."""
  return f'{value:.4g}' if isinstance(value, numbers.Real) else '(' + ', '.join(f'{v:.4g}' for v in value) + ')'


def product(chain: Sequence[Step], kind: str) -> Any:
  """What the chain's steps of `kind` ('temperature', 'label_temperature', 'variance_scale') amount to together:
  their product (two temperatures in a row scale as their product does); one per label where a step has one per
  label, a tuple."""
  values = [step['value'] for step in chain if step.kind == kind]
  if any(isinstance(v, tuple) for v in values):
    return tuple(float(v) for v in np.prod(np.broadcast_arrays(*values, 1.0), axis=0))
  return math.prod(values)


def last(chain: Sequence[Step], kind: str) -> Step | None:
  return next((step for step in reversed(chain) if step.kind == kind), None)


def summary(chain: Sequence[Step]) -> dict[str, float]:
  """What `Ensemble.summary` says of the chain: the temperature (a regression's variance scale) the steps amount
  to, and the last conformal step's alpha."""
  # A multi-label ensemble's temperature (one, or one per label) is its summary's 'temperature' too.
  found = {kind.replace('label_', ''): product(chain, kind) for kind in ('temperature', 'label_temperature',
                                                                       'variance_scale')
           if any(step.kind == kind for step in chain)}
  conformal_step = last(chain, 'conformal')
  if conformal_step is not None:
    found['conformal_alpha'] = conformal_step['alpha']
  return found


def to_json(chain: Sequence[Step]) -> list[dict[str, Any]]:
  return [step.to_dict() for step in chain]


def from_json(saved: Any, where: str, task: Any) -> tuple[Step, ...]:
  """The chain a manifest holds, of the ensemble's `task`; a step of unknown kind or shape is one UsageError naming
  `where`."""
  if not isinstance(saved, list):
    raise UsageError(f'{where}: its post-hoc steps are not a list; write it again with Ensemble.save')
  chain = []
  for i, entry in enumerate(saved):
    try:
      values = {k: v for k, v in entry.items() if k not in ('kind', 'fitted_on')}
      fitted_on = FittedOn(int(entry['fitted_on']['epoch']), tuple(entry['fitted_on']['after']),
                           int(entry['fitted_on']['examples']), str(entry['fitted_on']['sha256']))
      if entry['kind'] not in KINDS:
        raise KeyError(entry['kind'])
      chain.append(Step(entry['kind'], _settings(values), fitted_on, task))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
      raise UsageError(f'{where}: post-hoc step {i + 1} cannot be read ({type(e).__name__}: {e}); write it again '
                       'with Ensemble.save, or remove the file to load the members without their post-hoc steps'
                       ) from None
  return tuple(chain)


def check(chain: Sequence[Step], epoch: int, where: str):
  """Refuses a chain whose steps were fitted on other members (another checkpoint than `epoch`) or after other
  steps than those before them: it would apply, silently, to other outputs than it was fitted on."""
  for i, step in enumerate(chain):
    before = tuple(s.id for s in chain[:i])
    if step.fitted_on.epoch != epoch:
      raise UsageError(f'{where}: its post-hoc step {step.describe()} was fitted on the members of checkpoint '
                       f'{step.fitted_on.epoch}, not {epoch}; load checkpoint {step.fitted_on.epoch}, or fit the step '
                       'again on these members')
    if step.fitted_on.after != before:
      raise UsageError(f'{where}: its post-hoc step {step.describe()} was fitted after other steps than those before '
                       'it; fit the chain again')
