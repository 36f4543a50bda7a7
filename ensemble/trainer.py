"""A run in a workdir: the in-memory loop (ensemble/loop.py) with checkpoints, metrics and resume attached.

What `python -m ensemble.train` and `ensemble.fit(workdir=...)` run: the
workdir's config.json, its lock, the resume from the newest intact checkpoint,
and a hook that writes each epoch's checkpoint (in the background) and its
metrics.jsonl and TensorBoard line. Ctrl-C ends a run once its last checkpoint
is complete (`Interrupted`), and the same command resumes it.
"""

import dataclasses
import functools
import json
import os
import shutil
import time
from typing import Any

import jax
from absl import logging

from ensemble import backends, checkpoint, console, data, divergence, files, loop, manifest, recipe as recipe_lib
from ensemble import sigterm, starts, writers
from ensemble.defaults import Recipe
from ensemble.errors import UsageError


class Interrupted(KeyboardInterrupt):
  """Ctrl-C in a workdir's training, raised once its last checkpoint is complete: where the run stopped, in words.

  A KeyboardInterrupt still, so that a notebook's `ensemble.fit(workdir=...)`
  stops as it would; `python -m ensemble.train` says it in one line.
  """

  def __init__(self, message: str, saved_epoch: int, terminated: bool = False, unit: str = 'epoch'):
    super().__init__(message)
    # saved_epoch: the newest position saved, an epoch or (unit 'step') a step; terminated: by SIGTERM, not Ctrl-C
    self.saved_epoch, self.terminated, self.unit = saved_epoch, terminated, unit


def _releases_the_workdir(train):
  """Gives the workdir's lock back however `train` ends, so that this process can train the workdir again."""
  @functools.wraps(train)
  def wrapped(config, workdir, **kwargs):
    held_before = checkpoint.holds_workdir(workdir)
    try:
      return train(config, workdir, **kwargs)
    finally:
      if not held_before:
        checkpoint.unlock_workdir(workdir)
  return wrapped


def check_workdir(workdir: str):
  """A workdir is only ever a workdir: a new or empty folder, or one a run wrote, which holds a run's config.json,
  its checkpoints/ or its lock. Any other folder, a saved ensemble's among them (`Ensemble.save`: one value, not a
  run's history), is refused before anything is written in it, so that it stays byte for byte as it was."""
  if not os.path.exists(workdir):
    return
  if not os.path.isdir(workdir):
    raise UsageError(f'{workdir} is a file, not a folder; give --workdir a new or empty folder, or a workdir')
  entries = sorted(os.listdir(workdir))
  if manifest.MANIFEST_FILE in entries:
    raise UsageError(f'{workdir} holds a saved ensemble ({manifest.MANIFEST_FILE}), one trained value that no run '
                     'trains on in place: train in another --workdir, or on from its members with '
                     'ensemble.fit(..., init=ensemble.load(...)); nothing in it was changed')
  if not entries or {checkpoint.CHECKPOINTS_DIR, checkpoint.STOPPED_DIR, checkpoint.LOCK_FILE} & set(entries):
    return
  if 'config.json' in entries:
    try:
      recorded = recipe_lib.read_record(os.path.join(workdir, 'config.json'), '')
    except UsageError:
      recorded = {}
    if all(key in recorded for key in recipe_lib.RECORD_KEYS):
      return
  held = ', '.join(entries[:3]) + (f' and {len(entries) - 3} more' if len(entries) > 3 else '')
  raise UsageError(f'{workdir} holds {held}, and is not a workdir (no config.json of a run, no checkpoints): give '
                   '--workdir a new or empty folder; nothing in this one was changed')


def _check_resume(recipe: Recipe, workdir: str, ckpt: checkpoint.Checkpointer) -> dict | None:
  """A workdir with checkpoints resumes only with the data settings that its config.json records; without a
  config.json that can be read, not at all (the resume would write the current config as if it were the original).
  Returns what config.json records, or None for a fresh run."""
  epochs = ckpt.epochs() or _stopped_steps(workdir)
  if not epochs:
    return None
  path = os.path.join(workdir, 'config.json')
  saved = recipe_lib.read_record(
      path, f'it records how the checkpoints of epochs {epochs} in {ckpt.directory} were trained, and a resume must '
      'keep their settings: put it back from a backup (or from the workdir this one was copied from), or train in a '
      'new --workdir')
  recipe_lib.check_resume(recipe, saved, path)
  return saved


def _config_json(recipe: Recipe) -> str:
  return json.dumps(recipe.to_dict(), indent=2, sort_keys=True)


