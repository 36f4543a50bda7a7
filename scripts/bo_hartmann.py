"""Bayesian optimisation of the Hartmann-6 function with a regression ensemble, against random search.

  python scripts/bo_hartmann.py [--acquisitions=ei,thompson,random] [--seeds=0,1,2,3,4] [--evaluations=50]
      [--initial=10] [--ensemble_size=4] [--epochs=100] [--workdir=/tmp/bo_hartmann]

Hartmann-6 on [0, 1]^6 (Surjanovic and Bingham's library of test functions),
minimised: its minimum is -3.32237. Every run starts from `initial` uniform
points drawn by its seed (the same for every acquisition), then evaluates
where the acquisition is highest (`ensemble.bayesian_optimization`: 1,000
uniform candidates, the best 8 refined by 50 Adam steps on the acquisition's
gradient through `Ensemble.apply`), the members an MLP trained from scratch on
every evaluation so far; 'random' is random search. The table gives the simple
regret (the best value found less the minimum) after 10, 20, 30, ... evaluations,
mean and standard deviation over the seeds, and the mean seconds an evaluation
spent fitting and maximising the acquisition. Each run keeps its record in
`workdir`/ACQUISITION-SEED, so a stopped benchmark goes on where it was.
"""

import os
import warnings

from absl import flags
import numpy as np

from ensemble import cli
from ensemble.errors import EnsembleWarning
from ensemble.loops import bayesian_optimization
import loop_flags

loop_flags.define_flags(['ei', 'thompson', 'random'], seeds=5, epochs=100, workdir='/tmp/bo_hartmann')
flags.DEFINE_integer('evaluations', 50, 'Evaluations of the function in all.')
flags.DEFINE_integer('initial', 10, 'Uniform points evaluated first.')
FLAGS = flags.FLAGS

_A = np.array([[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14], [3, 3.5, 1.7, 10, 17, 8],
               [17, 8, 0.05, 10, 0.1, 14]])
_P = 1e-4 * np.array([[1312, 1696, 5569, 124, 8283, 5886], [2329, 4135, 8307, 3736, 1004, 9991],
                      [2348, 1451, 3522, 2883, 3047, 6650], [4047, 8828, 8732, 5743, 1091, 381]])
_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])
MINIMUM = -3.32237


def hartmann6(x: np.ndarray) -> float:
  return -float(np.sum(_ALPHA * np.exp(-np.sum(_A * (x - _P) ** 2, axis=1))))


def main(argv):
  del argv
  warnings.simplefilter('ignore', EnsembleWarning)  # a batch of all the rows while there are few, as meant
  marks = list(range(10, FLAGS.evaluations + 1, 10))
  print(f'| acquisition | {" | ".join(f"regret at {n}" for n in marks)} | fit s | acquire s |')
  print(f'| --- |{" ---: |" * (len(marks) + 2)}')
  for acquisition in FLAGS.acquisitions:
    runs = [bayesian_optimization.bayesian_optimization(
        'mlp', hartmann6, [(0.0, 1.0)] * 6, evaluations=FLAGS.evaluations, initial=FLAGS.initial,
        acquisition=acquisition, maximize=False, seed=int(seed), ensemble_size=FLAGS.ensemble_size,
        epochs=FLAGS.epochs, batch_size=16, workdir=os.path.join(FLAGS.workdir, f'{acquisition}-{seed}'))
            for seed in FLAGS.seeds]
    regret = np.array([[run.curve[n - 1]['best'] - MINIMUM for n in marks] for run in runs])
    seconds = lambda part, runs=runs: np.mean([e['seconds'].get(part, 0.0) for run in runs
                                              for e in run.curve[FLAGS.initial:]])
    cells = [f'{m:.3f} ± {s:.3f}' for m, s in zip(regret.mean(0), regret.std(0))]
    print(f'| {acquisition} | {" | ".join(cells)} | {seconds("fit"):.2f} | {seconds("acquire"):.2f} |', flush=True)


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/bo_hartmann.py', lambda: main(argv)))
