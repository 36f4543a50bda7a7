"""Multi-label classification: L labels of 0 or 1 per example, each member a sigmoid per label; the ensemble's
probability of a label is the mean of the members' (binary classification is L = 1).

A member gives L logits z; its probability of label l is sigmoid(z_l), trained by the binary cross-entropy of each
label averaged over the labels, with an optional weight on each label's positive term (`pos_weight`: a rare label's
positives count more). The mean, not the sum: summed over 10 labels, each logit's gradient is as large as a binary
classifier's while the recipe's learning rate was chosen for one softmax's, and the default recipe's CNN diverged
on MNIST mosaics (mAP 0.74 against 0.95; docs/benchmarks.md). Prediction takes the logits themselves: a post-hoc
temperature divides them, and the members' probabilities are their sigmoids."""

import dataclasses
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from absl import logging

from ensemble import console, posthoc, scoring
from ensemble.errors import DataError, UsageError
from ensemble.tasks import base, classification
from ensemble.uncertainty import conformal, multilabel, ood

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


def as_multilabels(labels: np.ndarray, name: str) -> np.ndarray:
  """(N, L) int32 multi-label labels from (N,) (one label: binary classification) or (N, L) 0s and 1s, of any
  number type or bool."""
  if labels.dtype == bool:
    labels = labels.astype(np.int32)
  if not np.issubdtype(labels.dtype, np.number) or labels.ndim not in (1, 2):
    raise DataError(f"{name}: labels of shape {labels.shape} and dtype {labels.dtype}; task='multilabel' takes (N, L) "
                    'labels of 0 and 1, one column per label')
  labels = labels.reshape(len(labels), -1)
  if labels.size and not np.isin(labels, (0, 1)).all():
    bad = labels[~np.isin(labels, (0, 1))].flat[0]
    raise DataError(f"{name}: a label of {bad:g}; task='multilabel' takes 0 or 1 per label (class indices: "
                    "task='classification'; a teacher's probabilities: ensemble.distill)")
  return labels.astype(np.int32)


def scores(member_logits: np.ndarray, labels: np.ndarray, scaled_probs: np.ndarray | None = None) -> dict:
  """A multi-label ensemble's scores on one labelled split, from its members' logits (K, N, L): the ensemble's
  and each member's (`uncertainty.multilabel.scores`, the NLL from the logits in log space), their mean and best,
  the gains and the ensemble-size curve; 'temperature_scaled' of `scaled_probs` (the chain's) where given."""
  member_probs = multilabel.sigmoid(member_logits)

  def scores_of(k: slice) -> dict[str, Any]:
    nll = multilabel.ensemble_nll(member_logits[k], labels)
    return {**multilabel.scores(member_probs[k].mean(0), labels), 'nll': float(nll.mean()),
            'nll_per_label': nll.tolist()}
  ensemble = scores_of(slice(None))
  members = [scores_of(slice(k, k + 1)) for k in range(len(member_logits))]
  flat = [name for name, value in ensemble.items() if not isinstance(value, list)]
  mean_member = scoring.mean_of_members([{name: m[name] for name in flat} for m in members])
  best_member = scoring.best_of_members(members, flat)
  result = {
      'ensemble': ensemble, 'members': members, 'mean_member': mean_member, 'best_member': best_member,
      'gain_over_mean_member': scoring.gain(ensemble, mean_member),
      'gain_over_best_member': scoring.gain(ensemble, best_member),
      'ensemble_size_curve': [{'members': k, **{name: scores_of(slice(0, k))[name] for name in ('map', 'nll')}}
                              for k in range(1, len(member_logits) + 1)]}
  if scaled_probs is not None:
    result['temperature_scaled'] = multilabel.scores(scaled_probs, labels)
  return result


