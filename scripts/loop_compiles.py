"""What each round of an active-learning loop on MNIST compiles, and its seconds: the cost of programs keyed on data.

  python scripts/loop_compiles.py [--labels=120] [--epochs=50] [--ensemble_size=4] [--candidates=2000] [--batch_size=0]

scripts/active_mnist.py's protocol (20 balanced initial labels, 10 a round, a small CNN, the whole test set scored
every round), one seed, BALD, no workdir (nothing read back); batches of `batch_size`, 0 for the loop's default (the
seed rows' number, 20: an epoch gains a step every other round). A round is what passes between two
calls of the labeller: its fit, its test pass and its pool's scores; the programs it compiles are counted by JAX's
compile events (the persistent compilation cache off: every program compiled here). Run it
on two versions of the package to compare; the counts do not depend on the machine, the seconds do.
"""

import time
import warnings

import jax
from absl import app, flags
import numpy as np

from ensemble import data
from ensemble.errors import EnsembleWarning
from ensemble.loops import active_learning
from ensemble.models.cnn import CNN

flags.DEFINE_integer('labels', 120, 'Stop once this many images are labelled.')
flags.DEFINE_integer('epochs', 50, 'Epochs of every fit.')
flags.DEFINE_integer('ensemble_size', 4, 'Members K.')
flags.DEFINE_integer('candidates', 2000, 'Pool images scored each round, drawn at random.')
flags.DEFINE_integer('batch_size', 0, "Each fit's batch; 0: the loop's default.")
FLAGS = flags.FLAGS
INITIAL, BATCH = 20, 10
COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


def main(argv):
  del argv
  warnings.simplefilter('ignore', EnsembleWarning)  # the batch of 64 exceeds the first rounds' rows, as meant
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **_: compiles.append(seconds) if event == COMPILE_EVENT else None)
  mnist = data.load('mnist')
  x, y = mnist.train['image'], mnist.train['label']
  rng = np.random.default_rng(0)
  initial = np.concatenate([rng.choice(np.flatnonzero(y == c), INITIAL // 10, replace=False) for c in range(10)])
  pool = np.setdiff1d(np.arange(len(y)), initial)
  marks = [(time.perf_counter(), 0)]

  def label(indices, inputs):
    del inputs
    marks.append((time.perf_counter(), len(compiles)))
    return y[pool[indices]]
  result = active_learning.active_learning(
      CNN(num_classes=10, widths=(16, 32, 128)), (x[initial], y[initial]), x[pool],
      (mnist.test['image'], mnist.test['label']), label=label, acquisition='bald', batch=BATCH,
      rounds=(FLAGS.labels - INITIAL) // BATCH, candidates=FLAGS.candidates, seed=0,
      ensemble_size=FLAGS.ensemble_size, epochs=FLAGS.epochs, compilation_cache='',
      **({'batch_size': FLAGS.batch_size} if FLAGS.batch_size else {}))
  print('| labels | programs compiled | compile s | fit s | test s | round s |')
  print('| ---: | ---: | ---: | ---: | ---: | ---: |')
  for (_, before), (_, after), entry in zip(marks, marks[1:], result.curve):
    seconds = entry['seconds']
    print(f'| {entry["labels"]} | {after - before} | {sum(compiles[before:after]):.2f} | {seconds["fit"]:.2f} | '
          f'{seconds["test"]:.2f} | {seconds["round"]:.2f} |')
  print(f'accuracy at {result.curve[-1]["labels"]} labels: {result.curve[-1]["accuracy"]:.4f}; '
        f'{len(compiles)} programs compiled in all, {sum(compiles):.1f} s')


if __name__ == '__main__':
  app.run(main)
