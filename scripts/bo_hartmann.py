"""Bayesian optimisation with a regression ensemble on small smooth test functions, against random search and
BoTorch's standard Gaussian process: docs/benchmarks.md's table, one command.

  python scripts/bo_hartmann.py [--functions=hartmann6,branin,levy4] [--rows=ei,random,gp] [--seeds=0,1,2,3,4]
      [--workdir=/tmp/bo_bench]
  python scripts/bo_hartmann.py --functions=ackley20 --rows=ei_tr_q4,turbo_q4,gp_q4 --seeds=0,1,2
  python scripts/bo_hartmann.py --functions=ackley20_2000,levy20_2000 --rows=ei_tr_q50,gp_q50 --seeds=0

Ackley-20 on [-5, 10]^20 is where a GP breaks, as BoTorch's TuRBO tutorial runs
it: 40 initial points, then rounds of 4, 396 evaluations in all (the tutorial's
initial points are Sobol's, these uniform ones, the same for every row).
ackley20_2000 and levy20_2000 (Levy on [-10, 10]^20) are many evaluations, where
an exact GP's refits slow down: 100 initial points, then rounds of 50 to 2,000.

Each function is minimised from `initial` uniform points drawn by the seed
(`np.random.default_rng(seed).uniform(low, high, (initial, D))`, the same for
every row), then the rest of its evaluations chosen by the row:

  ei          `ensemble.bayesian_optimization`'s defaults, nothing set per function
  thompson    the same, acquisition='thompson'
  noise       the defaults but noise=True (members trained by the Gaussian NLL, the mixture's EI)
  no_prior    the defaults but prior=0
  k4, k8, k16  the defaults but ensemble_size=4, 8 (the default before ENSEMBLE_SIZE=16), 16
  prior1, prior10  the defaults but prior=1, 10
  steps100    the defaults but train_steps=100
  rank, log   the defaults but transform='rank', 'log'
  before      da6b8ab's benchmark settings as far as they can still be set (noise=True, prior=0, K=4, 100 epochs
              of batches of 16, 8 starts of 50 steps); its maximiser's candidates about the best and its log EI
              are new and stay
  ei_q5       the defaults in rounds of 5 points chosen jointly (batch=5: greedy q-EI over the members' joint draws)
  ei_q5_k16, ei_q5_k8  batch=5 with ensemble_size=16 (the default), 8: the joint draws span 15 directions, 7
  thompson_q5  acquisition='thompson', batch=5: 5 distinct members' optima a round
  ei_tr_q4    batch=4 in a trust region (trust_region=True: TuRBO's box about the best point)
  thompson_tr_q4  acquisition='thompson', batch=4, trust_region=True (TuRBO-1's own acquisition, by members)
  ei_tr_q4_k8, thompson_tr_q4_k8  the two above with ensemble_size=8
  ei_tr_q50, thompson_tr_q50  the same in rounds of 50 (Thompson's with ensemble_size=50: a member a point)
  ei_q4       batch=4 in the whole box
  tanh        a surrogate of tanh layers (the MLP and its prior), zero initial biases, prior=3
  bias05, bias1, bias2  the MLP and its prior with initial biases N(0, 0.5² / 1 / 2²), not zeros, prior=3
  sin         sine layers with initial biases N(0, 1), prior=3
  scales      each member's own input scales, log-uniform in [0.5, 4] a dimension, for its MLP and its prior
              (zero biases, prior=3)
  maximiser   zero initial biases, prior=3 (the defaults before BIAS), the acquisition maximised harder: 4,000
              candidates, 20 starts of 200 steps
  bias1_k16, bias1_maximiser  bias1 with ensemble_size=16; with the maximiser row's settings
  bias1_prior15, bias1_prior5  bias1 with prior=1.5 (the defaults since: `bayesian_optimization.BIAS`, `PRIOR`), 5
  random      random search
  turbo_q4    TuRBO-1 (Eriksson et al. 2019) as BoTorch's tutorial builds it: an ARD Matern-5/2 GP, Thompson
              samples in a trust region stretched by its lengthscales, 4 a round (`turbo_run`)
  gp_q4, gp_q5  BoTorch's GP in rounds of 4, 5: qLogExpectedImprovement (its default 512 quasi-random draws), the
              points maximised jointly by optimize_acqf(q=...) (10 restarts, 512 raw samples), the GP refitted each
              round; gp_q50 in rounds of 50, greedily (optimize_acqf(sequential=True): jointly, 50 points are 1,000
              variables in 20 dimensions)
  turbo_q50   TuRBO-1 in rounds of 50
  gp          BoTorch: SingleTaskGP on inputs scaled to the unit box and standardised values, its marginal
              likelihood fitted, LogExpectedImprovement maximised by optimize_acqf (10 restarts, 512 raw
              samples). A benchmark-only dependency, never the package's: pip install -e '.[bo]'

The table gives the simple regret (the best value found less the minimum)
at the end of the initial points, halfway and at the end, mean ± standard
deviation over the seeds (the many-evaluation problems: at 100, 500, 1,000
and 2,000); how many evaluations were at a point already
evaluated (all seeds together); and the mean seconds an evaluation spent
fitting and maximising the acquisition. Each ensemble run keeps its record
in `workdir`/FUNCTION-ROW-SEED, and each peer's in FUNCTION-ROW-SEED.json
after every round, so a stopped benchmark goes on where it was.
"""

