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
import time
from typing import Any

import jax
import ml_collections
from absl import logging

from ensemble import backends, checkpoint, config as config_lib, console, data, loop, writers
from ensemble import files
from ensemble.errors import UsageError


class Interrupted(KeyboardInterrupt):
  """Ctrl-C in a workdir's training, raised once its last checkpoint is complete: where the run stopped, in words.

  A KeyboardInterrupt still, so that a notebook's `ensemble.fit(workdir=...)`
  stops as it would; `python -m ensemble.train` says it in one line.
  """

  def __init__(self, message: str, saved_epoch: int):
    super().__init__(message)
    self.saved_epoch = saved_epoch


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


def _check_resume(config: ml_collections.ConfigDict, workdir: str, ckpt: checkpoint.Checkpointer) -> dict | None:
  """A workdir with checkpoints resumes only with the data settings that its config.json records; without a
  config.json that can be read, not at all (the resume would write the current config as if it were the original).
  Returns what config.json records, or None for a fresh run."""
  epochs = ckpt.epochs()
  if not epochs:
    return None
  path = os.path.join(workdir, 'config.json')
  saved = config_lib.read_run_config(
      path, f'it records how the checkpoints of epochs {epochs} in {ckpt.directory} were trained, and a resume must '
      'keep their settings: put it back from a backup (or from the workdir this one was copied from), or train in a '
      'new --workdir')
  config_lib.check_resume(config, saved, path)
  return saved


def _config_json(config: ml_collections.ConfigDict) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True)


def _log_changes(config: ml_collections.ConfigDict, saved: dict[str, Any], workdir: str):
  """Names the settings a resume changes: `config` as the run will train, filled in as the run that wrote
  config.json filled in its own, and in JSON's types as written there (a tuple is a list), against that record."""
  recorded = json.loads(_config_json(config))
  changed = {key: value for key, value in recorded.items() if key in saved and saved[key] != value}
  if changed:
    logging.info('Resuming with %s; %s keeps the settings the workdir was started with.', changed,
                 os.path.join(workdir, 'config.json'))


def _write_config(config: ml_collections.ConfigDict, workdir: str, resuming: bool):
  """config.json describes the checkpoints: written when a run starts afresh, never replaced by a resume."""
  path = os.path.join(workdir, 'config.json')
  if jax.process_index() != 0 or (resuming and os.path.exists(path)):
    return
  files.write_atomically(path, _config_json(config))


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


class _SavesInBackground(loop.Hook):
  """Each checkpoint written while training goes on, and its metrics.jsonl line once the checkpoint is complete: a
  crash before the line costs no metric, as the resume writes it from the checkpoint."""

  def __init__(self, ckpt: checkpoint.Checkpointer, writer: writers.Writers, meta: dict[str, Any], saved_epoch: int,
               by_step: bool):
    self._ckpt, self._writer, self._saving, self._meta, self._by_step = ckpt, writer, None, meta, by_step
    self._report_progress = writers.ProgressReport(writer.progress)
    self.saved_epoch = saved_epoch  # the newest checkpoint (its number) complete on disk

  def after_steps(self, step: int):
    self._report_progress(step)

  def save_point(self, epoch: int, position: loop.Position, state: Any, summary: dict[str, float]):
    self.finish()
    started = time.perf_counter()
    key = position.step if self._by_step else epoch
    meta = {**self._meta, 'position': dataclasses.asdict(position)}
    self._ckpt.save(key, state, meta, summary=(position.step, summary), wait=False)
    self._saving = key, position.step, summary, time.perf_counter() - started

  def finish(self):
    """Waits for the checkpoint being written, then writes its line, whose `save_seconds` is the time training
    waited for that checkpoint: copying the state to the host, and any wait for the files."""
    if self._saving is None:
      return
    (epoch, step, summary, seconds), self._saving = self._saving, None
    started = time.perf_counter()
    self._ckpt.wait()
    self.saved_epoch = epoch
    self._writer.epoch.write_scalars(step, {**summary, 'save_seconds': seconds + time.perf_counter() - started})
    self._writer.epoch.flush()

  def close(self):
    """However the run ends, its last checkpoint is complete (and its line written) before it returns."""
    try:
      self.finish()
    finally:
      self._writer.epoch.close()
      self._ckpt.close()


