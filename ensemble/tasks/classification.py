"""Classification: each member gives logits; the ensemble predicts the mean of the members' probabilities."""

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ensemble import acquire, calibration, posthoc, scoring
from ensemble.errors import DataError
from ensemble.tasks import base
from ensemble.uncertainty import conformal, decomposition

AxisName = str | Sequence[str]
Metrics = dict[str, jnp.ndarray]


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def distillation_loss(logits: jnp.ndarray, teacher_probs: jnp.ndarray, temperature: float = 1.0) -> jnp.ndarray:
  """(N,) Hinton et al.'s (2015) distillation loss: T^2 times the cross-entropy of softmax(logits / T) against
  the teacher's probabilities at temperature T, p^(1/T) renormalised. The T^2 keeps the gradients' scale as T
  changes; at T = 1 it is the cross-entropy against the teacher's probabilities themselves."""
  log_teacher = jnp.log(jnp.maximum(teacher_probs, jnp.finfo(teacher_probs.dtype).tiny))
  targets = jax.nn.softmax(log_teacher / temperature, axis=-1)
  return temperature ** 2 * optax.softmax_cross_entropy(logits / temperature, targets)


def ensemble_probs(probs: jnp.ndarray, axis_name: AxisName) -> jnp.ndarray:
  """The ensemble prediction: the mean of the members' probabilities over the mapped axes."""
  return jax.lax.pmean(probs, axis_name)


def log_mean_exp(log_values: jnp.ndarray, axis_name: AxisName) -> jnp.ndarray:
  """log(mean(exp(log_values))) over the mapped axes, without leaving log space.

  The ensemble's log-probability of a label from its members': shifted by the
  members' maximum, the largest term is exp(0) = 1, so a confident mistake
  (every member's probability below float32's smallest) keeps its cost
  instead of being clipped at float32 tiny (87 nats).
  """
  peak = jax.lax.pmax(log_values, axis_name)
  return peak + jnp.log(jax.lax.pmean(jnp.exp(log_values - peak), axis_name))


