"""Active learning on MNIST as Gal, Islam and Ghahramani (2017) measured it, against random acquisition.

  python scripts/active_mnist.py [--acquisitions=bald,entropy,variation_ratios,batch_bald,random] [--seeds=0,1,2]
      [--max_labels=300] [--epochs=50] [--ensemble_size=4] [--candidates=2000] [--workdir=/tmp/active_mnist]

The protocol: 20 initial labels balanced over the classes (2 a class, drawn by
the seed), 10 acquired a round from a pool of the other 59,980 training
images, the whole 10,000-image test set scored every round. Departures, for a
2-core CPU: each round scores `candidates` images of the pool drawn at random
(not all of it), the members are a small CNN (16 and 32 filters, 128 hidden
units; `ensemble.models.cnn.CNN`) trained from scratch each round for
`epochs` epochs of batches of 64, and the loop stops at `max_labels`. The
table gives, per acquisition, the labels each seed needed to reach 90% and
95% test accuracy (mean over the seeds that reached it, and how many did),
the accuracy at the last round, and the mean seconds a round spent fitting,
scoring the test set, scoring the pool, choosing the batch, and in the loop itself. Each run
keeps its record in `workdir`/ACQUISITION-SEED, so a stopped benchmark goes
on where it was.
"""

import os
import warnings

from absl import flags
import numpy as np

from ensemble import cli, data
from ensemble.loops import active_learning
from ensemble.errors import EnsembleWarning
from ensemble.models.cnn import CNN
import loop_flags

loop_flags.define_flags(['bald', 'entropy', 'variation_ratios', 'batch_bald', 'random'], seeds=3, epochs=50,
                        workdir='/tmp/active_mnist')
flags.DEFINE_integer('max_labels', 300, 'Stop once this many images are labelled.')
flags.DEFINE_integer('candidates', 2000, 'Pool images scored each round, drawn at random.')
FLAGS = flags.FLAGS
INITIAL, BATCH, TARGETS = 20, 10, (0.90, 0.95)
PARTS = ('fit', 'test', 'pool', 'acquire')  # the rest of a round is the loop's own: reading rows, labels, records


def run(acquisition: str, seed: int, mnist: data.Dataset) -> list[dict]:
  x, y = mnist.train['image'], mnist.train['label']
  rng = np.random.default_rng(seed)
  initial = np.concatenate([rng.choice(np.flatnonzero(y == c), INITIAL // 10, replace=False) for c in range(10)])
  pool = np.setdiff1d(np.arange(len(y)), initial)
  result = active_learning.active_learning(
      CNN(num_classes=10, widths=(16, 32, 128)), (x[initial], y[initial]), (x[pool], y[pool]),
      (mnist.test['image'], mnist.test['label']), acquisition=acquisition, batch=BATCH,
      rounds=(FLAGS.max_labels - INITIAL) // BATCH, candidates=FLAGS.candidates, seed=seed,
      workdir=os.path.join(FLAGS.workdir, f'{acquisition}-{seed}'), ensemble_size=FLAGS.ensemble_size,
      epochs=FLAGS.epochs, batch_size=64)
  return result.curve


def labels_to_reach(curve: list[dict], target: float) -> int | None:
  return next((entry['labels'] for entry in curve if entry['accuracy'] >= target), None)


def main(argv):
  del argv
  warnings.simplefilter('ignore', EnsembleWarning)  # the batch of 64 exceeds the first rounds' rows, as meant
  mnist = data.load('mnist')
  print(f'| acquisition | labels to {TARGETS[0]:.0%} | labels to {TARGETS[1]:.0%} | accuracy at {FLAGS.max_labels} '
        '| fit s | test s | pool s | acquire s | loop s |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for acquisition in FLAGS.acquisitions:
    curves = [run(acquisition, int(seed), mnist) for seed in FLAGS.seeds]
    cells = []
    for target in TARGETS:
      reached = [n for n in (labels_to_reach(curve, target) for curve in curves) if n is not None]
      cells.append(f'{np.mean(reached):.0f} ({len(reached)}/{len(curves)})' if reached
                   else f'> {FLAGS.max_labels} (0/{len(curves)})')
    final = np.mean([curve[-1]['accuracy'] for curve in curves])
    seconds = lambda part, curves=curves: np.mean([entry['seconds'].get(part, 0.0) for curve in curves
                                                   for entry in curve])
    loop = np.mean([entry['seconds']['round'] - sum(entry['seconds'].get(p, 0.0) for p in PARTS)
                    for curve in curves for entry in curve])
    print(f'| {acquisition} | {cells[0]} | {cells[1]} | {final:.4f} | {seconds("fit"):.2f} | {seconds("test"):.2f} '
          f'| {seconds("pool"):.2f} | {seconds("acquire"):.3f} | {loop:.3f} |', flush=True)


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/active_mnist.py', lambda: main(argv)))
