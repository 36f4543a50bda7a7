"""Several processes, one ensemble: 2 processes x 4 CPU devices against 1 process x 8, on 127.0.0.1 only.

Starting processes is the expensive part, so one module-scoped pair of runs
serves several tests: the jit backend on the fast path (resident data) with
shared batches on 2 processes until process 1 is killed after epoch 1, then
the pmap backend on the plain path with per-member (shuffled) batches on 2
processes, through the local launcher, resuming that workdir to epoch 2.
Evaluation feeds both backends split batches. The same sequence on 1 process
with 8 devices is the reference.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from conftest import small_config, synthetic_mnist, write_mnist
from ensemble import backends, checkpoint, config as config_lib, data, distributed, trainer, writers
from ensemble.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, 'scripts', 'launch_local.py')
HEARTBEAT_TIMEOUT_S = 10
# Generous for a shared 2-core machine; without the heartbeat the survivor would wait forever.
EXIT_BOUND_S = 60
FIRST = {'backend': 'jit', 'steps_per_dispatch': 4}  # epoch 1: fast path, shared batches
SECOND = {'backend': 'pmap', 'member_data': 'shuffled'}  # epoch 2: plain path, a batch per member


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env(**extra) -> dict[str, str]:
  """Only the CLI's --cpu_devices decides the devices; no cluster variables leak in from outside."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'OMPI_', 'JAX_COORDINATOR'))}
  return {**env, 'XLA_FLAGS': '', 'JAX_PLATFORMS': 'cpu', **extra}


def _train_args(workdir: str, mnist_dir: str, **overrides) -> list[str]:
  """The CLI flags for `small_config(mnist_dir, **overrides)`."""
  config = small_config(mnist_dir, **overrides)
  fields = ('data_dir', 'num_epochs', 'batch_size', 'eval_batch_size', 'ensemble_size', 'heldout_fraction',
            'backend', 'member_data', 'steps_per_dispatch')
  return [f'--workdir={workdir}', '--config=configs/default.py', *(f'--config.{k}={config[k]}' for k in fields)]


def _errors(output: str) -> list[str]:
  return [line for line in output.splitlines() if 'error:' in line]


def _metrics(workdir: str) -> list[dict]:
  return writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))


def _checkpoint_params(workdir: str, epoch: int):
  config = small_config('')
  ckpt = checkpoint.Checkpointer(workdir)
  member = config_lib.member(config, ckpt.meta(epoch)['data'])
  abstract = backends.abstract_member_state(member, config.ensemble_size, jax.devices())
  state = ckpt.restore(epoch, abstract, {'model': config.model, 'ensemble_size': config.ensemble_size})
  ckpt.close()
  return jax.tree.map(np.asarray, state.params)


