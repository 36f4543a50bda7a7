"""A trained workdir read and scored: its recipe and checkpoints restored onto the devices at hand, its data's
held-out slice, and `evaluate`, the library half of `python -m ensemble.evaluate` (no flags, no logging set-up),
which scores a checkpoint with its task's `Task.report` (what `Ensemble.report` runs on any ensemble) and writes
metrics.json, report.md and PNG plots.
"""

import collections
import difflib
import json
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging

from ensemble import backends, checkpoint, console, data, manifest, members, posthoc
from ensemble import recipe as recipe_lib, scoring, sharing, steps
from ensemble.data import tfds
from ensemble.models import user
from ensemble.devices import evaluation_devices
from ensemble.predictor import Predictor
from ensemble.errors import UsageError

# Runs trained before `heldout_fraction` existed (or with 0) held nothing out; the temperature is then
# fitted on this last fraction of the training split, which the members have seen, and the report says so.
FALLBACK_HELDOUT_FRACTION = 0.1


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


DEFAULT_OOD = scoring.DEFAULT_OOD


def fit_flag_threshold(ens: Any, target_risk: float, data_dir: str | None, ood_rate: float) -> dict[str, Any]:
  """`Ensemble.flag_threshold`'s fit on the held-out slice of the ensemble's run, a batch of its `batch_size`
  images at a time."""
  dataset = data.load(ens.config.dataset, ens.config.data_dir if data_dir is None else data_dir,
                      ens.config.train_split, ens.config.test_split, streaming=ens.config.streaming)
  if tuple(dataset.image_shape) != ens.image_shape:
    raise UsageError(f'{dataset.source} holds {"x".join(map(str, dataset.image_shape))} images but '
                     f'{ens.workdir} was trained on {"x".join(map(str, ens.image_shape))}; give --data_dir the '
                     'data it was trained on')
  heldout, seen_in_training = heldout_split(dataset.train, ens.config)
  if seen_in_training:
    logging.warning('%s held out no training examples (heldout_fraction=0): the flag threshold is fitted on '
                    'examples the members were trained on and flags too few images.', ens.workdir)
  result, labels = predict_split(ens.predict, heldout, ens.batch_size)
  return {**posthoc.flag_thresholds(result[posthoc.FLAG_SCORE], result[posthoc.OOD_SCORE],
                                    result['class'] == labels, target_risk, ood_rate),
          'examples': len(labels), 'seen_in_training': seen_in_training}


def load_ood(names: Sequence[str], image_shape: Sequence[int], test: data.Split) -> dict[str, np.ndarray]:
  """name -> uint8 images of each out-of-distribution set; a set of another image shape is refused."""
  sets = {}
  for name in names:
    if name in scoring.OOD_BUILTINS:
      images = scoring.OOD_BUILTINS[name](test['image'])
    else:
      is_path = os.path.exists(os.path.expanduser(name)) or name.endswith('.npz')
      try:
        images = (data.load(data_dir=name) if is_path else data.load(dataset=name)).test['image']
      except tfds.UnknownDataset as e:
        close = difflib.get_close_matches(name, scoring.OOD_BUILTINS, n=2, cutoff=0.6) + e.close
        hint = f' (did you mean {", ".join(close)}?)' if close else ''
        raise UsageError(f'--ood={name}: no such set{hint}; give {", ".join(scoring.OOD_BUILTINS)}, an IDX folder '
                         'or .npz file that exists, or a tensorflow-datasets name') from None
      except data.DataError as e:
        raise UsageError(f'--ood={name}: {e}') from None
    if images.shape[1:] != tuple(image_shape):
      raise UsageError(f'--ood={name}: {"x".join(map(str, images.shape[1:]))} images, but the ensemble takes '
                       f'{"x".join(map(str, image_shape))}; give sets of the training data\'s image shape')
    sets[name] = images
  return sets