def _position(ckpt: checkpoint.Checkpointer, key: int, config: ml_collections.ConfigDict,
              steps_per_epoch: int) -> loop.Position:
  """Where the checkpoint numbered `key` (0: none) left training: its record's position, or (written before
  positions were recorded) the end of epoch `key`."""
  if not key:
    return loop.Position()
  recorded = ckpt.meta(key).get('position')
  if recorded is None:
    return loop.Position(key * steps_per_epoch)
  return loop.Position(**recorded)


@_releases_the_workdir
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, dataset: data.Dataset | None = None,
                       model: Any = None, progress: bool | None = None) -> tuple[Any, dict[str, float]]:
  """Trains (or resumes) the ensemble in `workdir`; returns its canonical state and last summary.

  `dataset` replaces the data `config` names (arrays in memory), `model` the
  model it names (a user's model object). `progress`: as `loop.train`'s.
  """
  config, devices = config_lib.resolve(config, jax.devices(), model)
  # Everything that can refuse the run does so before the workdir is written; a resume with other data
  # settings before any data is read.
  # One process writes its checkpoints in the background while the next epoch trains; across processes, orbax's
  # saves meet at barriers, kept in the training thread.
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=config.checkpoints_to_keep,
                                 asynchronous=jax.process_count() == 1)
  saved_config = _check_resume(config, workdir, ckpt)
  if dataset is None:
    dataset = data.load(config.dataset, config.data_dir, config.train_split, config.test_split,
                        task=config.get('task', 'classification'), target=config.get('target', ''),
                        streaming=config.get('streaming', 'never'))
  run = loop.prepare(config, dataset, model, devices=devices)
  config, backend = run.config, run.backend
  ckpt_meta = {'model': config.model, 'ensemble_size': config.ensemble_size, 'data': run.data_info}

  ckpt.check_fits(backend.abstract_state(), ckpt_meta)
  checkpoint.lock_workdir(workdir)  # the first write; refused while another run holds the workdir
  # A damaged checkpoint is moved aside and the epochs after the newest intact one are trained again.
  start_key, restored = ckpt.restore_newest_intact(backend.abstract_state(), ckpt_meta, move_aside=True)
  start = _position(ckpt, start_key, config, run.steps_per_epoch)
  start_epoch, into_epoch = start.epoch(run.steps_per_epoch)
  if start_key:
    state = backend.from_canonical(restored)
    if into_epoch:
      logging.info('Resumed from %s at step %d, %d steps into epoch %d.', ckpt.path(start_key), start.step,
                   into_epoch, start_epoch + 1)
    else:
      logging.info('Resumed from %s at epoch %d.', ckpt.directory, start_epoch)
  else:
    state = run.init()
  if saved_config is not None:
    _log_changes(config, saved_config, workdir)

  _write_config(config, workdir, resuming=bool(start_key))
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
    layout = config.get('member_sharding', 'replicated')
    logging.info('Each member %s-parallel on %d devices, member_sharding=%s: %.2f MB of its state per device '
                 '(replicated: %.2f MB).', 'model' if layout == 'model' else 'data',
                 len(devices) // config.ensemble_size, layout,
                 backends.bytes_per_device(state) / 1e6, member_bytes / config.ensemble_size / 1e6)
  saves = _SavesInBackground(ckpt, writer, ckpt_meta, start_key, config_lib.checkpoint_unit(config) == 'step')
  try:
    state, summary = loop.train(run, state, start=start, hooks=[saves], progress=progress)
  except loop.Diverged as e:
    resume = f'resume from epoch {e.epoch - 1}' if e.epoch > 1 else 'start again'
    raise UsageError(f'{e} and re-run to {resume} (the checkpoints saved so far are kept)') from None
  except KeyboardInterrupt:  # the hooks have closed: the last checkpoint is complete
    saved = saves.saved_epoch
    if config_lib.checkpoint_unit(config) == 'step':
      kept = f'the checkpoint of step {saved} is in {ckpt.directory}' if saved else 'no step was saved yet'
      raise Interrupted(f'stopped after step {saved}; {kept}', saved) from None
    where = f'in epoch {saved + 1} of {config.num_epochs}' if saved < config.num_epochs else 'after its last epoch'
    kept = f'the checkpoint of epoch {saved} is in {ckpt.directory}' if saved else 'no epoch was saved yet'
    raise Interrupted(f'stopped {where}; {kept}', saved) from None
  return state, summary
