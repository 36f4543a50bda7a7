"""Training and evaluation throughput of the ensemble backends against the classic recipe.

  python scripts/benchmark.py --cpu_devices=8 [--data_dir=IDX_FOLDER] [--json=BENCH.json]   # the bundled MNIST
  python scripts/benchmark.py --cpu_devices=8 --model=resnet   # ResNet-20 on arrays of CIFAR-10's shape

Measures, in one process on one machine: member-images/s of training (K members x batch x
steps / seconds, steady state after compilation, median of --repeats timings) for the
reference recipe (scripts/reference_recipe.py, one member per device) and for the trainer's
paths: pmap and jit, each plain (a host batch per step) and fast (resident data, several steps
per dispatch). An ensemble size that divides the device count runs on jit only, twice: on K
devices (one each) and spread over all of them (each member data-parallel over D/K). Also the
ratio of each to the reference, achieved FLOP/s as a fraction of a matmul peak measured in the
same run (the step's FLOPs from XLA's cost analysis of the compiled program), evaluation
throughput and compile time.

`--model=resnet` times ResNet-20 members with crop-and-flip augmentation (configs/cifar10.py's
member) on random uint8 arrays of CIFAR-10's shape: no download, and speed does not depend on
the pixels. The classic recipe is a CNN recipe, so that table has no reference rows.

On CPU the reference runs first, as the classic recipe runs; then the script keeps freed host
memory as `ensemble.train` does at start-up (ensemble/host_memory.py) and times the reference
again ('reference, freed memory kept'), so the table separates the allocator's share of the
trainer's lead from the rest. Ratios are to the first reference.

On CPU the trainer's rows run as `ensemble.train` trains: its train steps compiled with XLA's own
kernels instead of YNNPACK's (`backends.train_program`, docs/speed.md), while the reference rows run
the classic recipe as it runs, with JAX's defaults.

`--dtypes=float32,bfloat16` times each path with both forward-pass dtypes (configs' `dtype`).
`--member_map=vmap|unrolled` forces how a device's members are mapped (the trainer chooses by
platform, `backends.unrolls`), to compare the two on one device.
`--peers` first runs scripts/torch_peers.py in a child process (before JAX takes the GPU's
memory): PyTorch's vmap ensemble and a loop over K models, compiled, channels-last, autocast for
bfloat16, at the first ensemble size and each batch size; the table then gives every row's ratio
to the fastest peer of its dtype. On a GPU host:

  python scripts/benchmark.py --dtypes=float32,bfloat16 --peers --ensemble_sizes=8 --batch_sizes=128
  python scripts/benchmark.py --model=resnet --dtypes=float32,bfloat16 --peers

Imports only jax, flax, optax, numpy and the ensemble modules that need nothing else, so it
runs on a GPU machine without clu, TFDS or ml_collections. On a GPU, leave --cpu_devices out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_recipe  # pylint: disable=g-import-not-at-top,wrong-import-position
from ensemble import backends, data, files, host_memory, steps  # pylint: disable=g-import-not-at-top,wrong-import-position
from ensemble.data import bundled, idx  # pylint: disable=g-import-not-at-top,wrong-import-position
from ensemble.errors import UsageError, exit_with_error  # pylint: disable=g-import-not-at-top,wrong-import-position
from ensemble.models import cnn, resnet  # pylint: disable=g-import-not-at-top,wrong-import-position


def load_data(model: str, data_dir: str, num_train: int) -> data.Dataset:
  """MNIST for the CNN; for the ResNet, random uint8 arrays of CIFAR-10's shape (speed ignores the pixels)."""
  if model == 'cnn':
    return idx.load(data_dir)
  rng = np.random.default_rng(0)
  split = lambda n: {'image': rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                     'label': rng.integers(0, 10, n).astype(np.int32)}
  return data.Dataset(split(num_train), split(1000), 'random arrays of CIFAR-10 shape', num_classes=10)


def make_member(model: str, dataset: data.Dataset, dtype: str = 'float32') -> steps.Member:
  """The member of configs/default.py (CNN) or configs/cifar10.py (ResNet-20 with crop and flip), SGD 0.1."""
  module = cnn.CNN(dataset.num_classes) if model == 'cnn' else resnet.ResNet(20, 1, dataset.num_classes)
  return steps.Member(module, optax.sgd(0.1, 0.9), dataset.image_shape, *data.channel_stats(dataset.train['image']),
                      augment='none' if model == 'cnn' else 'crop_flip', dtype=dtype)