def _log_changes(recipe: Recipe, saved: dict[str, Any], workdir: str):
  """Names the settings a resume changes: the recipe as the run will train, in JSON's types as written there (a
  tuple is a list), against that record."""
  recorded = json.loads(_config_json(recipe))
  changed = {key: value for key, value in recorded.items() if key in saved and saved[key] != value}
  if changed:
    logging.info('Resuming with %s; %s keeps the settings the workdir was started with.', changed,
                 os.path.join(workdir, 'config.json'))


def _write_config(recipe: Recipe, workdir: str, resuming: bool):
  """config.json describes the checkpoints: written when a run starts afresh, never replaced by a resume."""
  path = os.path.join(workdir, 'config.json')
  if jax.process_index() != 0 or (resuming and os.path.exists(path)):
    return
  files.write_atomically(path, _config_json(recipe))


def _missing_summaries(ckpt: checkpoint.Checkpointer, workdir: str, start_key: int,
                       start_step: int) -> list[tuple[int, dict]]:
  """(step, scalars) of the checkpoints up to `start_key` whose lines metrics.jsonl lacks, read from them.

  A crash between a checkpoint and its line loses the line, and resuming starts
  after that checkpoint. Lines after `start_step` (their checkpoints were
  damaged) are dropped; those steps are trained again.
  """
  if jax.process_index() != 0:
    return []
  written = writers.drop_lines_after(os.path.join(workdir, 'metrics.jsonl'), start_step)
  summaries = [ckpt.summary(key) for key in ckpt.epochs() if key <= start_key]
  return [summary for summary in summaries if summary is not None and summary[0] not in written]


def _earlier_losses(workdir: str, epochs: int, steps_per_epoch: int) -> list[float] | None:
  """The training loss of each of the first `epochs` epochs, from metrics.jsonl's lines at their ends (lines written
  between checkpoints inside an epoch are not its loss); None where they cannot all be read (a process other than 0,
  which writes no lines; a file edited or lost)."""
  if not epochs:
    return []
  if jax.process_index() != 0:
    return None
  try:
    lines = writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  except (OSError, ValueError):
    return None
  ends = {line['epoch']: line['train_loss'] for line in lines
          if 'train_loss' in line and line.get('step') == line.get('epoch', 0) * steps_per_epoch}
  losses = [ends.get(epoch) for epoch in range(1, epochs + 1)]
  return None if None in losses else losses


def _best_so_far(ckpt: checkpoint.Checkpointer, key: int, restored: Any) -> loop.Best | None:
  """Early stopping's best epoch when a run resumes: its last checkpoint (only the epochs that lower the validation
  NLL are kept), `restored`, copied (training donates the state it starts from)."""
  scalars = (ckpt.summary(key) or (0, {}))[1] if key else {}
  if 'validation_loss' not in scalars:  # a run that started without early stopping: the first epoch sets it
    return None
  return loop.Best(scalars['validation_loss'], key, loop.copied(restored), scalars)


def _stopped_early(workdir: str, best: loop.Best, patience: int) -> int:
  """The epochs trained, where the run ended by early stopping already (metrics.jsonl has `patience` epochs after
  the best one, none of them better); else 0."""
  try:
    lines = writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  except OSError:
    return 0
  after = [line['epoch'] for line in lines if line.get('best_epoch') == best.epoch and line['epoch'] > best.epoch]
  return max(after) if after and max(after) - best.epoch >= patience else 0


def _stopped_steps(workdir: str) -> list[int]:
  """The steps saved in STOPPED_DIR (where SIGTERM stopped a run that checkpoints by epoch), read from its folder."""
  folder = os.path.join(workdir, checkpoint.STOPPED_DIR)
  return sorted(int(name) for name in os.listdir(folder) if name.isdigit()) if os.path.isdir(folder) else []


def _remove_stopped(workdir: str):
  """Once an epoch's checkpoint passes it, the step SIGTERM saved is of no more use."""
  if jax.process_index() == 0:
    shutil.rmtree(os.path.join(workdir, checkpoint.STOPPED_DIR), ignore_errors=True)


