"""The numbers of an ensemble's report, from its members' outputs: the test set's scores against the members', the
ensemble-size curve, shifts (rotations, Gaussian noise), temperature scaling, selective prediction, conformal sets
and out-of-distribution detection. What `python -m ensemble.evaluate` (`evaluation.evaluate`, a workdir) and
`Ensemble.report` (any ensemble, in memory or loaded) both compute: one implementation.

  results = ens.task.report(predict, test, heldout, seen_in_training, size=K, angles=(0, 90), noise=True, ...)

`predict` is the ensemble's forward pass over a split ({'image', 'label'}): `predict.log_probs(split)` the (K, N, C)
member outputs, `predict(split)` their probabilities, `predict.labels(split)` its labels (a
`predictor.Predictor`, or an `Ensemble`'s own). Every split is predicted once; the shifts at a level that leaves
the images as they are (a rotation by 0 degrees) reuse the test set's outputs. Plain numpy on the host; no
checkpoint, file or plot here (ensemble/report.py draws them).
"""

import functools
import math
from typing import Any, Sequence

import numpy as np
import scipy.ndimage
from absl import logging

from ensemble import calibration, console, posthoc
from ensemble.uncertainty import conformal, decomposition, ood, selective

DEFAULT_ANGLES = tuple(range(0, 181, 15))
# The standard deviations (pixels in [0, 1]) of CIFAR-10-C's gaussian_noise at severities 1 to 5.
NOISE_STDS = (0.04, 0.06, 0.08, 0.09, 0.10)
OOD_SCORES = ('max_probability', 'entropy', 'mutual_information')  # each oriented so that higher means "more OOD"
OOD_HISTOGRAM_BINS = 40
DEFAULT_ALPHAS = (0.1, 0.05, 0.01)
# Coverages at which the report tabulates the risk (the plot and metrics.json keep a 100-point curve).
SELECTIVE_COVERAGES = (1.0, 0.99, 0.98, 0.95, 0.9, 0.8, 0.5)


def score_classes(predict: Any, test: dict[str, np.ndarray], test_outputs: np.ndarray, labels: np.ndarray,
                  heldout: tuple[np.ndarray, np.ndarray] | None, seen_in_training: bool, *, angles: Sequence[int],
                  noise: bool, ood_sets: dict[str, np.ndarray] | None, alphas: Sequence[float], flags: bool,
                  iou: bool = False) -> dict[str, Any]:
  """The report's numbers of class probabilities: the (K, N, C) member log-probabilities of the test split and its
  labels (a dense task's labelled positions, each an example); with `heldout` (its outputs and labels: examples the
  members did not train on, unless `seen_in_training`), the temperature, the conformal sets and (`flags`) the flag
  thresholds fitted on it. `angles` and `noise`: the image shifts of `test` to score; `ood_sets`: name -> inputs
  to detect against the test set; `iou`: the classes' intersection over union too."""
  member_probs = np.exp(test_outputs)
  with console.stage('test scores'):
    results = {'test_examples': len(test['label']), **score_test_set(test_outputs, labels, iou=iou)}
    if iou:
      results.update(labelled_positions=len(labels), iou=iou_list(member_probs.mean(0), labels))
  logging.info('test: ensemble accuracy %.4f NLL %.4f ECE %.4f; mean member accuracy %.4f NLL %.4f ECE %.4f',
               *(results[who][name] for who in ('ensemble', 'mean_member') for name in ('accuracy', 'nll', 'ece')))
  if angles:
    logging.info('Rotating the test set by %s degrees.', list(angles))
    with console.stage(f'rotations ({len(angles)})'):
      results['rotation'] = score_rotations(predict, test, angles, test_outputs)
  if noise:
    logging.info('Adding Gaussian noise to the test set at %d severities.', len(NOISE_STDS))
    with console.stage(f'gaussian noise ({len(NOISE_STDS)} severities)'):
      results['gaussian_noise'] = score_noise(predict, test)
  if heldout is not None:
    heldout_probs, heldout_labels = np.exp(heldout[0]), heldout[1]
    with console.stage('temperature'):
      results['temperature_scaling'] = score_temperature(heldout_probs.mean(0), heldout_labels, seen_in_training,
                                                         member_probs.mean(0), labels)
    logging.info('temperature %.3f: test NLL %.4f -> %.4f', results['temperature_scaling']['temperature'],
                 results['temperature_scaling']['before']['nll'], results['temperature_scaling']['after']['nll'])
    with console.stage('conformal'):
      results['conformal'] = score_conformal(heldout_probs, heldout_labels, seen_in_training, member_probs, labels,
                                             alphas)
    if flags:
      with console.stage('flags'):
        results['flags'] = score_flags(heldout_probs, heldout_labels, seen_in_training)
  with console.stage('selective'):
    results['selective'] = score_selective(member_probs, labels)
  if ood_sets:
    logging.info('Detecting %d out-of-distribution sets: %s.', len(ood_sets), ', '.join(ood_sets))
    distance = getattr(predict, 'distance', lambda split: None)  # the chain's distance step, where it has one
    with console.stage(f'out-of-distribution sets ({len(ood_sets)})'):
      results['ood'] = score_ood(predict, member_probs, ood_sets, distance, distance(test))
  return results