def run_peers(model: str, members: int, batch_sizes: list[int], dtypes: str, repeats: int,
              peer_compile: str = 'auto') -> list[dict]:
  """scripts/torch_peers.py's results, from a child process: PyTorch never shares a process (or the GPU's
  memory, which JAX takes at its start) with JAX here."""
  results = []
  for batch in batch_sizes:
    with tempfile.NamedTemporaryFile(suffix='.json') as out:
      subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'torch_peers.py'),
                      f'--model={model}', f'--members={members}', f'--batch={batch}', f'--dtypes={dtypes}',
                      f'--repeats={repeats}', f'--peer_compile={peer_compile}', f'--json={out.name}'], check=True)
      results += json.load(out)['results']
  return results


def train_flops_per_image(member: steps.Member, batch: int = 64) -> float:
  """FLOPs of one member's train step per image, from XLA:CPU's cost analysis of the step compiled for the host,
  whatever the devices: XLA:GPU hands convolutions to cuDNN as custom calls, which its cost analysis does not
  count (on an H100 it reported 5.21 M for the CNN, whose step the CPU's analysis counts at 25.8 M)."""
  with jax.default_device(jax.devices('cpu')[0]):
    state = member.init(jax.random.key(0))
    images = jnp.zeros((batch, *member.image_shape), jnp.uint8)
    cost = jax.jit(member.train_step).lower(state, images, jnp.zeros((batch,), jnp.int32)).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)['flops'] / batch


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
  """The guide's recipe as it runs: float32 images in [0, 1] on the host, one member per device."""
  split = {'image': split['image'].astype(np.float32) / 255.0, 'label': split['label']}
  state = reference_recipe.create_train_state(
      jax.random.split(jax.random.key(0), len(devices)), 0.1, 0.9)

  def run(n):
    nonlocal state
    state, _, _ = reference_recipe.train_epoch(state, split, batch, jax.random.key(1), max_steps=n)
  first, seconds = _time(run, steps, repeats)
  return {'path': 'reference', 'K': len(devices), 'D': len(devices), 'batch': batch,
          'compile_s': first - seconds / steps,
          'member_images_per_s': len(devices) * batch * steps / seconds}


