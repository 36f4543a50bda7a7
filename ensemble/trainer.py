"""The training loop: data -> backend step -> clu metrics -> writers and checkpoints."""

import functools
import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from ensemble import backends, checkpoint, config as config_lib, data, distributed, metrics, writers
from ensemble import console, devices as devices_lib, files, host_memory
from ensemble.errors import UsageError


def evaluate(backend, state, split: data.Split, batch_size: int, task: Any) -> dict[str, Any]:
  """The `task`'s ensemble and member metrics over the whole split, each example counted once.

  Each process feeds only its rows of every batch; the outputs cover whole batches.
  """
  outputs, masks = [], []
  rows = distributed.process_rows(backend.devices, batch_size)
  for images, labels, mask in data.eval_batches(split, batch_size, rows):
    outputs.append(backend.eval_step(state, images, labels))
    masks.append(mask)
  outputs = jax.tree.map(lambda *xs: np.concatenate(xs, axis=-1), *backend.to_host(outputs))
  # The ensemble outputs are the same on every member; member 0's copy is enough.
  outputs = {k: v[0] if k.startswith('ensemble_') else v.T for k, v in outputs.items()}
  return metrics.BY_TASK[task.name].eval.single_from_model_output(**outputs, mask=np.concatenate(masks)).compute()


def _epoch_summary(train: dict[str, Any], test: dict[str, Any], epoch: int, train_seconds: float,
                   test_seconds: float, task: Any) -> dict[str, float]:
  """The line metrics.jsonl gets for `epoch`, but its checkpoint's save time (known only after the save).

  `train_seconds` is its training time (the first epoch's compiles too),
  `test_seconds` its test pass's: with `save_seconds`, where an epoch's time goes.
  """
  summary = {'epoch': epoch, 'train_seconds': train_seconds, 'test_seconds': test_seconds,
             **task.summary(train, test)}
  return {k: float(v) for k, v in summary.items()}


def _standardise_targets(dataset: data.Dataset, train_split: data.Split):
  """Regression: (train split, test split, (mean, std)) with targets standardised by the training split's
  per-target mean and standard deviation (a constant target's taken as 1); classification: as they are."""
  if dataset.task != 'regression':
    return train_split, dataset.test, None
  targets = train_split['label'].astype(np.float64)
  mean, std = targets.mean(0), targets.std(0)
  std = np.where(std > 0, std, 1.0)
  scale = lambda split: {**split, 'label': ((split['label'] - mean) / std).astype(np.float32)}
  return scale(train_split), scale(dataset.test), (mean, std)


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


def _check_resume(config: ml_collections.ConfigDict, workdir: str, ckpt: checkpoint.Checkpointer):
  """A workdir with checkpoints resumes only with the data settings that its config.json records; without a
  config.json that can be read, not at all (the resume would write the current config as if it were the original)."""
  epochs = ckpt.epochs()
  if not epochs:
    return
  path = os.path.join(workdir, 'config.json')
  saved = config_lib.read_run_config(
      path, f'it records how the checkpoints of epochs {epochs} in {ckpt.directory} were trained, and a resume must '
      'keep their settings: put it back from a backup (or from the workdir this one was copied from), or train in a '
      'new --workdir')
  config_lib.check_resume(config, saved, path)
  changed = {key: value for key, value in config.to_dict().items() if key in saved and saved[key] != value}
  if changed:
    logging.info('Resuming with %s; %s keeps the settings the workdir was started with.', changed, path)


def _write_config(config: ml_collections.ConfigDict, workdir: str, resuming: bool):
  """config.json describes the checkpoints: written when a run starts afresh, never replaced by a resume."""
  path = os.path.join(workdir, 'config.json')
  if jax.process_index() != 0 or (resuming and os.path.exists(path)):
    return
  files.write_atomically(path, json.dumps(config.to_dict(), indent=2, sort_keys=True))


