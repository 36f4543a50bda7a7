"""The training loop end to end, in process: metrics, resume, checkpoints across backends."""

import functools
import json
import logging
import os

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from ensemble import backends, checkpoint, data, loop, members as members_lib, recipe as recipe_lib, trainer, writers
from ensemble.errors import UsageError

from conftest import MNIST_INFO, timeless


def _params(state):
  return jax.tree.map(np.asarray, state.params)


def _snapshot(workdir):
  """Every file under workdir with its size and mtime, to prove nothing was written."""
  return {os.path.join(root, f): (os.stat(os.path.join(root, f)).st_size,
                                  os.stat(os.path.join(root, f)).st_mtime_ns)
          for root, _, files in os.walk(workdir) for f in files}


class _Scalars:
  def __init__(self):
    self.written = []

  def write_scalars(self, step, scalars):
    self.written.append((step, scalars))

  def flush(self):
    pass


def test_progress_report_writes_steps_per_second_once_its_interval_has_passed(monkeypatch):
  clock = iter([100.0, 100.0, 130.0, 161.0])
  monkeypatch.setattr(writers.time, 'monotonic', lambda: next(clock))
  scalars = _Scalars()
  report = writers.ProgressReport(scalars, every_secs=60.0)
  report(10)  # the first call sets the origin
  report(40)  # 30 s on: not yet
  report(71)  # 61 s on: 61 steps in 61 s
  assert scalars.written == [(71, {'steps_per_sec': 1.0, 'uptime': 61.0})]


def test_metrics_jsonl_and_checkpoints(make_config, tmp_path, monkeypatch):
  workdir = str(tmp_path / 'run')
  events = []

  def recording(fn, event):
    def recorded(*args, **kwargs):
      events.append(event(*args, **kwargs))
      return fn(*args, **kwargs)
    return recorded

  monkeypatch.setattr(backends, 'train_chunk', recording(backends.train_chunk, lambda *_: 'train'))
  monkeypatch.setattr(checkpoint.Checkpointer, 'save',
                      recording(checkpoint.Checkpointer.save, lambda _, epoch, *__, **___: f'save {epoch}'))
  monkeypatch.setattr(checkpoint.Checkpointer, 'wait',
                      recording(checkpoint.Checkpointer.wait, lambda ckpt: f'wait for {ckpt._in_flight}'))
  _, summary = trainer.train_and_evaluate(make_config(num_epochs=2, eval_batch_size=1000), workdir)
  # Epoch 1's checkpoint is written while epoch 2 trains: the trainer waits for it after epoch 2's steps, and for
  # epoch 2's before it returns.
  steps = events.count('train') // 2
  assert steps == 8  # 256 examples in batches of 32: every step goes through backends.train_chunk
  assert [e for e in events if e != 'wait for None'] == (
      ['train'] * steps + ['save 1'] + ['train'] * steps + ['wait for 1', 'save 2', 'wait for 2'])
  lines = writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  assert [line['epoch'] for line in lines] == [1, 2]
  for key in ('train_loss', 'train_accuracy', 'test_loss', 'test_accuracy'):
    assert all(np.isfinite(line[key]) for line in lines)
  assert len(lines[-1]['member_test_accuracy']) == 8
  assert lines[-1]['test_accuracy'] == summary['test_accuracy']
  assert lines[-1]['train_loss'] < lines[0]['train_loss']
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['1', '2']
  # TensorBoard reads the same scalars, per member too (the events are written without TensorFlow).
  events = event_accumulator.EventAccumulator(workdir)
  events.Reload()
  for tag, value in (('test_accuracy', lines[-1]['test_accuracy']), ('train_loss', lines[-1]['train_loss']),
                     ('member_test_accuracy/7', lines[-1]['member_test_accuracy'][7])):
    assert [(e.step, e.value) for e in events.Scalars(tag)][-1] == (lines[-1]['step'], pytest.approx(value, rel=1e-6))
  assert [e.step for e in events.Scalars('epoch')] == [line['step'] for line in lines]
  config = json.load(open(os.path.join(workdir, 'config.json')))
  # The 100 test examples are one batch, not padded to 1000: a multiple of the 8 devices.
  assert config['ensemble_size'] == 8 and config['eval_batch_size'] == 104


# A ResNet with BatchNorm, per-member augmentation, AdamW and weight decay. (A schedule spans num_epochs, so a
# run resumed with more epochs than it started with follows another schedule; tests/test_optim.py covers them.)
RESNET = dict(model='resnet', resnet_depth=8, augment='crop_flip', optimizer='adamw', learning_rate=1e-3,
              weight_decay=5e-4, member_data='shuffled')