import functools
import json
import os
import time
import warnings
from typing import Callable, NamedTuple

from absl import flags
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from ensemble import cli
from ensemble.errors import EnsembleWarning
from ensemble.loops import bayesian_optimization, trust_region
from ensemble.models import mlp, prior

flags.DEFINE_list('functions', ['hartmann6', 'branin', 'levy4'], 'Test functions, a table each.')
flags.DEFINE_list('rows', ['ei', 'random', 'gp'], 'Rows: ROWS\' names (the docstring says what each is).')
flags.DEFINE_list('seeds', [str(s) for s in range(5)], 'Seeds; each row is the mean over them.')
flags.DEFINE_string('workdir', '/tmp/bo_bench', 'Where each run keeps its record (and resumes from).')
FLAGS = flags.FLAGS

_A = np.array([[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14], [3, 3.5, 1.7, 10, 17, 8],
               [17, 8, 0.05, 10, 0.1, 14]])
_P = 1e-4 * np.array([[1312, 1696, 5569, 124, 8283, 5886], [2329, 4135, 8307, 3736, 1004, 9991],
                      [2348, 1451, 3522, 2883, 3047, 6650], [4047, 8828, 8732, 5743, 1091, 381]])
_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])


def hartmann6(x: np.ndarray) -> float:
  return -float(np.sum(_ALPHA * np.exp(-np.sum(_A * (x - _P) ** 2, axis=1))))


def branin(x: np.ndarray) -> float:
  b, c, t = 5.1 / (4 * np.pi ** 2), 5 / np.pi, 1 / (8 * np.pi)
  return float((x[1] - b * x[0] ** 2 + c * x[0] - 6) ** 2 + 10 * (1 - t) * np.cos(x[0]) + 10)


def levy(x: np.ndarray) -> float:
  w = 1 + (x - 1) / 4
  middle = np.sum((w[:-1] - 1) ** 2 * (1 + 10 * np.sin(np.pi * w[:-1] + 1) ** 2))
  return float(np.sin(np.pi * w[0]) ** 2 + middle + (w[-1] - 1) ** 2 * (1 + np.sin(2 * np.pi * w[-1]) ** 2))


def ackley(x: np.ndarray) -> float:
  return float(-20 * np.exp(-0.2 * np.sqrt(np.mean(x ** 2))) - np.exp(np.mean(np.cos(2 * np.pi * x))) + 20 + np.e)


class Problem(NamedTuple):
  function: Callable[[np.ndarray], float]
  bounds: list[tuple[float, float]]
  minimum: float
  initial: int
  evaluations: int
  marks: tuple[int, ...] = ()  # where the table reads the regret: the start, halfway and the end unless given