def outputs(forward: Any, split: dict[str, np.ndarray], name: str) -> np.ndarray:
  """`forward.log_probs(split)`, a split's member outputs: the report's pass over it, one stage ('test pass')."""
  with console.stage(f'{name} pass'):
    return forward.log_probs(split)


def score_flags(heldout_member_probs: np.ndarray, heldout_labels: np.ndarray, seen_in_training: bool,
                target_risk: float = posthoc.DEFAULT_FLAG_RISK,
                ood_rate: float = posthoc.DEFAULT_FLAG_OOD_RATE) -> dict[str, Any]:
  """The flag thresholds `python -m ensemble.predict` applies (`posthoc.flag_thresholds`), fitted on the held-out
  examples' outputs already predicted: the class is the mean probabilities' (a temperature does not change it),
  the entropy and mutual information the members' own."""
  mean = heldout_member_probs.mean(0)
  split = decomposition.decompose(heldout_member_probs)
  fitted = posthoc.flag_thresholds(split['entropy'], split['mutual_information'],
                                   np.argmax(mean, -1) == heldout_labels, target_risk, ood_rate)
  return {**fitted, 'examples': len(heldout_labels), 'seen_in_training': seen_in_training}


def rotate(images: np.ndarray, angle: float) -> np.ndarray:
  """(N, H, W, C) images turned counter-clockwise by `angle` degrees about their centre, black outside."""
  return scipy.ndimage.rotate(images, angle, axes=(1, 2), reshape=False, order=1, mode='constant', cval=0.0)


def add_gaussian_noise(images: np.ndarray, std: float, seed: int = 0) -> np.ndarray:
  """Pixels in [0, 1] plus N(0, std^2) noise, clipped to [0, 1] (CIFAR-10-C's gaussian_noise); float32.

  The noise is a function of `seed` and `std` only, so every evaluation sees the same corrupted set.
  """
  rng = np.random.default_rng([seed, round(std * 1e6)])
  unit = images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else images.astype(np.float32)
  noisy = unit + rng.normal(0.0, std, images.shape).astype(np.float32)
  return np.clip(noisy, 0.0, 1.0)


def mean_of_members(member_scores: list[dict[str, float]]) -> dict[str, float]:
  return {name: float(np.mean([s[name] for s in member_scores])) for name in member_scores[0]}


# The scores that are better higher; every other is better lower.
HIGHER_IS_BETTER = ('accuracy', 'map', 'subset_accuracy', 'miou')


