"""Dense classification: a class per position (each pixel of a segmentation, each token of a sequence labelling).

A member gives logits (N, *positions, C): the positions of its input come before the class axis. Labels are
(N, *positions) class indices, and `IGNORED` (-1) where a position carries no label: the data layer maps a run's
`ignore_label` to it when it reads the labels, so that every program and score knows one marker. Each labelled
position is a classification of its own: the loss is the cross-entropy averaged over the batch's labelled
positions, the ensemble is the mean of the members' probabilities position by position, and every score pools the
labelled positions, each counted once.
"""

import dataclasses

import jax.numpy as jnp

from ensemble.tasks import classification

AxisName = classification.AxisName
Metrics = classification.Metrics
IGNORED = -1  # a position without a label, as the data layer hands the labels over


def _labelled(labels: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(a mask of the labelled positions as floats, the labels with 0 where there is none: a class to index by)."""
  mask = labels != IGNORED
  return mask.astype(jnp.float32), jnp.where(mask, labels, 0)


def _per_input(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
  """(N,) each input's mean of `values` over its labelled positions (0 where it has none)."""
  axes = tuple(range(1, values.ndim))
  return (values * mask).sum(axes) / jnp.maximum(mask.sum(axes), 1.0)


@dataclasses.dataclass(frozen=True)
class Dense:
  """Logits (N, *positions, C); trained by the cross-entropy of each labelled position, or, against a teacher's
  probabilities (N, *positions, C) (`ensemble.distill`), by the distillation loss of every position."""
  name: str = 'dense'
  temperature: float = 1.0

  member_output = classification.Classification.member_output

  def loss(self, logits: jnp.ndarray, labels: jnp.ndarray) -> tuple[jnp.ndarray, Metrics]:
    """(the mean cross-entropy over the batch's labelled positions, the step's metrics: its loss and the share of
    those positions right)."""
    if jnp.issubdtype(labels.dtype, jnp.floating):  # a teacher's probabilities: every position is labelled
      labels = jnp.pad(labels, [(0, 0)] * (labels.ndim - 1) + [(0, logits.shape[-1] - labels.shape[-1])])
      per_position = classification.distillation_loss(logits, labels, self.temperature)
      mask, labels = jnp.ones(per_position.shape, jnp.float32), jnp.argmax(labels, -1)
    else:
      mask, labels = _labelled(labels)
      per_position = classification.cross_entropy(logits, labels)
    count = jnp.maximum(mask.sum(), 1.0)
    loss = (per_position * mask).sum() / count
    accuracy = ((jnp.argmax(logits, -1) == labels) * mask).sum() / count
    return loss, {'loss': loss, 'accuracy': accuracy}

  def eval_outputs(self, logits: jnp.ndarray, labels: jnp.ndarray, *, axis_name: AxisName) -> Metrics:
    """Per input, over its labelled positions: the member's and the ensemble's mean NLL and share right, and how
    many positions are labelled ('ensemble_labelled'), by which the split's mean weighs it (metrics.PerPosition)."""
    mask, labels = _labelled(labels)
    per_position = classification.eval_outputs(logits, labels, axis_name=axis_name)
    outputs = {name: _per_input(values, mask) for name, values in per_position.items()}
    return {**outputs, 'ensemble_labelled': mask.sum(tuple(range(1, mask.ndim)))}

  combine_snapshots = classification.Classification.combine_snapshots
  reported_loss = classification.Classification.reported_loss
  in_data_units = classification.Classification.in_data_units
  summary = classification.Classification.summary
