"""Several processes, one ensemble: 2 processes x 4 CPU devices against 1 process x 8, on 127.0.0.1 only.

Starting processes is the expensive part, so one module-scoped set of runs
serves several tests: the jit backend on the fast path (resident data) with
shared batches on 2 processes until process 1 is killed after epoch 1, then
the classic recipe (pmap, plain path, shared batches) on 2 processes, through
the local launcher, resuming that workdir to epoch 2; and in a workdir of its
own (a resume keeps the data settings), the pmap backend on the plain path
with per-member (shuffled) batches for one epoch. Evaluation feeds both
backends split batches. The same runs on 1 process with 8 devices are the
reference.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

import ensemble

from conftest import COMPILE_FLAGS, SAME_SUMS, checkpoint_state, small_config, synthetic_mnist, write_mnist
from ensemble import backends, checkpoint, data, distributed, trainer, writers
from ensemble.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, 'scripts', 'launch_local.py')
HEARTBEAT_TIMEOUT_S = 10
# Generous for a shared 2-core machine; without the heartbeat the survivor would wait forever.
EXIT_BOUND_S = 60
FIRST = {'backend': 'jit', 'steps_per_dispatch': 4}  # epoch 1: fast path, shared batches
SECOND = {'backend': 'pmap'}  # epoch 2: the classic recipe: pmap, plain path, shared batches
SHUFFLED = {'backend': 'pmap', 'member_data': 'shuffled'}  # its own workdir: plain path, a batch per member


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env(**extra) -> dict[str, str]:
  """Only the CLI's --cpu_devices decides the devices; no cluster variables leak in from outside."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'OMPI_', 'JAX_COORDINATOR'))}
  return {**env, 'XLA_FLAGS': COMPILE_FLAGS, 'JAX_PLATFORMS': 'cpu', **extra}


def _train_args(workdir: str, mnist_dir: str, **overrides) -> list[str]:
  """The CLI flags for `small_config(mnist_dir, **overrides)`."""
  config = small_config(mnist_dir, **overrides)
  fields = ('data_dir', 'num_epochs', 'batch_size', 'eval_batch_size', 'ensemble_size', 'heldout_fraction',
            'backend', 'member_data', 'steps_per_dispatch', 'learning_rate')
  fields += tuple(name for name in overrides if name not in fields)
  return [f'--workdir={workdir}', '--config=configs/classic.py', *(f'--config.{k}={config[k]}' for k in fields)]


def _errors(output: str) -> list[str]:
  return [line for line in output.splitlines() if 'error:' in line]


def _metrics(workdir: str) -> list[dict]:
  return writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))


_checkpoint_state = checkpoint_state


def _checkpoint_params(workdir: str, epoch: int):
  return _checkpoint_state(workdir, epoch)['params']


def _start_two(workdir: str, mnist_dir: str, logs: str, **config) -> list[subprocess.Popen]:
  """2 processes (found through SLURM's variables, as on a cluster) start training `config` in `workdir`."""
  port, processes = _free_port(), []
  for process_id in range(2):
    env = _env(SLURM_JOB_ID='1', SLURM_STEP_NODELIST='127.0.0.1', SLURM_NTASKS='2',
               SLURM_PROCID=str(process_id), SLURM_LOCALID=str(process_id), JAX_COORDINATOR_PORT=str(port))
    command = [sys.executable, '-m', 'ensemble.train', *_train_args(workdir, mnist_dir, **config),
               '--cpu_devices=4', f'--heartbeat_timeout={HEARTBEAT_TIMEOUT_S}']
    with open(os.path.join(logs, f'process{process_id}.log'), 'w') as log:
      processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
  return processes


def _kill_after_first_epoch(workdir: str, mnist_dir: str, logs: str) -> dict:
  """2 processes train; process 1 dies after epoch 1."""
  processes = []
  try:
    processes = _start_two(workdir, mnist_dir, logs, **FIRST, num_epochs=3)
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


