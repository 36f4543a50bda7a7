"""Out-of-distribution detection by the distance step (`Ensemble.distance`) against the predictive entropy and the
members' disagreement (mutual information): AUROC of each, on a table and on MNIST (docs/benchmarks.md, "Distance").

  python scripts/ood_distance.py [--train=10000] [--epochs=3] [--ensemble_size=4] [--seed=0] [--skip_images]

Table: four overlapping Gaussian blobs in 12 features, 4,000 training rows, the built-in MLP; the
out-of-distribution rows are the 1,000 test rows moved 6 standard deviations of the training data away from its
mean, each feature. Images: the built-in CNN on `--train` digits of the bundled MNIST (no download), scored by
`Ensemble.report` on the test set against the report's own sets (uniform noise, the test images' pixels permuted)
and the test images rotated by 90 degrees. Each distance step is fitted on the training rows.
"""

import os
import sys
import time

# Run from a checkout: import the `ensemble` package that sits next to this script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import ensemble  # pylint: disable=g-import-not-at-top
from ensemble import cli, data, scoring  # pylint: disable=g-import-not-at-top
from ensemble.uncertainty import ood  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer('train', 10000, 'MNIST training images (a subset keeps the run to a few minutes on CPU).')
flags.DEFINE_integer('test', 2000, 'MNIST test images, and images of each out-of-distribution set.')
flags.DEFINE_integer('epochs', 3, 'Epochs of each fit.')
flags.DEFINE_integer('ensemble_size', 4, 'Members.')
flags.DEFINE_integer('seed', 0, 'Seed of the fits and of the table.')
flags.DEFINE_bool('skip_images', False, 'Only the table.')
FLAGS = flags.FLAGS

SCORES = ('distance', 'mutual_information', 'entropy')


def table_row() -> dict[str, float]:
  centres = np.random.default_rng(FLAGS.seed).normal(0, 1.5, (4, 12))

  def blobs(n, seed):
    rng = np.random.default_rng([FLAGS.seed, seed])
    y = rng.integers(0, 4, n)
    return (centres[y] + rng.normal(0, 1, (n, 12))).astype(np.float32), y.astype(np.int32)
  (x, y), (x_test, _) = blobs(4000, 1), blobs(1000, 2)
  far = x_test + 6 * x.std(0) * np.sign(x_test - x.mean(0))
  ens = ensemble.fit('mlp', (x, y), ensemble_size=FLAGS.ensemble_size, epochs=10, standardize_features=True,
                     learning_rate=0.05, seed=FLAGS.seed, progress=False).distance(x, y)
  near, away = ens.predict(x_test), ens.predict(far)
  print(f'table: mean top-class probability {near["probs"].max(-1).mean():.3f} on test rows, '
        f'{away["probs"].max(-1).mean():.3f} on rows 6 std away')
  return {score: ood.auroc(near[score], away[score]) for score in SCORES}


def image_rows() -> dict[str, dict[str, float]]:
  mnist = data.load('mnist')
  rng = np.random.default_rng(FLAGS.seed)
  train = rng.permutation(len(mnist.train['label']))[:FLAGS.train]
  x, y = mnist.train['image'][train], mnist.train['label'][train]
  x_test, y_test = mnist.test['image'][:FLAGS.test], mnist.test['label'][:FLAGS.test]
  start = time.perf_counter()
  ens = ensemble.fit('cnn', (x, y), ensemble_size=FLAGS.ensemble_size, epochs=FLAGS.epochs, seed=FLAGS.seed,
                     progress=False)
  measured = ens.distance(x, y)
  print(f'images: fitted and measured in {time.perf_counter() - start:.0f} s; test accuracy '
        f'{ens.evaluate(x_test, y_test)["ensemble"]["accuracy"]:.4f}')
  sets = {name: make(x_test) for name, make in scoring.OOD_BUILTINS.items()}
  sets['rotated_90'] = np.rint(scoring.rotate(x_test, 90)).astype(np.uint8)
  found = measured.report(x_test, y_test, ood=sets, angles=(), noise=False)['ood']
  return {name: {score: result['ensemble'][score]['auroc'] for score in SCORES} for name, result in found.items()}


def main(argv):
  del argv
  rows = {'table: rows 6 std away': table_row()}
  if not FLAGS.skip_images:
    rows.update({f'MNIST: {name}': row for name, row in image_rows().items()})
  print('| set | distance | mutual information | entropy |')
  print('|---|---|---|---|')
  for name, row in rows.items():
    print(f'| {name} | ' + ' | '.join(f'{row[score]:.3f}' for score in SCORES) + ' |')


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/ood_distance.py', lambda: main(argv)))