# Surjanovic and Bingham's library of test functions, on their usual boxes.
PROBLEMS = {'hartmann6': Problem(hartmann6, [(0.0, 1.0)] * 6, -3.32237, 10, 50),
            'branin': Problem(branin, [(-5.0, 10.0), (0.0, 15.0)], 0.397887, 8, 24),
            'levy4': Problem(levy, [(-10.0, 10.0)] * 4, 0.0, 8, 40),
            'ackley20': Problem(ackley, [(-5.0, 10.0)] * 20, 0.0, 40, 396),
            # Many evaluations, where an exact GP's refits slow down (Li et al. 2024): rounds of 50 to 2,000.
            'ackley20_2000': Problem(ackley, [(-5.0, 10.0)] * 20, 0.0, 100, 2000, (100, 500, 1000, 2000)),
            'levy20_2000': Problem(levy, [(-10.0, 10.0)] * 20, 0.0, 100, 2000, (100, 500, 1000, 2000))}
ROWS = {'ei': {}, 'thompson': {'acquisition': 'thompson'}, 'noise': {'noise': True}, 'no_prior': {'prior': 0.0},
        'k4': {'ensemble_size': 4}, 'k8': {'ensemble_size': 8}, 'k16': {'ensemble_size': 16}, 'prior1': {'prior': 1.0},
        'prior10': {'prior': 10.0},
        'steps100': {'train_steps': 100}, 'rank': {'transform': 'rank'}, 'log': {'transform': 'log'},
        'before': {'noise': True, 'prior': 0.0, 'ensemble_size': 4, 'epochs': 100, 'batch_size': 16, 'starts': 8,
                   'steps': 50},
        'random': {'acquisition': 'random'}, 'ei_q5': {'batch': 5}, 'ei_q5_k16': {'batch': 5, 'ensemble_size': 16},
        'ei_q5_k8': {'batch': 5, 'ensemble_size': 8},
        'thompson_q5': {'acquisition': 'thompson', 'batch': 5}, 'ei_q4': {'batch': 4},
        'ei_tr_q4': {'batch': 4, 'trust_region': True},
        'thompson_tr_q4': {'acquisition': 'thompson', 'batch': 4, 'trust_region': True},
        'ei_tr_q4_k8': {'batch': 4, 'trust_region': True, 'ensemble_size': 8},
        'thompson_tr_q4_k8': {'acquisition': 'thompson', 'batch': 4, 'trust_region': True, 'ensemble_size': 8},
        'ei_tr_q50': {'batch': 50, 'trust_region': True},
        'thompson_tr_q50': {'acquisition': 'thompson', 'batch': 50, 'trust_region': True, 'ensemble_size': 50}}


def surrogate(activation=nn.relu, input_scales=None, scale=3.0, bias=0.0) -> dict:
  """A row's fields for a surrogate other than the built-in one: the MLP and its randomised prior with another
  activation, initial biases or each member's own input scales, given as a model object (its prior frozen); the
  prior's scale and the biases are a4b95ee's defaults (3, zeros) unless given, as the rows were measured."""
  layers = {'activation': activation, 'bias_init': nn.initializers.normal(bias) if bias else nn.initializers.zeros}
  model = prior.RandomPrior(mlp.Plain(num_classes=2, **layers), mlp.Plain(num_classes=1, **layers), scale,
                            input_scales=input_scales)
  frozen = (prior.PRIOR,) + ((prior.INPUT_SCALES,) if input_scales else ())
  return {'model': model, 'prior': 0.0, 'frozen': frozen}


ROWS.update({'tanh': surrogate(nn.tanh), 'scales': surrogate(input_scales=(0.5, 4.0)),
             'maximiser': {**surrogate(), 'candidates': 4000, 'starts': 20, 'steps': 200},
             'bias1': surrogate(bias=1.0), 'sin': surrogate(jnp.sin, bias=1.0),
             'bias05': surrogate(bias=0.5), 'bias2': surrogate(bias=2.0),
             'bias1_k16': {**surrogate(bias=1.0), 'ensemble_size': 16},
             'bias1_maximiser': {**surrogate(bias=1.0), 'candidates': 4000, 'starts': 20, 'steps': 200},
             'bias1_prior15': surrogate(bias=1.0, scale=1.5), 'bias1_prior5': surrogate(bias=1.0, scale=5.0)})


