"""Trains a deep ensemble on images (MNIST by default), or on a .csv table's feature vectors for regression.

  python -m ensemble.train --workdir=/tmp/mnist --config=configs/default.py \
      [--config.backend=jit] [--cpu_devices=8]

The configs/ of the checkout the package runs from are found from any folder.
Ctrl-C stops a run with one line (exit status 130) that says where it stopped;
the same command resumes it.

On several hosts, run it once per host with the same flags plus
--coordinator_address=HOST0:PORT --num_processes=N --process_id=I (docs/several-hosts.md).
"""

import os
import shlex
import sys

from ensemble import console

console.quiet_libraries()  # before TensorFlow and JAX load
if __name__ == '__main__':  # a workdir another run holds is refused before JAX starts and the data load
  console.refuse_a_busy_workdir(sys.argv[1:])

from absl import flags, logging  # pylint: disable=g-import-not-at-top,g-multiple-import
import jax  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

from ensemble import cli, distributed, host_memory, trainer  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS


def define_flags(required: bool = True):
  """The program's flags, defined when it runs (not on import), as ensemble.evaluate's are: a test process runs
  `main` beside the other programs with `required=False`, where this program's required flags would refuse theirs.
  allow_override lets them define --workdir too."""
  if 'cpu_devices' in FLAGS:
    return
  flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics.jsonl and TensorBoard events go.',
                      allow_override=True)
  config_flags.DEFINE_config_file('config', None, 'A Python config file with get_config().',
                                  lock_config=True)
  flags.DEFINE_integer('cpu_devices', None,
                       'Simulate this many CPU devices (jax_num_cpu_devices), e.g. 8 to try an '
                       '8-member ensemble on a laptop. Must be set before jax starts, hence a flag.')
  flags.DEFINE_string('coordinator_address', None,
                      'HOST:PORT where process 0 runs the jax.distributed coordinator; with --num_processes '
                      'and --process_id, for one process per host. Leave all three out on a cluster that '
                      'jax.distributed detects (SLURM, Open MPI, Cloud TPU), or for a single process.')
  flags.DEFINE_integer('num_processes', None, 'How many processes train the ensemble together.')
  flags.DEFINE_integer('process_id', None, "This process's id, 0 to num_processes - 1; 0 hosts the coordinator.")
  flags.DEFINE_integer('initialization_timeout', 300,
                       'Seconds to wait at start-up for the coordinator and all processes before giving up.')
  flags.DEFINE_integer('heartbeat_timeout', 100,
                       'Seconds after which a silent process counts as dead and the others stop too.')
  if required:
    flags.mark_flags_as_required(['workdir', 'config'])


def _exit(code: int):
  """Exits; in a multi-process run without jax.distributed's shutdown barrier.

  An error that only this process met (its disk is full) leaves the others
  waiting in a collective or in orbax's barrier, where they never reach the
  shutdown barrier, and both sides would wait there for minutes. Gone at
  once, this process stops answering, and the coordination service stops the
  others within --heartbeat_timeout.
  """
  if jax.distributed.is_initialized() and jax.process_count() > 1:
    sys.stdout.flush()
    sys.stderr.flush()
    if code in (cli.TERMINATED, cli.INTERRUPTED):
      distributed.coordinator_last()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)


def main(argv):
  if FLAGS.cpu_devices:  # before JAX picks its backend
    jax.config.update('jax_num_cpu_devices', FLAGS.cpu_devices)
  cli.run(argv, 'ensemble.train', _train, exit_=_exit)


def _train():
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                         initialization_timeout=FLAGS.initialization_timeout,
                         heartbeat_timeout=FLAGS.heartbeat_timeout)
  logging.info('Process %d of %d; JAX devices: %s', jax.process_index(), jax.process_count(), jax.devices())
  # On CPU, XLA's buffers come from malloc: kept mapped, steps stop page-faulting (a setting of the whole process,
  # which ensemble.fit leaves to its caller).
  host_memory.keep_freed_memory_on_cpu()
  try:
    _, summary = trainer.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except KeyboardInterrupt as e:  # Ctrl-C: `cli.run` says this in one line
    if not isinstance(e, trainer.Interrupted):
      raise KeyboardInterrupt(f'stopped before training began; run the same command to go on: {_command()}') from None
    go_on = f'resume from {e.unit} {e.saved_epoch}' if e.saved_epoch else 'start again'
    raise trainer.Interrupted(f'{e}; to {go_on}, run the same command: {_command()}', e.saved_epoch,
                              e.terminated, e.unit) from None
  # The flag thresholds `python -m ensemble.predict` applies are fitted when first needed (and kept), or by
  # `python -m ensemble.evaluate` from the held-out outputs it predicts: not in a second pass here.
  console.log_training_summary(FLAGS.workdir, summary, method=FLAGS.config.method)


def _command() -> str:
  """This program's command line, as the user can run it again."""
  return shlex.join(['python', '-m', 'ensemble.train', *sys.argv[1:]])


if __name__ == '__main__':
  define_flags()
  cli.start(main)