def evaluate(workdir: str, *, data_dir: str | None = None, step: int | None = None,
             output_dir: str | None = None, angles: Sequence[int] = scoring.DEFAULT_ANGLES, noise: bool = True,
             ood_names: Sequence[str] = DEFAULT_OOD, alphas: Sequence[float] = scoring.DEFAULT_ALPHAS,
             max_examples: int | None = None) -> dict[str, Any]:
  """Scores the checkpoint (`Task.report`, as `Ensemble.report` does), writes the report into `output_dir`
  (default WORKDIR/eval) and returns its numbers. `max_examples`: score the first that many test examples only.

  The report records which checkpoint (`checkpoint_id`) and which data (`data_dir`) it scored, so that the
  temperature it fits is applied (`ensemble.load`) only to that checkpoint of a run trained on that data; the
  flag thresholds `python -m ensemble.predict` applies are fitted from the held-out outputs it predicted, and kept
  (`manifest.keep_flag_thresholds`) when it scored the run's own data.
  """
  config = load_run_config(workdir)
  refuse_single_model(config, workdir)
  devices = evaluation_devices(config.ensemble_size)
  member, state, epoch = restore(workdir, config, step, devices)
  logging.info('Restored %s %d of %s: %s on %s.', config.checkpoint_unit, epoch, workdir,
               console.count(config.ensemble_size, 'member'), console.count(len(devices), 'device'))
  task = member.task
  if not task.detects_ood and ood_names and list(ood_names) != list(DEFAULT_OOD):  # the built-in image sets
    raise UsageError(f'--ood detects unfamiliar images, and {workdir} is a {task.name} ensemble: leave --ood out')
  if max_examples is not None and max_examples < 1:
    raise UsageError(f'--max_examples={max_examples}: give a positive number of test examples, or leave it out for '
                     'all of them')
  data_dir = config.data_dir if data_dir is None else data_dir
  dataset = data.load(config.dataset, data_dir, config.train_split, config.test_split, task=task.name,
                      target=config.target, streaming=config.streaming, ignore=config.ignore_label)
  test = data.stream.in_memory(dataset.test, None if max_examples is None else
                               np.arange(min(max_examples, len(dataset.test['label']))))
  shape = member.image_shape
  if tuple(dataset.image_shape) != shape or (task.standardises_targets and dataset.num_classes != task.targets):
    raise UsageError(f'{dataset.source} holds {"x".join(map(str, dataset.image_shape))} {dataset.inputs} but '
                     f'{workdir} was trained on {"x".join(map(str, shape))}; give --data_dir the data it was trained '
                     'on')
  heldout, seen_in_training = heldout_split(dataset.train, config)
  if seen_in_training:
    logging.warning('%s held out no training examples (heldout_fraction=0): the temperature and the conformal sets '
                    'are fitted on examples the members were trained on.', workdir)
  images = member.inputs == 'images' and task.shifts  # what the shifts score
  logging.info('Predicting the %d test examples and the %d held-out ones.', len(test['label']), len(heldout['label']))
  forward = Predictor(member, state, devices, config.eval_batch_size)
  results = {'workdir': os.path.abspath(workdir), 'epoch': epoch, 'checkpoint_unit': config.checkpoint_unit,
             'checkpoint': checkpoint.checkpoint_id(workdir, epoch), 'ensemble_size': config.ensemble_size,
             'task': task.name,
             'data': dataset.source, 'data_dir': recipe_lib.data_location(data_dir),
             **task.report(forward, test, heldout,
                           seen_in_training, size=config.ensemble_size, angles=angles if images else (),
                           noise=noise and images, alphas=alphas,
                           ood_sets=(load_ood(ood_names, shape, test) if member.inputs == 'images'
                                     and task.detects_ood else None))}
  if manifest.saved_epoch(workdir) == epoch:  # a saved ensemble's chain: its own conformal sets judged too
    chain, _ = manifest.read(workdir, config, epoch, task, {})
    chained = scoring.score_chain_conformal(task, chain, forward, test)
    results.update({'posthoc_conformal': chained} if chained else {})
  own = os.path.join(workdir, 'eval')
  output_dir = output_dir or own
  task.write_report(results, output_dir)
  logging.info('Wrote metrics.json, report.md and plots to %s.', output_dir)
  # The temperature `ensemble.load` applies is this one where the report is the workdir's own and of its data: the
  # flags predict applies at it are the ones just fitted.
  if ('flags' in results and os.path.abspath(output_dir) == os.path.abspath(own)
      and recipe_lib.data_location(data_dir) == recipe_lib.data_location(config.data_dir)):
    manifest.keep_flag_thresholds(workdir, epoch, results['flags'], results['temperature_scaling']['temperature'],
                                  data_dir=config.data_dir)
  return results
