"""A saved ensemble: one value in one folder, that `Ensemble.save` writes and `ensemble.load` reads back whole.

  PATH/config.json            the recipe, resolved (with the data's fingerprint), as a run records it
  PATH/checkpoints/EPOCH/     the members at the value's one checkpoint (orbax), with its record: the data's
                              description and the training summary
  PATH/metrics.jsonl          that summary, as a run's last line
  PATH/ensemble.json          the manifest: its checkpoint (epoch and id), its summary and its post-hoc chain

The folder is a workdir to every reader (`python -m ensemble.evaluate / predict / export`), holding the one
checkpoint the value is; the manifest says which, and what was fitted on it after training (ensemble/posthoc.py).
A folder a run trains in (a workdir) is that run's history instead: `load` takes its newest checkpoint, or the one
asked for, and the post-hoc steps the earlier versions of this package kept beside it (`legacy_chain`).
"""

import json
import os
import shutil
from typing import Any

import numpy as np
from absl import logging

from ensemble import files, posthoc, recipe as recipe_lib
from ensemble.errors import UsageError

MANIFEST_FILE = 'ensemble.json'
FORMAT = 1
# What `Ensemble.save` wrote of a calibrated ensemble before the manifest: its temperature and conformal quantile.
CALIBRATION_FILE = 'calibration.json'
# The flag thresholds `python -m ensemble.predict` applies to a run's workdir, fitted on its held-out slice, by
# checkpoint and settings (`Ensemble.flag_threshold`, `python -m ensemble.evaluate`): fitted once, not at every call.
FLAG_THRESHOLDS_FILE = 'flag_thresholds.json'


def read_json(path: str) -> dict[str, Any]:
  """A JSON object kept in a workdir, {} when it is not there or cannot be read (what it caches is fitted again)."""
  try:
    with open(path, encoding='utf-8') as f:
      found = json.load(f)
  except (OSError, ValueError):
    return {}
  return found if isinstance(found, dict) else {}


def _flag_key(workdir: str, epoch: int, target_risk: float, ood_rate: float, data_dir: str, temperature: float) -> str:
  from ensemble import checkpoint  # pylint: disable=g-import-not-at-top  # orbax
  return json.dumps([checkpoint.checkpoint_id(workdir, epoch), target_risk, ood_rate,
                     recipe_lib.data_location(data_dir), temperature])


def kept_flag_thresholds(workdir: str, epoch: int, target_risk: float, ood_rate: float, data_dir: str,
                         temperature: float) -> dict[str, Any] | None:
  """The flag thresholds kept for this checkpoint and these settings, None where none are."""
  kept = read_json(os.path.join(workdir, FLAG_THRESHOLDS_FILE))
  return kept.get(_flag_key(workdir, epoch, target_risk, ood_rate, data_dir, temperature))


def keep_flag_thresholds(workdir: str, epoch: int, fitted: dict[str, Any], temperature: float, data_dir: str):
  """Keeps `fitted` (its 'target_risk' and 'ood_rate' among them) for this checkpoint, data and temperature; a
  workdir this process may not write is left as it is (they are fitted again when next needed)."""
  path = os.path.join(workdir, FLAG_THRESHOLDS_FILE)
  key = _flag_key(workdir, epoch, fitted['target_risk'], fitted['ood_rate'], data_dir, temperature)
  try:
    files.write_atomically(path, json.dumps({**read_json(path), key: fitted}, indent=2))
  except OSError as e:
    logging.warning('The flag thresholds cannot be kept in %s (%s): each prediction fits them again.', path, e)


def write(ens: Any, path: str) -> str:
  """Writes the ensemble `ens` at `path` (which must not exist) and returns the absolute path: a new folder,
  filled beside it and renamed into place when complete, so that a failed save leaves nothing at `path`."""
  from ensemble import checkpoint  # pylint: disable=g-import-not-at-top  # orbax
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path):
    raise UsageError(f'{path} exists; save to a new path (a saved ensemble is never overwritten)')
  if not os.path.isdir(os.path.dirname(path)):
    raise UsageError(f'no folder {os.path.dirname(path)}; create it first')
  trained = {k: v for k, v in ens._summary.items()}  # pylint: disable=protected-access
  partial = files.partial_folder(path)
  try:
    files.write_atomically(os.path.join(partial, 'config.json'),
                           json.dumps(ens.config.to_dict(), indent=2, sort_keys=True))
    meta = {'model': ens.config.model, 'ensemble_size': ens.size, 'data': ens._data_info}  # pylint: disable=protected-access
    step = int(np.asarray(ens.state.step).reshape(-1)[0])
    ckpt = checkpoint.Checkpointer(partial, method=ens.member.method)
    try:
      ckpt.save(ens.epoch, ens.state, meta, summary=(step, trained))
    finally:
      ckpt.close()
    files.write_atomically(os.path.join(partial, 'metrics.jsonl'), json.dumps({'step': step, **trained}) + '\n')
    manifest = {'format': FORMAT, 'epoch': ens.epoch, 'checkpoint': checkpoint.checkpoint_id(partial, ens.epoch),
                'summary': trained, 'posthoc': posthoc.to_json(ens.posthoc)}
    files.write_atomically(os.path.join(partial, MANIFEST_FILE), json.dumps(manifest, indent=2))
    os.replace(partial, path)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  return path


def _manifest(workdir: str) -> dict[str, Any] | None:
  """The folder's manifest, None where it has none (a run's workdir); one that cannot be read is refused."""
  path = os.path.join(workdir, MANIFEST_FILE)
  if not os.path.exists(path):
    return None
  found = read_json(path)
  if not isinstance(found.get('epoch'), int) or found.get('format') != FORMAT:
    raise UsageError(f'{path} cannot be read as the manifest of a saved ensemble (format {FORMAT}); save the '
                     'ensemble again, or remove the file to load the newest checkpoint without its post-hoc steps')
  return found


