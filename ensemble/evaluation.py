"""Scores a trained ensemble: accuracy, calibration and robustness to shifts, as numbers and plots.

The library half of `python -m ensemble.evaluate` (no flags, no logging set-up):
restores a checkpoint onto the devices at hand, predicts the test set once per
member, and scores the members and their average (the ensemble) with
`calibration`: on the test set, on the test set rotated by a range of angles
(Ovadia et al. 2019) and with Gaussian noise at CIFAR-10-C's five severities
(Hendrycks and Dietterich 2019), both for any image size and without a
download, and after temperature scaling of the average (Ashukha et al. 2020).
`evaluate` writes metrics.json, report.md and PNG plots.
"""

import collections
import difflib
import functools
import hashlib
import json
import math
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
import scipy.ndimage
from absl import logging

from ensemble import backends, calibration, checkpoint, console, data, regression_report, report, steps
from ensemble import members, recipe as recipe_lib, sharing
from ensemble.data import tfds
from ensemble.models import user
from ensemble.predictor import Predictor, evaluation_devices
from ensemble.errors import UsageError
from ensemble.uncertainty import conformal, decomposition, ood, selective

DEFAULT_ANGLES = tuple(range(0, 181, 15))
# The standard deviations (pixels in [0, 1]) of CIFAR-10-C's gaussian_noise at severities 1 to 5.
NOISE_STDS = (0.04, 0.06, 0.08, 0.09, 0.10)
# Runs trained before `heldout_fraction` existed (or with 0) held nothing out; the temperature is then
# fitted on this last fraction of the training split, which the members have seen, and the report says so.
FALLBACK_HELDOUT_FRACTION = 0.1
OOD_SCORES = ('max_probability', 'entropy', 'mutual_information')  # each oriented so that higher means "more OOD"
OOD_HISTOGRAM_BINS = 40
DEFAULT_ALPHAS = (0.1, 0.05, 0.01)
# Coverages at which the report tabulates the risk (the plot and metrics.json keep a 100-point curve).
SELECTIVE_COVERAGES = (1.0, 0.99, 0.98, 0.95, 0.9, 0.8, 0.5)


def load_run_config(workdir: str,
                    fix: str = '--workdir must name a folder written by python -m ensemble.train') -> recipe_lib.Recipe:
  """The recipe that a run (or `Ensemble.save`) recorded next to its checkpoints; `fix` ends the refusal of a folder
  without one (it names the flag or argument that gave `workdir`)."""
  path = os.path.join(workdir, 'config.json')
  config = recipe_lib.read_record(path, fix)
  missing = [key for key in recipe_lib.RECORD_KEYS if key not in config]
  if missing:
    raise UsageError(f'{path}: lacks {", ".join(missing)}; {fix}')
  try:
    return recipe_lib.from_record(config)
  except UsageError as e:
    raise UsageError(f'{path}: {e}') from None


def refuse_single_model(config: recipe_lib.Recipe, workdir: str):
  """The mesh backends train one model split over a mesh, not an ensemble of members: nothing here reads it."""
  backend = config.backend
  if backend in backends.MESH_MODELS:
    raise UsageError(f'{workdir} holds one {config.model} model trained with backend {backend!r}, not an ensemble; '
                     'evaluate, predict and export read ensembles trained with backend pmap or jit (its test loss '
                     f'and accuracy per epoch are in {os.path.join(workdir, "metrics.jsonl")})')