def report_scores(test_logits: np.ndarray, labels: np.ndarray, heldout_logits: np.ndarray | None,
                     heldout_labels: np.ndarray | None, seen_in_training: bool, alphas: Sequence[float],
                     ood_logits: dict[str, np.ndarray]) -> dict[str, Any]:
  """A multi-label ensemble's report from its members' logits: the test split's scores (`scores`); with
  held-out examples, a temperature per label fitted on them and the test scores before and after it, and conformal
  sets per label at each alpha (each label's coverage, their mean set size, and the 99% bounds every label's
  coverage falls in where calibration and test examples are exchangeable); per set of `ood_logits`, the AUROC,
  AUPR and FPR95 of the members' disagreement (mutual information) and of the predictive entropy, each summed over
  the labels."""
  with console.stage('test scores'):
    results = scores(test_logits, labels)
  logging.info('test: ensemble mAP %.4f NLL %.4f Hamming loss %.4f; mean member mAP %.4f NLL %.4f',
               *(results['ensemble'][name] for name in ('map', 'nll', 'hamming_loss')),
               *(results['mean_member'][name] for name in ('map', 'nll')))
  member_probs = multilabel.sigmoid(test_logits)
  probs = member_probs.mean(0)
  if heldout_logits is not None:
    heldout_probs = multilabel.sigmoid(heldout_logits).mean(0)
    with console.stage('temperature'):
      temperature = multilabel.fit_temperature(heldout_probs, heldout_labels, per_label=True)
      results['temperature_scaling'] = {
          'temperature': [float(t) for t in temperature], 'heldout_examples': len(heldout_labels),
          'seen_in_training': seen_in_training, 'before': multilabel.scores(probs, labels),
          'after': multilabel.scores(multilabel.temperature_scale(probs, temperature), labels)}
    rows = []
    with console.stage('conformal'):
      for alpha in alphas:
        sets = multilabel.prediction_sets(probs,
                                          multilabel.calibrated_quantiles(heldout_probs, heldout_labels, alpha))
        coverage = np.take_along_axis(sets, np.asarray(labels)[..., None], -1)[..., 0].mean(0)
        bounds = list(conformal.coverage_bounds(len(heldout_labels), len(labels), alpha))
        rows.append({'alpha': alpha, 'coverage_per_label': coverage.tolist(), 'coverage': float(coverage.mean()),
                     'mean_set_size': float(sets.sum(-1).mean()), 'bounds': bounds,
                     'within_bounds': bool(((bounds[0] <= coverage) & (coverage <= bounds[1])).all())})
    results['conformal'] = {'calibration_examples': len(heldout_labels), 'seen_in_training': seen_in_training,
                            'rows': rows}
  doubts = lambda member_probs: {name: values.sum(-1) for name, values in multilabel.decompose(member_probs).items()
                                 if name in ('mutual_information', 'entropy')}
  inside = doubts(member_probs)
  results['ood'] = {}
  for name, logits in ood_logits.items():
    outside = doubts(multilabel.sigmoid(logits))
    results['ood'][name] = {'examples': len(logits[0]),
                            'ensemble': {score: ood.detection(inside[score], outside[score]) for score in inside}}
  return results