def saved_epoch(workdir: str) -> int | None:
  """The checkpoint a saved ensemble is (what `load` reads when no step is asked for); None for a run's workdir."""
  found = _manifest(workdir)
  return None if found is None else found['epoch']


def is_saved(workdir: str) -> bool:
  """Whether `workdir` holds a saved ensemble (a manifest), which no run trains on in place."""
  return os.path.exists(os.path.join(workdir, MANIFEST_FILE))


def read(workdir: str, config: recipe_lib.Recipe, epoch: int, task: Any,
         summary: dict[str, float]) -> tuple[tuple[posthoc.Step, ...], dict[str, float]]:
  """(post-hoc chain, training summary) of checkpoint `epoch` of `workdir`: a saved ensemble's from its manifest,
  checked against the checkpoint it names; a run's from what earlier versions kept beside its checkpoints."""
  found = _manifest(workdir)
  if found is None:
    return legacy_chain(workdir, config, epoch, task), summary
  from ensemble import checkpoint  # pylint: disable=g-import-not-at-top  # orbax
  where = os.path.join(workdir, MANIFEST_FILE)
  if found['epoch'] != epoch:
    raise UsageError(f'{where} is the ensemble of checkpoint {found["epoch"]}, not {epoch}: load it without step=')
  if found.get('checkpoint') != checkpoint.checkpoint_id(workdir, epoch):
    raise UsageError(f'{where} names another checkpoint {epoch} than the one in {workdir} (it was replaced since '
                     'the ensemble was saved); save the ensemble again')
  chain = posthoc.from_json(found.get('posthoc', []), where, task)
  posthoc.check(chain, epoch, where)
  return chain, found.get('summary', summary)


def legacy_chain(workdir: str, config: recipe_lib.Recipe, epoch: int, task: Any) -> tuple[posthoc.Step, ...]:
  """The post-hoc steps an earlier version kept beside checkpoint `epoch` of a workdir: `Ensemble.save`'s
  calibration.json (a temperature, then a conformal quantile, as its predictions applied them), or the
  temperature `python -m ensemble.evaluate` fitted on the held-out slice (eval/metrics.json). Steps given, not
  fitted here: they record no examples."""
  saved = _saved_calibration(workdir, epoch)
  kind = task.calibration
  temperature = saved.get('temperature') or fitted_temperature(workdir, config, epoch)
  chain = []
  if isinstance(temperature, list):  # a multi-label ensemble's, one per label
    chain.append(posthoc.given(kind, chain, epoch, task, value=[float(t) for t in temperature]))
  elif temperature and temperature != 1.0 and kind:
    chain.append(posthoc.given(kind, chain, epoch, task, value=float(temperature)))
  found = saved.get('conformal')
  if found:
    chain.append(posthoc.given('conformal', chain, epoch, task, alpha=float(found['alpha']), score=found['score'],
                               quantile=found['quantile']))
  return tuple(chain)


def _saved_calibration(workdir: str, epoch: int) -> dict[str, Any]:
  """The calibration an earlier `Ensemble.save` wrote for checkpoint `epoch` ({} if none: a later checkpoint is
  not it)."""
  path = os.path.join(workdir, CALIBRATION_FILE)
  try:
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    raise UsageError(f'{path} cannot be read ({e}); remove it to load the ensemble uncalibrated') from None
  if saved.get('epoch') != epoch:
    logging.warning('%s was fitted for checkpoint %s, not %d: loading checkpoint %d without it.', path,
                    saved.get('epoch'), epoch, epoch)
    return {}
  return saved


def fitted_temperature(workdir: str, config: recipe_lib.Recipe, epoch: int) -> float | None:
  """The temperature `ensemble.evaluate` fitted (in WORKDIR/eval/metrics.json; for a regression workdir its
  variance scale, regression's temperature), if it was fitted for this checkpoint and on the held-out slice of the
  data this run was trained on; None, with a warning that says why, if not."""
  from ensemble import checkpoint, data  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, 'eval', 'metrics.json')
  try:
    with open(path, encoding='utf-8') as f:
      results = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    logging.warning('%s cannot be read (%s): predicting without temperature scaling.', path, e)
    return None
  temperature = results.get('temperature_scaling', {}).get('temperature',
                                                          results.get('variance_scaling', {}).get('scale'))
  if temperature is None:
    return None
  fitted_on, trained_on = (recipe_lib.data_location(results.get('data_dir', '')),
                           recipe_lib.data_location(config.data_dir))
  if results.get('epoch') != epoch:
    problem = f'was fitted for epoch {results.get("epoch")}, not {epoch}'
  elif results.get('checkpoint') != checkpoint.checkpoint_id(workdir, epoch):
    problem = (f'was fitted for another checkpoint of epoch {epoch} (the run was trained again since)'
               if results.get('checkpoint') else 'does not record the checkpoint it was fitted for (an older version)')
  elif config.dataset != data.ARRAYS and fitted_on != trained_on:  # arrays in memory: --data_dir names them
    problem = (f'was fitted on the held-out slice of {fitted_on or "the named dataset"}, not of the data the run was '
               f'trained on ({trained_on or config.dataset})')
  else:
    return temperature
  logging.warning('The temperature in %s %s: predicting without temperature scaling; run python -m '
                  'ensemble.evaluate --workdir=%s --step=%d to fit one.', path, problem, workdir, epoch)
  return None
