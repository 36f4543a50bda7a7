"""Bayesian optimisation with a regression ensemble as the surrogate: find the maximum of an expensive function of
a box-bounded input in few evaluations.

  result = ensemble.bayesian_optimization('mlp', f, bounds=[(0, 1)] * 6, evaluations=50, initial=10,
                                          workdir='/tmp/bo')
  result.best_x, result.best_y, result.curve

After `initial` points drawn uniformly in the box, each round fits the
ensemble (task='regression') on every evaluation so far, maximises the
acquisition over the box and evaluates `function` there (at `batch` points
chosen jointly, where the evaluations can run at once). The surrogate is
made to do what a Gaussian process does on a small smooth problem: fit its
observations (`train_steps` Adam steps a fit however few the points; for a
deterministic function, `noise=False`, members through the points, so that
their disagreement, which the acquisition reads, vanishes there) and be
unsure between and beyond them (a randomised prior per member, `prior`). The
acquisition is maximised by a stated method (`proposer`). Every evaluation is
recorded as the active-learning loop's rounds are (ensemble/loops/record.py):
a stopped loop run again with the same workdir never evaluates a recorded
point twice.
"""

import json
import math
import numbers
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import special, stats

from ensemble import acquire, host_memory, sigterm, tasks
from ensemble.loops import record as record_lib
from ensemble.loops import trust_region as trust_region_lib
from ensemble.models import prior as prior_lib
from ensemble.models.prior import RandomPrior
from ensemble.tasks import regression
from ensemble.errors import UsageError

__all__ = ['Result', 'bayesian_optimization']

ACQUISITIONS = ('ei', 'pi', 'ucb', 'thompson', 'epistemic_std', 'random')
_LOOP_KEYWORDS = ('init', 'workdir', 'test', 'validation', 'early_stopping', 'task')
TRANSFORMS = (None, 'rank', 'log')
# The surrogate's defaults, measured on Hartmann-6 (docs/benchmarks.md, "Bayesian optimisation"): Adam steps per fit,
# members, the randomised prior's scale, and the standard deviation of the built-in MLP's initial biases (its and its
# prior's: `surrogate_model`).
TRAIN_STEPS, ENSEMBLE_SIZE, PRIOR, BIAS = 1000, 16, 1.5, 1.0


class Result(NamedTuple):
  ensemble: Any  # the last fit's Ensemble (None where acquisition='random' fitted none)
  curve: list[dict[str, Any]]  # one entry per evaluation
  x: np.ndarray  # (n, D): every point evaluated, in order
  y: np.ndarray  # (n,): what `function` returned there
  best_x: np.ndarray
  best_y: float


def as_it_ran(kept: dict[str, Any]) -> dict[str, Any]:
  """A loop's recorded settings as this version records them: a record from before `batch`, `trust_region` and
  `ensemble_size` were settings of their own ran one point a round in the whole box, with the members its fit's
  keywords gave or the 8 that were the default before ENSEMBLE_SIZE. Such a record resumes with those, and with
  others is refused as any other change of settings."""
  fit = dict(kept.get('fit', {}))
  return {'batch': 1, 'trust_region': False, 'ensemble_size': fit.pop('ensemble_size', 8), **kept, 'fit': fit}


def _bounds(bounds: Any) -> tuple[np.ndarray, np.ndarray]:
  """[(low, high), ...] per dimension, as scipy.optimize takes them, checked in one line."""
  try:
    array = np.asarray(bounds, np.float64)
  except (TypeError, ValueError):
    array = np.zeros(0)
  if array.ndim != 2 or array.shape[1] != 2 or not len(array):
    raise UsageError(f'bounds={bounds!r}: give one (low, high) pair per dimension of the input, e.g. [(0, 1)] * 6')
  low, high = array[:, 0], array[:, 1]
  if not (np.isfinite(array).all() and (low < high).all()):
    raise UsageError(f'bounds={bounds!r}: each (low, high) must be finite with low < high')
  return low, high