# Two ResNet members: their batch statistics, augmentation and data order are each member's own, which 8 would repeat
# at 4 times the cost (the CNN's case resumes 8).
@pytest.mark.parametrize('recipe, epochs', [({}, 3), ({**RESNET, 'ensemble_size': 2}, 2)], ids=['cnn', 'resnet'])
def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(make_config, tmp_path, recipe, epochs):
  straight, _ = trainer.train_and_evaluate(make_config(num_epochs=epochs, **recipe), str(tmp_path / 'a'))
  trainer.train_and_evaluate(make_config(num_epochs=1, **recipe), str(tmp_path / 'b'))
  resumed, _ = trainer.train_and_evaluate(make_config(num_epochs=epochs, **recipe), str(tmp_path / 'b'))
  # Same placement, same programs: the resumed run must match to the last bit, batch statistics and keys too.
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), _params(straight))
  jax.tree.map(np.testing.assert_array_equal, (resumed.batch_stats, resumed.key), (straight.batch_stats, straight.key))
  a = writers.read_jsonl(str(tmp_path / 'a' / 'metrics.jsonl'))
  b = writers.read_jsonl(str(tmp_path / 'b' / 'metrics.jsonl'))
  assert [line['epoch'] for line in b] == list(range(1, epochs + 1))
  for line_a, line_b in zip(a, b):
    assert line_a.keys() == line_b.keys()
    assert all(line[key] > 0 for line in (line_a, line_b) for key in ('train_seconds', 'test_seconds', 'save_seconds'))
  assert timeless(a) == timeless(b)


def _logged(caplog, text: str) -> list[str]:
  return [record.getMessage() for record in caplog.records if text in record.getMessage()]


def test_a_resume_names_only_what_changed_and_a_finished_run_says_nothing_was_left(make_config, tmp_path, caplog):
  """Issue 56: config.json's lists against the config's tuples, and a test batch lowered to the test set's size,
  were reported as changed on every resume; a run resumed at its last epoch ended in "Done" as if it had trained."""
  workdir = str(tmp_path / 'run')
  settings = dict(ensemble_size=2, num_devices=2, eval_batch_size=1000)
  trainer.train_and_evaluate(make_config(**settings), workdir)
  with caplog.at_level(logging.INFO, logger='absl'):  # whatever verbosity an earlier test left absl at
    trainer.train_and_evaluate(make_config(**settings), workdir)
    assert not _logged(caplog, 'Resuming with') and not _logged(caplog, 'Training 2 members')
    assert _logged(caplog, 'already trained to epoch 1 of 1: nothing to train; raise --config.num_epochs')
    caplog.clear()
    trainer.train_and_evaluate(make_config(num_epochs=2, **settings), workdir)
  assert [message.split(';')[0] for message in _logged(caplog, 'Resuming with')] == [
      "Resuming with {'num_epochs': 2}"]
  assert not _logged(caplog, 'nothing to train') and _logged(caplog, 'Training 2 members on 2 devices')
  assert [line['epoch'] for line in writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))] == [1, 2]


@pytest.mark.parametrize('backend', ['pmap', 'jit'])
@pytest.mark.parametrize('num_devices, members', [(1, recipe_lib.ONE_DEVICE_MEMBERS), (2, 2), (8, 8)])
def test_the_default_ensemble_size_is_a_member_per_device_or_several_on_one(make_config, backend, num_devices,
                                                                             members):
  """Issue 56: ensemble_size=0 meant one member per device, which on one device is no ensemble."""
  config, devices = recipe_lib.resolve(make_config(ensemble_size=0, backend=backend, num_devices=num_devices),
                                       jax.devices())
  assert config.ensemble_size == members > 1 and len(devices) == num_devices
  backend = backends.create(backend, member=members_lib.member(config, MNIST_INFO), devices=devices,
                            ensemble_size=config.ensemble_size, member_data=config.member_data, config=config)
  assert jax.tree.leaves(backend.abstract_state())[0].shape[0] == members  # placed: the canonical (K, ...) state


def _restore_and_evaluate(config, workdir, backend_name, num_devices):
  """Restores the latest checkpoint onto `num_devices` devices and evaluates it there."""
  config, devices = recipe_lib.resolve(config.copy_and_resolve_references(), jax.devices()[:num_devices])
  ckpt = checkpoint.Checkpointer(workdir)
  member = members_lib.member(config, ckpt.meta(ckpt.latest_epoch())['data'])
  backend = backends.create(backend_name, member=member, devices=devices, ensemble_size=8, member_data='shared')
  state = ckpt.restore(ckpt.latest_epoch(), backend.abstract_state(), {'model': config.model, 'ensemble_size': 8})
  test = loop.evaluate(backend, backend.from_canonical(state), data.load(data_dir=config.data_dir).test,
                       config.eval_batch_size, member.task)
  return state, test


