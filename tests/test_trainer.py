"""The training loop end to end, in process: metrics, resume, checkpoints across backends."""

import json
import os

import jax
import numpy as np
import pytest

from ensemble import backends, checkpoint, config as config_lib, data, models, steps, trainer, writers
from ensemble.errors import UsageError


def _params(state):
  return jax.tree.map(np.asarray, state.params)


def _snapshot(workdir):
  """Every file under workdir with its size and mtime, to prove nothing was written."""
  return {os.path.join(root, f): (os.stat(os.path.join(root, f)).st_size,
                                  os.stat(os.path.join(root, f)).st_mtime_ns)
          for root, _, files in os.walk(workdir) for f in files}


def test_metrics_jsonl_and_checkpoints(make_config, tmp_path):
  workdir = str(tmp_path / 'run')
  _, summary = trainer.train_and_evaluate(make_config(num_epochs=2), workdir)
  lines = writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  assert [line['epoch'] for line in lines] == [1, 2]
  for key in ('train_loss', 'train_accuracy', 'test_loss', 'test_accuracy'):
    assert all(np.isfinite(line[key]) for line in lines)
  assert len(lines[-1]['member_test_accuracy']) == 8
  assert lines[-1]['test_accuracy'] == summary['test_accuracy']
  assert lines[-1]['train_loss'] < lines[0]['train_loss']
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['1', '2']
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(workdir))
  assert json.load(open(os.path.join(workdir, 'config.json')))['ensemble_size'] == 8


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(make_config, tmp_path):
  straight, _ = trainer.train_and_evaluate(make_config(num_epochs=3), str(tmp_path / 'a'))
  trainer.train_and_evaluate(make_config(num_epochs=1), str(tmp_path / 'b'))
  resumed, _ = trainer.train_and_evaluate(make_config(num_epochs=3), str(tmp_path / 'b'))
  # Same placement, same programs: the resumed run must match to the last bit.
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), _params(straight))
  a = writers.read_jsonl(str(tmp_path / 'a' / 'metrics.jsonl'))
  b = writers.read_jsonl(str(tmp_path / 'b' / 'metrics.jsonl'))
  assert [line['epoch'] for line in b] == [1, 2, 3]
  for line_a, line_b in zip(a, b):
    assert line_a.keys() == line_b.keys()
    assert line_a == line_b


def _restore_and_evaluate(config, workdir, backend_name, num_devices):
  """Restores the latest checkpoint onto `num_devices` devices and evaluates it there."""
  config, devices = config_lib.resolve(config.copy_and_resolve_references(), jax.devices()[:num_devices])
  model, tx = models.create_model(config.model), steps.create_optimizer(config)
  backend = backends.create(backend_name, model=model, tx=tx, devices=devices, ensemble_size=8,
                            member_data='shared', input_shape=trainer.INPUT_SHAPE)
  ckpt = checkpoint.Checkpointer(workdir)
  state = ckpt.restore(ckpt.latest_epoch(), backend.abstract_state(), {'model': 'cnn', 'ensemble_size': 8})
  test = trainer.evaluate(backend, backend.from_canonical(state), data.load(config.data_dir)['test'],
                          config.eval_batch_size)
  return state, test


@pytest.mark.parametrize('backend, num_devices', [('jit', 4), ('pmap', 1)])
def test_checkpoint_moves_between_backends_and_device_counts(make_config, tmp_path, backend, num_devices):
  """pmap on 8 devices writes a checkpoint; another backend on fewer devices restores and continues it."""
  workdir = str(tmp_path / 'run')
  saved, summary = trainer.train_and_evaluate(make_config(), workdir)
  restored, test = _restore_and_evaluate(make_config(), workdir, backend, num_devices)
  jax.tree.map(np.testing.assert_array_equal, _params(restored), _params(saved))
  np.testing.assert_allclose(test['loss'], summary['test_loss'], rtol=1e-5)
  np.testing.assert_allclose(test['member_accuracy'],
                             [summary[f'member_test_accuracy/{i}'] for i in range(8)], rtol=1e-5)

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
    ({'ensemble_size': 12}, 'ensemble_size=12 cannot be placed on 8 devices: use a multiple of 8'),
    ({'num_devices': 9}, 'num_devices=9 but 8 devices are available'),
    ({'member_data': 'bagged'}, "unknown member_data 'bagged'"),
    ({'batch_size': 10_000}, 'batch_size=10000 exceeds the 256 training examples'),
    ({'seed': -1}, r'seed=-1 must be in \[0, 4294967295\]'),
    ({'seed': 2**32}, r'seed=4294967296 must be in \[0, 4294967295\]'),
    ({'learning_rate': float('inf')}, 'learning_rate=inf must be positive and finite'),
])
def test_bad_config_is_refused_before_the_workdir_is_touched(make_config, tmp_path, override, message):
  workdir = tmp_path / 'run'
  with pytest.raises(UsageError, match=message):
    trainer.train_and_evaluate(make_config(**override), str(workdir))
  assert not workdir.exists()


def test_the_fast_path_writes_the_plain_paths_metrics(make_config, tmp_path):
  """README: `steps_per_dispatch` computes exactly the plain path's steps; 8 steps an epoch: chunks of 3, 3, 2."""
  trainer.train_and_evaluate(make_config(num_epochs=2), str(tmp_path / 'plain'))
  trainer.train_and_evaluate(make_config(num_epochs=2, steps_per_dispatch=3), str(tmp_path / 'fast'))
  plain = writers.read_jsonl(str(tmp_path / 'plain' / 'metrics.jsonl'))
  fast = writers.read_jsonl(str(tmp_path / 'fast' / 'metrics.jsonl'))
  assert [line['epoch'] for line in fast] == [1, 2] and [line['step'] for line in fast] == [8, 16]
  assert fast == plain


def test_survives_a_thousand_steps_on_eight_devices(make_config, tmp_path):
  """README, "Many devices on a CPU": on 2 cores, unbounded async dispatch over 8 devices aborts within 300 steps."""
  config = make_config(backend='jit', num_epochs=8, batch_size=2, eval_batch_size=100)
  state, summary = trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert int(np.asarray(state.step)[0]) == 8 * 128
  assert np.isfinite(summary['train_loss'])
