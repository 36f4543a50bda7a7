"""The training loop: data -> backend step -> clu metrics -> writers and checkpoints."""

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import periodic_actions

from ensemble import backends, checkpoint, config as config_lib, data, distributed, metrics, writers
from ensemble import console
from ensemble.errors import UsageError


def evaluate(backend, state, split: data.Split, batch_size: int) -> dict[str, Any]:
  """Ensemble and member metrics over the whole split, each example counted once.

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
  return metrics.EvalMetrics.single_from_model_output(**outputs, mask=np.concatenate(masks)).compute()


def _epoch_summary(train: dict[str, Any], test: dict[str, Any], epoch: int) -> dict[str, float]:
  summary = {'epoch': epoch,
             'train_loss': train['loss'], 'train_accuracy': train['accuracy'],
             'test_loss': test['loss'], 'test_accuracy': test['accuracy']}
  for i, (loss, accuracy) in enumerate(zip(test['member_loss'], test['member_accuracy'])):
    summary[f'member_test_loss/{i}'] = loss
    summary[f'member_test_accuracy/{i}'] = accuracy
  return {k: float(v) for k, v in summary.items()}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> tuple[Any, dict[str, float]]:
  """Trains (or resumes) the ensemble in `workdir`; returns its canonical state and last summary."""
  config, devices = config_lib.resolve(config, jax.devices())
  dataset = data.load(config.dataset, config.data_dir, config.train_split, config.test_split)
  train_split, _ = data.hold_out(dataset.train, config.heldout_fraction)
  num_train = len(train_split['label'])
  if config.batch_size > num_train:
    raise UsageError(f'batch_size={config.batch_size} exceeds the {num_train} training examples; '
                     'lower --config.batch_size')
  steps_per_epoch = data.steps_per_epoch(num_train, config.batch_size)
  data_info = config_lib.data_info(dataset.image_shape, dataset.num_classes, *data.channel_stats(train_split['image']))
  member = config_lib.member(config, data_info, steps_per_epoch)
  backend = backends.create(config.backend, member=member, devices=devices, ensemble_size=config.ensemble_size,
                            member_data=config.member_data, config=config)
  ckpt_meta = {'model': config.model, 'ensemble_size': config.ensemble_size, 'data': data_info}

  # Everything that can refuse the run does so before the workdir is written.
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=config.checkpoints_to_keep)
  start_epoch = ckpt.latest_epoch() or 0
  if start_epoch:
    state = backend.from_canonical(ckpt.restore(start_epoch, backend.abstract_state(), ckpt_meta))
    logging.info('Resumed from %s at epoch %d.', ckpt.directory, start_epoch)
  else:
    state = backend.init(config.seed)

  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      json.dump(config.to_dict(), f, indent=2, sort_keys=True)
  writer = writers.create_writers(workdir, is_main_process=jax.process_index() == 0)
  report_progress = periodic_actions.ReportProgress(
      num_train_steps=config.num_epochs * steps_per_epoch, writer=writer.progress)
  logging.info('Training %d members on %d devices with the %s backend, %d steps per epoch; data: %s, '
               '%d classes, images %s.', config.ensemble_size, len(devices), config.backend, steps_per_epoch,
               dataset.source, dataset.num_classes, 'x'.join(map(str, dataset.image_shape)))

  # The fast path keeps the training set on the devices and runs several steps per dispatch.
  resident = backend.put_dataset(train_split) if config.steps_per_dispatch else None
  steps_per_dispatch = config.steps_per_dispatch or 1
  step, summary = start_epoch * steps_per_epoch, {}
  for epoch in range(start_epoch + 1, config.num_epochs + 1):
    indices = data.train_batch_indices(num_train, config.batch_size, config.seed, epoch,
                                       config.ensemble_size, config.member_data)
    train_outputs = []
    progress = console.Progress(steps_per_epoch, f'epoch {epoch}/{config.num_epochs}',
                                items_per_step=config.batch_size * config.ensemble_size)
    for start in range(0, len(indices), steps_per_dispatch):
      chunk = indices[start:start + steps_per_dispatch]
      with jax.profiler.StepTraceAnnotation('train', step_num=step):
        state, chunk_metrics = backends.train_chunk(backend, state, train_split, resident, chunk)
      # Block on every dispatch: with several simulated CPU devices, a deep queue of
      # in-flight multi-device programs starves XLA's collective rendezvous and
      # aborts the process; waiting here costs no throughput (DEVELOPERS.md).
      train_outputs.append(jax.block_until_ready(chunk_metrics))
      step += len(chunk)
      report_progress(step)
      progress.update(len(chunk), chunk_metrics)
    train_outputs = jax.tree.map(
        lambda *xs: np.concatenate([x.reshape(config.ensemble_size, -1) for x in xs], axis=1),
        *backend.to_host(train_outputs))
    train = metrics.TrainMetrics.single_from_model_output(**train_outputs).compute()
    test = evaluate(backend, state, dataset.test, config.eval_batch_size)
    summary = _epoch_summary(train, test, epoch)
    # Checkpoint first: a crash between the two repeats this epoch on resume rather than losing it.
    ckpt.save(epoch, backend.to_canonical(state), ckpt_meta)
    writer.epoch.write_scalars(step, summary)
    writer.epoch.flush()
    console.log_epoch(summary, config.num_epochs, progress.close())
  writer.epoch.close()
  ckpt.close()
  return backend.to_canonical(state), summary