def evaluated(function: Callable, x: np.ndarray) -> float:
  """`function(x)` as one finite float, or a one-line error that says what it returned."""
  value = function(x.copy())
  array = np.asarray(value)
  if array.size != 1 or not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
    raise UsageError(f'function returned {type(value).__name__} {array.shape} at x={x.tolist()}: return one real '
                     'number, the value to maximise')
  result = float(array.reshape(()))
  if not np.isfinite(result):
    raise UsageError(f'function returned {result} at x={x.tolist()}: return a finite number (a failed evaluation '
                     'can return the worst value seen)')
  return result


def proposer(template: Any, name: str, low: np.ndarray, high: np.ndarray, candidates: int, starts: int,
             steps: int, noise: bool, learning_rate: float = 0.05, joint: Callable | None = None
             ) -> Callable[..., tuple[np.ndarray, float]]:
  """f(ens, key, best, best_x, region=None) -> (the point maximising `ens`'s acquisition found, its value), within
  `region` ((low, high) in the unit box, a trust region's: ensemble/loops/trust_region.py) or the whole box.

  `candidates` points scored, half uniform in the box and half scattered
  about the best point so far (at scales from 0.5% to 20% of the box, log-
  uniformly: where an improvement is likeliest once the best is good, and
  what uniform points in six dimensions almost never reach, as BoTorch's
  `sample_around_best`); the best `starts` refined by `steps` steps of Adam on
  the acquisition's gradient in the unit box (clipped to it), its rate decayed
  by a cosine to 1% so that the last steps settle, each start kept where it
  began if its steps ended lower (in the last fits of five Hartmann-6 runs, a
  fifth of the maximisations' refined best was below their best candidate,
  by up to 0.65 in log EI). EI is climbed in logs
  (`acquire.log_expected_improvement`), which has a gradient where EI has
  underflowed to 0. Without `noise`, the members are posterior draws of a
  deterministic function: the acquisition reads the Gaussian of their means'
  mean and spread (their own variances, untrained, are no noise), except
  Thompson's, which draws a member, and epistemic_std, the spread itself.

  One program, compiled once for every ensemble of `template`'s shapes (a
  loop's fits): the ensemble's parameters, state and statistics are its
  arguments (`Ensemble.apply_variables`), not its constants.

  `joint(members' (means, variances), key, context) -> (N,)` replaces the
  score (in logs for 'ei'), `context` any arrays, given where `best` is: what
  `batch_proposer` climbs for each point after a batch's first. The program
  is `run.program`, to be called inside another; its last argument, `taken`
  (M, D) in the unit box, are points it must not propose again (within
  `TAKEN`): a round's points so far, where the score does not already
  vanish there."""
  score = acquire.REGRESSION[name]
  if name == 'ei':
    score = lambda outputs, key, best: acquire.log_expected_improvement(outputs, best)
  score = joint or score
  low_j, width = jnp.asarray(low, jnp.float32), jnp.asarray(high - low, jnp.float32)
  dimensions, near = len(low), candidates // 2

  def surrogate(variables, params, unit):
    means, variances = template.apply_variables(variables, params, low_j + unit * width)
    if noise or name in ('thompson', 'epistemic_std') or joint:  # what reads the members themselves
      return means, variances
    scale = variables['statistics'].get('target_std', jnp.ones(1)) ** 2  # the floor in the targets' units
    return means.mean(0, keepdims=True), means.var(0, keepdims=True) + regression.VARIANCE_FLOOR * scale

  @jax.jit
  def propose(variables, params, key, best, best_unit, region_low, region_high, taken=None):
    uniform_key, near_key, scale_key, acquisition_key = jax.random.split(key, 4)

    def values(unit):
      scores = score(surrogate(variables, params, unit), acquisition_key, best)
      if taken is None:
        return scores
      apart = jnp.max(jnp.abs(unit[:, None] - taken[None]), -1)  # (N, M): the largest coordinate's difference
      return jnp.where(jnp.min(apart, -1) < TAKEN, -jnp.inf, scores)
    scales = jnp.exp(jax.random.uniform(scale_key, (near, 1), minval=math.log(0.005), maxval=math.log(0.2)))
    uniform = jax.random.uniform(uniform_key, (candidates - near, dimensions))
    unit = jnp.concatenate([
        region_low + uniform * (region_high - region_low),
        jnp.clip(best_unit + scales * jax.random.normal(near_key, (near, dimensions)), region_low, region_high)])
    unit = unit[acquire.top(values(unit), starts)]
    optimizer = optax.adam(optax.cosine_decay_schedule(learning_rate, max(steps, 1), alpha=0.01))
    gain = lambda u: -jnp.sum(values(u))  # each start's own value: their gradients are apart

    def step(carry, _):
      u, state = carry
      grads = jax.grad(gain)(u)
      updates, state = optimizer.update(grads, state, u)
      return (jnp.clip(optax.apply_updates(u, updates), region_low, region_high), state), None
    (refined_unit, _), _ = jax.lax.scan(step, (unit, optimizer.init(unit)), None, length=steps)
    unit = jnp.concatenate([unit, refined_unit])  # a start whose steps went downhill keeps where it began
    refined = values(unit)
    best_index = jnp.argmax(refined)
    value = jnp.exp(refined[best_index]) if name == 'ei' else refined[best_index]
    return low_j + unit[best_index] * width, value

  def run(ens, key, best, best_x, region=None):
    unit = jnp.asarray((best_x - low) / (high - low), jnp.float32)
    point, value = propose(ens.variables, ens.params, key, jnp.float32(best), unit, *_region(region, dimensions))
    return np.clip(np.asarray(point, np.float64), low, high), float(value)
  run.program = propose
  run.unit = lambda point: (point - low_j) / width  # a point the program returned, in the unit box
  return run