def _kill_after_first_epoch(workdir: str, mnist_dir: str, logs: str) -> dict:
  """2 processes (found through SLURM's variables, as on a cluster) train; process 1 dies after epoch 1."""
  port = _free_port()
  processes = []
  try:
    for process_id in range(2):
      env = _env(SLURM_JOB_ID='1', SLURM_STEP_NODELIST='127.0.0.1', SLURM_NTASKS='2',
                 SLURM_PROCID=str(process_id), SLURM_LOCALID=str(process_id), JAX_COORDINATOR_PORT=str(port))
      command = [sys.executable, '-m', 'ensemble.train', *_train_args(workdir, mnist_dir, **FIRST, num_epochs=3),
                 '--cpu_devices=4', f'--heartbeat_timeout={HEARTBEAT_TIMEOUT_S}']
      with open(os.path.join(logs, f'process{process_id}.log'), 'w') as log:
        processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 300
    metrics = os.path.join(workdir, 'metrics.jsonl')
    while not (os.path.exists(metrics) and _metrics(workdir)):
      assert time.monotonic() < deadline, 'epoch 1 did not finish in time'
      assert all(p.poll() is None for p in processes), open(os.path.join(logs, 'process0.log')).read()[-3000:]
      time.sleep(0.2)
    processes[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    try:
      code = processes[0].wait(timeout=120)
    except subprocess.TimeoutExpired:
      code = None
    return {'code': code, 'exit_s': time.monotonic() - killed,
            'output': open(os.path.join(logs, 'process0.log')).read()}
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
      process.wait()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp('distributed')
  mnist_dir = write_mnist(str(root / 'mnist'))
  two, one = str(root / 'two_processes'), str(root / 'one_process')
  killed = _kill_after_first_epoch(two, mnist_dir, str(root))
  resumed = subprocess.run(
      [sys.executable, LAUNCHER, '--num_processes=2', '--cpu_devices=4', '--',
       *_train_args(two, mnist_dir, **SECOND, num_epochs=2)],
      cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  # The reference: the same two runs on one process with 8 devices.
  trainer.train_and_evaluate(small_config(mnist_dir, **FIRST, num_epochs=1), one)
  trainer.train_and_evaluate(small_config(mnist_dir, **SECOND, num_epochs=2), one)
  return types.SimpleNamespace(two=two, one=one, killed=killed, resumed=resumed)


def test_a_dead_process_stops_the_others_within_the_heartbeat_timeout(runs):
  assert runs.killed['code'] not in (None, 0), 'the surviving process must stop, and not as a success'
  assert runs.killed['exit_s'] < EXIT_BOUND_S
  # JAX's coordination service names the cause.
  assert 'another task died' in runs.killed['output'], runs.killed['output'][-3000:]


def test_two_processes_resume_after_a_crash_and_write_metrics_once(runs):
  assert runs.resumed.returncode == 0, runs.resumed.stdout[-3000:]
  assert '[process 0]' in runs.resumed.stdout and '[process 1]' in runs.resumed.stdout
  assert runs.resumed.stdout.count('Resumed from') == 2  # both processes start from epoch 1's checkpoint
  assert [line['epoch'] for line in _metrics(runs.two)] == [1, 2]  # written by process 0 alone
  events = [f for f in os.listdir(runs.two) if f.startswith('events.out.tfevents')]
  assert len(events) == 2  # one TensorBoard file per run, from process 0
  assert sorted(os.listdir(os.path.join(runs.two, 'checkpoints'))) == ['1', '2']


@pytest.mark.parametrize('backend, epoch', [('jit', 1), ('pmap', 2)])
def test_two_processes_train_the_same_ensemble_as_one(runs, backend, epoch):
  """Epoch 1 ran on jit, epoch 2 on pmap: each is compared with 1 process x 8 devices after that epoch."""
  del backend  # the parameter names what the epoch exercised
  two, one = _metrics(runs.two)[epoch - 1], _metrics(runs.one)[epoch - 1]
  assert two.keys() == one.keys()
  for key in one:
    np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _checkpoint_params(runs.two, epoch), _checkpoint_params(runs.one, epoch))


@pytest.mark.parametrize('flags, message', [
    ({'num_processes': 2, 'process_id': 2}, '--process_id=2 is out of range for --num_processes=2'),
    ({'num_processes': 2, 'process_id': -1}, '--process_id=-1 is out of range for --num_processes=2'),
    ({'num_processes': 2}, '--coordinator_address, --num_processes and --process_id go together'),
    ({'coordinator_address': 'no-port', 'num_processes': 2, 'process_id': 1},
     "--coordinator_address='no-port' is not HOST:PORT"),
    ({'num_processes': 2, 'process_id': 1, 'initialization_timeout': 2}, 'cannot reach the coordinator at 127.0.0.1:'),
])
def test_bad_process_flags_are_refused_before_jax_starts(flags, message):
  jax.devices()  # should initialize() get past its checks, JAX refuses at once rather than join a job
  flags = {'coordinator_address': f'127.0.0.1:{_free_port()}', **flags}  # nothing listens on that port
  started = time.monotonic()
  with pytest.raises(UsageError, match=re.escape(message)) as error:
    distributed.initialize(**flags)
  assert time.monotonic() - started < 10
  assert '\n' not in str(error.value)


def test_an_unreachable_coordinator_ends_the_cli_with_one_line(mnist_dir, tmp_path):
  port, workdir = _free_port(), tmp_path / 'run'
  started = time.monotonic()
  result = subprocess.run(
      [sys.executable, '-m', 'ensemble.train', *_train_args(str(workdir), mnist_dir), '--cpu_devices=4',
       f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', '--process_id=1', '--initialization_timeout=3'],
      cwd=REPO, env=_env(), capture_output=True, text=True, timeout=EXIT_BOUND_S * 2)
  assert result.returncode == 2, result.stderr[-3000:]
  assert time.monotonic() - started < EXIT_BOUND_S
  assert _errors(result.stderr) == [f'error: cannot reach the coordinator at 127.0.0.1:{port} within 3 s: start '
                                    'process 0 there, check the address and that its port is open, or raise '
                                    '--initialization_timeout'], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert not workdir.exists()


def test_a_batch_the_devices_cannot_split_stops_every_process(mnist_dir, tmp_path):
  workdir = tmp_path / 'run'
  started = time.monotonic()
  result = subprocess.run(
      [sys.executable, LAUNCHER, '--num_processes=2', '--cpu_devices=4', '--',
       *_train_args(str(workdir), mnist_dir, batch_size=60)],
      cwd=REPO, env=_env(), capture_output=True, text=True, timeout=EXIT_BOUND_S * 2)
  assert result.returncode == 2, result.stdout[-3000:]
  assert time.monotonic() - started < EXIT_BOUND_S
  message = ('error: batch_size=60 gives each of the 2 processes 30 examples per step, which its 4 devices '
             'cannot split evenly; set --config.batch_size to a multiple of 8')
  assert f'[process 0] {message}' in result.stdout.splitlines(), result.stdout[-3000:]
  assert _errors(result.stderr) == [result.stderr.strip()] and 'exited with code 2' in result.stderr
  assert not workdir.exists()


# Process 0 (this one) holding devices 0, 1, 4 and 5 of 8 feeds their blocks of a 16-row batch.
_TWO_PROCESSES = [types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1, 0, 0, 1, 1)]
_MY_ROWS = [0, 1, 2, 3, 8, 9, 10, 11]


def test_each_process_feeds_the_rows_of_its_own_devices():
  np.testing.assert_array_equal(distributed.process_rows(_TWO_PROCESSES, 16), _MY_ROWS)
  # A single process feeds whole batches, even ones its devices could not split.
  np.testing.assert_array_equal(distributed.process_rows(jax.devices(), 5), np.arange(5))


def test_a_process_reads_only_its_rows_of_each_batch():
  (images, labels), _ = synthetic_mnist(num_train=64)
  split = {'image': images[..., None].astype(np.float32) / 255, 'label': labels.astype(np.int32)}
  batch = np.arange(16) * 3  # one step's example indices
  backend = types.SimpleNamespace(devices=_TWO_PROCESSES, train_step=lambda state, x, y: (x, y))
  fed_images, fed_labels = backends.train_chunk(backend, None, split, None, batch[None])
  np.testing.assert_array_equal(fed_images, split['image'][batch[_MY_ROWS]])
  np.testing.assert_array_equal(fed_labels, split['label'][batch[_MY_ROWS]])
  for (x, y, mask), (my_x, my_y, my_mask) in zip(data.eval_batches(split, 16),
                                                 data.eval_batches(split, 16, _MY_ROWS), strict=True):
    np.testing.assert_array_equal(my_x, x[_MY_ROWS])
    np.testing.assert_array_equal(my_y, y[_MY_ROWS])
    np.testing.assert_array_equal(my_mask, mask)  # the outputs cover the whole batch
