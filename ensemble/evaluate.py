"""Evaluates a trained ensemble: accuracy, calibration and robustness to shifts, as numbers and plots.

  python -m ensemble.evaluate --workdir=/tmp/mnist [--data_dir=DIR] [--step=N] [--output_dir=DIR] [--angles=0,90]
                              [--nonoise] [--ood=uniform_noise] [--max_examples=N]

A shell over `ensemble.evaluation.evaluate`: parses the flags, scores the
checkpoint and writes metrics.json, report.md and PNG plots into
WORKDIR/eval. The flags are defined only when this module runs as a program
(`define_flags`), so importing it adds none to a caller's program.
"""

from typing import Sequence

from ensemble import console

console.quiet_libraries()  # before TensorFlow (if tensorflow-datasets loads the data) and JAX load

from absl import flags  # pylint: disable=g-import-not-at-top,g-multiple-import

from ensemble import cli, evaluation, host_memory, scoring  # pylint: disable=g-import-not-at-top
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS


def define_flags():
  """The program's flags; allow_override lets `ensemble.predict` or `ensemble.export` define theirs too."""
  if 'angles' in FLAGS:
    return
  flags.DEFINE_string('workdir', None, 'A folder trained by `python -m ensemble.train`.', allow_override=True)
  flags.DEFINE_string('data_dir', None, 'Folder of IDX files or an .npz file; default: the data the workdir '
                      'was trained with (its data_dir, or its tensorflow-datasets dataset).', allow_override=True)
  flags.DEFINE_integer('step', None, 'The checkpoint (epoch) to evaluate; default: the latest.', allow_override=True)
  flags.DEFINE_string('output_dir', None, 'Where the report goes; default: WORKDIR/eval.')
  flags.DEFINE_list('angles', [str(a) for a in scoring.DEFAULT_ANGLES],
                    'Rotations of the test set, in degrees; --angles= (empty) for none.')
  flags.DEFINE_bool('noise', True, 'Score the test set with Gaussian noise at CIFAR-10-C\'s five severities; '
                    '--nonoise skips them.')
  flags.DEFINE_integer('max_examples', None, 'Score the first this many test examples only; default: all.')
  flags.DEFINE_list('ood', list(evaluation.DEFAULT_OOD), 'Out-of-distribution sets to detect against the test set: '
                    'uniform_noise, permuted_pixels (the test images with their pixels shuffled), tensorflow-datasets '
                    'names, IDX folders or .npz files (their test images); same image shape as the training data. '
                    '--ood= (empty) for none.')
  flags.DEFINE_list(
      'alpha', [str(a) for a in scoring.DEFAULT_ALPHAS],
      'Miscoverage levels of the conformal prediction sets: a set holds the true class with probability at '
      'least 1 - alpha.')
  flags.mark_flags_as_required(['workdir'])


def _parse_angles(values: Sequence[str]) -> list[int]:
  try:
    angles = [int(v) for v in values]
  except ValueError:
    raise UsageError(f'--angles={",".join(values)}: give whole degrees separated by commas, e.g. --angles=0,45,90, '
                     'or --angles= for none') from None
  return angles


def _parse_alphas(values: Sequence[str]) -> list[float]:
  try:
    alphas = [float(v) for v in values]
  except ValueError:
    alphas = []
  if not alphas or not all(0 < a < 1 for a in alphas):
    raise UsageError(f'--alpha={",".join(values)}: give miscoverage levels between 0 and 1 separated by commas, '
                     'e.g. --alpha=0.05,0.01')
  return alphas


def main(argv):
  def body():
    host_memory.keep_freed_memory_on_cpu()
    evaluation.evaluate(FLAGS.workdir, data_dir=FLAGS.data_dir, step=FLAGS.step, output_dir=FLAGS.output_dir,
                        angles=_parse_angles(FLAGS.angles), noise=FLAGS.noise, ood_names=FLAGS.ood,
                        alphas=_parse_alphas(FLAGS.alpha), max_examples=FLAGS.max_examples)
  cli.run(argv, 'ensemble.evaluate', body)  # a damaged checkpoint's failed reads leave closed event loops too


if __name__ == '__main__':
  define_flags()
  cli.start(main)