# Joint draws of a batch's values that its greedy expected improvement averages over (BoTorch's qEI takes 256-512).
JOINT_DRAWS = 256
# How near (in the unit box, every coordinate) a proposal may come to a point its round has taken: two members'
# optima clipped to the same corner of the box were one point evaluated twice.
TAKEN = 1e-6
BATCH_ACQUISITIONS = ('ei', 'thompson', 'random')


def _region(region: tuple[np.ndarray, np.ndarray] | None, dimensions: int) -> tuple[np.ndarray, np.ndarray]:
  """Where a proposal may be, (low, high) in the unit box: a trust region's, or the whole box."""
  return region or (np.zeros(dimensions, np.float32), np.ones(dimensions, np.float32))


def _members(outputs: Any) -> tuple[jax.Array, jax.Array]:
  """The members' (means, variances) at N points, each (K, N): one target's."""
  return tuple(jnp.reshape(array, array.shape[:2]) for array in outputs)


def batch_proposer(template: Any, name: str, low: np.ndarray, high: np.ndarray, candidates: int, starts: int,
                   steps: int, noise: bool, batch: int
                   ) -> Callable[[Any, jax.Array, float, np.ndarray], tuple[np.ndarray, list[float]]]:
  """f(ens, key, best, best_x, region=None) -> ((batch, D) points chosen jointly, their values), each maximised as
  `proposer`'s, in its `region`.

  'ei': greedy q-EI. The members are K joint draws of the function, so the
  Gaussian they span (their mean, and their deviations from it as the
  covariance's factor: K - 1 directions) is a joint posterior over any set
  of points, as a GP's is. Its `JOINT_DRAWS` draws are fixed for the round
  (sample average approximation); the first point is `proposer`'s, and each
  next one maximises the expected improvement of the batch's best over what
  the points before it reach in each draw (the draw's own threshold, its
  Gaussian part for the noise, or the variance floor, in closed form and in
  logs): a point next to one chosen gains little where the draws agree they
  move together, and the point itself nothing. 'thompson': the optima of
  `batch` distinct members drawn at random (each a draw of the function),
  each apart from the round's points before it (`TAKEN`).

  One program for every ensemble of `template`'s shapes, as `proposer`'s."""
  if name == 'thompson':
    joint = lambda outputs, key, member: _members(outputs)[0][member]
  else:
    def joint(outputs, key, context):
      threshold, weights, floor = context
      means, variances = _members(outputs)
      variance = variances.mean(0) if noise else floor
      draws = _drawn(means, weights)
      return acquire.log_expected_improvement((draws, jnp.broadcast_to(variance, draws.shape)), threshold[:, None])
  single = proposer(template, name, low, high, candidates, starts, steps, noise)
  chosen = proposer(template, name, low, high, candidates, starts, steps, noise, joint=joint)

  size = template.size  # the members

  @jax.jit
  def propose(variables, params, key, best, best_unit, *region):
    if name == 'thompson':  # each member's optimum apart from the points the round took before it
      order = jax.random.permutation(jax.random.fold_in(key, batch), size)

      def optimum(taken, j):
        point, value = chosen.program(variables, params, jax.random.fold_in(key, j), order[j], best_unit, *region,
                                      taken)
        return taken.at[j].set(chosen.unit(point)), (point, value)
      away = jnp.full((batch, len(low)), 2.0)  # outside the unit box: nothing taken yet
      return jax.lax.scan(optimum, away, jnp.arange(batch))[1]
    first, value = single.program(variables, params, key, best, best_unit, *region)
    weights_key, noise_key = jax.random.split(jax.random.fold_in(key, batch))
    weights = jax.random.normal(weights_key, (JOINT_DRAWS, size))
    noises = jax.random.normal(noise_key, (batch, JOINT_DRAWS))
    floor = regression.VARIANCE_FLOOR * variables['statistics'].get('target_std', jnp.ones(1))[0] ** 2

    def reached(point, noise_draws):  # (JOINT_DRAWS,): each draw's value at `point`, its noise drawn
      means, variances = _members(template.apply_variables(variables, params, point[None]))
      variance = variances.mean(0) if noise else floor
      return _drawn(means, weights)[:, 0] + jnp.sqrt(variance) * noise_draws

    def step(threshold, j):
      point, gain = chosen.program(variables, params, jax.random.fold_in(key, j), (threshold, weights, floor),
                                   best_unit, *region)
      return jnp.maximum(threshold, reached(point, noises[j])), (point, gain)
    _, (points, gains) = jax.lax.scan(step, jnp.maximum(best, reached(first, noises[0])), jnp.arange(1, batch))
    return jnp.concatenate([first[None], points]), jnp.concatenate([value[None], gains])

  def run(ens, key, best, best_x, region=None):
    unit = jnp.asarray((best_x - low) / (high - low), jnp.float32)
    points, values = propose(ens.variables, ens.params, key, jnp.float32(best), unit, *_region(region, len(low)))
    return np.clip(np.asarray(points, np.float64), low, high), np.asarray(values, np.float64).tolist()
  return run


