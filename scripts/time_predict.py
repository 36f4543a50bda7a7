"""Times `ensemble.load(workdir).predict` on one batch of images: images/s once its programs are compiled.

  python scripts/time_predict.py --workdir=/tmp/mnist [--images=10000] [--batch_size=N] [--repeats=3] \
      [--cpu_devices=8]

The images are random pixels of the run's image shape (the time does not depend
on what they show). Prints the compile-and-first-call time, then the best and
the median of `--repeats` timed calls, as images/s.
"""

import os
import sys
import time

# Run from a checkout: import the `ensemble` package that sits next to this script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from ensemble import api, cli, host_memory  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'A folder trained by `python -m ensemble.train`.', allow_override=True)
flags.DEFINE_integer('images', 10_000, 'Images in the batch.')
flags.DEFINE_integer('batch_size', 0, 'Images per device program; default: the run\'s eval_batch_size.')
flags.DEFINE_integer('repeats', 3, 'Timed calls after the first.')
flags.DEFINE_integer('cpu_devices', None, 'Simulate this many CPU devices, as ensemble.train --cpu_devices.')


def main(argv):
  del argv
  if FLAGS.cpu_devices:
    jax.config.update('jax_num_cpu_devices', FLAGS.cpu_devices)
  host_memory.keep_freed_memory_on_cpu()  # as the CLIs do
  model = api.load(FLAGS.workdir, batch_size=FLAGS.batch_size or None)
  images = np.random.default_rng(0).integers(0, 256, (FLAGS.images, *model.image_shape), dtype=np.uint8)
  start = time.perf_counter()
  model.predict(images)
  first = time.perf_counter() - start
  seconds = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    model.predict(images)
    seconds.append(time.perf_counter() - start)
  print(f'{model.size} members on {len(model.devices)} {model.devices[0].platform} devices, batch_size '
        f'{model.batch_size}, {FLAGS.images} images: first call (compiles) {first:.2f} s; then best '
        f'{FLAGS.images / min(seconds):,.0f} images/s, median {FLAGS.images / np.median(seconds):,.0f} images/s')


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir'])
  cli.start(main)
