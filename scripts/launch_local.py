"""Runs a multi-process training job on one machine: N trainer processes, each with its own CPU devices.

  python scripts/launch_local.py --num_processes=2 --cpu_devices=4 -- \
      --workdir=/tmp/mp --config=configs/default.py --config.data_dir=../shared/mnist

The processes find each other through a jax.distributed coordinator on
127.0.0.1 (a free port), and their CPU devices run collectives over gloo, just
as processes on separate hosts would over the network: a way to try multi-host
training without a cluster. Everything after `--` goes to `python -m
ensemble.train` unchanged. Output is streamed with a `[process i]` prefix. If
a process fails, the others are stopped and the launcher exits with its code.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

_GRACE_S = 10  # how long stopped processes get to exit before they are killed
# How long the others get, once one process has failed, to stop by themselves before they are stopped: told the same
# answer (a held workdir, a bad batch), each prints its own error line, which a loaded machine took longer to do.
_SETTLE_S = 5


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _stream(process: subprocess.Popen, prefix: str, lock: threading.Lock):
  for line in process.stdout:
    with lock:
      sys.stdout.write(f'{prefix} {line}')
      sys.stdout.flush()


def _stop(processes: list[subprocess.Popen]):
  for process in processes:
    if process.poll() is None:
      process.terminate()
  deadline = time.monotonic() + _GRACE_S
  for process in processes:
    try:
      process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


def launch(num_processes: int, cpu_devices: int, train_args: list[str]) -> int:
  """Starts the processes and returns 0 when all succeed, else the first failure's exit code."""
  address = f'127.0.0.1:{_free_port()}'
  processes, lock = [], threading.Lock()
  for process_id in range(num_processes):
    command = [sys.executable, '-u', '-m', 'ensemble.train', *train_args,
               f'--coordinator_address={address}', f'--num_processes={num_processes}',
               f'--process_id={process_id}', f'--cpu_devices={cpu_devices}']
    processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  streams = [threading.Thread(target=_stream, args=(p, f'[process {i}]', lock), daemon=True)
             for i, p in enumerate(processes)]
  for stream in streams:
    stream.start()
  try:
    while True:
      codes = [p.poll() for p in processes]
      failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
      if failed or all(code == 0 for code in codes):
        break
      time.sleep(0.2)
  except KeyboardInterrupt:
    _stop(processes)
    return 130
  settled = time.monotonic() + (_SETTLE_S if failed else 0.0)
  while any(p.poll() is None for p in processes) and time.monotonic() < settled:
    time.sleep(0.1)
  running = [i for i, p in enumerate(processes) if p.poll() is None]
  if failed:
    _stop(processes)
  for stream in streams:
    stream.join(timeout=5)
  if not failed:
    return 0
  process_id, code = failed[0]
  how = f'was killed by signal {-code}' if code < 0 else f'exited with code {code}'
  stopped = f'; stopped process(es) {", ".join(map(str, running))}' if running else ''
  print(f'error: process {process_id} {how}{stopped}', file=sys.stderr)
  return code if code > 0 else 1


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      usage='%(prog)s [--num_processes=N] [--cpu_devices=D] -- TRAINER FLAGS')
  parser.add_argument('--num_processes', type=int, default=2, help='processes to start (default 2)')
  parser.add_argument('--cpu_devices', type=int, default=4, help='simulated CPU devices per process (default 4)')
  args, train_args = parser.parse_known_args()
  if train_args[:1] == ['--']:
    train_args = train_args[1:]
  if args.num_processes < 1 or args.cpu_devices < 1:
    parser.error('--num_processes and --cpu_devices must be at least 1')
  # CPU devices only (a GPU would be shared by every process), and the trainer's own --cpu_devices
  # must decide how many, not an inherited XLA flag.
  os.environ['JAX_PLATFORMS'] = 'cpu'
  os.environ['XLA_FLAGS'] = ' '.join(flag for flag in os.environ.get('XLA_FLAGS', '').split()
                                     if not flag.startswith('--xla_force_host_platform_device_count'))
  sys.exit(launch(args.num_processes, args.cpu_devices, train_args))


if __name__ == '__main__':
  main()