def _drawn(means: jax.Array, weights: jax.Array) -> jax.Array:
  """(S, N): S joint draws of the Gaussian the K members' means (K, N) span, one a row of `weights` (S, K), standard
  normals: their mean plus the weighted deviations from it / sqrt(K), whose variance is the members' spread."""
  mean = means.mean(0)
  return mean + weights @ (means - mean) / math.sqrt(means.shape[0])


def rounds_of(evaluations: int, initial: int, batch: int) -> list[tuple[int, int]]:
  """(first evaluation, evaluations) of each round: the initial points one at a time, then `batch` at a time, the
  last round what is left."""
  uniform = min(initial, evaluations)
  return [(n, 1) for n in range(uniform)] + [(n, min(batch, evaluations - n))
                                             for n in range(uniform, evaluations, batch)]


def transformed(values: np.ndarray, transform: str | None) -> np.ndarray:
  """The values to maximise as the surrogate is fitted to them: as they are (None); 'rank', their ranks mapped to
  a standard normal's quantiles (a Gaussian copula: only their order counts, so one extreme value cannot flatten
  the rest); 'log', -log(best - value + s), s a tenth of their standard deviation (or 1 where all are equal):
  the differences among the best values stretched and the worst ones' compressed, for a function whose values
  span orders of magnitude. Both keep the order, so the best point is the same and EI improves on its image."""
  if transform is None:
    return values
  if transform == 'rank':
    ranks = stats.rankdata(values)  # ties share their mean rank
    return special.ndtri((ranks - 0.5) / len(values))
  spread = float(np.std(values)) / 10 or 1.0
  return -np.log(values.max() - values + spread)