@dataclasses.dataclass(frozen=True)
class Multilabel(base.Task):
  """L logits, one per label; trained by the per-label binary cross-entropy against labels (N, L) of 0 and 1, or a
  teacher's probabilities (N, L) (`ensemble.distill`). The summary's accuracy is the fraction of labels right
  (1 - the Hamming loss), its loss the mean per-label NLL."""
  name = 'multilabel'
  label_kind = 'binary'
  pos_weight: tuple[float, ...] = ()  # per label, the weight of its positive term; () for 1 each
  noun = ('label', 'labels')
  tables = True
  fields = ('pos_weight',)
  calibration = 'label_temperature'
  conformal_scores = ('label',)
  class_conditional = True
  detects_ood = True
  report_writer = 'ensemble.multilabel_report'

  @classmethod
  def field_error(cls, name, value):
    if all(base.positive(v) for v in value):
      return None
    return (f'{name}={value!r} must be positive weights, one per label, e.g. negatives / positives of each; or () for '
            '1 each')

  @classmethod
  def of(cls, config, data_info=None):
    return cls(pos_weight=tuple(float(w) for w in config.pos_weight))

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

  summary = classification.Classification.summary

  # --- labels ------------------------------------------------------------------------------------------------------

  def read_labels(self, labels, name, ignore=base.IGNORED):
    return as_multilabels(labels, name)

  def layout_error(self, labels, images, num_classes):
    if labels.dtype not in (np.dtype(np.int32), np.dtype(np.float32)) or labels.shape != (len(images), num_classes):
      return (f'labels must be int32 0/1 or float32 probabilities ({len(images)}, {num_classes}), got '
              f'{labels.dtype} {labels.shape}')
    return None

  def output_error(self, shape, width, positions):
    if shape is None or len(shape) != 2 or shape[1] != width:
      return f'not to (batch, {width}) logits, one per label: give its last layer {width} outputs'
    return None

  # --- what an ensemble answers ------------------------------------------------------------------------------------

  def member_probs(self, outputs):
    return multilabel.sigmoid(outputs)

  def view(self, outputs, xp=np):
    member_probs = multilabel.sigmoid(outputs) if xp is np else jax.nn.sigmoid(outputs)
    return {'member_label_probs': member_probs, 'label_probs': member_probs.mean(0)}

  def check_predict_options(self, levels, threshold):
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 < threshold < 1:
      raise UsageError(f'threshold={threshold!r} must be in (0, 1): a label is predicted where its probability '
                       'exceeds it')

  def predict(self, outputs, *, members, levels, threshold):
    """Per label: the chain's probabilities, the decisions at `threshold` and the members' own probabilities' split
    of the uncertainty (`uncertainty.multilabel.decompose`)."""
    member_probs, probs = outputs['member_label_probs'], outputs['label_probs']
    result = {'probs': probs, 'labels': (probs > threshold).astype(np.int32), **multilabel.decompose(member_probs)}
    if 'set' in outputs:
      result['set'] = outputs['set']
    if members:
      result['member_probs'] = member_probs
    return result

  def evaluate(self, outputs, labels, chain, size):
    scaled = (posthoc.apply(posthoc.of_outputs(chain), self.view(outputs))['label_probs']
              if any(step.kind == self.calibration for step in chain) else None)
    return scores(outputs, labels, scaled)

  def report(self, forward, test, heldout, seen_in_training, *, size, angles, noise, ood_sets, alphas):
    outputs = scoring.outputs(forward, test, 'test')
    held_outputs = held_labels = None
    if heldout is not None:
      held_outputs, held_labels = scoring.outputs(forward, heldout, 'calibration'), forward.labels(heldout)
    ood_logits = {name: scoring.outputs(forward, {'image': x, 'label': np.zeros(len(x), np.int32)}, f'{name} (OOD)')
                  for name, x in (ood_sets or {}).items()}
    return {'test_examples': len(test['label']),
            **report_scores(outputs, test['label'], held_outputs, held_labels, seen_in_training, alphas,
                                       ood_logits)}

  def exported(self, outputs, chain, xp):
    """'member_logits' (K, N, L), 'probs' (N, L) after the chain (its temperature), and its conformal step's 'set'
    (N, L, 2)."""
    chained = posthoc.apply(chain, self.view(outputs, xp), xp=xp)
    return {'member_logits': outputs, 'probs': chained['label_probs'],
            **{key: chained[key] for key in ('set',) if key in chained}}

  def fitted_scale(self, view, labels, per_label=False):
    value = multilabel.fit_temperature(view['label_probs'], labels, per_label=per_label)
    return {'value': [float(v) for v in value] if per_label else float(value)}

  def fit_conformal(self, view, labels, alpha, score, class_conditional=False):
    """A quantile per label, of 1 - p(the label's value); `class_conditional`: per label and value, (L, 2), each of
    the examples whose label has that value (a rare positive is covered as often as the common negatives), a value
    too rare for `alpha` pooled into its label's quantile (`uncertainty.multilabel.class_conditional_quantiles`)."""
    fitted = {'alpha': float(alpha), 'score': score}
    if not class_conditional:
      q = multilabel.calibrated_quantiles(view['label_probs'], labels, alpha)
      return {**fitted, 'quantile': [float(v) for v in q]}
    quantiles, examples, pooled = multilabel.class_conditional_quantiles(view['label_probs'], labels, alpha)
    return {**fitted, 'class_conditional': True, 'quantile': quantiles.tolist(), 'class_examples': examples.tolist(),
            'pooled': pooled}

  def apply_conformal(self, step, view, xp):
    return {**view, 'set': multilabel.prediction_sets(view['label_probs'], xp.asarray(step['quantile']), xp=xp)}

  def covered(self, result, labels):
    return np.take_along_axis(result['set'], labels[..., None], -1)[..., 0]

  def table(self, names, result):
    """(columns, rows): the labels predicted (their indices, by spaces), and per label l its probability and the
    members' mutual information ('probability_l', 'mutual_information_l'); with the chain's conformal step, the
    values its set holds for each label ('set_l': '0', '1' or '0 1')."""
    figure = lambda x: float(f'{x:.6g}')
    count = result['probs'].shape[1]
    parts = ('probability', 'mutual_information')
    sets = ['set'] if 'set' in result else []
    columns = ['name', 'labels', *(f'{part}_{label}' for part in (*parts, *sets) for label in range(count))]

    def rows():
      for i, name in enumerate(names):
        row = {'name': name, 'labels': ' '.join(map(str, np.flatnonzero(result['labels'][i])))}
        for part, values in zip(parts, (result['probs'], result['mutual_information'])):
          row.update({f'{part}_{label}': figure(values[i, label]) for label in range(count)})
        if sets:
          row.update({f'set_{label}': ' '.join(map(str, np.flatnonzero(result['set'][i, label])))
                      for label in range(count)})
        yield row
    return columns, rows()