def ensemble_run(name: str, row: str, seed: int) -> tuple[list[float], dict[str, float], np.ndarray]:
  """The best value after each evaluation, an evaluation's mean seconds fitting and acquiring, and the points."""
  problem = PROBLEMS[name]
  fields = {'model': 'mlp', **ROWS[row]}
  result = bayesian_optimization.bayesian_optimization(
      fields.pop('model'), problem.function, problem.bounds, evaluations=problem.evaluations,
      initial=problem.initial, maximize=False, seed=seed, **fields,
      workdir=os.path.join(FLAGS.workdir, f'{name}-{row}-{seed}'))
  chosen = result.curve[problem.initial:]
  seconds = {part: float(np.mean([e['seconds'].get(part, 0.0) for e in chosen])) for part in ('fit', 'acquire')}
  return [e['best'] for e in result.curve], seconds, result.x


def _botorch():
  """What the GP rows import, or a one-line exit that says how to install it."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    from botorch import fit, models  # pylint: disable=g-import-not-at-top
    from botorch.models import transforms  # pylint: disable=g-import-not-at-top
    from gpytorch.mlls import ExactMarginalLogLikelihood  # pylint: disable=g-import-not-at-top
  except ImportError as error:
    raise SystemExit(f'the gp and turbo rows need BoTorch ({error}): pip install -e ".[bo]" (a benchmark-only '
                     'extra)') from None
  return torch, fit, models, transforms, ExactMarginalLogLikelihood


def _peer_start(problem: Problem, seed: int, path: str | None) -> tuple[list[np.ndarray], list[float], list]:
  """A peer's points, values and [evaluations before, seconds a point] of each round so far: those `path` kept of a
  stopped run (which goes on from its last round, its random draws then not an unstopped run's), or the seed's
  initial points."""
  if path and os.path.exists(path):
    with open(path) as file:
      kept = json.load(file)
    return [np.asarray(x) for x in kept['x']], kept['y'], kept['seconds']
  low, high = (np.asarray(side, np.float64) for side in zip(*problem.bounds))
  xs = list(np.random.default_rng(seed).uniform(low, high, (problem.initial, len(low))))
  return xs, [problem.function(x) for x in xs], []


def _peer_keep(path: str | None, xs: list[np.ndarray], ys: list[float], seconds: list) -> None:
  """Each round's end written whole to `path` (a long run stopped keeps what it reached, and goes on from it)."""
  if path:
    with open(path + '.tmp', 'w') as file:
      json.dump({'x': np.stack(xs).tolist(), 'y': ys, 'seconds': seconds}, file)
    os.replace(path + '.tmp', path)


def _peer_result(ys: list[float], seconds: list, xs: list[np.ndarray]
                 ) -> tuple[list[float], dict[str, float], np.ndarray]:
  return (list(np.minimum.accumulate(ys)), {'fit': float(np.mean([s for _, s in seconds] or [0.0])), 'acquire': 0.0},
          np.stack(xs))


def gp_run(problem: Problem, seed: int, batch: int = 1, sequential: bool = False, path: str | None = None
           ) -> tuple[list[float], dict[str, float], np.ndarray]:
  """BoTorch's standard loop from the same initial points: the GP on the unit box, the values negated (BoTorch
  maximises) and standardised; `batch` > 1: qLogEI's points maximised jointly (`sequential`: greedily, one after
  another, BoTorch's way for large batches), a last round what is left. The seconds are a round's over its
  points; `path` keeps each round's end."""
  torch, fit, models, transforms, ExactMarginalLogLikelihood = _botorch()
  from botorch import optim  # pylint: disable=g-import-not-at-top
  from botorch.acquisition import analytic, logei  # pylint: disable=g-import-not-at-top
  torch.manual_seed(seed)
  low, high = (np.asarray(side, np.float64) for side in zip(*problem.bounds))
  xs, ys, seconds = _peer_start(problem, seed, path)
  unit_box = torch.tensor([[0.0] * len(low), [1.0] * len(low)], dtype=torch.float64)
  while len(ys) < problem.evaluations:
    start = time.perf_counter()
    train_x = torch.tensor((np.stack(xs) - low) / (high - low))
    train_y = -torch.tensor(ys, dtype=torch.float64)[:, None]
    gp = models.SingleTaskGP(train_x, train_y, outcome_transform=transforms.outcome.Standardize(1))
    fit.fit_gpytorch_mll(ExactMarginalLogLikelihood(gp.likelihood, gp))
    size = min(batch, problem.evaluations - len(ys))
    acquisition = (analytic.LogExpectedImprovement(gp, best_f=train_y.max()) if batch == 1 else
                   logei.qLogExpectedImprovement(gp, best_f=train_y.max()))
    points, _ = optim.optimize_acqf(acquisition, bounds=unit_box, q=size, num_restarts=10, raw_samples=512,
                                    sequential=sequential)
    before = len(ys)
    for point in points.detach().numpy():
      xs.append(low + point * (high - low))
      ys.append(problem.function(xs[-1]))
    seconds.append([before, (time.perf_counter() - start) / size])
    _peer_keep(path, xs, ys, seconds)
  return _peer_result(ys, seconds, xs)


def turbo_run(problem: Problem, seed: int, batch: int, path: str | None = None
              ) -> tuple[list[float], dict[str, float], np.ndarray]:
  """TuRBO-1 (Eriksson et al. 2019) as BoTorch's tutorial builds it, from the same initial points: a GP with an ARD
  Matern-5/2 kernel on the unit box, a trust region about the best point (its side replayed by the package's own
  rule, ensemble/loops/trust_region.py, so that both boxes grow and shrink alike) stretched per dimension by the
  GP's lengthscales, and `batch` Thompson samples among 2,000-5,000 candidates that change a random subset of the
  best point's coordinates (each with chance min(1, 20 / D)). `path` keeps each round's end."""
  torch, fit, models, transforms, ExactMarginalLogLikelihood = _botorch()
  from botorch.generation import MaxPosteriorSampling  # pylint: disable=g-import-not-at-top
  from gpytorch import constraints, kernels, likelihoods  # pylint: disable=g-import-not-at-top
  torch.manual_seed(seed)
  low, high = (np.asarray(side, np.float64) for side in zip(*problem.bounds))
  dimensions = len(low)
  xs, ys, seconds = _peer_start(problem, seed, path)
  while len(ys) < problem.evaluations:
    start = time.perf_counter()
    rounds = [[-y for y in ys[n:n + batch]] for n in range(problem.initial, len(ys), batch)]
    size = min(batch, problem.evaluations - len(ys))
    train_x = torch.tensor((np.stack(xs) - low) / (high - low))
    train_y = -torch.tensor(ys, dtype=torch.float64)[:, None]
    kernel = kernels.ScaleKernel(kernels.MaternKernel(
        nu=2.5, ard_num_dims=dimensions, lengthscale_constraint=constraints.Interval(0.005, 4.0)))
    likelihood = likelihoods.GaussianLikelihood(noise_constraint=constraints.Interval(1e-8, 1e-3))
    gp = models.SingleTaskGP(train_x, train_y, covar_module=kernel, likelihood=likelihood,
                             outcome_transform=transforms.outcome.Standardize(1))
    fit.fit_gpytorch_mll(ExactMarginalLogLikelihood(gp.likelihood, gp))
    side = trust_region.side(float(train_y[:problem.initial].max()), rounds, dimensions)
    centre = train_x[train_y.argmax()]
    scales = gp.covar_module.base_kernel.lengthscale.detach().reshape(-1)
    scales = scales / scales.mean() / torch.prod(scales / scales.mean()) ** (1.0 / dimensions)
    box_low = torch.clamp(centre - scales * side / 2, 0.0, 1.0)
    box_high = torch.clamp(centre + scales * side / 2, 0.0, 1.0)
    count = min(5000, max(2000, 200 * dimensions))
    sobol = torch.quasirandom.SobolEngine(dimensions, scramble=True, seed=seed * 100_003 + len(ys))
    moved = box_low + (box_high - box_low) * sobol.draw(count).to(torch.float64)
    changed = torch.rand(count, dimensions, dtype=torch.float64) <= min(1.0, 20.0 / dimensions)
    unchanged = torch.where(changed.sum(1) == 0)[0]
    changed[unchanged, torch.randint(0, dimensions, (len(unchanged),))] = True
    candidates = torch.where(changed, moved, centre.expand(count, dimensions))
    with torch.no_grad():
      points = MaxPosteriorSampling(model=gp, replacement=False)(candidates, num_samples=size)
    before = len(ys)
    for point in points.numpy():
      xs.append(low + point * (high - low))
      ys.append(problem.function(xs[-1]))
    seconds.append([before, (time.perf_counter() - start) / size])
    _peer_keep(path, xs, ys, seconds)
  return _peer_result(ys, seconds, xs)


# The BoTorch rows: how each runs, (problem, seed, path) -> what `ensemble_run` returns.
PEERS = {'gp': gp_run, 'gp_q4': functools.partial(gp_run, batch=4), 'gp_q5': functools.partial(gp_run, batch=5),
         'gp_q50': functools.partial(gp_run, batch=50, sequential=True),
         'turbo_q4': functools.partial(turbo_run, batch=4), 'turbo_q50': functools.partial(turbo_run, batch=50)}


def repeats(x: np.ndarray) -> int:
  """Evaluations at a point evaluated before (to 1e-9 of the box's width)."""
  return sum(bool(np.any(np.all(np.abs(x[:i] - x[i]) < 1e-9, axis=1))) for i in range(1, len(x)))


def main(argv):
  del argv
  warnings.simplefilter('ignore', EnsembleWarning)  # a batch of all the rows while there are few, as meant
  for name in FLAGS.functions:
    problem = PROBLEMS[name]
    marks = problem.marks or [problem.initial, (problem.initial + problem.evaluations) // 2, problem.evaluations]
    os.makedirs(FLAGS.workdir, exist_ok=True)
    print(f'\n{name}: {problem.initial} uniform points + {problem.evaluations - problem.initial} chosen, '
          f'{len(FLAGS.seeds)} seeds\n')
    print(f'| row | {" | ".join(f"regret at {n}" for n in marks)} | repeats | fit s | acquire s |')
    print(f'| --- |{" ---: |" * (len(marks) + 3)}')
    for row in FLAGS.rows:
      runs = [PEERS[row](problem, int(seed), path=os.path.join(FLAGS.workdir, f'{name}-{row}-{seed}.json'))
              if row in PEERS else ensemble_run(name, row, int(seed)) for seed in FLAGS.seeds]
      regret = np.array([[best[n - 1] - problem.minimum for n in marks] for best, _, _ in runs])
      cells = [f'{m:.3f} ± {s:.3f}' for m, s in zip(regret.mean(0), regret.std(0))]
      seconds = {part: np.mean([s[part] for _, s, _ in runs]) for part in ('fit', 'acquire')}
      print(f'| {row} | {" | ".join(cells)} | {sum(repeats(x) for _, _, x in runs)} | {seconds["fit"]:.2f} | '
            f'{seconds["acquire"]:.2f} |', flush=True)
      print(f'  per seed at {marks[-1]}: {" / ".join(f"{r:.3f}" for r in regret[:, -1])} (median '
            f'{np.median(regret[:, -1]):.3f})', flush=True)


if __name__ == '__main__':
  cli.start(lambda argv: cli.run(argv, 'scripts/bo_hartmann.py', lambda: main(argv)))
