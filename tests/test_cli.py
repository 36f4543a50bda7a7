"""`python -m ensemble.train` as a user runs it."""

import os
import subprocess
import sys

import pytest

from ensemble import writers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*args):
  env = {**os.environ, 'XLA_FLAGS': ''}  # the CLI's own --cpu_devices must do the job
  return subprocess.run([sys.executable, '-m', 'ensemble.train', '--config', 'configs/default.py', *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_cli_trains_and_resumes(mnist_dir, tmp_path):
  args = ['--workdir', str(tmp_path / 'run'), '--cpu_devices=4', f'--config.data_dir={mnist_dir}',
          '--config.batch_size=32', '--config.ensemble_size=8', '--config.backend=jit']
  first = _train(*args, '--config.num_epochs=1')
  assert first.returncode == 0, first.stderr[-2000:]
  second = _train(*args, '--config.num_epochs=2')
  assert second.returncode == 0, second.stderr[-2000:]
  assert 'Resumed from' in second.stderr
  lines = writers.read_jsonl(str(tmp_path / 'run' / 'metrics.jsonl'))
  assert [line['epoch'] for line in lines] == [1, 2]
  assert len(lines[0]['member_test_accuracy']) == 8


@pytest.mark.parametrize('args, message', [
    (['--config.backend=tpu'],
     "error: unknown backend 'tpu': set --config.backend to one of ['pmap', 'jit', 'sharded', 'dp', 'fsdp']"),
    (['--config.ensemble_size=3'], 'error: ensemble_size=3 cannot be placed on 2 devices'),
    (['--config.data_dir=/nonexistent'], 'error: /nonexistent: no such folder or .npz file'),
])
def test_cli_bad_input_is_one_line_and_nonzero(tmp_path, args, message):
  result = _train('--workdir', str(tmp_path / 'run'), '--cpu_devices=2', *args)
  assert result.returncode == 2
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
  assert 'Traceback' not in result.stderr
  assert not (tmp_path / 'run').exists()
