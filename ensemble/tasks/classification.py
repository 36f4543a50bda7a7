"""Classification: each member gives logits; the ensemble predicts the mean of the members' probabilities."""

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

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


@dataclasses.dataclass(frozen=True)
class Classification:
  """Logits, one per class; trained by cross-entropy against integer labels, or, against a teacher's probabilities
  (N, C) as labels (`ensemble.distill`), by `distillation_loss` at `temperature`."""
  name: str = 'classification'
  temperature: float = 1.0

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

  # What the progress bar shows as the running loss: the train steps' 'loss' as it is.
  reported_loss = ('loss', 0.0)

  def in_data_units(self, outputs: dict) -> dict:
    """The test pass's outputs as the data's units have them: a class is a class."""
    return outputs

  def summary(self, train, test=None) -> dict[str, float]:
    """The task's part of metrics.jsonl's line for an epoch: the training metrics, and the test set's scores when
    it was scored (`train` None: the test set's alone)."""
    summary = {} if train is None else {'train_loss': train['loss'], 'train_accuracy': train['accuracy']}
    if test is None:
      return summary
    summary.update(test_loss=test['loss'], test_accuracy=test['accuracy'])
    for i, (loss, accuracy) in enumerate(zip(test['member_loss'], test['member_accuracy'])):
      summary[f'member_test_loss/{i}'] = loss
      summary[f'member_test_accuracy/{i}'] = accuracy
    return summary