def surrogate_model(model: Any, prior: float) -> Any:
  """`model` as each fit takes it: with `prior` > 0, the built-in MLP plus a randomised prior of its kind
  (ensemble/models/prior.py); a model of the caller's is taken as it is, and a prior for it is refused.

  Both networks start with biases drawn N(0, BIAS²), not zeros: a ReLU network without biases is positively
  homogeneous (f(c x) = c f(x)), so each prior vanishes at the standardised inputs' origin, the points' mean, and
  grows linearly away from it. The members' spread then was least amid the points and most at the box's corners,
  where EI sent a third to a half of the chosen coordinates. Random biases put each unit's kink anywhere in the
  inputs and the prior's spread about level over the box, as a stationary GP's is."""
  if not prior:
    return model
  if model != 'mlp':
    raise UsageError(f'prior={prior} adds a random network to the built-in model, and model={model!r} is another: '
                     "give model='mlp', or prior=0 for a model of your own")
  from ensemble.models import mlp  # pylint: disable=g-import-not-at-top
  layers = {'bias_init': nn.initializers.normal(BIAS)}
  return RandomPrior(mlp.Plain(num_classes=2, **layers), mlp.Plain(num_classes=1, **layers), float(prior))


@sigterm.stops_in_one_line
def bayesian_optimization(model: Any, function: Callable, bounds: Any, *, evaluations: int = 50, initial: int = 10,
                          acquisition: str = 'ei', batch: int = 1, noise: bool = False, prior: float | None = None,
                          train_steps: int | None = None, transform: str | None = None, candidates: int = 1000,
                          starts: int = 10, steps: int = 100, trust_region: bool = False, maximize: bool = True,
                          warm: bool = False, workdir: str | None = None, seed: int = 0, **fit_fields) -> Result:
  """Evaluates `function` `evaluations` times in all, at `initial` uniform points of `bounds` and then where the
  ensemble's `acquisition` ('ei', 'pi', 'ucb', 'thompson', 'epistemic_std'; 'random': random search, no fit) is
  highest; returns the ensemble, the record and the best point.

  `function(x) -> float` takes one point, a (D,) float64 array within
  `bounds` ([(low, high)] per dimension); `maximize=False` minimises it.
  `noise=False` (the default) says it is deterministic: its value at a point
  is known once evaluated, so the members are fitted through the points (loss
  'mse') and the acquisition reads their disagreement alone, which vanishes
  there: a point is not evaluated twice. `trust_region=True` maximises the
  acquisition in a box about the best point that grows while rounds improve on
  it and shrinks while they do not (TuRBO's; ensemble/loops/trust_region.py):
  for many dimensions, where a global acquisition spends its evaluations on the
  domain's far corners. `noise=True`: each member also
  predicts the noise (the Gaussian NLL) and the acquisition takes the members'
  mixture. `prior` scales each member's randomised prior (a fixed random
  network added to it; 0: none), what puts the members' disagreement between
  and beyond the points; None: 1.5 for the built-in 'mlp' (whose networks then
  start from random biases, `surrogate_model`), none for a model of
  the caller's (which has no prior network of its kind). Each fit is `train_steps` steps (1,000; batches of
  the `initial` points' number of rows), whatever the number of points, unless
  `epochs=` is given. `transform` (None, 'rank', 'log') is what the members are
  fitted to (`transformed`). `model` and `fit_fields` are `ensemble.fit`'s
  (ensemble_size=, 16 by default; ...; the task is regression). `warm` starts
  each fit from the last one's members; `workdir` keeps the record and resumes
  from it; `seed` seeds the initial points, the fits and the acquisition's
  draws.

  `batch` points are evaluated a round, chosen jointly from one fit
  (`batch_proposer`: 'ei', 'thompson' or 'random'), for evaluations that can
  run at once; `evaluations` counts them all, a last round taking what is
  left. Each keeps its own entry of the record, with its 'round' (0: the
  initial points), answered and recorded one by one: a loop stopped inside a
  round resumes to the same points.
  """
  from ensemble import api  # pylint: disable=g-import-not-at-top
  from ensemble.trained import check_flag  # pylint: disable=g-import-not-at-top
  if not callable(function):
    raise UsageError(f'function={type(function).__name__}: give the function to maximise, f(x) -> float')
  for key in _LOOP_KEYWORDS:
    if key in fit_fields:
      raise UsageError(f'{key}= is set by the loop for each fit (task=\'regression\'; warm=True starts each from the '
                       'last); leave it out')
  if acquisition not in ACQUISITIONS:
    raise UsageError(f'acquisition={acquisition!r}: give one of {", ".join(ACQUISITIONS)}')
  if trust_region is True and acquisition == 'random':
    raise UsageError("trust_region=True narrows where the acquisition is maximised, and acquisition='random' has "
                     "none: give another acquisition, or trust_region=False")
  if transform not in TRANSFORMS:
    raise UsageError(f'transform={transform!r}: give None (the values as they are), \'rank\' or \'log\'')
  if prior is None:
    prior = PRIOR if isinstance(model, str) and model == 'mlp' else 0.0
  if isinstance(prior, bool) or not isinstance(prior, numbers.Real) or not 0 <= prior < math.inf:
    raise UsageError(f'prior={prior!r} must be a number >= 0 (the random prior network\'s scale; 0: none)')
  low, high = _bounds(bounds)
  whole = record_lib.whole_number
  evaluations, initial = whole('evaluations', evaluations, 1), whole('initial', initial, 1)
  candidates, seed = whole('candidates', candidates, 1), whole('seed', seed, 0)
  starts, steps = whole('starts', starts, 1), whole('steps', steps, 0)
  batch = whole('batch', batch, 1)
  if batch > 1 and acquisition not in BATCH_ACQUISITIONS:
    raise UsageError(f'batch={batch} chooses points jointly by {", ".join(BATCH_ACQUISITIONS)}, and '
                     f'acquisition={acquisition!r} one at a time: give one of those, or batch=1')
  epochs_given = [key for key in ('epochs', 'num_epochs', 'num_train_steps') if key in fit_fields]
  if train_steps is not None and epochs_given:
    raise UsageError(f'train_steps={train_steps} and {epochs_given[0]}= both say how long each fit trains: give one')
  train_steps = None if epochs_given else whole('train_steps', TRAIN_STEPS if train_steps is None else train_steps, 1)
  if starts > candidates:
    raise UsageError(f'starts={starts} refines that many of the candidates={candidates}: give starts <= candidates')
  for name, value in (('maximize', maximize), ('warm', warm), ('noise', noise), ('trust_region', trust_region)):
    check_flag(name, value)
  surrogate = surrogate_model(model, prior) if acquisition != 'random' else model
  defaults = {'ensemble_size': ENSEMBLE_SIZE, **({} if noise else {'loss': 'mse'}),
              **({'frozen': (prior_lib.PRIOR,)} if surrogate is not model else {})}
  fields = record_lib.fit_fields({**defaults, **fit_fields, 'task': tasks.DEFAULT_FOR_TARGETS}, initial)
  settings = {'loop': 'bayesian_optimization', 'acquisition': acquisition, 'bounds': np.stack([low, high], 1).tolist(),
              'evaluations': evaluations, 'initial': initial, 'candidates': candidates, 'starts': starts,
              'steps': steps, 'maximize': maximize, 'warm': warm, 'seed': seed, 'noise': noise, 'prior': prior,
              'train_steps': train_steps, 'transform': transform, 'batch': batch, 'trust_region': trust_region,
              **record_lib.recorded({'ensemble_size': fields['ensemble_size']}),
              'fit': record_lib.recorded({k: v for k, v in fit_fields.items() if k != 'ensemble_size'})}
  if acquisition == 'thompson' and batch > fields['ensemble_size']:
    raise UsageError(f"batch={batch} Thompson draws take as many distinct members, and ensemble_size="
                     f"{fields['ensemble_size']}: give ensemble_size >= batch")
  sign = 1.0 if maximize else -1.0
  key = jax.random.key(seed)
  uniform = np.random.default_rng(seed).uniform(low, high, (initial, len(low)))
  loaded = None if isinstance(surrogate, str) else surrogate
  with record_lib.Record(workdir, settings, since=as_it_ran) as record, sigterm.interrupting():
    xs = [np.asarray(entry['x'], np.float64) for entry in record.rounds]
    ys = [entry['y'] for entry in record.rounds]
    done, schedule = len(record.rounds), rounds_of(evaluations, initial, batch)
    fitted_at = {n: first for first, size in schedule for n in range(first, first + size)}  # each round's first
    # Warm: the last recorded round's fit, what the next fit starts from (or, stopped inside a round, that round's).
    ens = record.last_ensemble(loaded, fitted_at[done - 1]) if warm and done else None
    propose = None  # built on the first fit, for all of them
    for first, size in schedule:
      if first + size <= done:
        continue
      clock, entry = record_lib.Clock(), {}
      if batch > 1:
        entry['round'] = 0 if first < initial else 1 + (first - initial) // batch
      if first < initial or acquisition == 'random':
        points = [uniform[n] if n < initial else np.random.default_rng([seed, n]).uniform(low, high)
                  for n in range(first, first + size)]
        entry['acquisition'], values = 'initial' if first < initial else 'random', None
      else:
        targets = transformed(sign * np.asarray(ys[:first]), transform)
        kept = warm and ens is not None and first < done  # resumed inside a warm round: its fit is the one kept
        if not kept:
          length = {} if train_steps is None else {'epochs': -(-train_steps // (first // fields['batch_size']))}
          with clock.part('fit'):
            ens = api.fit(surrogate, (np.stack(xs[:first]), targets), init=ens if warm else None, seed=seed,
                          **{'progress': False, **fields, **length})
          if (warm or first + size == evaluations) and first >= done:  # the last once its first evaluation is
            with clock.part('save'):  # recorded: the next warm fit starts from it
              record.stage(ens)
        with clock.part('acquire'):
          leader = int(np.argmax(targets))
          build, shape = (proposer, ()) if batch == 1 else (batch_proposer, (batch,))
          # One program for every fit, and for a kept ensemble loaded from the record: the same variables.
          propose = propose or build(ens, acquisition, low, high, candidates, starts, steps, noise, *shape)
          region = None
          if trust_region:  # replayed from the rounds recorded before this one
            rounds = [sign * np.asarray(ys[f:f + n]) for f, n in schedule if initial <= f < first]
            side = trust_region_lib.side(float(np.max(sign * np.asarray(ys[:initial]))), rounds, len(low))
            region = trust_region_lib.box((xs[leader] - low) / (high - low), side)
            entry['trust_region'] = side
          points, values = propose(ens, jax.random.fold_in(key, first), targets[leader], xs[leader], region)
          points, values = (points, values) if batch > 1 else ([points], [values])
        entry['acquisition'] = acquisition
      for n in range(max(first, done), first + size):  # those of a round stopped inside it: recorded, not asked
        x = points[n - first]
        with clock.part('function'):
          y = float(record.answers([json.dumps(x.tolist())], lambda at, x=x: [evaluated(function, x)],
                                   'function')[0])
        xs.append(x)
        ys.append(y)
        best = int(np.argmax(sign * np.asarray(ys)))
        with clock.part('loop'):
          host_memory.release_compiled_programs_if_many()  # a loop of many rounds compiles many programs
        chosen = {} if values is None else {'acquisition_value': values[n - first]}
        record.add({'evaluation': n + 1, **entry, **chosen, 'x': x.tolist(), 'y': y, 'best': ys[best],
                    'seconds': clock.seconds()})
        clock = record_lib.Clock()  # a round's next evaluation: its own seconds
    if ens is None and acquisition != 'random':  # a finished loop run again: the ensemble its last fit kept
      ens = record.last_ensemble(loaded, fitted_at.get(evaluations - 1))
  best = int(np.argmax(sign * np.asarray(ys)))
  return Result(ens, record.rounds, np.stack(xs), np.asarray(ys), xs[best], float(ys[best]))
