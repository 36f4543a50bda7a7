"""Class-conditional (Mondrian) conformal sets against one marginal quantile, on the bundled MNIST (no download):
how far each class's coverage strays from 1 - alpha when one quantile serves them all, and how close it stays with a
quantile per class (`Ensemble.conformal(..., class_conditional=True)`; docs/benchmarks.md, "Conformal sets per
class").

  python scripts/conformal_per_class.py [--train=12000] [--test=4000] [--calibration=2000] [--epochs=4]
                                        [--ensemble_size=4] [--seeds=0] [--alpha=0.1]

Two ensembles, each trained once per seed: the default CNN classifying `--train` digits, and the built-in segmenter
on the same digits segmented as scripts/segmentation_mnist.py segments them (a pixel's class its digit's, the
background class 10, the stroke's faint edges unlabelled). Each is calibrated on `--calibration` digits of the test
split and judged on `--test` others: the marginal coverage, the lowest and highest class's coverage, and the mean
set size; the segmenter's also on boundary pixels (a 4-neighbour labelled otherwise, the unlabelled edge included)
and interior ones. A row per quantile: 'marginal' and 'per class'.
"""

import os
import sys

# Run from a checkout: import the `ensemble` package that sits next to this script (and the benchmarks beside it).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import ensemble  # pylint: disable=g-import-not-at-top
from ensemble import cli, data  # pylint: disable=g-import-not-at-top
from ensemble.tasks import dense  # pylint: disable=g-import-not-at-top
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top
import segmentation_mnist  # pylint: disable=g-import-not-at-top  # its flags (task_tables), digits and recipe
import task_tables  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS


def coverage(ens: ensemble.Ensemble, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
  """The chain's conformal sets on labelled `x`: marginal, lowest and highest class's coverage, mean set size; a
  dense ensemble's on boundary and interior positions too."""
  sets, mask = ens.predict(x)['set'], y != segmentation_mnist.IGNORED
  covered = np.take_along_axis(sets[mask], y[mask][:, None], -1)[:, 0]
  classes = [covered[y[mask] == c].mean() for c in np.unique(y[mask])]
  found = {'coverage': covered.mean(), 'min class': min(classes), 'max class': max(classes),
           'set size': sets[mask].sum(-1).mean()}
  if ens.task.per_position:
    boundary = dense.boundary_positions(y)[mask]
    found.update({'boundary': covered[boundary].mean(), 'interior': covered[~boundary].mean()})
  return found


def rows(ens: ensemble.Ensemble, calibration: tuple, test: tuple) -> dict[str, dict[str, float]]:
  return {name: coverage(ens.conformal(*calibration, alpha=FLAGS.alpha, class_conditional=by_class), *test)
          for name, by_class in (('marginal', False), ('per class', True))}


def main(argv):
  del argv
  mnist = data.load('mnist')
  if FLAGS.train > len(mnist.train['label']) or FLAGS.test + FLAGS.calibration > len(mnist.test['label']):
    raise UsageError(f'--train={FLAGS.train}, --test={FLAGS.test} and --calibration={FLAGS.calibration}: MNIST has '
                     f'{len(mnist.train["label"])} training and {len(mnist.test["label"])} test digits; ask for no '
                     'more')
  results = {}
  for seed in (int(s) for s in FLAGS.seeds):
    rng = np.random.default_rng(seed)
    train, test = rng.permutation(len(mnist.train['label']))[:FLAGS.train], rng.permutation(len(mnist.test['label']))
    held, judged = test[FLAGS.test:FLAGS.test + FLAGS.calibration], test[:FLAGS.test]
    digits = lambda split, picks: (split['image'][picks], split['label'][picks])
    classifier = ensemble.fit('cnn', digits(mnist.train, train), ensemble_size=FLAGS.ensemble_size,
                              epochs=FLAGS.epochs, seed=seed, progress=False)
    segmenter = ensemble.fit('segmenter', segmentation_mnist.segmented(mnist.train, train), task='dense',
                             ensemble_size=FLAGS.ensemble_size, epochs=FLAGS.epochs, seed=seed, progress=False,
                             **segmentation_mnist.RECIPE)
    for task, ens, split in (('digits', classifier, digits), ('pixels', segmenter, segmentation_mnist.segmented)):
      for name, found in rows(ens, split(mnist.test, held), split(mnist.test, judged)).items():
        results.setdefault(f'{task}, {name}', []).append(found)
  for task in ('digits', 'pixels'):
    print(f'\n{task} (K={FLAGS.ensemble_size}, alpha={FLAGS.alpha:g}):')
    task_tables.print_table({name: runs for name, runs in results.items() if name.startswith(task)})


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/conformal_per_class.py', lambda: main(argv)))
