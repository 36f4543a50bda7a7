"""`python -m ensemble.train` as a user runs it."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ensemble import writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*args, config='configs/default.py', **env):
  env = {**os.environ, 'XLA_FLAGS': '', **env}  # the CLI's own --cpu_devices must do the job
  return subprocess.run([sys.executable, '-m', 'ensemble.train', '--config', config, *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_cli_trains_and_resumes(mnist_dir, tmp_path):
  args = ['--workdir', str(tmp_path / 'run'), '--cpu_devices=4', f'--config.data_dir={mnist_dir}',
          '--config.batch_size=32', '--config.ensemble_size=8', '--config.backend=jit']
  cache = tmp_path / 'compiled'
  first = _train(*args, '--config.num_epochs=1', f'--config.compilation_cache={cache}')
  assert first.returncode == 0, first.stderr[-2000:]
  cached = set(os.listdir(cache))
  assert len(cached) > 20  # every program, however fast it compiled: the steps and the small ones of set-up
  second = _train(*args, '--config.num_epochs=2', '--config.compilation_cache=',
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', XDG_CACHE_HOME=str(tmp_path / 'user_cache'))
  assert second.returncode == 0, second.stderr[-2000:]
  assert 'Resumed from' in second.stderr
  assert set(os.listdir(cache)) == cached and not (tmp_path / 'user_cache').exists()  # '' is off
  lines = writers.read_jsonl(str(tmp_path / 'run' / 'metrics.jsonl'))
  assert [line['epoch'] for line in lines] == [1, 2]
  assert len(lines[0]['member_test_accuracy']) == 8


@pytest.mark.parametrize('args, message', [
    (['--config.backend=tpu'],
     "error: unknown backend 'tpu': set --config.backend to one of ['pmap', 'jit', 'sharded', 'dp', 'fsdp']"),
    (['--config.ensemble_size=3'], 'error: ensemble_size=3 cannot be placed on 2 devices'),
    (['--config.data_dir=/nonexistent'], 'error: /nonexistent: no such folder or .npz file'),
    (['--config.augment=mixup'], "error: unknown augment 'mixup': set --config.augment to one of"),
    (['--config.optimizer=lamb'], "error: unknown optimizer 'lamb': set --config.optimizer to one of"),
    (['--config.model=resnet', '--config.resnet_depth=10'], 'error: resnet_depth=10 is not 6n+2'),
    (['configs/dp.py', '--config.augment=shift'], "error: backend 'dp' trains one model on plain batches"),
    (['--config.model=no_such_module:Net'],
     "error: model 'no_such_module:Net': module 'no_such_module' does not import"),
    (['--config.model=ensemble.models:MODELS'], "error: model ensemble.models:MODELS is neither a flax.linen Module"),
    # Found by ml_collections while absl parses the flags, before main: its traceback had the suggestion inside.
    (['--config.ensembel_size=4'], 'error: --config.ensembel_size: configs/default.py has no such field (did you '
                                   'mean --config.ensemble_size?); name fields of configs/default.py'),
    (['--config.ensemble_size=four'], "error: flag --config.ensemble_size=four: invalid literal for int() with base "
                                      "10: 'four'; see --helpfull for the flags"),
    (['configs/nonexistent.py'], "error: --config=configs/nonexistent.py: cannot be loaded ([Errno 2] No such file or "
                                 "directory: 'configs/nonexistent.py'); name a Python file with a get_config()"),
])
def test_cli_bad_input_is_one_line_and_nonzero(tmp_path, args, message):
  config = args.pop(0) if args[0].startswith('configs/') else 'configs/default.py'
  result = _train('--workdir', str(tmp_path / 'run'), '--cpu_devices=2', *args, config=config)
  _assert_refused(result, tmp_path, message)


def _assert_refused(result, tmp_path, message):
  assert result.returncode == 2
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
  assert 'Traceback' not in result.stderr
  assert not (tmp_path / 'run').exists()


def _cifar_like(path, num_train=64, num_test=32, num_classes=4):
  """An .npz of 8x8 RGB images whose class sets one colour channel bright: learnable and tiny."""
  rng = np.random.default_rng(0)
  def split(n):
    labels = rng.integers(0, num_classes, n)
    images = rng.integers(0, 80, (n, 8, 8, 3)).astype(np.uint8)
    images[np.arange(n), :, :, labels % 3] += 150
    return images, labels
  (x_train, y_train), (x_test, y_test) = split(num_train), split(num_test)
  np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  return str(path)


def test_an_npz_of_colour_images_trains_a_resnet_and_evaluates(tmp_path):
  """Image shape, channels and class count come from the data; evaluation's shifts work on any image."""
  npz = _cifar_like(tmp_path / 'colours.npz')
  workdir = tmp_path / 'run'
  result = _train('--workdir', str(workdir), '--cpu_devices=2', f'--config.data_dir={npz}', '--config.model=resnet',
                  '--config.resnet_depth=8', '--config.augment=crop_flip', '--config.ensemble_size=2',
                  '--config.batch_size=16', '--config.eval_batch_size=16', '--config.heldout_fraction=0.25')
  assert result.returncode == 0, result.stderr[-3000:]
  assert '4 classes, images 8x8x3' in result.stderr
  assert len(writers.read_jsonl(str(workdir / 'metrics.jsonl'))[0]['member_test_accuracy']) == 2
  env = {**os.environ, 'XLA_FLAGS': ''}
  result = subprocess.run([sys.executable, '-m', 'ensemble.evaluate', '--workdir', str(workdir), '--angles=0,90'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  metrics = json.loads((workdir / 'eval' / 'metrics.json').read_text())
  assert metrics['test_examples'] == 32 and len(metrics['gaussian_noise']) == 5
  assert metrics['temperature_scaling']['fit_examples'] == 16


@pytest.mark.parametrize('change, message', [
    (lambda arrays: arrays.pop('y_test'), 'no array y_test'),
    (lambda arrays: arrays.update(x_test=arrays['x_test'][:, :4]), 'images must have the same shape'),
])
def test_cli_bad_npz_is_one_line_and_nonzero(tmp_path, change, message):
  arrays = dict(np.load(_cifar_like(tmp_path / 'good.npz')))
  change(arrays)
  np.savez(tmp_path / 'bad.npz', **arrays)
  result = _train('--workdir', str(tmp_path / 'run'), '--cpu_devices=2', f'--config.data_dir={tmp_path}/bad.npz')
  _assert_refused(result, tmp_path, 'error: ')
  assert message in result.stderr and 'bad.npz' in result.stderr