def _resume_from_stop(workdir: str, abstract_state: Any, meta: dict[str, Any], start: loop.Position,
                      steps_per_epoch: int, method: Any) -> tuple[loop.Position, Any]:
  """(position, state) of the step SIGTERM saved in STOPPED_DIR where it is further than `start` (the newest
  epoch's checkpoint); else (start, None), and a step that is not further is removed."""
  if not _stopped_steps(workdir):
    return start, None
  stopped = checkpoint.Checkpointer(workdir, max_to_keep=1, folder=checkpoint.STOPPED_DIR, method=method)
  try:
    step, state = stopped.restore_newest_intact(abstract_state, meta, move_aside=True)
    position = _position(stopped, step, steps_per_epoch) if step else start
  except checkpoint.NoIntactCheckpoint as e:
    logging.warning('%s; resuming from the last epoch instead.', e)
    step, position = 0, start
  finally:
    stopped.close()
  if position.step <= start.step:
    _remove_stopped(workdir)
    return start, None
  return position, state


class _SavesInBackground(loop.Hook):
  """Each checkpoint written while training goes on, and its metrics.jsonl line once the checkpoint is complete: a
  crash before the line costs no metric, as the resume writes it from the checkpoint."""

  def __init__(self, ckpt: checkpoint.Checkpointer, writer: writers.Writers, meta: dict[str, Any], saved_epoch: int,
               by_step: bool):
    self._ckpt, self._writer, self._saving, self._meta, self._by_step = ckpt, writer, None, meta, by_step
    self._report_progress = writers.ProgressReport(writer.progress)
    self.saved_epoch = saved_epoch  # the newest checkpoint (its number) complete on disk
    self.stopped_at = 0  # the step that SIGTERM stopped at, saved apart (checkpoint.STOPPED_DIR)
    self.resumed_stop = 0  # the step saved apart that this run resumed from, removed once a checkpoint passes it

  def after_steps(self, step: int):
    self._report_progress(step)

  def save_point(self, epoch: int, position: loop.Position, state: Any, summary: dict[str, float]):
    self.finish()
    if summary.get('best_epoch', epoch) != epoch:  # early stopping: the last checkpoint stays the best epoch's
      self._writer.epoch.write_scalars(position.step, summary)
      self._writer.epoch.flush()
      self._passed(position.step)
      return
    started = time.perf_counter()
    key = position.step if self._by_step else epoch
    meta = {**self._meta, 'position': dataclasses.asdict(position)}
    self._ckpt.save(key, state, meta, summary=(position.step, summary), wait=False)
    self._saving = key, position.step, summary, time.perf_counter() - started

  def stop_point(self, epoch: int, position: loop.Position, state: Any, summary: dict[str, float]):
    """A run that checkpoints by step saves where SIGTERM stopped it as a step checkpoint; one that checkpoints by
    epoch saves it apart (checkpoint.STOPPED_DIR), where no epoch's checkpoint is mistaken for it."""
    if self._by_step:
      self.save_point(epoch, position, state, summary)
      return
    self.finish()
    stopped = checkpoint.Checkpointer(self._ckpt.workdir, max_to_keep=1, folder=checkpoint.STOPPED_DIR,
                                      method=self._ckpt.method)
    try:
      stopped.save(position.step, state, {**self._meta, 'position': dataclasses.asdict(position)})
    finally:
      stopped.close()
    self.stopped_at = position.step

  def _passed(self, step: int):
    """Training is past `step`, with an epoch's end recorded after it (its checkpoint, or under early stopping its
    metrics line beside the best epoch's checkpoint): the step SIGTERM saved apart there is of no more use."""
    if self.resumed_stop and step >= self.resumed_stop:
      _remove_stopped(self._ckpt.workdir)
      self.resumed_stop = 0

  def finish(self):
    """Waits for the checkpoint being written, then writes its line, whose `save_seconds` is the time training
    waited for that checkpoint: copying the state to the host, and any wait for the files."""
    if self._saving is None:
      return
    (epoch, step, summary, seconds), self._saving = self._saving, None
    started = time.perf_counter()
    self._ckpt.wait()
    self.saved_epoch = epoch
    self._passed(step)
    self._writer.epoch.write_scalars(step, {**summary, 'save_seconds': seconds + time.perf_counter() - started})
    self._writer.epoch.flush()

  def close(self):
    """However the run ends, its last checkpoint is complete (and its line written) before it returns."""
    try:
      self.finish()
    finally:
      self._writer.epoch.close()
      self._ckpt.close()


def _position(ckpt: checkpoint.Checkpointer, key: int, steps_per_epoch: int) -> loop.Position:
  """Where the checkpoint numbered `key` (0: none) left training: its record's position, or (written before
  positions were recorded) the end of epoch `key`."""
  if not key:
    return loop.Position()
  recorded = ckpt.meta(key).get('position')
  if recorded is None:
    return loop.Position(key * steps_per_epoch)
  return loop.Position(**recorded)


