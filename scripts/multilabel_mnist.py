"""Multi-label on real images, from the bundled MNIST (no download): 2x2 mosaics of digits, each labelled with which
of the 10 digits it shows; K CNN members against one CNN of a member's size (docs/benchmarks.md, "Multi-label").

  python scripts/multilabel_mnist.py [--train=12000] [--test=4000] [--epochs=6] [--ensemble_size=4] [--seeds=0]

A mosaic is four digits drawn at random (training mosaics from MNIST's training split, test and calibration ones
from its test split), 56x56 pixels; its labels are 1 for each digit among them (one to four of the ten). Each row
trains the built-in CNN (`fit('cnn', ..., task='multilabel')`, the recipe's defaults otherwise) and prints, on the
test mosaics: mAP, the mean per-label NLL, Brier and ECE, subset accuracy and Hamming loss; the mean per-label
coverage and set size of 90% conformal sets fitted on held-out mosaics after a per-label temperature; and the AUROC
of telling the test mosaics from mosaics of an unseen transform (every digit rotated by 90 degrees; the pixels
inverted) by the members' disagreement (mutual information, summed over the labels; a single model has none) and
by the predictive entropy (summed over the labels).
"""

import os
import sys
import time

# Run from a checkout: import the `ensemble` package that sits next to this script (and task_tables beside it).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import ensemble  # pylint: disable=g-import-not-at-top
from ensemble import cli, data  # pylint: disable=g-import-not-at-top
from ensemble.uncertainty import ood  # pylint: disable=g-import-not-at-top
import task_tables  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
task_tables.define_flags('mosaics (test: and as many of each unseen transform)', epochs=6)

DIGITS = 10
# What the mosaics of each unseen transform are made of: MNIST test digits, changed.
TRANSFORMS = {'rotated 90': lambda digits: np.rot90(digits, 1, axes=(1, 2)), 'inverted': lambda digits: 255 - digits}


def mosaics(split: dict, count: int, rng: np.random.Generator, transform=None) -> tuple[np.ndarray, np.ndarray]:
  """`count` 2x2 mosaics (N, 56, 56, 1) uint8 of random digits of `split`, and their labels (N, 10): which digits
  they show."""
  picks = rng.integers(0, len(split['label']), (count, 4))
  digits = split['image'][picks.ravel()][..., 0]  # (4 N, 28, 28)
  if transform is not None:
    digits = transform(digits)
  digits = digits.reshape(count, 2, 2, 28, 28)
  images = digits.transpose(0, 1, 3, 2, 4).reshape(count, 56, 56, 1)
  labels = np.zeros((count, DIGITS), np.int32)
  np.put_along_axis(labels, split['label'][picks], 1, axis=1)
  return np.ascontiguousarray(images), labels


def row(size: int, seed: int, splits: dict) -> dict[str, float]:
  """A row's figures for one seed: `size` members."""
  started = time.perf_counter()
  ens = ensemble.fit('cnn', splits['train'], task='multilabel', ensemble_size=size, epochs=FLAGS.epochs, seed=seed,
                     progress=False)
  seconds = time.perf_counter() - started
  x_test, y_test = splits['test']
  scores = ens.evaluate(x_test, y_test)['ensemble']
  chained = ens.calibrate(*splits['calibration'], per_label=True).conformal(*splits['calibration'], alpha=FLAGS.alpha)
  got = chained.predict(x_test)
  covered = np.take_along_axis(got['set'], y_test[..., None], -1)[..., 0]
  plain = ens.predict(x_test)
  figures = {'map': scores['map'], 'nll': scores['nll'], 'brier': scores['brier'], 'ece': scores['ece'],
             'subset_accuracy': scores['subset_accuracy'], 'hamming_loss': scores['hamming_loss'],
             'coverage': float(covered.mean()), 'set_size': float(got['set'].sum(-1).mean()), 'seconds': seconds}
  for transform, (x_out, _) in splits['unseen'].items():
    out = ens.predict(x_out)
    for key, short in (('mutual_information', 'mi'), ('entropy', 'entropy')):
      figures[f'auroc_{short}/{transform}'] = (ood.auroc(plain[key].sum(-1), out[key].sum(-1))
                                               if size > 1 or short != 'mi' else float('nan'))
  return figures


def main(argv):
  del argv
  rows = task_tables.rows()
  mnist = data.load('mnist')
  results = {name: [] for name in rows}
  for seed in (int(s) for s in FLAGS.seeds):
    rng = np.random.default_rng(seed)
    splits = {'train': mosaics(mnist.train, FLAGS.train, rng), 'test': mosaics(mnist.test, FLAGS.test, rng),
              'calibration': mosaics(mnist.test, FLAGS.calibration, rng),
              'unseen': {name: mosaics(mnist.test, FLAGS.test, rng, transform)
                         for name, transform in TRANSFORMS.items()}}
    for name, size in rows.items():
      results[name].append(row(size, seed, splits))
  task_tables.print_table(results)


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/multilabel_mnist.py', lambda: main(argv)))
