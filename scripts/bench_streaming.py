"""Streamed training against in-memory training: speed, peak memory, and each process's share of the rows.

  python scripts/bench_streaming.py --part=throughput --data_dir=/tmp/mnist_ar   # a folder from ensemble.data.convert
  python scripts/bench_streaming.py --part=memory --folder=/tmp/cifar_shaped --gigabytes=2 --steps=300
  python scripts/bench_streaming.py --part=memory --folder=/tmp/c1 --gigabytes=1.2 --steps=100 --read_whole_steps=0
  python scripts/bench_streaming.py --part=memory --folder=/tmp/cf --examples=100000 --pixels=float32
  python scripts/bench_streaming.py --part=processes --data_dir=/tmp/mnist_ar

throughput: the default recipe (K = 8 CNN members, one per simulated CPU device, batch 128) trains --epochs
epochs on the folder read whole (streaming=never), then the same epochs streamed (streaming=always), in one
process after one compiling step, and prints each epoch's member-images/s and the ratio. memory: writes a folder
of random CIFAR-shaped images (32x32x3, --gigabytes of records or --examples of them; uint8 pixels, or float32 in
[0, 1] with --pixels=float32, which training keeps at their precision; kept for the next run), then trains --steps steps
on it streamed and --read_whole_steps steps read whole (K = --ensemble_size members), each in its own
`python -m ensemble.train` under /usr/bin/time (which ends by fitting the flag thresholds on the held-out tenth),
and prints each one's peak resident memory. processes: two processes (scripts/launch_local.py, 4 CPU devices each)
train on the folder streamed with shared batches, and each says how many rows it read for its batches.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np


class _EpochTimes:
  """A loop hook that keeps each epoch's training seconds."""

  def __init__(self):
    self.seconds = []

  def after_steps(self, step):
    pass

  def save_point(self, epoch, position, state, summary):
    self.seconds.append(summary['train_seconds'])

  def close(self):
    pass


def throughput(args):
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={args.cpu_devices}'
  import jax  # pylint: disable=g-import-not-at-top
  from ensemble import data, defaults, host_memory, loop, recipe  # pylint: disable=g-import-not-at-top

  def prepared(config, dataset):
    resolved, devices = recipe.resolve(config, jax.devices(), dataset=dataset)
    return loop.prepare(resolved, devices, dataset)

  host_memory.keep_freed_memory_on_cpu()  # as python -m ensemble.train does
  config = defaults.get_config()
  config.update(num_epochs=args.epochs, eval_every=0)
  warm = defaults.get_config()
  warm.update(num_train_steps=1)
  run = prepared(warm, data.load(data_dir=args.data_dir, streaming='never'))
  loop.train(run, run.init(), progress=False)  # compiles the programs both runs below share
  results = {}
  for streaming in ('never', 'always'):
    dataset = data.load(data_dir=args.data_dir, streaming=streaming)
    run = prepared(config, dataset)
    timer = _EpochTimes()
    loop.train(run, run.init(), hooks=[timer], progress=False)
    images = run.steps_per_epoch * run.recipe.batch_size * run.recipe.ensemble_size
    results[streaming] = [images / s for s in timer.seconds]
    print(f'streaming={streaming}: ' + ', '.join(f'epoch {i + 1} {r:,.0f}' for i, r in enumerate(results[streaming]))
          + ' member-images/s', flush=True)
  total = lambda rates: len(rates) / sum(1 / r for r in rates)
  print(f'streamed / in memory, all epochs: {total(results["always"]) / total(results["never"]):.3f}')


class _Synthetic:
  """Random CIFAR-shaped examples made a batch at a time, the same for the same rows."""

  def __init__(self, size: int, seed: int, pixels: str = 'uint8'):
    self._size, self._seed, self._pixels = size, seed, pixels

  def __len__(self):
    return self._size

  def __getitems__(self, rows):
    rng = np.random.default_rng([self._seed, rows[0], len(rows)])
    images = rng.integers(0, 256, (len(rows), 32, 32, 3), dtype=np.uint8)
    if self._pixels == 'float32':
      images = (images.astype(np.float32) + rng.uniform(0, 1, images.shape).astype(np.float32)) / 256
    return [(image, np.int32(row % 10)) for image, row in zip(images, rows)]

  def __getitem__(self, row):
    return self.__getitems__([row])[0]