def train_and_evaluate(config: Any, workdir: str, *, dataset: data.Dataset | None = None, model: Any = None,
                       progress: bool | None = None, validation: data.Split | None = None,
                       init_params: Any = None) -> tuple[Any, dict[str, float]]:
  """Trains (or resumes) the ensemble that `config` (an ml_collections ConfigDict, a dict of fields) describes in
  `workdir`: the settings resolved (ensemble/recipe.py) and a resume with other data settings refused before any
  data is read, then the data read and the settings resolved against it, then `train`. `dataset` replaces the data
  the config names, `model` the model it names (a user's model object); the rest as `train`'s."""
  recipe, devices = recipe_lib.resolve(config, jax.devices(), model=model)
  check_workdir(workdir)
  records = checkpoint.Checkpointer(workdir)
  try:
    _check_resume(recipe, workdir, records)
  finally:
    records.close()
  if dataset is None:
    dataset = data.load(recipe.dataset, recipe.data_dir, recipe.train_split, recipe.test_split, task=recipe.task,
                        target=recipe.target, streaming=recipe.streaming, ignore=recipe.ignore_label)
  recipe, devices = recipe_lib.resolve(recipe, devices, model=model, dataset=dataset)
  return train(recipe, workdir, devices=devices, dataset=dataset, model=model, progress=progress,
               validation=validation, init_params=init_params)