def restore(workdir: str, config: recipe_lib.Recipe, step: int | None, devices: Sequence[jax.Device],
            model: Any = None) -> tuple[steps.Member, steps.TrainState, int]:
  """The members saved at `step` (default: the newest intact checkpoint): what they are, their state, its epoch.

  The state is in the canonical layout. `model`, a user's model object,
  replaces the one config.json names (`ensemble.load(workdir, model=...)`).
  """
  ckpt = checkpoint.Checkpointer(workdir)
  epochs = ckpt.epochs()
  if not epochs:
    raise UsageError(f'{ckpt.directory}: no checkpoint; train first with python -m ensemble.train '
                     f'--workdir={workdir}')
  if step is not None and step not in epochs:
    raise UsageError(f'--step={step}: no such checkpoint in {ckpt.directory}; choose one of {epochs}')
  member = restored_member(config, _recorded_data(ckpt, epochs if step is None else [step]), model)
  ckpt.method = member.method  # how its checkpoints hold the shared parameters
  target = backends.abstract_member_state(member, config.ensemble_size, devices)
  meta = {'model': config.model, 'ensemble_size': config.ensemble_size}
  try:
    if step is None:  # the newest intact checkpoint; damaged ones are reported and left for the trainer
      epoch, state = ckpt.restore_newest_intact(target, meta, move_aside=False)
    else:
      epoch, state = step, ckpt.restore(step, target, meta)
  except checkpoint.DamagedCheckpoint as e:
    raise UsageError(f'--step={step}: {e}; choose another of {epochs}, or leave --step out for the newest '
                     'intact one') from None
  except checkpoint.NoIntactCheckpoint:
    raise
  except UsageError as e:
    raise UsageError(f'{os.path.join(workdir, "config.json")} does not describe its checkpoint: {e}') from None
  ckpt.close()
  return member, state, epoch


_RESTORED: 'collections.OrderedDict[Any, steps.Member]' = collections.OrderedDict()
_RESTORED_KEPT = 16


def restored_member(config: recipe_lib.Recipe, data_info: dict[str, Any], model: Any = None) -> steps.Member:
  """The member a recipe and a data description make, one per what its programs compute (`recipe.for_programs`),
  kept for the process: the ensembles restored alike share it, and so their compiled programs (a loop of
  `ensemble.load` and `predict` compiles its predictions once)."""
  key = (recipe_lib.for_programs(config), json.dumps(data_info, sort_keys=True), user.key(model))
  if key not in _RESTORED:
    _RESTORED[key] = members.member(config, data_info, model=model)
    while len(_RESTORED) > _RESTORED_KEPT:
      _RESTORED.popitem(last=False)
  _RESTORED.move_to_end(key)
  return _RESTORED[key]


def first_member_params(workdir: str, shared: Sequence[str] = ()) -> Any:
  """`init_from`'s parameters (one model's tree, for `init_params`): the first member's of `workdir`'s latest
  checkpoint; those under `shared` where it names any (a pretrained backbone for K heads), else all of them. Where
  the run's model has collections besides its parameters (BatchNorm's running averages), its whole variables,
  {'params': ..., 'batch_stats': ...}, those collections under `shared` alike."""
  fix = ("--config.init_from must name a trained run's folder (written by python -m ensemble.train, by ensemble.fit "
         'into a workdir, or by Ensemble.save)')
  config = load_run_config(workdir, fix)
  refuse_single_model(config, workdir)
  ckpt = checkpoint.Checkpointer(workdir)
  try:
    if not ckpt.epochs():
      raise UsageError(f'{workdir} holds no checkpoint yet; {fix}')
  finally:
    ckpt.close()
  member, state, _ = restore(workdir, config, None, jax.local_devices()[:1])
  first = lambda tree: jax.tree.map(lambda leaf: jax.device_get(leaf)[0], tree)
  params = {key: value for key, value in first(state.params).items() if key != sharing.ADAPTERS}
  collections = first(member._collections(state.batch_stats))  # pylint: disable=protected-access
  if shared:
    params, collections = (jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf if sharing.matches(shared, sharing.names(path)) else None, tree)
                           for tree in (params, collections))
  collections = {name: tree for name, tree in collections.items() if jax.tree.leaves(tree)}
  return {'params': params, **collections} if collections else params


def checkpoint_id(workdir: str, epoch: int) -> str:
  """What tells this checkpoint from any other of its epoch: a hash of its record, which holds the epoch's
  summary (its timings too), so a run trained again in the same workdir gets other ids. A copy keeps its id."""
  record = checkpoint.read_record(workdir, epoch)
  return hashlib.sha256(json.dumps(record, sort_keys=True).encode('utf-8')).hexdigest()[:16]