def _write_folder(folder: str, gigabytes: float, examples: int, pixels: str):
  from ensemble import data
  from ensemble.data import convert, stream

  examples = examples or int(gigabytes * 1e9 / (32 * 32 * 3 * np.dtype(pixels).itemsize + 4))
  splits = [stream.Records(stream.RandomAccessSource(_Synthetic(n, seed, pixels), f'synthetic {n}'))
            for n, seed in ((examples, 0), (10_000, 1))]
  started = time.perf_counter()
  convert.write(data.Dataset(splits[0], splits[1], 'random CIFAR-shaped images', 10), folder)
  size = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
  print(f'wrote {folder}: {examples:,} + 10,000 examples, {size / 1e9:.2f} GB on disk, in '
        f'{time.perf_counter() - started:.0f} s', flush=True)


def _peak_rss(command: list[str]) -> tuple[float, float]:
  """(peak resident GB, wall seconds) of `command`, from /usr/bin/time -v."""
  started = time.perf_counter()
  done = subprocess.run(['/usr/bin/time', '-v', *command], cwd=REPO, capture_output=True, text=True, check=False)
  if done.returncode:
    sys.exit(f'{" ".join(command)} failed:\n{done.stderr[-3000:]}')
  kilobytes = int(re.search(r'Maximum resident set size \(kbytes\): (\d+)', done.stderr).group(1))
  return kilobytes / 1e6, time.perf_counter() - started


def memory(args):
  if not os.path.isdir(args.folder):
    _write_folder(args.folder, args.gigabytes, args.examples, args.pixels)
  for streaming, steps in (('always', args.steps), ('never', args.read_whole_steps)):
    if not steps:
      continue
    with tempfile.TemporaryDirectory() as workdir:
      command = [sys.executable, '-m', 'ensemble.train', f'--workdir={workdir}', '--config=configs/default.py',
                 f'--config.data_dir={args.folder}', f'--config.streaming={streaming}',
                 f'--config.num_train_steps={steps}', f'--config.ensemble_size={args.ensemble_size}',
                 '--config.augment=crop_flip', '--config.eval_batch_size=500']
      peak, seconds = _peak_rss(command)
    print(f'streaming={streaming}: {steps} steps, peak resident memory {peak:.2f} GB, {seconds:.0f} s in all',
          flush=True)


def processes(args):
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, os.path.join(REPO, 'scripts', 'launch_local.py'), '--num_processes=2',
               '--cpu_devices=4', '--', f'--workdir={workdir}', '--config=configs/default.py',
               f'--config.data_dir={args.data_dir}', '--config.streaming=always', '--config.member_data=shared',
               f'--config.num_train_steps={args.steps}', '--config.eval_batch_size=1000']
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
  if done.returncode:
    sys.exit(f'the two processes failed:\n{done.stdout[-3000:]}')
  counts = re.findall(r'Process (\d) read (\d+) rows of (.*) for its training batches', done.stdout)
  for process, rows, source in sorted(counts):
    print(f'process {process}: read {int(rows):,} rows of {source}')
  print(f'{args.steps} steps of 128 shared rows: {args.steps * 128:,} rows in all, {args.steps * 64:,} each')


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--part', choices=('throughput', 'memory', 'processes'), required=True)
  parser.add_argument('--data_dir', help='throughput, processes: a folder from python -m ensemble.data.convert')
  parser.add_argument('--epochs', type=int, default=2, help='throughput')
  parser.add_argument('--cpu_devices', type=int, default=8, help='throughput')
  parser.add_argument('--folder', help='memory: the folder of CIFAR-shaped images, written if it does not exist')
  parser.add_argument('--gigabytes', type=float, default=2.0, help='memory')
  parser.add_argument('--examples', type=int, default=0, help='memory: training examples (0: as --gigabytes holds)')
  parser.add_argument('--pixels', choices=('uint8', 'float32'), default='uint8', help='memory: the images\' dtype')
  parser.add_argument('--steps', type=int, help='memory (default 300), processes (default 40)')
  parser.add_argument('--ensemble_size', type=int, default=2, help='memory: members of both runs')
  parser.add_argument('--read_whole_steps', type=int, default=20,
                      help='memory: steps of the run on the folder read whole (streaming=never); 0 leaves it out')
  args = parser.parse_args()
  if (args.folder if args.part == 'memory' else args.data_dir) is None:
    parser.error(f'--part={args.part} needs --{"folder" if args.part == "memory" else "data_dir"}')
  args.steps = args.steps or (300 if args.part == 'memory' else 40)
  {'throughput': throughput, 'memory': memory, 'processes': processes}[args.part](args)


if __name__ == '__main__':
  main()