@_releases_the_workdir
def train(recipe: Recipe, workdir: str, *, devices: list[jax.Device], dataset: data.Dataset, model: Any = None,
          progress: bool | None = None, validation: data.Split | None = None,
          init_params: Any = None) -> tuple[Any, dict[str, float]]:
  """Trains (or resumes) the ensemble of a resolved `recipe` on `devices` and `dataset` in `workdir` (what
  `ensemble.fit` calls with its arrays); returns its canonical state and last summary.

  `progress`: as `loop.train`'s; `validation`: as `loop.prepare`'s (early stopping's; default: the held-out slice);
  `init_params`: as `starts.from_variables`', for a fresh start (a resume goes on from its checkpoint); without
  them, `init_from`'s.
  """
  # Everything that can refuse the run does so before the workdir is written.
  check_workdir(workdir)
  # One process writes its checkpoints in the background while the next epoch trains; across processes, orbax's
  # saves meet at barriers, kept in the training thread.
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=recipe.checkpoints_to_keep,
                                 asynchronous=jax.process_count() == 1)
  saved_config = _check_resume(recipe, workdir, ckpt)
  run = loop.prepare(recipe, devices, dataset, model, validation=validation)
  ckpt.method = run.member.method  # how its checkpoints hold the shared parameters
  config, backend = recipe, run.backend
  ckpt_meta = {'model': config.model, 'ensemble_size': config.ensemble_size, 'data': run.data_info}

  ckpt.check_fits(backend.abstract_state(), ckpt_meta)
  if saved_config is None:  # a fresh start: what starts its members is checked before anything is written
    if config.init_noise and init_params is None and not config.init_from:
      raise UsageError(f'--config.init_noise={config.init_noise} adds noise to the start that --config.init_from '
                       'gives every member, and none is given: set --config.init_from, or leave init_noise out')
    init_params = starts.given(run, init_params)
    if init_params is not None:
      starts.variables(run, init_params)
  checkpoint.lock_workdir(workdir)  # the first write; refused while another run holds the workdir
  # A damaged checkpoint is moved aside and the epochs after the newest intact one are trained again.
  start_key, restored = ckpt.restore_newest_intact(backend.abstract_state(), ckpt_meta, move_aside=True)
  start = _position(ckpt, start_key, run.steps_per_epoch)
  best = _best_so_far(ckpt, start_key, restored) if config.early_stopping else None
  trained = _stopped_early(workdir, best, config.early_stopping) if best is not None else 0
  if trained:
    logging.info('%s stopped early: no lower validation NLL in %d epochs after epoch %d, its last checkpoint; '
                 'nothing to train (raise --config.early_stopping to train further).', workdir,
                 config.early_stopping, best.epoch)
    return restored, {**best.summary, 'best_epoch': best.epoch, 'epochs_trained': trained}
  resumed_from, resumed_stop = ckpt.path(start_key), 0
  if config.checkpoint_unit == 'epoch':  # where SIGTERM stopped the run, if past that epoch
    stop, stopped_state = _resume_from_stop(workdir, backend.abstract_state(), ckpt_meta, start, run.steps_per_epoch,
                                            run.member.method)
    if stopped_state is not None:
      start, restored, resumed_stop = stop, stopped_state, stop.step
      resumed_from = os.path.join(workdir, checkpoint.STOPPED_DIR, str(stop.step))
  start_epoch, into_epoch = start.epoch(run.steps_per_epoch)
  if start_key or resumed_stop:
    state = backend.from_canonical(restored)
    if into_epoch:
      logging.info('Resumed from %s at step %d, %d steps into epoch %d.', resumed_from, start.step,
                   into_epoch, start_epoch + 1)
    else:
      logging.info('Resumed from %s at epoch %d.', ckpt.directory, start_epoch)
  else:
    state = starts.from_variables(run, run.init(), init_params)
  if saved_config is not None:
    _log_changes(config, saved_config, workdir)

  _write_config(config, workdir, resuming=bool(start_key or resumed_stop))
  missing = _missing_summaries(ckpt, workdir, start_key, start.step)
  writer = writers.create_writers(workdir, is_main_process=jax.process_index() == 0)
  for summary_step, scalars in missing:
    writer.epoch.write_scalars(summary_step, scalars)
  writer.epoch.flush()
  if start.step >= loop.total_steps(config, run.steps_per_epoch):
    length = 'num_train_steps' if config.num_train_steps else 'num_epochs'
    logging.info('%s is already trained to epoch %d %s %d: nothing to train; raise --config.%s to train '
                 'further.', workdir, start_epoch, 'of' if start_epoch == config.num_epochs else 'beyond num_epochs =',
                 config.num_epochs, length)
  else:
    logging.info('Training %s on %s with the %s backend, %s per epoch; data: %s, %s.',
                 console.count(config.ensemble_size, 'member'), console.count(len(devices), 'device'), config.backend,
                 console.count(run.steps_per_epoch, 'step'), dataset.source, dataset.describe())
  if config.ensemble_size < len(devices):
    member_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(backend.abstract_state()))
    layout = config.member_sharding
    logging.info('Each member %s-parallel on %d devices, member_sharding=%s: %.2f MB of its state per device '
                 '(replicated: %.2f MB).', 'model' if layout == 'model' else 'data',
                 len(devices) // config.ensemble_size, layout,
                 backends.bytes_per_device(state) / 1e6, member_bytes / config.ensemble_size / 1e6)
  if config.shared_sharding == 'fsdp':
    logging.info('The shared parameters and their optimizer state split over %s (shared_sharding=fsdp): %.2f MB of '
                 'the state per device.', console.count(len(devices), 'device'), backends.bytes_per_device(state) / 1e6)
  saves = _SavesInBackground(ckpt, writer, ckpt_meta, start_key, config.checkpoint_unit == 'step')
  saves.resumed_stop = resumed_stop
  try:
    with sigterm.stop_on_sigterm():
      state, summary = loop.train(run, state, start=start, hooks=[saves], progress=progress, best=best,
                                  earlier_losses=_earlier_losses(workdir, start_epoch, run.steps_per_epoch))
  except divergence.Diverged as e:
    resume = f'resume from epoch {e.epoch - 1}' if e.epoch > 1 else 'start again'
    raise UsageError(f'{e} and re-run to {resume} (the checkpoints saved so far are kept)') from None
  except KeyboardInterrupt as e:  # the hooks have closed: the last checkpoint is complete
    saved, terminated = saves.saved_epoch, isinstance(e, sigterm.Stopped)
    by = 'on SIGTERM ' if terminated else ''
    if config.checkpoint_unit == 'step':
      kept = f'the checkpoint of step {saved} is in {ckpt.directory}' if saved else 'no step was saved yet'
      raise Interrupted(f'stopped {by}after step {saved}; {kept}', saved, terminated, 'step') from None
    if saves.stopped_at:
      step = saves.stopped_at
      epoch = step // run.steps_per_epoch + 1
      raise Interrupted(f'stopped {by}at step {step}, in epoch {epoch} of {config.num_epochs}; that step is saved in '
                        f'{os.path.join(workdir, checkpoint.STOPPED_DIR, str(step))}', step, terminated,
                        'step') from None
    where = f'in epoch {saved + 1} of {config.num_epochs}' if saved < config.num_epochs else 'after its last epoch'
    kept = f'the checkpoint of epoch {saved} is in {ckpt.directory}' if saved else 'no epoch was saved yet'
    raise Interrupted(f'stopped {by}{where}; {kept}', saved, terminated) from None
  return state, summary
