"""Active learning on MNIST as Gal, Islam and Ghahramani (2017) measured it, or as Kirsch, van Amersfoort and Gal
(2019, "BatchBALD") did, against random acquisition.

  python scripts/active_mnist.py [--protocol=gal|kirsch]
      [--acquisitions=bald,entropy,variation_ratios,batch_bald,random] [--seeds=0,1,2] [--max_labels=300]
      [--epochs=50] [--batch_size=64] [--widths=16,32,128] [--ensemble_size=4] [--candidates=2000]
      [--eval_batch_size=256]
      [--workdir=/tmp/active_mnist] [--data_dir=]

The protocol: 20 initial labels balanced over the classes (2 a class, drawn by
the seed), 10 acquired a round from a pool of the other 59,980 training
images, the whole 10,000-image test set scored every round. Departures, for a
2-core CPU: each round scores `candidates` images of the pool drawn at random
(not all of it), the members are a small CNN (16 and 32 filters, 128 hidden
units by default: `widths`; `ensemble.models.cnn.CNN`) trained from scratch
each round for `epochs` epochs of batches of `batch_size` (64), and the loop
stops at `max_labels`. The
table gives, per acquisition, the labels each seed needed to reach 90% and
95% test accuracy (mean over the seeds that reached it, and how many did),
the accuracy at the last round, and the mean seconds a round spent fitting,
scoring the test set, scoring the pool, choosing the batch, and in the loop itself. Each run
keeps its record in `workdir`/ACQUISITION-SEED, so a stopped benchmark goes
on where it was.

`--protocol=kirsch` is BatchBALD's table (its Table 1, MNIST, batches of
10): BatchBALD and random over 6 seeds to 200 labels, in a workdir of its own, and the
labels to each accuracy given as the paper gives them, the median and the
quartiles over the seeds (numpy's percentiles with method='nearest', a seed
that never reached it counting as beyond `max_labels`), with how many seeds
reached it and the median accuracy at the last round. A flag given on the
command line overrides what the protocol sets. Labels here are the whole
training set's, the 20 initial ones included; the paper's count of the same
round is 10 fewer (its results loader attributes a batch's accuracy from the
batch's first label and counts the labels before it).
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
flags.DEFINE_integer('batch_size', 64, 'Rows a training step (all of them where fewer): a smaller batch takes more '
                     'steps an epoch, which the first rounds\' few labels need.')
flags.DEFINE_list('widths', ['16', '32', '128'], "The CNN's two convolutions' filters and its hidden units.")
flags.DEFINE_integer('eval_batch_size', 256, 'Images a program scores (the test set, the pool): on a CPU this CNN '
                     "scored 10,000 in 1.15 s in batches of 256, 1.85 s in the default's 1,000 (docs/benchmarks.md).")
flags.DEFINE_string('data_dir', '', "MNIST's folder (empty: the bundled or tensorflow-datasets' copy).")
flags.DEFINE_enum('protocol', 'gal', ['gal', 'kirsch'], "Gal et al.'s table (means over the seeds) or Kirsch et "
                  "al.'s (BatchBALD and random, 6 seeds, medians and quartiles).")
FLAGS = flags.FLAGS
# What --protocol=kirsch sets where the command line does not: the flags' values, and the table's form.
KIRSCH = {'acquisitions': ['batch_bald', 'random'], 'seeds': [str(s) for s in range(6)], 'max_labels': 200,
          'workdir': '/tmp/al_kirsch'}
INITIAL, BATCH, TARGETS = 20, 10, (0.90, 0.95)
PARTS = ('fit', 'test', 'pool', 'acquire')  # the rest of a round is the loop's own: reading rows, labels, records


def run(acquisition: str, seed: int, mnist: data.Dataset) -> list[dict]:
  x, y = mnist.train['image'], mnist.train['label']
  rng = np.random.default_rng(seed)
  initial = np.concatenate([rng.choice(np.flatnonzero(y == c), INITIAL // 10, replace=False) for c in range(10)])
  pool = np.setdiff1d(np.arange(len(y)), initial)
  model = CNN(num_classes=10, widths=tuple(int(width) for width in FLAGS.widths))
  result = active_learning.active_learning(
      model, (x[initial], y[initial]), (x[pool], y[pool]),
      (mnist.test['image'], mnist.test['label']), acquisition=acquisition, batch=BATCH,
      rounds=(FLAGS.max_labels - INITIAL) // BATCH, candidates=FLAGS.candidates, seed=seed,
      workdir=os.path.join(FLAGS.workdir, f'{acquisition}-{seed}'), ensemble_size=FLAGS.ensemble_size,
      epochs=FLAGS.epochs, batch_size=FLAGS.batch_size, eval_batch_size=FLAGS.eval_batch_size)
  return result.curve


def labels_to_reach(curve: list[dict], target: float) -> float:
  """The labels of the first round at `target` accuracy; infinite for a run that never reached it, so that the
  quartiles of a protocol whose seeds did not all reach it say so."""
  return next((float(entry['labels']) for entry in curve if entry['accuracy'] >= target), np.inf)


def labels_cell(labels: list[float], quartiles: bool) -> str:
  """The labels each seed needed: their median [25%, 75%] as BatchBALD's results loader takes them (the seeds that
  did not reach it included, beyond the last round), or the mean over the seeds that reached it; and how many did."""
  reached = f'({int(np.isfinite(labels).sum())}/{len(labels)})'
  shown = lambda n: f'{n:.0f}' if np.isfinite(n) else f'> {FLAGS.max_labels}'
  if quartiles:
    median, low, high = np.percentile(labels, (50, 25, 75), method='nearest')
    return f'{shown(median)} [{shown(low)}, {shown(high)}] {reached}'
  finite = [n for n in labels if np.isfinite(n)]
  return f'{shown(np.mean(finite) if finite else np.inf)} {reached}'


def main(argv):
  del argv
  warnings.simplefilter('ignore', EnsembleWarning)  # the batch of 64 exceeds the first rounds' rows, as meant
  quartiles = FLAGS.protocol == 'kirsch'
  if quartiles:
    for name, value in KIRSCH.items():
      if not FLAGS[name].present:
        FLAGS[name].value = value
  mnist = data.load('mnist', FLAGS.data_dir)
  form = 'median [25%, 75%]' if quartiles else 'mean'
  print(f'| acquisition | labels to {TARGETS[0]:.0%}, {form} | labels to {TARGETS[1]:.0%}, {form} '
        f'| accuracy at {FLAGS.max_labels}, {"median" if quartiles else "mean"} '
        '| fit s | test s | pool s | acquire s | loop s |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for acquisition in FLAGS.acquisitions:
    curves = [run(acquisition, int(seed), mnist) for seed in FLAGS.seeds]
    cells = [labels_cell([labels_to_reach(curve, target) for curve in curves], quartiles) for target in TARGETS]
    final = (np.median if quartiles else np.mean)([curve[-1]['accuracy'] for curve in curves])
    seconds = lambda part, curves=curves: np.mean([entry['seconds'].get(part, 0.0) for curve in curves
                                                   for entry in curve])
    loop = np.mean([entry['seconds']['round'] - sum(entry['seconds'].get(p, 0.0) for p in PARTS)
                    for curve in curves for entry in curve])
    print(f'| {acquisition} | {cells[0]} | {cells[1]} | {final:.4f} | {seconds("fit"):.2f} | {seconds("test"):.2f} '
          f'| {seconds("pool"):.2f} | {seconds("acquire"):.3f} | {loop:.3f} |', flush=True)


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/active_mnist.py', lambda: main(argv)))