@pytest.mark.parametrize('backend, num_devices, recipe, continues', [
    ('jit', 4, {}, True), ('pmap', 1, {}, True), ('jit', 2, RESNET, False)],
    ids=['cnn-jit4', 'cnn-pmap1', 'resnet-jit2'])
def test_checkpoint_moves_between_backends_and_device_counts(make_config, tmp_path, backend, num_devices, recipe,
                                                             continues):
  """pmap on 8 devices writes a checkpoint; another backend on fewer devices restores and continues it.

  The ResNet's checkpoint (with its batch statistics) is restored and scored elsewhere; that its members then
  train alike on any placement is test_backends' augmented ResNet test.
  """
  make_config = functools.partial(make_config, **recipe)
  workdir = str(tmp_path / 'run')
  saved, summary = trainer.train_and_evaluate(make_config(), workdir)
  restored, test = _restore_and_evaluate(make_config(), workdir, backend, num_devices)
  jax.tree.map(np.testing.assert_array_equal, _params(restored), _params(saved))
  jax.tree.map(np.testing.assert_array_equal, restored.batch_stats, saved.batch_stats)
  np.testing.assert_allclose(test['loss'], summary['test_loss'], rtol=1e-5)
  np.testing.assert_allclose(test['member_accuracy'],
                             [summary[f'member_test_accuracy/{i}'] for i in range(8)], rtol=1e-5)
  if not continues:
    return
  continued, _ = trainer.train_and_evaluate(
      make_config(num_epochs=2, backend=backend, num_devices=num_devices), workdir)
  reference, _ = trainer.train_and_evaluate(make_config(num_epochs=2), str(tmp_path / 'ref'))
  # Eight more SGD steps on another placement: round-off differences of ~1e-7 per
  # convolution grow to ~1e-5; a wrong restore or data order would differ by ~1e-2.
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4),
               _params(continued), _params(reference))


@pytest.mark.parametrize('override, message', [
    ({'ensemble_size': 16}, 'holds ensemble_size=8 but the config asks for ensemble_size=16'),
    ({'ensemble_size': 16, 'num_devices': 4, 'backend': 'jit'}, 'holds ensemble_size=8'),
])
def test_a_checkpoint_that_does_not_fit_is_refused_and_nothing_is_overwritten(
    make_config, tmp_path, override, message):
  workdir = str(tmp_path / 'run')
  trainer.train_and_evaluate(make_config(), workdir)
  before = _snapshot(workdir)
  with pytest.raises(UsageError, match=message):
    trainer.train_and_evaluate(make_config(num_epochs=2, **override), workdir)
  assert _snapshot(workdir) == before


@pytest.mark.parametrize('override, message', [
    ({'backend': 'tpu'}, "unknown backend 'tpu'"),
    ({'ensemble_size': 12, 'num_devices': 8}, 'ensemble_size=12 cannot be placed on 8 devices: use a multiple of 8'),
    ({'num_devices': 9}, 'num_devices=9 but 8 devices are available'),
    ({'member_data': 'bagged'}, "unknown member_data 'bagged'"),
    ({'batch_size': 10_000}, 'batch_size=10000 exceeds the 256 training examples'),
    ({'seed': -1}, r'seed=-1 must be in \[0, 4294967295\]'),
    ({'seed': 2**32}, r'seed=4294967296 must be in \[0, 4294967295\]'),
    ({'learning_rate': float('inf')}, 'learning_rate=inf must be positive and finite'),
    ({'weight_decay': float('inf')}, 'weight_decay=inf must be 0 or positive, and finite'),
    ({'heldout_fraction': 1e-9}, 'heldout_fraction=1e-09 of the 256 training examples holds out none; set '
                                 '--config.heldout_fraction to at least 0.0039, or to 0'),
    # Positivity first: the snapshot method's cycle check divides by num_epochs.
    ({'method': 'snapshot', 'num_epochs': 0}, '^num_epochs=0 must be positive$'),
])
def test_bad_config_is_refused_before_the_workdir_is_touched(make_config, tmp_path, override, message):
  workdir = tmp_path / 'run'
  with pytest.raises(UsageError, match=message):
    trainer.train_and_evaluate(make_config(**override), str(workdir))
  assert not workdir.exists()


@pytest.mark.optimized
def test_the_fast_path_writes_the_plain_paths_metrics(make_config, tmp_path):
  """docs/speed.md: `steps_per_dispatch` computes exactly the plain path's steps; 8 steps an epoch: chunks 3, 3, 2."""
  trainer.train_and_evaluate(make_config(num_epochs=2), str(tmp_path / 'plain'))
  trainer.train_and_evaluate(make_config(num_epochs=2, steps_per_dispatch=3), str(tmp_path / 'fast'))
  plain = writers.read_jsonl(str(tmp_path / 'plain' / 'metrics.jsonl'))
  fast = writers.read_jsonl(str(tmp_path / 'fast' / 'metrics.jsonl'))
  assert [line['epoch'] for line in fast] == [1, 2] and [line['step'] for line in fast] == [8, 16]
  assert timeless(fast) == timeless(plain)


