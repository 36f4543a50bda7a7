"""Trains a deep ensemble on MNIST.

  python -m ensemble.train --workdir=/tmp/mnist --config=configs/default.py \
      [--config.backend=jit] [--cpu_devices=8]
"""

import os
import sys

# Silence TensorFlow's C++ start-up chatter; it is only here for clu's TensorBoard writer.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top,g-multiple-import
import jax  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

from ensemble import cli, trainer  # pylint: disable=g-import-not-at-top
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics.jsonl and TensorBoard events go.')
config_flags.DEFINE_config_file('config', None, 'A Python config file with get_config().',
                                lock_config=True)
flags.DEFINE_integer('cpu_devices', None,
                     'Simulate this many CPU devices (jax_num_cpu_devices), e.g. 8 to try an '
                     '8-member ensemble on a laptop. Must be set before jax starts, hence a flag.')
flags.mark_flags_as_required(['workdir', 'config'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.get_absl_logger().addFilter(cli.QuietLibraries())
  if FLAGS.cpu_devices:
    jax.config.update('jax_num_cpu_devices', FLAGS.cpu_devices)
  logging.info('JAX devices: %s', jax.devices())
  try:
    trainer.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main)