def _recorded_data(ckpt: checkpoint.Checkpointer, epochs: Sequence[int]) -> dict[str, Any]:
  """The data description the run recorded, from the newest of `epochs` whose record reads: all record the same."""
  for epoch in reversed(epochs):
    try:
      data_info = ckpt.meta(epoch).get('data')
    except checkpoint.DamagedCheckpoint:
      continue
    if data_info is None:
      raise UsageError(f'{ckpt.directory}/{epoch} was written by an older version that did not record its data; '
                       'retrain it with this version of python -m ensemble.train')
    return data_info
  raise checkpoint.NoIntactCheckpoint(f'no intact checkpoint in {ckpt.directory}: the records of epochs '
                                      f'{list(epochs)} cannot be read; copy intact ones back from a backup, or '
                                      'train afresh in a new --workdir')


def rotate(images: np.ndarray, angle: float) -> np.ndarray:
  """(N, H, W, C) images turned counter-clockwise by `angle` degrees about their centre, black outside."""
  return scipy.ndimage.rotate(images, angle, axes=(1, 2), reshape=False, order=1, mode='constant', cval=0.0)


def add_gaussian_noise(images: np.ndarray, std: float, seed: int = 0) -> np.ndarray:
  """Pixels in [0, 1] plus N(0, std^2) noise, clipped to [0, 1] (CIFAR-10-C's gaussian_noise); float32.

  The noise is a function of `seed` and `std` only, so every evaluation sees the same corrupted set.
  """
  rng = np.random.default_rng([seed, round(std * 1e6)])
  noisy = images.astype(np.float32) / 255.0 + rng.normal(0.0, std, images.shape).astype(np.float32)
  return np.clip(noisy, 0.0, 1.0)


def _mean_member(member_scores: list[dict[str, float]]) -> dict[str, float]:
  return {name: float(np.mean([s[name] for s in member_scores])) for name in member_scores[0]}


