"""Dense classification on real images, from the bundled MNIST (no download): each pixel's class is the digit it
belongs to, the background a class of its own; K segmenter members against one of a member's size
(docs/benchmarks.md, "Segmentation").

  python scripts/segmentation_mnist.py [--train=12000] [--test=4000] [--epochs=4] [--ensemble_size=4] [--seeds=0]

A pixel brighter than half the range is the image's digit (classes 0-9), a black pixel background (class 10), and
the faint pixels in between, the stroke's edges, carry no label (the ignored label, -1): they are left out of the
loss and of every score, as the boundaries of a segmentation benchmark are. Each row trains the built-in segmenter
(`fit('segmenter', ..., task='dense')` with Adam at 3e-3, `RECIPE`) and prints, over the labelled pixels of
the test digits: pixel accuracy, the mean IoU of the 11 classes, NLL, Brier and ECE; the temperature fitted on
held-out digits and the NLL and ECE it leaves; the coverage and mean size of 90% conformal sets fitted on the
held-out digits after it (marginal over the pixels); and how well each
pixel's uncertainty finds the pixels the ensemble gets wrong (the AUROC of the predictive entropy, and of the
members' disagreement, the mutual information, which a single model does not have).
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
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top
from ensemble.uncertainty import ood  # pylint: disable=g-import-not-at-top
import task_tables  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
task_tables.define_flags('digits', epochs=4)

# Adam at 3e-3: with the default recipe's SGD at 0.1, a first version of the segmenter (its context the mean of its
# features) learned in 4 epochs where the strokes are but not which digit they belong to (mIoU 0.14, one member),
# a pixel of a digit being outnumbered six to one by the background's.
RECIPE = {'optimizer': 'adamw', 'learning_rate': 3e-3, 'weight_decay': 0.0}
BACKGROUND = 10  # the class of a black pixel
IGNORED = -1  # a faint pixel's: an edge of the stroke, neither digit nor background
DIGIT_ABOVE = 127  # a pixel brighter than this is the digit's


def segmented(split: dict, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The digits `picks` of `split` (N, 28, 28, 1) uint8 and their labels per pixel (N, 28, 28)."""
  images = split['image'][picks]
  pixels = images[..., 0]
  labels = np.where(pixels > DIGIT_ABOVE, split['label'][picks][:, None, None], IGNORED)
  return images, np.where(pixels == 0, BACKGROUND, labels).astype(np.int32)


def row(size: int, seed: int, splits: dict) -> dict[str, float]:
  """A row's figures for one seed: `size` members."""
  started = time.perf_counter()
  ens = ensemble.fit('segmenter', splits['train'], task='dense', ensemble_size=size, epochs=FLAGS.epochs, seed=seed,
                     progress=False, **RECIPE)
  seconds = time.perf_counter() - started
  x_test, y_test = splits['test']
  scores = ens.evaluate(x_test, y_test)['ensemble']
  labelled = y_test != IGNORED
  calibrated = ens.calibrate(*splits['calibration'])
  scaled = calibrated.evaluate(x_test, y_test)['temperature_scaled']
  sets = calibrated.conformal(*splits['calibration'], alpha=FLAGS.alpha).predict(x_test)['set'][labelled]
  plain = ens.predict(x_test)
  wrong = plain['class'][labelled] != y_test[labelled]
  finds = lambda key: ood.auroc(plain[key][labelled][~wrong], plain[key][labelled][wrong])
  return {'accuracy': scores['accuracy'], 'miou': scores['miou'], 'nll': scores['nll'], 'brier': scores['brier'],
          'ece': scores['ece'], 'temperature': calibrated.temperature, 'nll_scaled': scaled['nll'],
          'ece_scaled': scaled['ece'], 'coverage': float(sets[np.arange(len(sets)), y_test[labelled]].mean()),
          'set_size': float(sets.sum(-1).mean()), 'errors_auroc_entropy': finds('entropy'),
          'errors_auroc_mi': finds('mutual_information') if size > 1 else float('nan'), 'seconds': seconds}


def main(argv):
  del argv
  rows = task_tables.rows()
  mnist = data.load('mnist')
  if FLAGS.train > len(mnist.train['label']) or FLAGS.test + FLAGS.calibration > len(mnist.test['label']):
    raise UsageError(f'--train={FLAGS.train}, --test={FLAGS.test} and --calibration={FLAGS.calibration}: MNIST has '
                     f'{len(mnist.train["label"])} training and {len(mnist.test["label"])} test digits; ask for no '
                     'more')
  results = {name: [] for name in rows}
  for seed in (int(s) for s in FLAGS.seeds):
    rng = np.random.default_rng(seed)
    test = rng.permutation(len(mnist.test['label']))
    splits = {'train': segmented(mnist.train, rng.permutation(len(mnist.train['label']))[:FLAGS.train]),
              'test': segmented(mnist.test, test[:FLAGS.test]),
              'calibration': segmented(mnist.test, test[FLAGS.test:FLAGS.test + FLAGS.calibration])}
    for name, size in rows.items():
      results[name].append(row(size, seed, splits))
  task_tables.print_table(results)


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/segmentation_mnist.py', lambda: main(argv)))
