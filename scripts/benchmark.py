"""Training and evaluation throughput of the ensemble backends against the classic recipe.

  python scripts/benchmark.py --cpu_devices=8 --data_dir=../shared/mnist [--json=BENCH.json]

Measures, in one process on one machine: member-images/s of training (K members x batch x
steps / seconds, steady state after compilation, median of --repeats timings) for the
reference recipe (scripts/reference_recipe.py, one member per device) and for the trainer's
paths: pmap and jit, each plain (a host batch per step) and fast (resident data, several steps
per dispatch). Also the ratio of each to the reference, achieved FLOP/s as a fraction of a
matmul peak measured in the same run, evaluation throughput and compile time.

On CPU the reference runs first, as the classic recipe runs; then the script keeps freed host
memory as `ensemble.train` does at start-up (ensemble/host_memory.py) and times the reference
again ('reference, freed memory kept'), so the table separates the allocator's share of the
trainer's lead from the rest. Ratios are to the first reference.

Imports only jax, flax, optax, numpy and the ensemble modules that need nothing else, so it
runs on a GPU machine without clu, TFDS or ml_collections. On a GPU, leave --cpu_devices out.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_recipe  # pylint: disable=g-import-not-at-top,wrong-import-position
from ensemble import backends, data, host_memory, models  # pylint: disable=g-import-not-at-top,wrong-import-position

INPUT_SHAPE = (28, 28, 1)  # MNIST until issue 11 takes the shape from the data


def cnn_train_flops_per_image() -> int:
  """Forward + backward FLOPs of one image through the CNN, counted layer by layer.

  A layer's forward costs 2 x MACs; backward costs the same again for the weight
  gradient and again for the input gradient, except at the first layer, whose
  input (the image) needs no gradient. Pooling, ReLU and softmax are negligible.
  """
  layers = [  # (MACs, is_first_layer)
      (28 * 28 * 32 * 3 * 3 * 1, True),     # conv 32 3x3 on 28x28x1
      (14 * 14 * 64 * 3 * 3 * 32, False),   # conv 64 3x3 on 14x14x32
      (7 * 7 * 64 * 256, False),            # dense 3136 -> 256
      (256 * 10, False),                    # dense 256 -> 10
  ]
  return sum(2 * macs * (2 if first else 3) for macs, first in layers)


def matmul_peak(devices, size: int, repeats: int) -> float:
  """FLOP/s of a large float32 matmul on every device at once: the machine's practical peak."""
  mats = jax.pmap(lambda k: jax.random.normal(k, (size, size)), devices=devices)(
      jax.random.split(jax.random.key(0), len(devices)))
  matmul = jax.pmap(lambda a: a @ a, devices=devices)
  jax.block_until_ready(matmul(mats))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(mats))
    times.append(time.perf_counter() - start)
  return 2 * size ** 3 * len(devices) / statistics.median(times)


def _time(run, steps: int, repeats: int) -> tuple[float, float]:
  """(compile + first call seconds, median seconds per `steps` steps)."""
  start = time.perf_counter()
  run(1)
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run(steps)
    times.append(time.perf_counter() - start)
  return first, statistics.median(times)


def bench_reference(split, devices, batch: int, steps: int, repeats: int) -> dict:
  state = reference_recipe.create_train_state(
      jax.random.split(jax.random.key(0), len(devices)), 0.1, 0.9)

  def run(n):
    nonlocal state
    state, _, _ = reference_recipe.train_epoch(state, split, batch, jax.random.key(1), max_steps=n)
  first, seconds = _time(run, steps, repeats)
  return {'path': 'reference', 'K': len(devices), 'batch': batch, 'compile_s': first - seconds / steps,
          'member_images_per_s': len(devices) * batch * steps / seconds}