def gain(ensemble: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
  """How much better the ensemble is: positive when it is better, whichever way the score points."""
  return {name: ensemble[name] - value if name in HIGHER_IS_BETTER else value - ensemble[name]
          for name, value in reference.items()}


def best_of_members(members: list[dict[str, float]], names) -> dict[str, float]:
  """The best member taken score by score: the member with the highest accuracy need not have the lowest NLL."""
  return {name: (max if name in HIGHER_IS_BETTER else min)(s[name] for s in members) for name in names}


def _reliability(probs: np.ndarray, labels: np.ndarray) -> dict[str, list]:
  counts, confidence, accuracy = calibration.reliability(probs, labels)
  as_list = lambda x: [None if math.isnan(v) else float(v) for v in x]
  return {'count': counts.tolist(), 'confidence': as_list(confidence), 'accuracy': as_list(accuracy)}


def intersection_over_union(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """(C,) per class, |predicted and labelled| / |predicted or labelled| over the examples; NaN for a class neither
  predicted nor labelled, which the mean IoU leaves out."""
  predicted, classes = np.argmax(probs, -1), np.arange(probs.shape[-1])[:, None]
  both = np.sum((predicted == classes) & (labels == classes), 1)
  either = np.sum((predicted == classes) | (labels == classes), 1)
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.where(either > 0, both / np.maximum(either, 1), np.nan)


def iou_list(probs: np.ndarray, labels: np.ndarray) -> list[float | None]:
  """Each class's IoU as JSON keeps it: None for a class neither predicted nor labelled."""
  return [None if math.isnan(v) else float(v) for v in intersection_over_union(probs, labels)]


def ensemble_scores(member_log_probs: np.ndarray, labels: np.ndarray, iou: bool = False) -> dict[str, float]:
  """`calibration.scores` of the members' mean prediction, (K, N, C) log-probabilities in, NLL in log space; with
  `iou`, the mean intersection over union of the classes ('miou')."""
  probs = np.exp(member_log_probs).mean(0)
  scores = {**calibration.scores(probs, labels), 'nll': calibration.ensemble_nll(member_log_probs, labels)}
  if iou:
    scores['miou'] = float(np.nanmean(intersection_over_union(probs, labels)))
  return scores


def score_test_set(member_log_probs: np.ndarray, labels: np.ndarray, iou: bool = False) -> dict[str, Any]:
  """Members, their average, the gains and the ensemble-size curve on one labelled split; with `iou`, each one's
  mean intersection over union too."""
  member_probs = np.exp(member_log_probs)
  ensemble_probs = member_probs.mean(0)
  members = [ensemble_scores(log_probs[None], labels, iou) for log_probs in member_log_probs]
  ensemble = {**ensemble_scores(member_log_probs, labels, iou),
              'entropy': calibration.entropy(ensemble_probs),
              'disagreement': calibration.disagreement(member_probs)}
  mean_member = mean_of_members(members)
  best_member = best_of_members(members, mean_member)
  pooled_labels = np.tile(labels, len(member_probs))
  return {
      'ensemble': ensemble,
      'members': members,
      'mean_member': mean_member,
      'best_member': best_member,
      'gain_over_mean_member': gain(ensemble, mean_member),
      'gain_over_best_member': gain(ensemble, best_member),
      'ensemble_size_curve': [
          {'members': k, 'accuracy': calibration.accuracy(member_probs[:k].mean(0), labels),
           'nll': calibration.ensemble_nll(member_log_probs[:k], labels)}
          for k in range(1, len(member_probs) + 1)],
      # The members' curve pools their predictions: per bin, the mean member weighted by its examples.
      'reliability': {
          'ensemble': _reliability(ensemble_probs, labels),
          'mean_member': _reliability(member_probs.reshape(-1, member_probs.shape[-1]), pooled_labels)},
  }


def score_shift(predict: Any, test: dict[str, np.ndarray], levels: dict[str, Any], shifted, *,
                desc: str, unit: str, unshifted: Any = None) -> list[dict[str, Any]]:
  """Accuracy, NLL and ECE of the ensemble and of the mean member on `shifted(images, **level)` per level.

  `levels` maps each row's label (logged, e.g. 'rotation  90 deg') to its level, a dict that the row keeps;
  `desc` and `unit` name the pass and its steps on the progress bar. `unshifted(level)`: the test set's own
  outputs where the level leaves the images as they are (a rotation by 0 degrees), not predicted again.
  """
  pick = lambda scores: {name: scores[name] for name in ('accuracy', 'nll', 'ece')}
  rows = []
  for label, level in console.track(list(levels.items()), desc, unit=unit):
    member_log_probs = unshifted(level) if unshifted is not None else None
    if member_log_probs is None:
      member_log_probs = predict.log_probs({'image': shifted(test['image'], **level), 'label': test['label']})
    ensemble = ensemble_scores(member_log_probs, test['label'])
    members = [ensemble_scores(log_probs[None], test['label']) for log_probs in member_log_probs]
    rows.append({**level, 'ensemble': pick(ensemble), 'mean_member': pick(mean_of_members(members))})
    logging.info('%s: ensemble accuracy %.4f NLL %.4f ECE %.4f', label,
                 ensemble['accuracy'], ensemble['nll'], ensemble['ece'])
  return rows


def score_rotations(predict: Any, test: dict[str, np.ndarray], angles: Sequence[int],
                    test_log_probs: np.ndarray | None = None) -> list[dict[str, Any]]:
  """The test set rotated by each angle (Ovadia et al. 2019); at a whole turn, its own outputs `test_log_probs`."""
  unshifted = lambda level: test_log_probs if level['angle'] % 360 == 0 else None
  return score_shift(predict, test, {f'rotation {a:3d} deg': {'angle': a} for a in angles}, rotate,
                     desc='rotations', unit='angle', unshifted=unshifted)


def score_noise(predict: Any, test: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  """The test set with CIFAR-10-C's Gaussian noise at severities 1 to 5."""
  levels = {f'gaussian noise severity {s} (std {std})': {'severity': s, 'std': std}
            for s, std in enumerate(NOISE_STDS, start=1)}
  return score_shift(predict, test, levels, lambda images, severity, std: add_gaussian_noise(images, std),
                     desc='gaussian noise', unit='severity')


def uniform_noise(images: np.ndarray, seed: int = 0) -> np.ndarray:
  """Images of independent uniform pixels, shaped like `images`: nothing a member has seen."""
  return np.random.default_rng([seed, 1]).integers(0, 256, images.shape, dtype=np.uint8)


def permute_pixels(images: np.ndarray, seed: int = 0) -> np.ndarray:
  """Each image's pixels (all channels of a pixel together) in its own random order: the same intensities, no
  shape. A model that judges by brightness alone cannot tell these from the test set."""
  rng = np.random.default_rng([seed, 2])
  flat = images.reshape(len(images), -1, images.shape[-1])
  order = np.argsort(rng.random(flat.shape[:2]), axis=1)
  return np.take_along_axis(flat, order[..., None], axis=1).reshape(images.shape)


# Out-of-distribution sets that need no download, made from the test images: their size and image shape. Two
# passes over the test set, so every report has them unless asked otherwise.
OOD_BUILTINS = {'uniform_noise': uniform_noise, 'permuted_pixels': permute_pixels}
DEFAULT_OOD = tuple(OOD_BUILTINS)


def _ood_scores(probs: np.ndarray, member_probs: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Per example, each of `OOD_SCORES` (mutual information only with the members' probabilities)."""
  scores = {'max_probability': 1.0 - probs.max(-1), 'entropy': decomposition.entropy(probs)}
  if member_probs is not None:
    scores['mutual_information'] = decomposition.decompose(member_probs)['mutual_information']
  return scores


def score_ood(predict: Any, test_member_probs: np.ndarray, ood_sets: dict[str, np.ndarray],
              distance: Any = None, test_distance: np.ndarray | None = None) -> dict[str, Any]:
  """Per set: AUROC, AUPR and FPR95 of each score against the test set, for the ensemble and the mean member,
  and histograms of the ensemble's scores on both (for the plot); with `test_distance`, the test set's distance from
  the data of the chain's distance step, the ensemble's 'distance' too (`distance(split)` gives each set's)."""
  inside = _ood_scores(test_member_probs.mean(0), test_member_probs)
  scores = OOD_SCORES if test_distance is None else (*OOD_SCORES, 'distance')
  if test_distance is not None:
    inside['distance'] = test_distance
  inside_members = [_ood_scores(p) for p in test_member_probs]
  results = {}
  for name, images in console.track(list(ood_sets.items()), 'out-of-distribution sets', unit='set'):
    split = {'image': images, 'label': np.zeros(len(images), np.int32)}
    member_probs = predict(split)
    outside = _ood_scores(member_probs.mean(0), member_probs)
    if test_distance is not None:
      outside['distance'] = distance(split)
    members = [{score: ood.detection(mine[score], theirs[score]) for score in theirs}
               for mine, theirs in zip(inside_members, (_ood_scores(p) for p in member_probs))]
    results[name] = {**_detected(inside, outside, scores, len(images)),
                     'mean_member': {score: mean_of_members([m[score] for m in members]) for score in members[0]}}
    logging.info('%s: ensemble AUROC %s', name, ', '.join(
        f'{score} {results[name]["ensemble"][score]["auroc"]:.4f}' for score in scores))
  return results


def _detected(inside: dict[str, np.ndarray], outside: dict[str, np.ndarray], scores: Sequence[str],
              examples: int) -> dict[str, Any]:
  """One OOD set's 'ensemble' detection figures of each score (higher: less familiar), and its histograms."""
  histograms = {}
  for score in scores:
    edges = np.histogram_bin_edges(np.concatenate([inside[score], outside[score]]), OOD_HISTOGRAM_BINS)
    histograms[score] = {'edges': edges.tolist(), 'test': np.histogram(inside[score], edges)[0].tolist(),
                         'ood': np.histogram(outside[score], edges)[0].tolist()}
  return {'examples': examples, 'ensemble': {score: ood.detection(inside[score], outside[score]) for score in scores},
          'histogram': histograms}


def score_distance_ood(distance: Any, test: dict[str, np.ndarray], ood_sets: dict[str, np.ndarray]) -> dict[str, Any]:
  """`score_ood` by the chain's distance alone: for an ensemble of any task whose outputs are no probabilities (a
  regression's, a quantile or dense one's), the distance is its one score of unfamiliar inputs."""
  inside = {'distance': distance(test)}
  return {name: _detected(inside, {'distance': distance({'image': x})}, ('distance',), len(x))
          for name, x in console.track(list(ood_sets.items()), 'out-of-distribution sets', unit='set')}


def _selective(member_probs: np.ndarray, labels: np.ndarray, coverages: np.ndarray) -> dict[str, Any]:
  """Risk-coverage of one model (K = 1) or of their average, ranked by predictive entropy."""
  probs = member_probs.mean(0)
  curve = selective.risk_coverage(decomposition.entropy(probs), np.argmax(probs, -1) == labels)
  return {'aurc': selective.area(curve), 'risk': selective.risk_at(curve, coverages)}


def score_selective(member_probs: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
  """The test set's error rate when the most uncertain inputs (by predictive entropy) are rejected, ensemble vs
  mean member: the area under the risk-coverage curve, and the curve at 100 coverages."""
  coverages = np.arange(1, 101) / 100
  ensemble = _selective(member_probs, labels, coverages)
  members = [_selective(p[None], labels, coverages) for p in member_probs]
  curve = lambda result: {'coverage': coverages.tolist(), 'risk': result['risk'].tolist()}
  mean_member = {'aurc': float(np.mean([m['aurc'] for m in members])),
                 'risk': np.mean([m['risk'] for m in members], axis=0)}
  at = lambda result, coverage: float(result['risk'][round(coverage * 100) - 1])
  return {
      'score': 'entropy',
      'ensemble': {'aurc': ensemble['aurc'], 'curve': curve(ensemble)},
      'mean_member': {'aurc': mean_member['aurc'], 'curve': curve(mean_member)},
      'table': [{'coverage': c, 'ensemble': at(ensemble, c), 'mean_member': at(mean_member, c)}
                for c in SELECTIVE_COVERAGES]}


def score_temperature(heldout_probs: np.ndarray, heldout_labels: np.ndarray, seen_in_training: bool,
                      test_probs: np.ndarray, test_labels: np.ndarray) -> dict[str, Any]:
  """Temperature scaling after averaging: fitted on held-out (calibration) examples' mean probabilities, judged on
  the test set."""
  temperature = calibration.fit_temperature(heldout_probs, heldout_labels)
  scaled = calibration.temperature_scale(test_probs, temperature)
  judge = lambda probs: {'nll': calibration.nll(probs, test_labels), 'ece': calibration.ece(probs, test_labels)}
  return {'temperature': temperature, 'fit_examples': len(heldout_labels), 'seen_in_training': seen_in_training,
          'before': judge(test_probs), 'after': judge(scaled)}


def score_conformal(heldout_member_probs: np.ndarray, heldout_labels: np.ndarray, seen_in_training: bool,
                    test_member_probs: np.ndarray, test_labels: np.ndarray, alphas: Sequence[float]) -> dict[str, Any]:
  """Split-conformal sets calibrated on the held-out (calibration) examples, judged on the test set: coverage and
  mean set size of each score at each alpha, for the ensemble and (each member calibrated on its own) the mean
  member. Each row has the coverage expected over draws of the calibration examples ('guaranteed') and the range
  that the test set's measured coverage falls in with 99% probability where calibration and test examples are
  exchangeable ('bounds', `conformal.coverage_bounds`): a measured coverage outside it says they are not."""
  n, m = len(heldout_labels), len(test_labels)
  finite = lambda q: q if math.isfinite(q) else None  # JSON has no infinity: no threshold, every class in the set
  rows = []
  for alpha in alphas:
    bounds = list(conformal.coverage_bounds(n, m, alpha))
    for score in conformal.SCORES:
      fit = functools.partial(conformal.split_conformal, calibration_labels=heldout_labels,
                              test_labels=test_labels, alpha=alpha, score=score)
      ensemble = fit(heldout_member_probs.mean(0), test_probs=test_member_probs.mean(0))
      members = [fit(cal, test_probs=test) for cal, test in zip(heldout_member_probs, test_member_probs)]
      rows.append({'alpha': alpha, 'score': score, 'guaranteed': [1 - alpha, min(1.0, 1 - alpha + 1 / (n + 1))],
                   'bounds': bounds, 'within_bounds': bounds[0] <= ensemble['coverage'] <= bounds[1],
                   'ensemble': {**ensemble, 'quantile': finite(ensemble['quantile'])},
                   'mean_member': mean_of_members([{k: v for k, v in m.items() if k != 'quantile'} for m in members])})
      logging.info('conformal %s at alpha %g: ensemble coverage %.4f, mean set size %.3f', score, alpha,
                   ensemble['coverage'], ensemble['mean_size'])
  return {'calibration_examples': n, 'seen_in_training': seen_in_training, 'rows': rows}


def score_chain_conformal(task: Any, chain: Sequence[posthoc.Step], predict: Any, test: dict[str, np.ndarray]
                          ) -> dict[str, Any] | None:
  """The chain's own conformal sets or intervals (its last conformal step's) judged on labelled test examples: the
  marginal coverage and, for a task with classes, each class's beside it (a multi-label's each label and value's),
  since a marginal quantile covers a hard class far less than 1 - alpha and hides it behind easy ones; a dense task's
  on its boundary positions (`boundary_positions`) and the interior ones, where such misses gather. A class with a
  quantile of its own (a class-conditional step's, not pooled) has the 99% bounds its coverage falls in
  (`conformal.coverage_bounds`). None where the chain has no conformal step (the test set is then not predicted
  again)."""
  step = posthoc.last(chain, 'conformal')
  if step is None:
    return None
  member_outputs, labels = predict.log_probs(test), test['label']
  covered = task.covered(posthoc.apply(posthoc.of_outputs(chain), task.view(member_outputs)), labels)
  fitted = dict(step.settings)
  own = fitted.get('class_conditional', False)
  pooled = [tuple(np.atleast_1d(group)) for group in fitted.get('pooled', ())]

  def row(hits: np.ndarray, group: tuple[int, ...]) -> dict[str, Any]:
    found = {'test_examples': int(hits.size), 'coverage': float(hits.mean())}
    if own:
      examples = int(np.asarray(fitted['class_examples'])[group])
      found.update(calibration_examples=examples, pooled=group in pooled)
      if group not in pooled:
        bounds = list(conformal.coverage_bounds(examples, hits.size, step['alpha']))
        found.update(bounds=bounds, within_bounds=bounds[0] <= found['coverage'] <= bounds[1])
    return found

  width = member_outputs.shape[-1]
  if not task.class_conditional:  # intervals of real-valued targets: the marginal coverage alone
    groups = []
  elif covered.ndim == 1:  # a class per example (a dense task's labelled positions)
    classes = task.labelled(labels)
    groups = [{'class': c, **row(covered[classes == c], (c,))} for c in range(width) if np.any(classes == c)]
  else:  # a multi-label task's per label and value
    groups = [{'label': label, 'value': value, **row(covered[labels[:, label] == value, label], (label, value))}
              for label in range(width) for value in (0, 1) if np.any(labels[:, label] == value)]
  found = {'step': step.describe(), 'alpha': step['alpha'], 'class_conditional': own,
           'calibration_examples': step.fitted_on.examples, 'coverage': float(covered.mean()),
           'test_examples': int(covered.size), 'groups': groups}
  regions = task.coverage_regions(labels)
  if regions:
    found['regions'] = {name: {'test_examples': int(where.sum()), 'coverage': float(covered[where].mean())}
                        for name, where in regions.items() if where.any()}
  return found