def bench_backend(name, fast, member, split, test, devices, k, batch, steps, repeats, steps_per_dispatch) -> dict:
  backend = backends.create(name, member=member, devices=devices, ensemble_size=k, member_data='shared')
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
  result = {'path': f'{name}-fast' if fast else name, 'K': k, 'D': len(devices), 'batch': batch,
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
  parser.add_argument('--model', choices=('cnn', 'resnet'), default='cnn',
                      help='cnn: the MNIST CNN on --data_dir; resnet: ResNet-20 on random CIFAR-10-shaped arrays')
  parser.add_argument('--data_dir', default=bundled.DATASETS['mnist'],
                      help='cnn: a folder of MNIST-like IDX files (default: the bundled MNIST)')
  parser.add_argument('--num_train', type=int, default=10_000, help='resnet: training arrays to make')
  parser.add_argument('--ensemble_sizes', default=None, help='default: 8,16,32 (cnn), 8 (resnet)')
  parser.add_argument('--batch_sizes', default=None, help='default: 64,128 (cnn), 128 (resnet)')
  parser.add_argument('--paths', default='pmap,jit,pmap-fast,jit-fast')
  parser.add_argument('--steps', type=int, default=16, help='training steps per timing')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--steps_per_dispatch', type=int, default=8, help='fast paths: steps per dispatch')
  parser.add_argument('--dtypes', default='float32', help="the members' forward-pass dtypes, e.g. float32,bfloat16")
  parser.add_argument('--peers', action='store_true', help="PyTorch's peers too (scripts/torch_peers.py)")
  parser.add_argument('--peer_compile', default='auto', choices=('auto', 'eager', 'compiled', 'both'),
                      help="torch_peers.py's --peer_compile: which forms of the peers' steps to time")
  parser.add_argument('--member_map', default='auto', choices=('auto', 'vmap', 'unrolled'),
                      help="how a device's members are mapped: 'auto' as the trainer does (`backends.unrolls`: "
                      "one after another on a CPU, for convolutions), or forced, to compare: 'vmap' (one grouped "
                      "convolution per layer) or 'unrolled' (one convolution per member, steps unrolled too)")
  parser.add_argument('--json', default='', help='also write the figures to this file (default: print them only)')
  args = parser.parse_args()
  if args.member_map != 'auto':  # an experiment: every program built below maps members this way
    forced = args.member_map == 'unrolled'
    backends.unrolls = lambda devices, member=None: forced
  if args.json:
    try:
      files.check_output('--json', args.json)  # before the minutes of timing, not after
    except UsageError as e:
      exit_with_error(str(e))
  ensemble_sizes = args.ensemble_sizes or ('8,16,32' if args.model == 'cnn' else '8')
  batch_sizes = [int(b) for b in (args.batch_sizes or ('64,128' if args.model == 'cnn' else '128')).split(',')]
  peers = (run_peers(args.model, int(ensemble_sizes.split(',')[0]), batch_sizes, args.dtypes, args.repeats,
                     args.peer_compile)
           if args.peers else [])
  if args.cpu_devices:
    jax.config.update('jax_num_cpu_devices', args.cpu_devices)
  devices = jax.devices()
  dataset = load_data(args.model, args.data_dir, args.num_train)
  split, test = dataset.train, dataset.test
  members = {dtype: make_member(args.model, dataset, dtype) for dtype in args.dtypes.split(',')}
  member = members['float32'] if 'float32' in members else next(iter(members.values()))
  platform = f'{devices[0].platform} x{len(devices)} ({devices[0].device_kind}), {os.cpu_count()} host cores'
  print(f'# {platform}, jax {jax.__version__}; {args.model} on {dataset.source}; members mapped: '
        f'{args.member_map}', flush=True)

  peak = matmul_peak(devices, 2048 if devices[0].platform == 'cpu' else 8192, args.repeats)
  flops_per_image = train_flops_per_image(member)
  print(f'# matmul peak {peak / 1e9:.1f} GFLOP/s; {args.model} train FLOPs/image {flops_per_image / 1e6:.2f} M '
        "(XLA:CPU's cost analysis of the step)", flush=True)

  results = []
  with_reference = args.model == 'cnn'  # the classic recipe is the guide's CNN
  for batch in batch_sizes if with_reference else []:
    results.append(bench_reference(split, devices, batch, args.steps, args.repeats))
    print(results[-1], flush=True)
  # What `ensemble.train` does at start-up on CPU (ensemble/host_memory.py); the reference
  # again with it shows how much of the trainer's lead comes from the allocator.
  if devices[0].platform == 'cpu' and host_memory.keep_freed_memory() and with_reference:
    for batch in batch_sizes:
      results.append(bench_reference(split, devices, batch, args.steps, args.repeats))
      results[-1]['path'] = 'reference, freed memory kept'
      print(results[-1], flush=True)
  for k in [int(k) for k in ensemble_sizes.split(',')]:
    if k % len(devices) and len(devices) % k:
      continue
    # Fewer members than devices (jit only): on K devices, a device each, then spread over all of them.
    placements = [devices] if k >= len(devices) else [devices[:k], devices]
    for batch in batch_sizes:
      for path in args.paths.split(','):
        if k < len(devices) and not path.startswith('jit'):
          continue  # pmap places K = m x D members only
        for placed in placements:
          for dtype, typed in members.items():
            results.append({**bench_backend(path.removesuffix('-fast'), path.endswith('-fast'), typed, split, test,
                                            placed, k, batch, args.steps, args.repeats, args.steps_per_dispatch),
                            'dtype': dtype})
            print(results[-1], flush=True)

  reference = {r['batch']: r['member_images_per_s'] for r in results if r['path'] == 'reference'}
  # The fastest peer per (batch, dtype); the peers train K = the first ensemble size.
  best_peer = {}
  for r in peers:
    key = r['batch'], r['dtype']
    best_peer[key] = max(best_peer.get(key, 0.0), r['member_images_per_s'])
  print('\n| path | dtype | K | devices | batch | member-images/s | vs reference | vs best peer | % of matmul peak | '
        'eval images/s | compile s |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for r in results + [{**r, 'D': 1} for r in peers]:
    r.setdefault('dtype', 'float32')
    r['vs_reference'] = r['member_images_per_s'] / reference[r['batch']] if reference else None
    ratio = f"{r['vs_reference']:.2f}x" if reference else ''
    peer = best_peer.get((r['batch'], r['dtype']))
    r['vs_best_peer'] = r['member_images_per_s'] / peer if peer else None
    peer_ratio = f"{r['vs_best_peer']:.2f}x" if peer else ''
    r['peak_fraction'] = r['member_images_per_s'] * flops_per_image / peak
    eval_rate = f"{r['eval_images_per_s']:.0f}" if 'eval_images_per_s' in r else ''
    print(f"| {r['path']} | {r['dtype']} | {r['K']} | {r['D']} | {r['batch']} | {r['member_images_per_s']:.0f} | "
          f"{ratio} | {peer_ratio} | {100 * r['peak_fraction']:.1f}% | {eval_rate} | {r['compile_s']:.1f} |")
  if args.json:
    files.write_atomically(args.json, json.dumps(
        {'platform': platform, 'jax': jax.__version__, 'model': args.model, 'data': dataset.source,
         'matmul_peak_flops': peak, 'train_flops_per_image': flops_per_image,
         'steps_per_dispatch': args.steps_per_dispatch, 'results': results, 'peers': peers}, indent=2))
    print(f'\nwrote {args.json}')


if __name__ == '__main__':
  main()
