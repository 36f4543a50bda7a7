"""Times `predict` on one batch of images: images/s once its programs are compiled, of a workdir's ensemble or of
every method's.

  python scripts/time_predict.py --workdir=/tmp/mnist [--images=10000] [--batch_size=N] [--repeats=3] \
      [--cpu_devices=8]
  python scripts/time_predict.py --methods=all [--model=cnn] [--ensemble_size=8] [--images=10000]

The images are random pixels of the run's image shape (the time does not depend
on what they show). Prints the compile-and-first-call time, then the best and
the median of `--repeats` timed calls, as images/s. With `--methods`, each
method's ensemble is fitted for 2 epochs on 512 random MNIST-shaped images
(what it predicts does not matter here) and timed alike, as a table: a method
whose members share one network (MIMO, BatchEnsemble, MC dropout) predicts
with the shared part computed once (`backends.predict_members`).
"""

import os
import sys
import time

# Run from a checkout: import the `ensemble` package that sits next to this script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import ensemble  # pylint: disable=g-import-not-at-top
from ensemble import api, cli, host_memory, methods  # pylint: disable=g-import-not-at-top
from ensemble.errors import exit_with_error  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'A folder trained by `python -m ensemble.train`.', allow_override=True)
flags.DEFINE_list('methods', [], "Instead of a workdir: these methods' ensembles ('all': every method).")
flags.DEFINE_string('model', 'cnn', 'With --methods: the model.')
flags.DEFINE_integer('ensemble_size', 8, 'With --methods: the members.')
# What some methods need besides their name, for a 2-epoch fit.
METHOD_FIELDS = {'hyper': {'hyper_learning_rate': (0.05, 0.2)}, 'snapshot': {'snapshot_cycles': 2},
                 'multiswag': {'swag_start': 0.5, 'swag_rank': 2, 'swag_samples': 2},
                 'adversarial': {'method': 'independent', 'adversarial_epsilon': 0.01}}
flags.DEFINE_integer('images', 10_000, 'Images in the batch.')
flags.DEFINE_integer('batch_size', 0, 'Images per device program; default: the run\'s eval_batch_size.')
flags.DEFINE_integer('repeats', 3, 'Timed calls after the first.')
flags.DEFINE_integer('cpu_devices', None, 'Simulate this many CPU devices, as ensemble.train --cpu_devices.')


def timed(model: api.Ensemble) -> tuple[float, list[float]]:
  """(the first call's seconds, the later calls' seconds) of `model.predict` on --images random images."""
  images = np.random.default_rng(0).integers(0, 256, (FLAGS.images, *model.image_shape), dtype=np.uint8)
  start = time.perf_counter()
  model.predict(images)
  first = time.perf_counter() - start
  seconds = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    model.predict(images)
    seconds.append(time.perf_counter() - start)
  return first, seconds


def each_method():
  """A table of every --methods' predict throughput, each ensemble fitted briefly here."""
  names = methods.NAMES + ('adversarial',) if FLAGS.methods == ['all'] else tuple(FLAGS.methods)
  device = jax.devices()[0]
  print(f'{FLAGS.ensemble_size} {FLAGS.model} members, predict on {FLAGS.images:,} images of 28x28x1, '
        f'{len(jax.devices())} {device.platform} device(s) ({device.device_kind}), jax {jax.__version__}\n')
  print('| method | first call (s) | images/s, median | against independent |')
  print('| --- | ---: | ---: | ---: |')
  x = np.random.default_rng(1).integers(0, 256, (512, 28, 28, 1), dtype=np.uint8)
  y = np.random.default_rng(2).integers(0, 10, 512).astype(np.int32)
  baseline = None
  for name in names:
    fields = {'method': name, **METHOD_FIELDS.get(name, {})}
    model = ensemble.fit(FLAGS.model, (x, y), ensemble_size=FLAGS.ensemble_size, epochs=2, batch_size=64,
                         progress=False, **({'eval_batch_size': FLAGS.batch_size} if FLAGS.batch_size else {}),
                         **fields)
    first, seconds = timed(model)
    rate = FLAGS.images / float(np.median(seconds))
    baseline = rate if name == 'independent' else baseline
    print(f'| {name} | {first:.2f} | {rate:,.0f} | {f"{rate / baseline:.2f}x" if baseline else ""} |', flush=True)


def main(argv):
  del argv
  if FLAGS.cpu_devices:
    jax.config.update('jax_num_cpu_devices', FLAGS.cpu_devices)
  host_memory.keep_freed_memory_on_cpu()  # as the CLIs do
  if FLAGS.methods:
    each_method()
    return
  if not FLAGS.workdir:
    exit_with_error('give --workdir (a trained run) or --methods')
  model = api.read(FLAGS.workdir, batch_size=FLAGS.batch_size or None)
  first, seconds = timed(model)
  print(f'{model.size} members on {len(model.devices)} {model.devices[0].platform} devices, batch_size '
        f'{model.batch_size}, {FLAGS.images} images: first call (compiles) {first:.2f} s; then best '
        f'{FLAGS.images / min(seconds):,.0f} images/s, median {FLAGS.images / np.median(seconds):,.0f} images/s')


if __name__ == '__main__':
  cli.start(main)
