"""Multi-label classification: L labels of 0 or 1 per example, each member a sigmoid per label; the ensemble's
probability of a label is the mean of the members' (binary classification is L = 1).

A member gives L logits z; its probability of label l is sigmoid(z_l), trained by the binary cross-entropy of each
label averaged over the labels, with an optional weight on each label's positive term (`pos_weight`: a rare label's
positives count more). The mean, not the sum: summed over 10 labels, each logit's gradient is as large as a binary
classifier's while the recipe's learning rate was chosen for one softmax's, and the default recipe's CNN diverged
on MNIST mosaics (mAP 0.74 against 0.95; docs/benchmarks.md). Prediction takes the logits themselves: a post-hoc
temperature divides them, and the members' probabilities are their sigmoids."""

import dataclasses

import jax
import jax.numpy as jnp

from ensemble.tasks import classification

AxisName = classification.AxisName
Metrics = classification.Metrics


def label_log_probs(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
  """log p(label) per label, log sigmoid(z) for a 1 and log sigmoid(-z) for a 0; a soft label (a teacher's
  probability) weighs the two."""
  labels = labels.astype(logits.dtype)
  return labels * jax.nn.log_sigmoid(logits) + (1 - labels) * jax.nn.log_sigmoid(-logits)


def combine(outputs: jnp.ndarray, count: jnp.ndarray) -> jnp.ndarray:
  """The logits whose sigmoid is the mean probability of the first `count` of `outputs` (C, ..., L), computed in
  log space: log p - log(1 - p) from the log-means of each side's probabilities."""
  kept = (jnp.arange(outputs.shape[0]) < count).reshape((-1,) + (1,) * (outputs.ndim - 1))
  log_count = jnp.log(jnp.maximum(count, 1))
  side = lambda z: jax.nn.logsumexp(jnp.where(kept, jax.nn.log_sigmoid(z), -jnp.inf), axis=0) - log_count
  return side(outputs) - side(-outputs)


@dataclasses.dataclass(frozen=True)
class Multilabel:
  """L logits, one per label; trained by the per-label binary cross-entropy against labels (N, L) of 0 and 1, or a
  teacher's probabilities (N, L) (`ensemble.distill`). The summary's accuracy is the fraction of labels right
  (1 - the Hamming loss), its loss the mean per-label NLL."""
  name: str = 'multilabel'
  pos_weight: tuple[float, ...] = ()  # per label, the weight of its positive term; () for 1 each

  def member_output(self, logits: jnp.ndarray) -> jnp.ndarray:
    """What prediction takes from a member: its logits (their sigmoids are its probabilities)."""
    return logits

  def loss(self, logits: jnp.ndarray, labels: jnp.ndarray) -> tuple[jnp.ndarray, Metrics]:
    """(the mean over the batch and the labels of the weighted binary cross-entropy, the step's metrics)."""
    labels = labels.astype(logits.dtype)
    weight = jnp.asarray(self.pos_weight, logits.dtype) if self.pos_weight else 1.0
    per_label = -(weight * labels * jax.nn.log_sigmoid(logits) + (1 - labels) * jax.nn.log_sigmoid(-logits))
    loss = per_label.mean()
    right = (logits > 0) == (labels > 0.5)
    return loss, {'loss': loss, 'accuracy': right.mean()}

  def eval_outputs(self, logits: jnp.ndarray, labels: jnp.ndarray, *, axis_name: AxisName) -> Metrics:
    """Per input: the member's and the ensemble's mean per-label NLL (the ensemble's from the mean of the members'
    probabilities, in log space: `classification.log_mean_exp`) and fraction of labels right."""
    log_probs = label_log_probs(logits, labels)
    ensemble = classification.ensemble_probs(jax.nn.sigmoid(logits), axis_name)
    truth = labels > 0.5
    return {
        'member_loss': -log_probs.mean(-1),
        'member_correct': ((logits > 0) == truth).mean(-1).astype(jnp.float32),
        'ensemble_loss': -classification.log_mean_exp(log_probs, axis_name).mean(-1),
        'ensemble_correct': ((ensemble > 0.5) == truth).mean(-1).astype(jnp.float32),
    }

  def combine_snapshots(self, outputs: jnp.ndarray, count: jnp.ndarray, current: jnp.ndarray) -> jnp.ndarray:
    """The logits of the mean probability of the `count` kept snapshots (`outputs` (C, N, L)); `current` before
    the first."""
    return jnp.where(count > 0, combine(outputs, count), current)

  reported_loss = classification.Classification.reported_loss

  def in_data_units(self, outputs: dict) -> dict:
    return outputs

  summary = classification.Classification.summary