def eval_outputs(logits: jnp.ndarray, labels: jnp.ndarray, *, axis_name: AxisName) -> Metrics:
  """A member's eval step from its logits: backends that compute the logits their own way use it."""
  log_probs = jax.nn.log_softmax(logits)
  ensemble = ensemble_probs(jnp.exp(log_probs), axis_name)
  label_log_prob = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
  return {
      'member_loss': cross_entropy(logits, labels),
      'member_correct': (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
      'ensemble_loss': -log_mean_exp(label_log_prob, axis_name),
      'ensemble_correct': (jnp.argmax(ensemble, -1) == labels).astype(jnp.float32),
  }


def as_labels(labels: np.ndarray, name: str) -> np.ndarray:
  """int32 (N,) class indices; (N, 1), as Keras's CIFAR arrays come, is flattened."""
  if labels.ndim == 2 and labels.shape[1] == 1:
    labels = labels[:, 0]
  if labels.ndim != 1:
    raise DataError(f'{name}: labels of shape {labels.shape}, expected (N,) integer class indices '
                    "(for one-hot labels store y.argmax(-1); for a class per position, task='dense')")
  if not np.issubdtype(labels.dtype, np.integer):
    if np.issubdtype(labels.dtype, np.number) and not np.all(np.mod(labels, 1) == 0):
      raise DataError(f"{name}: real-valued targets (dtype {labels.dtype}) with task='classification': pass "
                      "task='regression' to predict them, or integer class indices 0..C-1 to classify")
    raise DataError(f'{name}: labels of dtype {labels.dtype}, expected integers: give class indices 0..C-1 '
                    "(y.astype(np.int32)), or task='regression' for real-valued targets")
  if len(labels) and labels.min() < 0:
    raise DataError(f'{name}: negative label {labels.min()}; labels must be class indices 0..C-1')
  if len(labels) and labels.max() > np.iinfo(np.int32).max:
    raise DataError(f'{name}: label {labels.max()} does not fit int32; labels must be class indices 0..C-1')
  return labels.astype(np.int32, copy=False)


@dataclasses.dataclass(frozen=True)
class Classification(base.Task):
  """Logits, one per class; trained by cross-entropy against integer labels, or, against a teacher's probabilities
  (N, C) as labels (`ensemble.distill`), by `distillation_loss` at `temperature`."""
  name = 'classification'
  label_kind = 'classes'
  temperature: float = 1.0
  has_classes = True
  image_datasets = True
  fields = ('distill_temperature',)
  calibration = 'temperature'
  conformal_scores = tuple(conformal.SCORES)
  class_conditional = True
  flags = True
  shifts = True
  detects_ood = True
  chance_hint = True
  acquisitions = acquire.CLASSIFICATION
  batch_acquisitions = acquire.BATCHES

  @classmethod
  def field_error(cls, name, value):
    return None if base.positive(value) else f'{name}={value!r} must be positive'

  @classmethod
  def of(cls, config, data_info=None):
    return cls(temperature=config.distill_temperature)

  def student_settings(self, teacher, temperature):
    """The student learns the teacher's probabilities at `temperature` (`distillation_loss`)."""
    return {'distill_temperature': float(temperature)}

  def member_output(self, logits: jnp.ndarray) -> jnp.ndarray:
    """What prediction takes from a member: its log-probabilities."""
    return jax.nn.log_softmax(logits)

  def loss(self, logits: jnp.ndarray, labels: jnp.ndarray) -> tuple[jnp.ndarray, Metrics]:
    """(mean cross-entropy of the batch, the step's metrics); with a teacher's probabilities as `labels`, the
    distillation loss, and the accuracy is the agreement with the teacher's class."""
    if jnp.issubdtype(labels.dtype, jnp.floating):  # (N, C) probabilities, not (N,) classes: known when traced
      # A model with more outputs than the teacher's classes, as fit allows more than the labels use: probability 0.
      labels = jnp.pad(labels, ((0, 0), (0, logits.shape[-1] - labels.shape[-1])))
      loss = distillation_loss(logits, labels, self.temperature).mean()
      labels = jnp.argmax(labels, -1)
    else:
      loss = cross_entropy(logits, labels).mean()
    return loss, {'loss': loss, 'accuracy': jnp.mean(jnp.argmax(logits, -1) == labels)}

  def eval_outputs(self, logits: jnp.ndarray, labels: jnp.ndarray, *, axis_name: AxisName) -> Metrics:
    return eval_outputs(logits, labels, axis_name=axis_name)

  def combine_snapshots(self, outputs: jnp.ndarray, count: jnp.ndarray, current: jnp.ndarray) -> jnp.ndarray:
    """log of the mean probability of the `count` kept snapshots (`outputs` (C, N, ..., classes)); `current`
    before the first."""
    cycles = outputs.shape[0]
    log_probs = jax.nn.log_softmax(outputs)
    kept_mask = (jnp.arange(cycles) < count).reshape((cycles,) + (1,) * (outputs.ndim - 1))
    mean = jax.nn.logsumexp(jnp.where(kept_mask, log_probs, -jnp.inf), axis=0) - jnp.log(jnp.maximum(count, 1))
    return jnp.where(count > 0, mean, current)

  def summary(self, train, test=None) -> dict[str, float]:
    """The task's part of metrics.jsonl's line for an epoch: the training metrics, and the test set's scores when
    it was scored (`train` None: the test set's alone)."""
    summary = {} if train is None else {'train_loss': train['loss'], 'train_accuracy': train['accuracy']}
    same = lambda value: value
    return base.with_test_scores(summary, test, {'loss': ('loss', same), 'accuracy': ('accuracy', same)})

  # --- labels ------------------------------------------------------------------------------------------------------

  def read_labels(self, labels, name, ignore=base.IGNORED):
    return as_labels(labels, name)

  def split_labels(self, labels, inputs, name, ignore=base.IGNORED):
    if (labels.ndim >= 2 and np.issubdtype(labels.dtype, np.integer) and labels.shape[1:] != (1,)
        and labels.shape[1:] == inputs.shape[1:labels.ndim]):
      raise DataError(f'{name}: labels of shape {labels.shape}, a label at each position of inputs '
                      f"{inputs.shape}: a class per position is task='dense'; give it (one integer class per input "
                      'is classification)')
    return self.read_labels(labels, name, ignore)

  def layout_error(self, labels, images, num_classes):
    # float32 (N, C): a teacher's probabilities, what ensemble.distill trains a student on
    if not ((labels.dtype == np.int32 and labels.shape == images.shape[:1])
            or (labels.dtype == np.float32 and labels.ndim == 2 and labels.shape[0] == len(images))):
      return (f'labels must be int32 ({len(images)},) classes or float32 ({len(images)}, C) probabilities, got '
              f'{labels.dtype} {labels.shape}')
    return None

  def num_outputs(self, labels):
    return int(self.labelled(labels).max(initial=-1)) + 1

  def labels(self, values, role, count, outputs, positions=(), ignore=base.IGNORED):
    values = base._as_array(values, role)  # pylint: disable=protected-access
    if values.shape[:1] != (count,) or not np.issubdtype(values.dtype, np.integer):
      raise DataError(f'{role}: labels of shape {values.shape} and dtype {values.dtype}; give {count} integer '
                      'class indices, one per input')
    return self.within_classes(self.read_labels(values, role, ignore), outputs, role)

  def within_classes(self, labels: np.ndarray, outputs: int, role: str) -> np.ndarray:
    """Class labels that the `outputs` classes hold; a label beyond them (which would score NaN, or nothing) is one
    line naming `role`."""
    labelled = self.labelled(labels)
    if labelled.size and not 0 <= labelled.min() <= labelled.max() < outputs:
      raise DataError(f'{role}: labels span [{labelled.min()}, {labelled.max()}], outside the {outputs} classes '
                      f'0..{outputs - 1} the members predict; give labels of those classes')
    return labels

  def output_error(self, shape, width, positions):
    if shape is None or len(shape) != 2 or shape[0] != 1 or shape[1] < width:
      return (f'not to (batch, {width}) logits, one per class; give its last layer {width} outputs (the labels run '
              f'0..{width - 1})')
    return None

  # --- what an ensemble answers ------------------------------------------------------------------------------------

  def member_probs(self, outputs):
    return np.exp(outputs)

  def view(self, outputs, xp=np):
    member_probs = xp.exp(outputs)
    return {'member_probs': member_probs, 'probs': member_probs.mean(0)}

  def predict(self, outputs, *, members, levels, threshold):
    member_probs, probs = outputs['member_probs'], outputs['probs']
    result = {'probs': probs, 'class': np.argmax(probs, -1), **decomposition.decompose(member_probs)}
    result.update({key: outputs[key] for key in ('set', 'flag') if key in outputs})
    if members:
      result['member_probs'] = member_probs
    return result

  def _scaled(self, chain, view) -> Any:
    """The chain's probabilities where it has a temperature, for the 'temperature_scaled' scores; else None."""
    if not any(step.kind == self.calibration for step in chain):
      return None
    return posthoc.apply(posthoc.of_outputs(chain), view)['probs']

  def evaluate(self, outputs, labels, chain, size):
    scores = scoring.score_test_set(outputs, labels)
    scaled = self._scaled(chain, self.view(outputs))
    if scaled is not None:
      scores['temperature_scaled'] = calibration.scores(scaled, labels)
    return scores

  def report(self, forward, test, heldout, seen_in_training, *, size, angles, noise, ood_sets, alphas):
    outputs = scoring.outputs(forward, test, 'test')
    held = None if heldout is None else (scoring.outputs(forward, heldout, 'calibration'), forward.labels(heldout))
    return scoring.score_classes(forward, test, outputs, test['label'], held, seen_in_training,
                                 angles=angles, noise=noise, ood_sets=ood_sets, alphas=alphas, flags=self.flags)

  def exported(self, outputs, chain, xp):
    chained = posthoc.apply(chain, self.view(outputs, xp), xp=xp)
    return {'member_log_probs': outputs, 'probs': chained['probs'],
            **{key: chained[key] for key in ('set', 'flag') if key in chained}}

  def fitted_scale(self, view, labels, **settings):
    return {'value': calibration.fit_temperature(view['probs'], labels)}

  def fit_conformal(self, view, labels, alpha, score, class_conditional=False):
    """The quantile of the true classes' scores; `class_conditional`: one per class, of its own examples' scores
    (a dense task's labelled positions of it), the classes too rare for `alpha` pooled (`conformal.group_quantiles`)."""
    fitted = {'alpha': float(alpha), 'score': score}
    if not class_conditional:
      return {**fitted, 'quantile': conformal.calibrated_quantile(view['probs'], labels, alpha, score)}
    scores = conformal.label_scores(conformal.SCORES[score](view['probs']), labels)
    quantiles, examples, pooled = conformal.group_quantiles(scores, labels, view['probs'].shape[-1], alpha)
    return {**fitted, 'class_conditional': True, 'quantile': [float(q) for q in quantiles],
            'class_examples': [int(n) for n in examples], 'pooled': pooled}

  def apply_conformal(self, step, view, xp):
    """Class c is in an input's set where its score is at most the quantile, class c's own where there is one each
    (a (C,) constant where exported)."""
    quantile = step['quantile']
    quantile = xp.asarray(quantile) if isinstance(quantile, tuple) else quantile
    return {**view, 'set': conformal.prediction_sets(view['probs'], quantile, step['score'], xp=xp)}

  def covered(self, result, labels):
    return np.take_along_axis(result['set'], labels[..., None], -1)[..., 0]

  # --- distillation and the loops ------------------------------------------------------------------------------------

  def curve_scores(self, ens, inputs, labels):
    labels = self.labels(labels, 'test', len(inputs), ens.num_classes)
    return {key: float(value) for key, value in scoring.ensemble_scores(ens.member_outputs(inputs, role='test'),
                                                                        labels).items()}
