"""Ensembles on one backbone against a deep ensemble, on MNIST: train speed, the members' state in memory, and the
uncertainty each buys (docs/benchmarks.md, "A shared backbone").

  python scripts/backbone.py [--rows=10000] [--test_rows=10000] [--epochs=2] [--ensemble_size=8] \
      [--sections=speed,memory,quality] [--member_data=shuffled|shared] [--augment=shift|none] [--peak]

The backbone is the built-in CNN's convolutions and hidden layer (Conv_0, Conv_1, Dense_0), pretrained by a
1-member fit on the same rows; its head (Dense_1) is what K heads have K of. Rows:

  deep ensemble     K full CNNs from their own keys (`fit('cnn', ...)`)
  heads (frozen)    K heads on one frozen copy of the pretrained backbone (shared=, frozen=, init_params=)
  heads (tuned)     K heads on one copy of it that they train together (shared=, init_params=)
  adapters (r=4)    K rank-4 adapters of its frozen kernels, and K heads (shared=, adapter_rank=4, init_params=)
  heads (tuned, split)  the tuned heads on backend jit, their backbone split over all the devices
                    (shared_sharding='fsdp'): on one device as the tuned heads; on D devices, 1/D of it on each

Speed is the training alone, at steady state: the row's fit again, without its test pass (which is the same work
for every row), after the first has compiled its programs; every row trains the same steps. Memory is the
members' state (parameters and optimizer state) as the backend lays it out on the device that holds the most of it
(on several devices, e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8, every fit uses all of them), and
what `save` writes; with --peak, also the device's peak memory while the row fits, read from the device's
allocator in a fresh process for each row (GPU and TPU report it; a CPU does not).
Quality is on the test split: accuracy, NLL, ECE, and the AUROC of telling the test digits from their pixels
permuted by the members' disagreement (mutual information) and by the predictive entropy.
"""

import os
import sys
import subprocess
import tempfile
import time

# Run from a checkout: import the `ensemble` package that sits next to this script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import ensemble  # pylint: disable=g-import-not-at-top
from ensemble import backends, cli, data, host_memory, loop, scoring  # pylint: disable=g-import-not-at-top
from ensemble.data import arrays  # pylint: disable=g-import-not-at-top
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top
from ensemble.uncertainty import ood  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_integer('rows', 10000, 'MNIST training rows every fit trains on.')
flags.DEFINE_integer('test_rows', 10000, 'MNIST test rows the quality is scored on (10000: the whole test split).')
flags.DEFINE_integer('epochs', 2, 'Epochs of every fit (the pretraining too).')
flags.DEFINE_integer('ensemble_size', 8, 'Members K.')
flags.DEFINE_list('sections', ['speed', 'memory', 'quality'], 'What to measure.')
flags.DEFINE_string('member_data', 'shuffled', "Every fit's batches: 'shuffled' (each member its own order) or "
                    "'shared' (the same batches: a frozen backbone's forward pass is then the same for every member).")
flags.DEFINE_string('augment', 'shift', "Every fit's augmentation: 'shift' (each member its own) or 'none'.")
flags.DEFINE_bool('peak', False, "Also read each row's peak device memory, each row fitted in a fresh process.")
flags.DEFINE_string('only', '', 'Fit this row alone and print its peak device memory in bytes (what --peak runs).')

BACKBONE = ('Conv_0', 'Conv_1', 'Dense_0')
ROWS = {
    'deep ensemble': {},
    'heads (frozen)': {'shared': BACKBONE, 'frozen': BACKBONE},
    'heads (tuned)': {'shared': BACKBONE},
    'adapters (r=4)': {'shared': BACKBONE, 'adapter_rank': 4},
    'heads (tuned, split)': {'shared': BACKBONE, 'backend': 'jit', 'shared_sharding': 'fsdp'},
}


def _fit(train, test, fields, pretrained):
  start = {'init_params': {k: v for k, v in pretrained.items() if k in BACKBONE}} if fields else {}
  return ensemble.fit('cnn', train, test=test, ensemble_size=FLAGS.ensemble_size, epochs=FLAGS.epochs,
                      member_data=FLAGS.member_data, augment=FLAGS.augment, progress=False, **fields, **start)


def _state_bytes(ens, train) -> int:
  """The members' parameters and optimizer state as the backend holds them on its fullest device."""
  devices = jax.devices()[:ens.config.num_devices]
  run = loop.prepare(ens.config, devices, arrays.from_arrays(train, None, 'images', 'classification'))
  state = run.init()
  return backends.bytes_per_device((state.params, state.opt_state))