def _gain(ensemble: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
  """How much better the ensemble is: positive when it is better, whichever way the score points."""
  return {name: ensemble[name] - value if name == 'accuracy' else value - ensemble[name]
          for name, value in reference.items()}


def _reliability(probs: np.ndarray, labels: np.ndarray) -> dict[str, list]:
  counts, confidence, accuracy = calibration.reliability(probs, labels)
  as_list = lambda x: [None if math.isnan(v) else float(v) for v in x]
  return {'count': counts.tolist(), 'confidence': as_list(confidence), 'accuracy': as_list(accuracy)}


def _scores(member_log_probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """`calibration.scores` of the members' mean prediction, (K, N, C) log-probabilities in, NLL in log space."""
  return {**calibration.scores(np.exp(member_log_probs).mean(0), labels),
          'nll': calibration.ensemble_nll(member_log_probs, labels)}


def score_test_set(member_log_probs: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
  """Members, their average, the gains and the ensemble-size curve on one labelled split."""
  member_probs = np.exp(member_log_probs)
  ensemble_probs = member_probs.mean(0)
  members = [_scores(log_probs[None], labels) for log_probs in member_log_probs]
  ensemble = {**_scores(member_log_probs, labels),
              'entropy': calibration.entropy(ensemble_probs),
              'disagreement': calibration.disagreement(member_probs)}
  mean_member = _mean_member(members)
  # The best member is taken score by score: the member with the highest accuracy need not have the lowest NLL.
  best_member = {name: (max if name == 'accuracy' else min)(s[name] for s in members) for name in mean_member}
  pooled_labels = np.tile(labels, len(member_probs))
  return {
      'ensemble': ensemble,
      'members': members,
      'mean_member': mean_member,
      'best_member': best_member,
      'gain_over_mean_member': _gain(ensemble, mean_member),
      'gain_over_best_member': _gain(ensemble, best_member),
      'ensemble_size_curve': [
          {'members': k, 'accuracy': calibration.accuracy(member_probs[:k].mean(0), labels),
           'nll': calibration.ensemble_nll(member_log_probs[:k], labels)}
          for k in range(1, len(member_probs) + 1)],
      # The members' curve pools their predictions: per bin, the mean member weighted by its examples.
      'reliability': {
          'ensemble': _reliability(ensemble_probs, labels),
          'mean_member': _reliability(member_probs.reshape(-1, member_probs.shape[-1]), pooled_labels)},
  }


def score_shift(predict: Predictor, test: data.Split, levels: dict[str, Any], shifted, *,
                desc: str, unit: str) -> list[dict[str, Any]]:
  """Accuracy, NLL and ECE of the ensemble and of the mean member on `shifted(images, **level)` per level.

  `levels` maps each row's label (logged, e.g. 'rotation  90 deg') to its level, a dict that the row keeps;
  `desc` and `unit` name the pass and its steps on the progress bar.
  """
  pick = lambda scores: {name: scores[name] for name in ('accuracy', 'nll', 'ece')}
  rows = []
  for label, level in console.track(list(levels.items()), desc, unit=unit):
    member_log_probs = predict.log_probs({'image': shifted(test['image'], **level), 'label': test['label']})
    ensemble = _scores(member_log_probs, test['label'])
    members = [_scores(log_probs[None], test['label']) for log_probs in member_log_probs]
    rows.append({**level, 'ensemble': pick(ensemble), 'mean_member': pick(_mean_member(members))})
    logging.info('%s: ensemble accuracy %.4f NLL %.4f ECE %.4f', label,
                 ensemble['accuracy'], ensemble['nll'], ensemble['ece'])
  return rows


def score_rotations(predict: Predictor, test: data.Split, angles: Sequence[int]) -> list[dict[str, Any]]:
  """The test set rotated by each angle (Ovadia et al. 2019)."""
  return score_shift(predict, test, {f'rotation {a:3d} deg': {'angle': a} for a in angles}, rotate,
                     desc='rotations', unit='angle')


def score_noise(predict: Predictor, test: data.Split) -> list[dict[str, Any]]:
  """The test set with CIFAR-10-C's Gaussian noise at severities 1 to 5."""
  levels = {f'gaussian noise severity {s} (std {std})': {'severity': s, 'std': std}
            for s, std in enumerate(NOISE_STDS, start=1)}
  return score_shift(predict, test, levels, lambda images, severity, std: add_gaussian_noise(images, std),
                     desc='gaussian noise', unit='severity')


def heldout_split(train: data.Split, config: recipe_lib.Recipe) -> tuple[data.Split, bool]:
  """The training examples to fit the temperature on, and whether the members were trained on them. Of a streamed
  split, the slice stays streamed: whatever scores it reads it a batch at a time (`predict_split`, `Predictor`,
  `data.stream.labels`), so that memory stays flat in the data's size."""
  fraction = config.heldout_fraction
  # Checked before `data.hold_out`, whose message asks for a setting to train with: the run has trained.
  if not data.heldout_count(len(train['label']), fraction or FALLBACK_HELDOUT_FRACTION):
    raise UsageError(f'heldout_fraction={fraction} of {len(train["label"])} training examples holds out none '
                     'to fit the temperature on; train with a larger --config.heldout_fraction')
  _, heldout = data.hold_out(train, fraction or FALLBACK_HELDOUT_FRACTION)
  return heldout, not fraction


def predict_split(predict: Callable[[np.ndarray], dict[str, np.ndarray]], split: data.Split,
                  batch_size: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """`predict`'s per-example results (`Ensemble.predict`'s dict) for every example of `split`, and the split's
  labels: `batch_size` examples read and predicted at a time, so a streamed slice is never read whole."""
  results, labels = [], []
  for images, batch_labels in data.stream.chunks(split, batch_size):
    results.append(predict(images))
    labels.append(batch_labels)
  return {key: np.concatenate([r[key] for r in results]) for key in results[0]}, np.concatenate(labels)


def score_temperature(predict: Predictor, heldout: data.Split, seen_in_training: bool,
                      test_probs: np.ndarray, test_labels: np.ndarray) -> dict[str, Any]:
  """Temperature scaling after averaging: fitted on held-out training data, judged on the test set."""
  temperature = calibration.fit_temperature(predict(heldout).mean(0), predict.labels(heldout))
  scaled = calibration.temperature_scale(test_probs, temperature)
  judge = lambda probs: {'nll': calibration.nll(probs, test_labels), 'ece': calibration.ece(probs, test_labels)}
  return {'temperature': temperature, 'fit_examples': len(heldout['label']), 'seen_in_training': seen_in_training,
          'before': judge(test_probs), 'after': judge(scaled)}


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


def load_ood(names: Sequence[str], image_shape: Sequence[int], test: data.Split) -> dict[str, np.ndarray]:
  """name -> uint8 images of each out-of-distribution set; a set of another image shape is refused."""
  sets = {}
  for name in names:
    if name in OOD_BUILTINS:
      images = OOD_BUILTINS[name](test['image'])
    else:
      is_path = os.path.exists(os.path.expanduser(name)) or name.endswith('.npz')
      try:
        images = (data.load(data_dir=name) if is_path else data.load(dataset=name)).test['image']
      except tfds.UnknownDataset as e:
        close = difflib.get_close_matches(name, OOD_BUILTINS, n=2, cutoff=0.6) + e.close
        hint = f' (did you mean {", ".join(close)}?)' if close else ''
        raise UsageError(f'--ood={name}: no such set{hint}; give {", ".join(OOD_BUILTINS)}, an IDX folder or .npz '
                         'file that exists, or a tensorflow-datasets name') from None
      except data.DataError as e:
        raise UsageError(f'--ood={name}: {e}') from None
    if images.shape[1:] != tuple(image_shape):
      raise UsageError(f'--ood={name}: {"x".join(map(str, images.shape[1:]))} images, but the ensemble takes '
                       f'{"x".join(map(str, image_shape))}; give sets of the training data\'s image shape')
    sets[name] = images
  return sets


def _ood_scores(probs: np.ndarray, member_probs: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Per example, each of `OOD_SCORES` (mutual information only with the members' probabilities)."""
  scores = {'max_probability': 1.0 - probs.max(-1), 'entropy': decomposition.entropy(probs)}
  if member_probs is not None:
    scores['mutual_information'] = decomposition.decompose(member_probs)['mutual_information']
  return scores


def score_ood(predict: Predictor, test_member_probs: np.ndarray,
              ood_sets: dict[str, np.ndarray]) -> dict[str, Any]:
  """Per set: AUROC, AUPR and FPR95 of each score against the test set, for the ensemble and the mean member,
  and histograms of the ensemble's scores on both (for the plot)."""
  inside = _ood_scores(test_member_probs.mean(0), test_member_probs)
  inside_members = [_ood_scores(p) for p in test_member_probs]
  results = {}
  for name, images in console.track(list(ood_sets.items()), 'out-of-distribution sets', unit='set'):
    member_probs = predict({'image': images, 'label': np.zeros(len(images), np.int32)})
    outside = _ood_scores(member_probs.mean(0), member_probs)
    members = [{score: ood.detection(mine[score], theirs[score]) for score in theirs}
               for mine, theirs in zip(inside_members, (_ood_scores(p) for p in member_probs))]
    histograms = {}
    for score in OOD_SCORES:
      edges = np.histogram_bin_edges(np.concatenate([inside[score], outside[score]]), OOD_HISTOGRAM_BINS)
      histograms[score] = {'edges': edges.tolist(), 'test': np.histogram(inside[score], edges)[0].tolist(),
                           'ood': np.histogram(outside[score], edges)[0].tolist()}
    results[name] = {
        'examples': len(images),
        'ensemble': {score: ood.detection(inside[score], outside[score]) for score in OOD_SCORES},
        'mean_member': {score: _mean_member([m[score] for m in members]) for score in members[0]},
        'histogram': histograms}
    logging.info('%s: ensemble AUROC %s', name, ', '.join(
        f'{score} {results[name]["ensemble"][score]["auroc"]:.4f}' for score in OOD_SCORES))
  return results


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


def score_conformal(predict: Predictor, heldout: data.Split, seen_in_training: bool, test_member_probs: np.ndarray,
                    test_labels: np.ndarray, alphas: Sequence[float]) -> dict[str, Any]:
  """Split-conformal sets calibrated on the held-out slice, judged on the test set: coverage and mean set size of
  each score at each alpha, for the ensemble and (each member calibrated on its own) the mean member."""
  heldout_member_probs, heldout_labels = predict(heldout), predict.labels(heldout)
  n = len(heldout_labels)
  finite = lambda q: q if math.isfinite(q) else None  # JSON has no infinity: no threshold, every class in the set
  rows = []
  for alpha in alphas:
    for score in conformal.SCORES:
      fit = functools.partial(conformal.split_conformal, calibration_labels=heldout_labels,
                              test_labels=test_labels, alpha=alpha, score=score)
      ensemble = fit(heldout_member_probs.mean(0), test_probs=test_member_probs.mean(0))
      members = [fit(cal, test_probs=test) for cal, test in zip(heldout_member_probs, test_member_probs)]
      rows.append({'alpha': alpha, 'score': score, 'guaranteed': [1 - alpha, min(1.0, 1 - alpha + 1 / (n + 1))],
                   'ensemble': {**ensemble, 'quantile': finite(ensemble['quantile'])},
                   'mean_member': _mean_member([{k: v for k, v in m.items() if k != 'quantile'} for m in members])})
      logging.info('conformal %s at alpha %g: ensemble coverage %.4f, mean set size %.3f', score, alpha,
                   ensemble['coverage'], ensemble['mean_size'])
  return {'calibration_examples': n, 'seen_in_training': seen_in_training, 'rows': rows}


def _evaluate_regression(workdir: str, config, member, state, devices, epoch: int, *, data_dir: str | None,
                         output_dir: str | None, alphas: Sequence[float]) -> dict[str, Any]:
  """`evaluate` for a regression workdir, restored by the caller: reads the data, scores it
  (`regression_report.score`), writes the report into `output_dir` (default WORKDIR/eval), returns its numbers."""
  data_dir = config.data_dir if data_dir is None else data_dir
  dataset = data.load(config.dataset, data_dir, task='regression', target=config.target, streaming=config.streaming)
  test = data.stream.in_memory(dataset.test)
  if tuple(dataset.image_shape) != member.image_shape or dataset.num_classes != member.task.targets:
    raise UsageError(f'{dataset.source} holds inputs {dataset.image_shape} with {dataset.num_classes} '
                     f'targets but {workdir} was trained on {member.image_shape} with '
                     f'{member.task.targets}; give --data_dir the data it was trained on')
  heldout, seen_in_training = heldout_split(dataset.train, config)
  predict = Predictor(member, state, devices, config.eval_batch_size)
  components = lambda split: (*member.task.components(predict.log_probs(split)),
                              predict.labels(split).astype(np.float64))
  logging.info('Predicting the %d test examples and the %d held-out ones.', len(test['label']), len(heldout['label']))
  results = {'workdir': os.path.abspath(workdir), 'epoch': epoch, 'checkpoint_unit': config.checkpoint_unit,
             'checkpoint': checkpoint_id(workdir, epoch), 'ensemble_size': config.ensemble_size,
             'task': 'regression', 'data': dataset.source,
             'data_dir': recipe_lib.data_location(data_dir), 'test_examples': len(test['label']),
             **regression_report.score(components(test), components(heldout), config.ensemble_size, alphas,
                                       seen_in_training)}
  logging.info('test: ensemble RMSE %.4g NLL %.4g CRPS %.4g 90%% coverage %.3f; mean member RMSE %.4g NLL %.4g '
               'CRPS %.4g 90%% coverage %.3f', *(results[who][name] for who in ('ensemble', 'mean_member')
                                                 for name in ('rmse', 'nll', 'crps', 'coverage_90')))
  regression_report.write(results, output_dir or os.path.join(workdir, 'eval'))
  return results


def evaluate(workdir: str, *, data_dir: str | None = None, step: int | None = None,
             output_dir: str | None = None, angles: Sequence[int] = DEFAULT_ANGLES,
             ood_names: Sequence[str] = DEFAULT_OOD, alphas: Sequence[float] = DEFAULT_ALPHAS) -> dict[str, Any]:
  """Scores the checkpoint, writes the report into `output_dir` (default WORKDIR/eval) and returns its numbers.

  The report records which checkpoint (`checkpoint_id`) and which data (`data_dir`) it scored, so that the
  temperature it fits is applied (`ensemble.load`) only to that checkpoint of a run trained on that data.
  """
  config = load_run_config(workdir)
  refuse_single_model(config, workdir)
  devices = evaluation_devices(config.ensemble_size)
  member, state, epoch = restore(workdir, config, step, devices)
  logging.info('Restored %s %d of %s: %s on %s.', config.checkpoint_unit, epoch, workdir,
               console.count(config.ensemble_size, 'member'), console.count(len(devices), 'device'))
  if member.task.name == 'regression':
    if ood_names and list(ood_names) != list(DEFAULT_OOD):  # the built-in image sets are on by default
      raise UsageError(f'--ood detects unfamiliar images, and {workdir} is a regression ensemble: leave --ood out')
    return _evaluate_regression(workdir, config, member, state, devices, epoch, data_dir=data_dir,
                                output_dir=output_dir, alphas=alphas)
  data_dir = config.data_dir if data_dir is None else data_dir
  dataset = data.load(config.dataset, data_dir, config.train_split, config.test_split, streaming=config.streaming)
  test = data.stream.in_memory(dataset.test)
  if tuple(dataset.image_shape) != member.image_shape:
    raise UsageError(f'{dataset.source} holds {"x".join(map(str, dataset.image_shape))} images but {workdir} '
                     f'was trained on {"x".join(map(str, member.image_shape))}; give --data_dir the data it was '
                     'trained on')
  heldout, seen_in_training = heldout_split(dataset.train, config)
  ood_sets = load_ood(ood_names, member.image_shape, test)
  predict = Predictor(member, state, devices, config.eval_batch_size)

  logging.info('Predicting the %d test examples.', len(test['label']))
  member_log_probs = predict.log_probs(test)
  member_probs = np.exp(member_log_probs)
  results = {'workdir': os.path.abspath(workdir), 'epoch': epoch, 'checkpoint_unit': config.checkpoint_unit,
             'checkpoint': checkpoint_id(workdir, epoch),
             'ensemble_size': config.ensemble_size, 'data': dataset.source,
             'data_dir': recipe_lib.data_location(data_dir), 'test_examples': len(test['label']),
             **score_test_set(member_log_probs, test['label'])}
  logging.info('test: ensemble accuracy %.4f NLL %.4f ECE %.4f; mean member accuracy %.4f NLL %.4f ECE %.4f',
               *(results[who][name] for who in ('ensemble', 'mean_member') for name in ('accuracy', 'nll', 'ece')))
  logging.info('Rotating the test set by %s degrees.', list(angles))
  results['rotation'] = score_rotations(predict, test, angles)
  logging.info('Adding Gaussian noise to the test set at %d severities.', len(NOISE_STDS))
  results['gaussian_noise'] = score_noise(predict, test)
  logging.info('Fitting the temperature on the last %d training examples.', len(heldout['label']))
  if seen_in_training:
    logging.warning('%s held out no training examples (heldout_fraction=0): the temperature is fitted on '
                    'examples the members were trained on and will sharpen the ensemble.', workdir)
  results['temperature_scaling'] = score_temperature(predict, heldout, seen_in_training,
                                                     member_probs.mean(0), test['label'])
  logging.info('temperature %.3f: test NLL %.4f -> %.4f', results['temperature_scaling']['temperature'],
               results['temperature_scaling']['before']['nll'], results['temperature_scaling']['after']['nll'])
  results['selective'] = score_selective(member_probs, test['label'])
  logging.info('Calibrating conformal prediction sets on the last %d training examples at alpha %s.',
               len(heldout['label']), ', '.join(map(str, alphas)))
  results['conformal'] = score_conformal(predict, heldout, seen_in_training, member_probs, test['label'], alphas)
  if ood_sets:
    logging.info('Detecting %d out-of-distribution sets: %s.', len(ood_sets), ', '.join(ood_sets))
    results['ood'] = score_ood(predict, member_probs, ood_sets)

  output_dir = output_dir or os.path.join(workdir, 'eval')
  report.write(results, output_dir)
  logging.info('Wrote metrics.json, report.md and plots to %s.', output_dir)
  return results