def bench_backend(name, fast, split, test, devices, k, batch, steps, repeats, steps_per_dispatch) -> dict:
  backend = backends.create(name, model=models.CNN(), tx=optax.sgd(0.1, 0.9), devices=devices,
                            ensemble_size=k, member_data='shared', input_shape=INPUT_SHAPE)
  state = backend.init(0)
  resident = backend.put_dataset(split) if fast else None
  chunk = steps_per_dispatch if fast else 1
  indices = data.train_batch_indices(len(split['label']), batch, 0, 1, k, 'shared')
  position = 0

  def run(n):  # n dispatches, each of `chunk` steps
    nonlocal state, position
    for _ in range(n):
      if position + chunk > len(indices):
        position = 0
      state, metrics = backends.train_chunk(backend, state, split, resident,
                                            indices[position:position + chunk])
      jax.block_until_ready(metrics)  # as the trainer does: survive many devices on few cores
      position += chunk
  dispatches = max(1, steps // chunk)
  first, seconds = _time(run, dispatches, repeats)
  result = {'path': f'{name}-fast' if fast else name, 'K': k, 'batch': batch,
            'compile_s': first - seconds / dispatches,
            'member_images_per_s': k * batch * dispatches * chunk / seconds}
  if not fast and batch == 128:
    images, labels = test['image'][:1000], test['label'][:1000]
    jax.block_until_ready(backend.eval_step(state, images, labels))
    start = time.perf_counter()
    for _ in range(repeats):
      jax.block_until_ready(backend.eval_step(state, images, labels))
    result['eval_images_per_s'] = 1000 * repeats / (time.perf_counter() - start)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--cpu_devices', type=int, default=None, help='simulate N CPU devices')
  parser.add_argument('--data_dir', default=os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'mnist'))
  parser.add_argument('--ensemble_sizes', default='8,16,32')
  parser.add_argument('--batch_sizes', default='64,128')
  parser.add_argument('--paths', default='pmap,jit,pmap-fast,jit-fast')
  parser.add_argument('--steps', type=int, default=16, help='training steps per timing')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--steps_per_dispatch', type=int, default=8, help='fast paths: steps per dispatch')
  parser.add_argument('--json', default='benchmark.json')
  args = parser.parse_args()
  if args.cpu_devices:
    jax.config.update('jax_num_cpu_devices', args.cpu_devices)
  devices = jax.devices()
  dataset = data.load_idx(args.data_dir)
  split, test = dataset['train'], dataset['test']
  platform = f'{devices[0].platform} x{len(devices)} ({devices[0].device_kind}), {os.cpu_count()} host cores'
  print(f'# {platform}, jax {jax.__version__}', flush=True)

  peak = matmul_peak(devices, 2048 if devices[0].platform == 'cpu' else 8192, args.repeats)
  flops_per_image = cnn_train_flops_per_image()
  print(f'# matmul peak {peak / 1e9:.1f} GFLOP/s; CNN train FLOPs/image {flops_per_image / 1e6:.2f} M', flush=True)

  results = []
  batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
  for batch in batch_sizes:
    results.append(bench_reference(split, devices, batch, args.steps, args.repeats))
    print(results[-1], flush=True)
  # What `ensemble.train` does at start-up on CPU (ensemble/host_memory.py); the reference
  # again with it shows how much of the trainer's lead comes from the allocator.
  if devices[0].platform == 'cpu' and host_memory.keep_freed_memory():
    for batch in batch_sizes:
      results.append(bench_reference(split, devices, batch, args.steps, args.repeats))
      results[-1]['path'] = 'reference, freed memory kept'
      print(results[-1], flush=True)
  for k in [int(k) for k in args.ensemble_sizes.split(',')]:
    if k % len(devices):
      continue
    for batch in batch_sizes:
      for path in args.paths.split(','):
        results.append(bench_backend(path.removesuffix('-fast'), path.endswith('-fast'), split, test,
                                     devices, k, batch, args.steps, args.repeats, args.steps_per_dispatch))
        print(results[-1], flush=True)

  reference = {r['batch']: r['member_images_per_s'] for r in results if r['path'] == 'reference'}
  print('\n| path | K | batch | member-images/s | vs reference | % of matmul peak | eval images/s | compile s |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- |')
  for r in results:
    r['vs_reference'] = r['member_images_per_s'] / reference[r['batch']]
    r['peak_fraction'] = r['member_images_per_s'] * flops_per_image / peak
    eval_rate = f"{r['eval_images_per_s']:.0f}" if 'eval_images_per_s' in r else ''
    print(f"| {r['path']} | {r['K']} | {r['batch']} | {r['member_images_per_s']:.0f} | "
          f"{r['vs_reference']:.2f}x | {100 * r['peak_fraction']:.1f}% | {eval_rate} | {r['compile_s']:.1f} |")
  with open(args.json, 'w', encoding='utf-8') as f:
    json.dump({'platform': platform, 'jax': jax.__version__, 'matmul_peak_flops': peak,
               'train_flops_per_image': flops_per_image, 'steps_per_dispatch': args.steps_per_dispatch,
               'results': results}, f, indent=2)
  print(f'\nwrote {args.json}')


if __name__ == '__main__':
  main()