def _terminate_one(workdir: str, mnist_dir: str, logs: str) -> list[dict]:
  """2 processes train; process 1 alone is sent SIGTERM (a preempted host) as training starts. Each process's exit
  status and output."""
  processes = []
  try:
    processes = _start_two(workdir, mnist_dir, logs, **SHUFFLED, num_epochs=1)
    log = os.path.join(logs, 'process1.log')
    deadline = time.monotonic() + 300
    while 'Training ' not in open(log).read():  # past jax.distributed's start-up, which takes the signal
      assert time.monotonic() < deadline and processes[1].poll() is None, open(log).read()[-3000:]
      time.sleep(0.05)
    processes[1].send_signal(signal.SIGTERM)
    codes = [process.wait(timeout=120) for process in processes]
    return [{'code': code, 'output': open(os.path.join(logs, f'process{i}.log')).read()}
            for i, code in enumerate(codes)]
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
  launch = lambda workdir, **config: subprocess.run(
      [sys.executable, LAUNCHER, '--num_processes=2', '--cpu_devices=4', '--',
       *_train_args(workdir, mnist_dir, **config)],
      cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  resumed = launch(two, **SECOND, num_epochs=2)
  shuffled = str(root / 'two_processes_shuffled')
  terminated = _terminate_one(shuffled, mnist_dir, str(root))
  resumed_shuffled = launch(shuffled, **SHUFFLED, num_epochs=1)
  assert resumed_shuffled.returncode == 0, resumed_shuffled.stdout[-3000:]
  # The reference: the same runs on one process with 8 devices.
  trainer.train_and_evaluate(small_config(mnist_dir, **FIRST, **SAME_SUMS, num_epochs=1), one)
  trainer.train_and_evaluate(small_config(mnist_dir, **SECOND, **SAME_SUMS, num_epochs=2), one)
  trainer.train_and_evaluate(small_config(mnist_dir, **SHUFFLED, **SAME_SUMS, num_epochs=1),
                             str(root / 'one_process_shuffled'))
  return types.SimpleNamespace(root=root, mnist_dir=mnist_dir, two=two, one=one, killed=killed, resumed=resumed,
                               terminated=terminated, resumed_shuffled=resumed_shuffled)


def test_a_dead_process_stops_the_others_within_the_heartbeat_timeout(runs):
  assert runs.killed['code'] not in (None, 0), 'the surviving process must stop, and not as a success'
  assert runs.killed['exit_s'] < EXIT_BOUND_S
  # JAX's coordination service names the cause.
  assert 'another task died' in runs.killed['output'], runs.killed['output'][-3000:]


def test_sigterm_to_one_process_stops_every_process_at_one_step(runs):
  """Issue 67: SIGTERM on one host (JAX's preemption service tells the others) stops both processes after the same
  dispatch, the step saved, each with the `interrupted:` line and status 143; the resume goes on from that step,
  to the ensemble one process trains (test_two_processes_train_the_same_ensemble_as_one, shuffled batches)."""
  stops = [re.findall(r'interrupted: stopped on SIGTERM at step (\d+), in epoch 1 of 1', run['output'])
           for run in runs.terminated]
  assert [run['code'] for run in runs.terminated] == [143, 143], runs.terminated[0]['output'][-3000:]
  assert len(stops[0]) == 1 and stops[0] == stops[1], (stops, runs.terminated[0]['output'][-3000:])
  assert runs.resumed_shuffled.stdout.count(f'checkpoints_stopped/{stops[0][0]} at step {stops[0][0]}') == 2
  assert not os.path.exists(os.path.join(str(runs.root / 'two_processes_shuffled'), checkpoint.STOPPED_DIR))


def test_two_processes_resume_after_a_crash_and_write_metrics_once(runs):
  assert runs.resumed.returncode == 0, runs.resumed.stdout[-3000:]
  assert '[process 0]' in runs.resumed.stdout and '[process 1]' in runs.resumed.stdout
  assert runs.resumed.stdout.count('Resumed from') == 2  # both processes start from epoch 1's checkpoint
  assert [line['epoch'] for line in _metrics(runs.two)] == [1, 2]  # written by process 0 alone
  events = [f for f in os.listdir(runs.two) if f.startswith('events.out.tfevents')]
  assert len(events) == 2  # one TensorBoard file per run, from process 0
  assert sorted(os.listdir(os.path.join(runs.two, 'checkpoints'))) == ['1', '2']


@pytest.mark.parametrize('recipe, workdirs, epoch', [
    ('jit, fast path, shared batches', ('two_processes', 'one_process'), 1),
    ('default: pmap, plain path, shared batches', ('two_processes', 'one_process'), 2),
    ('pmap, plain path, shuffled batches', ('two_processes_shuffled', 'one_process_shuffled'), 1),
])
def test_two_processes_train_the_same_ensemble_as_one(runs, recipe, workdirs, epoch):
  """Each recipe's epoch on 2 processes x 4 devices against 1 process x 8, from the same state before it."""
  del recipe  # the parameter names what the epoch exercised
  two, one = (str(runs.root / name) for name in workdirs)
  two_line, one_line = _metrics(two)[epoch - 1], _metrics(one)[epoch - 1]
  assert two_line.keys() == one_line.keys() and two_line['epoch'] == epoch
  for key in {key for key in one_line if not key.endswith('_seconds')}:
    np.testing.assert_allclose(two_line[key], one_line[key], rtol=1e-5, atol=1e-6, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _checkpoint_params(two, epoch), _checkpoint_params(one, epoch))


SPANNING = {'backend': 'jit', 'ensemble_size': 1, 'member_data': 'shuffled', 'steps_per_dispatch': 4}
# K=2 heads whose backbone is split over all 8 devices: its gathers and reduce-scatters cross the processes.
SHARED_SPLIT = {'backend': 'jit', 'ensemble_size': 2, 'member_data': 'shuffled', 'steps_per_dispatch': 4,
                'shared': ('Conv_0', 'Conv_1', 'Dense_0'), 'shared_sharding': 'fsdp', 'min_weight_size': 64}


@pytest.mark.parametrize('fields', [SPANNING, SHARED_SPLIT], ids=['a_member_spanning_them', 'a_split_backbone'])
def test_two_processes_train_as_one(tmp_path, fields):
  """2 processes x 4 devices against 1 process x 8, by the metrics and the parameters: K=1 member data-parallel
  over both processes (the fast path: its own batches' indices split over its devices, which are both
  processes'), and K=2 heads on one backbone split over all 8 devices (shared_sharding=fsdp)."""
  mnist_dir = write_mnist(str(tmp_path / 'mnist'))
  two, one = str(tmp_path / 'two'), str(tmp_path / 'one')
  launched = subprocess.run([sys.executable, LAUNCHER, '--num_processes=2', '--cpu_devices=4', '--',
                             *_train_args(two, mnist_dir, **fields, num_epochs=1)],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert launched.returncode == 0, launched.stdout[-3000:]
  trainer.train_and_evaluate(small_config(mnist_dir, **fields, **SAME_SUMS, num_epochs=1), one)
  (two_line,), (one_line,) = _metrics(two), _metrics(one)
  for key in {key for key in one_line if not key.endswith('_seconds')}:
    np.testing.assert_allclose(two_line[key], one_line[key], rtol=1e-5, atol=1e-6, err_msg=key)
  params = [ensemble.load(workdir).params for workdir in (two, one)]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *params)


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


def test_a_held_workdir_stops_every_process_with_the_holder_named(mnist_dir, tmp_path):
  """Only process 0 takes the lock; the others learn its answer and stop alike, at once."""
  workdir = str(tmp_path / 'run')
  lock = checkpoint.WorkdirLock(workdir)
  assert lock.acquire() is None
  try:
    started = time.monotonic()
    result = subprocess.run([sys.executable, LAUNCHER, '--num_processes=2', '--cpu_devices=4', '--',
                             *_train_args(workdir, mnist_dir)],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=EXIT_BOUND_S * 2)
  finally:
    lock.release()
  assert result.returncode == 2, result.stdout[-3000:]
  assert time.monotonic() - started < EXIT_BOUND_S
  message = (f'error: {workdir} is in use by process {os.getpid()} on {socket.gethostname()} (it holds '
             f'{workdir}/lock); wait for that run to end or stop it, or train in another --workdir')
  lines = result.stdout.splitlines()
  assert f'[process 0] {message}' in lines and f'[process 1] {message}' in lines, result.stdout[-3000:]
  assert os.listdir(workdir) == ['lock']


def test_a_save_that_fails_on_one_process_stops_them_all_and_keeps_the_checkpoints(runs, tmp_path):
  """Process 1 cannot write files over 1 MB (its disk is full): it stops with the one-line cause, and the
  coordination service stops process 0, which waits for it in orbax's barrier, within the heartbeat timeout."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(runs.two, workdir)
  before = {epoch: _checkpoint_state(workdir, epoch) for epoch in (1, 2)}
  limit = ('import resource, runpy; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY)); '
           'runpy.run_module("ensemble.train", run_name="__main__", alter_sys=True)')
  port, processes, logs = _free_port(), [], [str(tmp_path / f'process{i}.log') for i in range(2)]
  try:
    for process_id in range(2):
      start = ['-c', limit] if process_id == 1 else ['-m', 'ensemble.train']
      command = [sys.executable, '-u', *start, *_train_args(workdir, runs.mnist_dir, **SECOND, num_epochs=3),
                 '--cpu_devices=4', f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
                 f'--process_id={process_id}', f'--heartbeat_timeout={HEARTBEAT_TIMEOUT_S}']
      with open(logs[process_id], 'w') as log:
        processes.append(subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT))
    assert processes[1].wait(timeout=300) == 2, open(logs[1]).read()[-3000:]
    failed = time.monotonic()
    assert processes[0].wait(timeout=EXIT_BOUND_S * 2) != 0
    assert time.monotonic() - failed < EXIT_BOUND_S
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
      process.wait()
  output = open(logs[1]).read()
  assert _errors(output) == [f'error: cannot save checkpoint {workdir}/checkpoints/3: File too large (EFBIG); free '
                             f'space or restore write access in {workdir}/checkpoints, then re-run the same command '
                             'to resume from the last checkpoint (2)'], output[-3000:]
  assert 'Traceback' not in output
  assert 'another task died' in open(logs[0]).read()
  assert sorted(name for name in os.listdir(os.path.join(workdir, 'checkpoints')) if name.isdigit()) == ['1', '2']
  for epoch, state in before.items():
    jax.tree.map(np.testing.assert_array_equal, _checkpoint_state(workdir, epoch), state)
  assert [line['epoch'] for line in _metrics(workdir)] == [1, 2]


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


def test_each_process_feeds_its_block_of_a_per_member_batch():
  """Per-member batches (K, B): whole members per device, or each member's rows over its D/K devices."""
  batch = np.arange(16 * 16).reshape(16, 16)
  np.testing.assert_array_equal(distributed.process_block(_TWO_PROCESSES, batch), batch[_MY_ROWS])
  two = batch[:2]  # members 0 and 1 on devices 0-3 and 4-7: this process holds half the devices of each
  np.testing.assert_array_equal(distributed.process_block(_TWO_PROCESSES, two), two[:, :8])
  one = batch[:1]  # one member over all 8 devices: this process holds the rows of its 4
  np.testing.assert_array_equal(distributed.process_block(_TWO_PROCESSES, one), one[:, _MY_ROWS])
  np.testing.assert_array_equal(distributed.process_block(jax.devices(), two), two)


_LEAVE = '''
import sys, time
import jax
from ensemble import distributed, train
index, address = int(sys.argv[1]), sys.argv[2]
distributed.initialize(address, 2, index)
jax.devices()  # the backend joins the job, as training's does
if index == 1:
  time.sleep(3)  # process 0, the coordination service's host, reaches its exit first
train._exit(143)
'''


def test_a_stop_every_process_makes_ends_each_with_its_own_status():
  """SIGTERM's stop (and Ctrl-C's) ends every process with status 143 (130), whichever reaches its exit first:
  process 0 hosts jax.distributed's coordination service and leaves after the others (before, a process still on its
  way out when process 0 had gone aborted, status -6: the SIGTERM test above, now and then)."""
  address = f'127.0.0.1:{_free_port()}'
  processes = [subprocess.Popen([sys.executable, '-c', _LEAVE, str(index), address], cwd=REPO, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for index in (0, 1)]
  outputs = [process.communicate(timeout=120)[0] for process in processes]
  assert [process.returncode for process in processes] == [143, 143], outputs[1][-3000:]