def _checkpoint_bytes(ens) -> int:
  """The size of what `save` writes (the checkpoint holds a shared part once)."""
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, 'saved')
    ens.save(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _quality(ens, test) -> dict:
  scores = ens.evaluate(*test)['ensemble']
  shifted = scoring.permute_pixels(test[0])
  inside, outside = ens.predict(test[0]), ens.predict(shifted)
  return {'accuracy': scores['accuracy'], 'nll': scores['nll'], 'ece': scores['ece'],
          'auroc_mi': ood.auroc(inside['mutual_information'], outside['mutual_information']),
          'auroc_entropy': ood.auroc(inside['entropy'], outside['entropy'])}


def _peak_megabytes(name: str) -> float:
  """The device's peak memory while `name` fits, pretraining included (the same for every row), in a process of
  its own: the allocator's peak only ever grows within one."""
  argv = [sys.executable, os.path.abspath(__file__), f'--only={name}'] + [
      FLAGS[flag].serialize() for flag in ('rows', 'test_rows', 'epochs', 'ensemble_size', 'member_data', 'augment')]
  done = subprocess.run(argv, capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f'{name}: its peak-memory fit failed:\n{done.stderr[-3000:]}')
  return float(done.stdout.split()[-1]) / 1e6


def _only(train, test, name) -> None:
  """One row's fit after the pretraining, then the device's peak bytes."""
  one = ensemble.fit('cnn', train, ensemble_size=1, epochs=FLAGS.epochs, progress=False)
  _fit(train, test, ROWS[name], jax.tree.map(lambda leaf: np.asarray(leaf)[0], one.params))
  print(jax.devices()[0].memory_stats()['peak_bytes_in_use'])


def main(argv):
  del argv
  if FLAGS.peak and not jax.devices()[0].memory_stats():
    raise UsageError(f"--peak reads the device allocator's peak memory, which {jax.devices()[0].platform} devices "
                     'do not report: run it on a GPU or TPU, or leave --peak out')
  host_memory.keep_freed_memory_on_cpu()
  mnist = data.load('mnist')
  train = (mnist.train['image'][:FLAGS.rows], mnist.train['label'][:FLAGS.rows])
  test = (mnist.test['image'][:FLAGS.test_rows], mnist.test['label'][:FLAGS.test_rows])
  if FLAGS.only:
    return _only(train, test, FLAGS.only)
  print(f'# {jax.devices()[0].device_kind}, jax {jax.__version__}; MNIST, {FLAGS.rows} training rows, '
        f'{FLAGS.epochs} epochs, K={FLAGS.ensemble_size}, the built-in CNN; member_data={FLAGS.member_data}, '
        f'augment={FLAGS.augment}', flush=True)
  started = time.perf_counter()
  one = ensemble.fit('cnn', train, ensemble_size=1, epochs=FLAGS.epochs, progress=False)
  pretrained = jax.tree.map(lambda leaf: np.asarray(leaf)[0], one.params)
  print(f'pretraining (1 member): {time.perf_counter() - started:.1f} s', flush=True)
  print('| ensemble | first fit s | steady fit s | speed-up | state MB | checkpoint MB | peak device MB | accuracy | '
        'NLL | ECE | AUROC (MI) | AUROC (entropy) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
        flush=True)
  reference = None
  for name, fields in ROWS.items():
    started = time.perf_counter()
    ens = _fit(train, test, fields, pretrained)
    first = time.perf_counter() - started
    steady = None
    if 'speed' in FLAGS.sections:
      started = time.perf_counter()
      _fit(train, None, fields, pretrained)  # training alone: the test pass is the same for every row
      steady = time.perf_counter() - started
    reference = reference or steady
    memory = 'memory' in FLAGS.sections
    megabytes = _state_bytes(ens, train) / 1e6 if memory else None
    saved = _checkpoint_bytes(ens) / 1e6 if memory else None
    peak = _peak_megabytes(name) if FLAGS.peak else None
    q = _quality(ens, test) if 'quality' in FLAGS.sections else {}
    cells = [(first, '.1f'), (steady, '.1f'), (steady and reference / steady, '.2f'), (megabytes, '.2f'),
             (saved, '.2f'), (peak, '.1f'), (q.get('accuracy'), '.4f'), (q.get('nll'), '.4f'), (q.get('ece'), '.4f'),
             (q.get('auroc_mi'), '.3f'), (q.get('auroc_entropy'), '.3f')]
    figures = ['–' if value is None else format(value, spec) for value, spec in cells]
    figures[2] += 'x' * (steady is not None)  # the speed-up
    print(f"| {name} | {' | '.join(figures)} |", flush=True)

if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/backbone.py', lambda: main(argv)))