@pytest.mark.compute_bound  # 36 s of CPU against 60 s compiled quickly
def test_survives_hundreds_of_steps_on_eight_devices(make_config, tmp_path):
  """docs/backends-and-devices.md, "Many devices on a CPU": on 2 cores, unbounded async dispatch over 8 devices
  aborts within 300 steps; 384 (3 epochs of 128) pass it."""
  config = make_config(backend='jit', num_epochs=3, batch_size=2, eval_batch_size=100)
  state, summary = trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert int(np.asarray(state.step)[0]) == 3 * 128
  assert np.isfinite(summary['train_loss'])


def test_a_cifar_shaped_tfds_dataset_trains_a_resnet_with_crop_and_flip(tmp_path):
  """tensorflow-datasets' CIFAR-10 under mock_data: 32x32x3 images and 10 classes reach the model and the head."""
  tfds = pytest.importorskip('tensorflow_datasets')
  from conftest import small_config  # pylint: disable=g-import-not-at-top
  config = small_config('', dataset='cifar10', model='resnet', resnet_depth=8, augment='crop_flip',
                        batch_size=16, eval_batch_size=16)
  with tfds.testing.mock_data(num_examples=32):
    state, summary = trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert state.params['Conv_0']['kernel'].shape == (8, 3, 3, 3, 16)
  assert state.params['Dense_0']['kernel'].shape == (8, 64, 10)
  assert np.isfinite(summary['test_loss']) and int(np.asarray(state.step)[0]) == 2
  meta = checkpoint.Checkpointer(str(tmp_path / 'run')).meta(1)
  assert meta['data']['image_shape'] == [32, 32, 3] and len(meta['data']['mean']) == 3


@pytest.mark.parametrize('unit', ['step', 'epoch'])
def test_sigterm_saves_the_step_it_stops_at_and_the_run_resumes_from_it_exactly(make_config, tmp_path, monkeypatch,
                                                                                 unit):
  """Issue 67: SIGTERM (a preempted VM, a scheduler) ended the process at once and lost the epoch. Now the run stops
  after the dispatch in progress, saves that step (as a step checkpoint, or for a run that checkpoints by epoch apart
  in checkpoints_stopped/, which evaluation never reads), raises `Interrupted` marked terminated, and the same run
  resumes from that step to the members an uninterrupted run trains, bit for bit, each epoch's line written once."""
  import signal  # pylint: disable=g-import-not-at-top
  settings = dict(num_epochs=2, checkpoint_every_steps=2, checkpoints_to_keep=10) if unit == 'step' else dict(
      num_epochs=2)
  straight, _ = trainer.train_and_evaluate(make_config(**settings), str(tmp_path / 'a'))
  after_steps = trainer._SavesInBackground.after_steps  # pylint: disable=protected-access

  def terminated_at_3(self, step):
    after_steps(self, step)
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(trainer._SavesInBackground, 'after_steps', terminated_at_3)  # pylint: disable=protected-access
  previous = signal.getsignal(signal.SIGTERM)
  said = ('stopped on SIGTERM after step 3; the checkpoint of step 3' if unit == 'step' else
          'stopped on SIGTERM at step 3, in epoch 1 of 2; that step is saved in .*checkpoints_stopped/3$')
  with pytest.raises(trainer.Interrupted, match=said) as e:
    trainer.train_and_evaluate(make_config(**settings), str(tmp_path / 'b'))
  assert e.value.terminated and e.value.saved_epoch == 3 and e.value.unit == 'step'
  assert signal.getsignal(signal.SIGTERM) == previous  # the handler is the run's alone
  if unit == 'epoch':  # nothing that reads epochs sees the part of one
    assert not (tmp_path / 'b' / checkpoint.CHECKPOINTS_DIR).exists()
  monkeypatch.setattr(trainer._SavesInBackground, 'after_steps', after_steps)  # pylint: disable=protected-access
  resumed, _ = trainer.train_and_evaluate(make_config(**settings), str(tmp_path / 'b'))
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), _params(straight))
  jax.tree.map(np.testing.assert_array_equal, (resumed.batch_stats, resumed.key), (straight.batch_stats, straight.key))
  epoch_lines = lambda run: timeless([line for line in writers.read_jsonl(str(tmp_path / run / 'metrics.jsonl'))
                                      if 'test_loss' in line])
  assert [line['epoch'] for line in epoch_lines('b')] == [1, 2] and epoch_lines('b') == epoch_lines('a')
  assert not (tmp_path / 'b' / checkpoint.STOPPED_DIR).exists()  # passed by epoch 1's checkpoint, removed