def _split_off_heldout(config: ml_collections.ConfigDict, dataset: data.Dataset,
                       devices: list[jax.Device]) -> tuple[data.Split, int]:
  """The training split without its held-out slice, and its size, once the split sizes are checked against the
  config; `config.eval_batch_size` at most the test set's size (rounded up to split over the devices), so that
  its one batch is not padded to many times its size."""
  train_split, heldout = data.hold_out(dataset.train, config.heldout_fraction)
  num_train, num_test = len(train_split['label']), len(dataset.test['label'])
  if config.heldout_fraction and not len(heldout['label']):
    raise UsageError(f'heldout_fraction={config.heldout_fraction} of the {num_train} training examples holds out '
                     f'none; set --config.heldout_fraction to at least {1 / num_train:.2g}, or to 0 to hold out '
                     'nothing')
  if config.batch_size > num_train:
    raise UsageError(f'batch_size={config.batch_size} exceeds the {num_train} training examples; '
                     'lower --config.batch_size')
  fitting = -(-num_test // len(devices)) * len(devices)
  if config.eval_batch_size > fitting:
    logging.info('Evaluating in batches of %d, the %d test examples, not of eval_batch_size=%d.', fitting, num_test,
                 config.eval_batch_size)
    config.eval_batch_size = fitting
  return train_split, num_train


def _missing_summaries(ckpt: checkpoint.Checkpointer, workdir: str, start_epoch: int) -> list[tuple[int, dict]]:
  """(step, scalars) of the checkpointed epochs that metrics.jsonl lacks, read from their checkpoints.

  A crash between a checkpoint and its line loses the line, and resuming starts
  after that epoch. Lines of epochs after `start_epoch` (their checkpoints were
  damaged) are dropped; those epochs are trained again.
  """
  if jax.process_index() != 0:
    return []
  written = writers.drop_epochs_after(os.path.join(workdir, 'metrics.jsonl'), start_epoch)
  summaries = [ckpt.summary(epoch) for epoch in ckpt.epochs() if epoch <= start_epoch and epoch not in written]
  return [summary for summary in summaries if summary is not None]


def _stop_if_diverged(losses: np.ndarray, config: ml_collections.ConfigDict, epoch: int, step: int):
  """Ends the run once a member's training loss is NaN or infinite: its state must not reach a checkpoint.

  `losses` is (K, S): the S steps that ended at `step`, as every process sees them.
  """
  finite = np.isfinite(losses.reshape(config.ensemble_size, -1))
  if finite.all():
    return
  first = step - finite.shape[1] + 1 + int(np.argmin(finite.all(0)))
  members = np.flatnonzero(~finite.all(1)).tolist()
  _diverged(config, epoch, first, f'members {members} have a non-finite training loss')


def _diverged(config: ml_collections.ConfigDict, epoch: int, step: int, what: str):
  resume = f'resume from epoch {epoch - 1}' if epoch > 1 else 'start again'
  raise UsageError(f'training diverged in epoch {epoch} at step {step}: {what}; lower --config.learning_rate '
                   f'(now {config.learning_rate}) or --config.momentum (now {config.momentum}) and re-run to '
                   f'{resume} (the checkpoints saved so far are kept)')


class _SavesInBackground:
  """Each epoch's checkpoint written while the next epoch trains, and the epoch's metrics.jsonl line once the
  checkpoint is complete: a crash before the line costs no metric, as the resume writes it from the checkpoint."""

  def __init__(self, ckpt: checkpoint.Checkpointer, writer: writers.Writers):
    self._ckpt, self._writer, self._saving = ckpt, writer, None

  def save(self, epoch: int, state: Any, meta: dict[str, Any], step: int, summary: dict[str, float]):
    self.finish()
    started = time.perf_counter()
    self._ckpt.save(epoch, state, meta, summary=(step, summary), wait=False)
    self._saving = step, summary, time.perf_counter() - started

  def finish(self):
    """Waits for the checkpoint being written, then writes its line, whose `save_seconds` is the time training
    waited for that checkpoint: copying the state to the host, and any wait for the files."""
    if self._saving is None:
      return
    (step, summary, seconds), self._saving = self._saving, None
    started = time.perf_counter()
    self._ckpt.wait()
    self._writer.epoch.write_scalars(step, {**summary, 'save_seconds': seconds + time.perf_counter() - started})
    self._writer.epoch.flush()

  def close(self):
    """However the run ends, its last checkpoint is complete (and its line written) before it returns."""
    try:
      self.finish()
    finally:
      self._writer.epoch.close()
      self._ckpt.close()


@_releases_the_workdir
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, dataset: data.Dataset | None = None,
                       model: Any = None, progress: bool | None = None) -> tuple[Any, dict[str, float]]:
  """Trains (or resumes) the ensemble in `workdir`; returns its canonical state and last summary.

  The one loop under `python -m ensemble.train` and `ensemble.fit`: `dataset`
  replaces the data `config` names (arrays in memory), `model` the model it
  names (a user's model object). `progress=True` shows a bar (on a terminal
  or in a notebook) and writes a line per epoch, `False` neither; by default
  the bar shows on a terminal at absl's INFO verbosity and the lines are logged.
  """
  config, devices = config_lib.resolve(config, jax.devices(), model)
  devices_lib.compilation_cache(config.get('compilation_cache', 'auto'))
  # On CPU, XLA's buffers come from malloc: kept mapped, steps stop page-faulting (as the programs do at start-up).
  host_memory.keep_freed_memory_on_cpu()
  # Everything that can refuse the run does so before the workdir is written; a resume with other data
  # settings before any data is read.
  # One process writes its checkpoints in the background while the next epoch trains; across processes, orbax's
  # saves meet at barriers, kept in the training thread.
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=config.checkpoints_to_keep,
                                 asynchronous=jax.process_count() == 1)
  _check_resume(config, workdir, ckpt)
  if dataset is None:
    dataset = data.load(config.dataset, config.data_dir, config.train_split, config.test_split,
                        task=config.get('task', 'classification'), target=config.get('target', ''))
  if config.get('inputs', 'auto') not in ('auto', dataset.inputs):
    raise UsageError(f'{dataset.source} holds {dataset.inputs}, not {config.inputs}: set --config.inputs=auto')
  if dataset.task != config.get('task', 'classification'):
    raise UsageError(f'{dataset.source} holds {dataset.task} data but task={config.get("task", "classification")!r}: '
                     f'set --config.task={dataset.task}')
  train_split, num_train = _split_off_heldout(config, dataset, devices)
  train_split, test_split, target_stats = _standardise_targets(dataset, train_split)
  steps_per_epoch = data.steps_per_epoch(num_train, config.batch_size)
  stats = data.input_stats(train_split['image'], dataset.inputs, config.get('standardize_features', False))
  # A regression member gives a mean and a raw scale per target.
  outputs = 2 * dataset.num_classes if target_stats else dataset.num_classes
  data_info = config_lib.data_info(dataset.image_shape, outputs, *stats, inputs=dataset.inputs,
                                   target_stats=target_stats)
  member = config_lib.member(config, data_info, steps_per_epoch, model)
  # The mesh backends' models are the package's own, built for their mesh (backends/sharded.py).
  num_classes = (outputs if config.backend in backends.MESH_MODELS
                 else config_lib.check_model(member, outputs, config.method))
  if num_classes != outputs:  # a user's model with more outputs than the training labels use
    data_info = {**data_info, 'num_classes': num_classes}
    member = config_lib.member(config, data_info, steps_per_epoch, model)
  backend = backends.create(config.backend, member=member, devices=devices, ensemble_size=config.ensemble_size,
                            member_data=config.member_data, config=config)
  ckpt_meta = {'model': config.model, 'ensemble_size': config.ensemble_size, 'data': data_info}

  ckpt.check_fits(backend.abstract_state(), ckpt_meta)
  checkpoint.lock_workdir(workdir)  # the first write; refused while another run holds the workdir
  # A damaged checkpoint is moved aside and the epochs after the newest intact one are trained again.
  start_epoch, restored = ckpt.restore_newest_intact(backend.abstract_state(), ckpt_meta, move_aside=True)
  if start_epoch:
    state = backend.from_canonical(restored)
    logging.info('Resumed from %s at epoch %d.', ckpt.directory, start_epoch)
  else:
    state = backend.init(config.seed)

  _write_config(config, workdir, resuming=bool(start_epoch))
  missing = _missing_summaries(ckpt, workdir, start_epoch)
  writer = writers.create_writers(workdir, is_main_process=jax.process_index() == 0)
  for summary_step, scalars in missing:
    writer.epoch.write_scalars(summary_step, scalars)
  writer.epoch.flush()
  report_progress = writers.ProgressReport(writer.progress)
  logging.info('Training %d members on %d devices with the %s backend, %d steps per epoch; data: %s, %s.',
               config.ensemble_size, len(devices), config.backend, steps_per_epoch, dataset.source, dataset.describe())
  if config.ensemble_size < len(devices):
    member_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(backend.abstract_state()))
    layout = config.get('member_sharding', 'replicated')
    logging.info('Each member %s-parallel on %d devices, member_sharding=%s: %.2f MB of its state per device '
                 '(replicated: %.2f MB).', 'model' if layout == 'model' else 'data',
                 len(devices) // config.ensemble_size, layout,
                 backends.bytes_per_device(state) / 1e6, member_bytes / config.ensemble_size / 1e6)

  # The fast path keeps the training set on the devices and runs several steps per dispatch.
  resident = backend.put_dataset(train_split) if config.steps_per_dispatch else None
  steps_per_dispatch = config.steps_per_dispatch or 1
  step, summary = start_epoch * steps_per_epoch, {}
  saves = _SavesInBackground(ckpt, writer)
  try:
    for epoch in range(start_epoch + 1, config.num_epochs + 1):
      indices = data.train_batch_indices(num_train, config.batch_size, config.seed, epoch,
                                         config.ensemble_size, config.member_data)
      train_outputs = []
      progress_bar = console.Progress(steps_per_epoch, f'epoch {epoch}/{config.num_epochs}',
                                      items_per_step=config.batch_size * config.ensemble_size,
                                      bar=None if progress is None else progress and console.interactive())
      started = time.perf_counter()
      for start in range(0, len(indices), steps_per_dispatch):
        chunk = indices[start:start + steps_per_dispatch]
        with jax.profiler.StepTraceAnnotation('train', step_num=step):
          state, chunk_metrics = backends.train_chunk(backend, state, train_split, resident, chunk)
        # Block on every dispatch: with several simulated CPU devices, a deep queue of
        # in-flight multi-device programs starves XLA's collective rendezvous and
        # aborts the process; waiting here costs no throughput (docs/backends-and-devices.md, "Many devices on a CPU").
        # Fetching the metrics waits, and lets a diverged member stop the run at once.
        train_outputs.append(backend.to_host(chunk_metrics))
        step += len(chunk)
        _stop_if_diverged(train_outputs[-1]['loss'], config, epoch, step)
        report_progress(step)
        progress_bar.update(len(chunk), chunk_metrics)
      train_outputs = jax.tree.map(
          lambda *xs: np.concatenate([x.reshape(config.ensemble_size, -1) for x in xs], axis=1), *train_outputs)
      train_seconds = time.perf_counter() - started
      train = metrics.BY_TASK[member.task.name].train.single_from_model_output(**train_outputs).compute()
      started = time.perf_counter()
      test = evaluate(backend, state, test_split, config.eval_batch_size, member.task)
      summary = _epoch_summary(train, test, epoch, train_seconds, time.perf_counter() - started, member.task)
      canonical = backend.to_canonical(state)
      nonfinite = checkpoint.nonfinite_members(canonical, config.ensemble_size)
      if nonfinite:
        _diverged(config, epoch, step, f'members {nonfinite} have non-finite parameters')
      saves.save(epoch, canonical, ckpt_meta, step, summary)
      console.log_epoch(summary, config.num_epochs, progress_bar.close(), echo=bool(progress),
                        num_classes=dataset.num_classes if dataset.task == 'classification' else None)
  finally:
    saves.close()
  return backend.to_canonical(state), summary
