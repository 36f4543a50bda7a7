"""Dense classification: a class per position (each pixel of a segmentation, each token of a sequence labelling).

A member gives logits (N, *positions, C): the positions of its input come before the class axis. Labels are
(N, *positions) class indices, and `IGNORED` (-1) where a position carries no label: the data layer maps a run's
`ignore_label` to it when it reads the labels, so that every program and score knows one marker. Each labelled
position is a classification of its own: the loss is the cross-entropy averaged over the batch's labelled
positions, the ensemble is the mean of the members' probabilities position by position, and every score pools the
labelled positions, each counted once.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from ensemble import calibration, defaults, scoring
from ensemble.errors import DataError
from ensemble.tasks import base, classification

AxisName = classification.AxisName
Metrics = classification.Metrics
IGNORED = base.IGNORED  # a position without a label, as the data layer hands the labels over


def _labelled(labels: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(a mask of the labelled positions as floats, the labels with 0 where there is none: a class to index by)."""
  mask = labels != IGNORED
  return mask.astype(jnp.float32), jnp.where(mask, labels, 0)


def _per_input(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
  """(N,) each input's mean of `values` over its labelled positions (0 where it has none)."""
  axes = tuple(range(1, values.ndim))
  return (values * mask).sum(axes) / jnp.maximum(mask.sum(axes), 1.0)


def as_dense_labels(labels: np.ndarray, name: str, ignore: int = IGNORED) -> np.ndarray:
  """int32 (N, *positions) class indices, `IGNORED` where a position has the label `ignore` (uint8 masks with 255
  for none included: the labels are widened before the marker is written)."""
  if labels.ndim < 2 or not np.issubdtype(labels.dtype, np.integer):
    raise DataError(f"{name}: labels of shape {labels.shape} and dtype {labels.dtype}; task='dense' takes integer "
                    'class indices per position, (N, *positions): (N, H, W) for images (N, H, W, C), (N, T) for '
                    'sequences (N, T, F)')
  unlabelled = labels == ignore
  labels = labels.astype(np.int64, copy=False)
  if labels.size and (labels[~unlabelled] < 0).any():
    raise DataError(f'{name}: a label of {labels[~unlabelled].min()}, neither a class 0..C-1 nor the ignored label '
                    f'{ignore}; set ignore_label={labels[~unlabelled].min()} if it marks positions without a label')
  if labels.size and labels[~unlabelled].max(initial=0) > np.iinfo(np.int32).max:
    raise DataError(f'{name}: label {labels.max()} does not fit int32; labels must be class indices 0..C-1')
  return np.where(unlabelled, IGNORED, labels).astype(np.int32)


def score_positions(member_log_probs: np.ndarray, labels: np.ndarray,
                    scaled_probs: np.ndarray | None = None) -> dict[str, Any]:
  """A dense task's scores: `score_test_set`'s over the labelled positions, each a classification of its own
  (accuracy, NLL, Brier, ECE), with the mean IoU of the classes ('miou') and the ensemble's IoU per class; with
  `scaled_probs` (the chain's temperature applied), 'temperature_scaled' scores of them."""
  labelled = labels != IGNORED
  positions = member_log_probs[:, labelled]
  scores = {'labelled_positions': int(labelled.sum()), **scoring.score_test_set(positions, labels[labelled], iou=True)}
  scores['ensemble']['iou'] = scoring.iou_list(np.exp(positions).mean(0), labels[labelled])
  if scaled_probs is not None:
    scores['temperature_scaled'] = calibration.scores(scaled_probs[labelled], labels[labelled])
  return scores


def boundary_positions(labels: np.ndarray) -> np.ndarray:
  """(N, *positions) bool: the labelled positions with a neighbour along a position axis (a pixel's 4-neighbours)
  that is labelled otherwise, the ignored label included: benchmarks (VOC; scripts/segmentation_mnist.py) leave
  the band between two regions unlabelled, and the positions beside it are the boundary."""
  labels = np.asarray(labels)
  edge = np.zeros(labels.shape, bool)
  for axis in range(1, labels.ndim):
    before, after = [slice(None)] * labels.ndim, [slice(None)] * labels.ndim
    before[axis], after[axis] = slice(None, -1), slice(1, None)
    differ = labels[tuple(before)] != labels[tuple(after)]
    edge[tuple(before)] |= differ
    edge[tuple(after)] |= differ
  return edge & (labels != IGNORED)


@dataclasses.dataclass(frozen=True)
class Dense(classification.Classification):
  """Logits (N, *positions, C); trained by the cross-entropy of each labelled position, or, against a teacher's
  probabilities (N, *positions, C) (`ensemble.distill`), by the distillation loss of every position. On the host,
  each labelled position is an example of its own: a post-hoc step is fitted on the labelled positions and counts
  them, a temperature is shared over them, conformal coverage is marginal over them and every score pools them."""
  name = 'dense'
  label_kind = 'classes_per_position'
  temperature: float = 1.0
  per_position = True
  image_datasets = False
  fit_defaults = defaults.DENSE  # augmentation would move an image's pixels but not its labels
  images_model = 'segmenter'
  flags = False  # a flag is an input's, and a dense one's uncertainty is a map
  shifts = False  # shifted images would need shifted labels
  detects_ood = False
  chance_hint = False
  acquisitions = {}
  batch_acquisitions = {}

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

  # --- labels ------------------------------------------------------------------------------------------------------

  def read_labels(self, labels, name, ignore=IGNORED):
    return as_dense_labels(labels, name, ignore)

  def split_labels(self, labels, inputs, name, ignore=IGNORED):
    """A label per position of the inputs: (N, *positions) labels of (N, *positions, ...) inputs (an image's (H, W)
    of its (H, W, C), a sequence's (T) of its (T, F), or a sequence of token ids (T) itself)."""
    labels = self.read_labels(labels, name, ignore)
    positions, shape = labels.shape[1:], inputs.shape[1:]
    tokens = np.issubdtype(inputs.dtype, np.integer) and inputs.dtype != np.uint8
    if shape[:len(positions)] != positions or len(shape) == len(positions) and not tokens:
      raise DataError(f'{name} of shape {labels.shape} for inputs of shape {inputs.shape}; task='
                      "'dense' takes a label per position of the inputs: labels (N, *positions) for inputs "
                      '(N, *positions, channels)')
    return labels

  def layout_error(self, labels, images, num_classes):
    positions = labels.shape[1:] if labels.dtype == np.int32 else labels.shape[1:-1]
    if (labels.dtype not in (np.dtype(np.int32), np.dtype(np.float32)) or labels.shape[:1] != images.shape[:1]
        or not positions or images.shape[1:1 + len(positions)] != positions):
      return (f'dense labels must be int32 (N, *positions) classes or float32 (N, *positions, C) probabilities of '
              f'inputs (N, *positions, ...), got {labels.dtype} {labels.shape} for inputs {images.shape}')
    return None

  def labelled(self, labels):
    return labels[labels != IGNORED]

  def examples(self, labels):
    return int(np.sum(labels != IGNORED))

  def labels(self, values, role, count, outputs, positions=(), ignore=IGNORED):
    checked = self.read_labels(base._as_array(values, role), role, ignore)  # pylint: disable=protected-access
    if checked.shape != (count, *positions):
      raise DataError(f'{role}: labels of shape {checked.shape}, but the ensemble predicts a class at each of the '
                      f'({", ".join(map(str, positions))}) positions of {count} inputs; give labels of shape '
                      f'{(count, *positions)}')
    return self.within_classes(checked, outputs, role)

  def output_error(self, shape, width, positions):
    if shape is None or tuple(shape[:-1]) != (1, *positions) or shape[-1] < width:
      want = ', '.join(map(str, ('batch', *positions, width)))
      return (f'not to ({want}) logits, a class per position of the labels: give it a last layer of {width} outputs '
              'at each position (a 1x1 convolution, or a Dense layer on unflattened inputs)')
    return None

  # --- what an ensemble answers: each labelled position an example ------------------------------------------------

  def labelled_view(self, view, labels):
    mask = labels != IGNORED
    return {'member_probs': view['member_probs'][:, mask], 'probs': view['probs'][mask]}, labels[mask]

  def coverage_regions(self, labels):
    """The labelled positions beside a region's edge (`boundary_positions`), where a conformal set's misses
    gather, and the rest."""
    boundary = boundary_positions(labels)[labels != IGNORED]
    return {'boundary': boundary, 'interior': ~boundary}

  def evaluate(self, outputs, labels, chain, size):
    return score_positions(outputs, labels, self._scaled(chain, self.view(outputs)))

  def report(self, forward, test, heldout, seen_in_training, *, size, angles, noise, ood_sets, alphas):
    outputs, labels = scoring.outputs(forward, test, 'test'), test['label']
    held = None
    if heldout is not None:
      held_outputs, held_labels = scoring.outputs(forward, heldout, 'calibration'), forward.labels(heldout)
      held = held_outputs[:, held_labels != IGNORED], self.labelled(held_labels)
    mask = labels != IGNORED
    results = scoring.score_classes(forward, test, outputs[:, mask], labels[mask], held, seen_in_training,
                                    angles=(), noise=False, ood_sets=None, alphas=alphas, flags=False, iou=True)
    return {**results, 'test_examples': len(labels)}

  def covered(self, result, labels):
    mask = labels != IGNORED
    return np.take_along_axis(result['set'][mask], labels[mask][:, None], -1)[:, 0]

  table = None  # python -m ensemble.predict writes maps (.npz)
