"""Bayesian optimisation with a regression ensemble as the surrogate: find the maximum of an expensive function of
a box-bounded input in few evaluations.

  result = ensemble.bayesian_optimization('mlp', f, bounds=[(0, 1)] * 6, evaluations=60, initial=10,
                                          acquisition='ei', ensemble_size=4, epochs=200, workdir='/tmp/bo')
  result.best_x, result.best_y, result.curve

After `initial` points drawn uniformly in the box, each round fits the
ensemble (task='regression') on every evaluation so far, maximises the
acquisition over the box and evaluates `function` there. The acquisition is
maximised by a stated method: `candidates` points drawn uniformly, the best
`starts` of them refined by `steps` steps of Adam on the acquisition's
gradient through `Ensemble.apply` (clipped to the box), the best point found
taken. Every evaluation is recorded as the active-learning loop's rounds are
(ensemble/loops/record.py): a stopped loop run again with the same workdir never
evaluates a recorded point twice.
"""

import json
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ensemble import acquire, host_memory, sigterm, tasks
from ensemble.loops import record as record_lib
from ensemble.errors import UsageError

__all__ = ['Result', 'bayesian_optimization']

ACQUISITIONS = ('ei', 'pi', 'ucb', 'thompson', 'epistemic_std', 'random')
_LOOP_KEYWORDS = ('init', 'workdir', 'test', 'validation', 'early_stopping', 'task')


class Result(NamedTuple):
  ensemble: Any  # the last fit's Ensemble (None where acquisition='random' fitted none)
  curve: list[dict[str, Any]]  # one entry per evaluation
  x: np.ndarray  # (n, D): every point evaluated, in order
  y: np.ndarray  # (n,): what `function` returned there
  best_x: np.ndarray
  best_y: float


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
             steps: int, learning_rate: float = 0.05) -> Callable[[Any, jax.Array, float], tuple[np.ndarray, float]]:
  """f(ens, key, best) -> (the point maximising `ens`'s acquisition found, its value): `candidates` uniform points
  scored, the best `starts` refined by `steps` steps of Adam on the acquisition's gradient in the unit box (clipped
  to it). One program, compiled once for every ensemble of `template`'s shapes (a loop's fits): the ensemble's
  parameters, state and statistics are its arguments (`Ensemble.apply_variables`), not its constants."""
  score = acquire.REGRESSION[name]
  low_j, width = jnp.asarray(low, jnp.float32), jnp.asarray(high - low, jnp.float32)

  @jax.jit
  def propose(variables, params, key, best):
    draw, acquisition_key = jax.random.split(key)
    values = lambda unit: score(template.apply_variables(variables, params, low_j + unit * width),
                                acquisition_key, best)
    unit = jax.random.uniform(draw, (candidates, len(low)))
    unit = unit[acquire.top(values(unit), starts)]
    optimizer = optax.adam(learning_rate)
    gain = lambda u: -jnp.sum(values(u))  # each start's own value: their gradients are apart

    def step(carry, _):
      u, state = carry
      grads = jax.grad(gain)(u)
      updates, state = optimizer.update(grads, state, u)
      return (jnp.clip(optax.apply_updates(u, updates), 0.0, 1.0), state), None
    (unit, _), _ = jax.lax.scan(step, (unit, optimizer.init(unit)), None, length=steps)
    refined = values(unit)
    best_index = jnp.argmax(refined)
    return low_j + unit[best_index] * width, refined[best_index]

  def run(ens, key, best):
    point, value = propose(ens.variables, ens.params, key, jnp.float32(best))
    return np.clip(np.asarray(point, np.float64), low, high), float(value)
  return run


@sigterm.stops_in_one_line
def bayesian_optimization(model: Any, function: Callable, bounds: Any, *, evaluations: int = 50, initial: int = 10,
                          acquisition: str = 'ei', candidates: int = 1000, starts: int = 8, steps: int = 50,
                          maximize: bool = True, warm: bool = False, workdir: str | None = None, seed: int = 0,
                          **fit_fields) -> Result:
  """Evaluates `function` `evaluations` times in all, at `initial` uniform points of `bounds` and then where the
  ensemble's `acquisition` ('ei', 'pi', 'ucb', 'thompson', 'epistemic_std'; 'random': random search, no fit) is
  highest; returns the ensemble, the record and the best point.

  `function(x) -> float` takes one point, a (D,) float64 array within
  `bounds` ([(low, high)] per dimension); `maximize=False` minimises it.
  `model` and `fit_fields` are `ensemble.fit`'s (ensemble_size=, epochs=,
  ...; the task is regression). `warm` starts each fit from the last one's
  members; `workdir` keeps the record and resumes from it; `seed` seeds the
  initial points, the fits and the acquisition's draws.
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
  low, high = _bounds(bounds)
  whole = record_lib.whole_number
  evaluations, initial = whole('evaluations', evaluations, 1), whole('initial', initial, 1)
  candidates, seed = whole('candidates', candidates, 1), whole('seed', seed, 0)
  starts, steps = whole('starts', starts, 1), whole('steps', steps, 0)
  if starts > candidates:
    raise UsageError(f'starts={starts} refines that many of the candidates={candidates}: give starts <= candidates')
  for name, value in (('maximize', maximize), ('warm', warm)):
    check_flag(name, value)
  settings = {'loop': 'bayesian_optimization', 'acquisition': acquisition, 'bounds': np.stack([low, high], 1).tolist(),
              'evaluations': evaluations, 'initial': initial, 'candidates': candidates, 'starts': starts,
              'steps': steps, 'maximize': maximize, 'warm': warm, 'seed': seed,
              'fit': record_lib.recorded(fit_fields)}
  fields = record_lib.fit_fields({**fit_fields, 'task': tasks.DEFAULT_FOR_TARGETS}, initial)
  sign = 1.0 if maximize else -1.0
  key = jax.random.key(seed)
  uniform = np.random.default_rng(seed).uniform(low, high, (initial, len(low)))
  with record_lib.Record(workdir, settings) as record, sigterm.interrupting():
    xs = [np.asarray(entry['x'], np.float64) for entry in record.rounds]
    ys = [entry['y'] for entry in record.rounds]
    ens = record.last_ensemble(None if isinstance(model, str) else model) if warm and record.rounds else None
    propose = None  # built on the first fit, for all of them
    for n in range(len(record.rounds), evaluations):
      clock, entry = record_lib.Clock(), {'evaluation': n + 1}
      if n < initial or acquisition == 'random':
        x = uniform[n] if n < initial else np.random.default_rng([seed, n]).uniform(low, high)
        entry['acquisition'] = 'initial' if n < initial else 'random'
      else:
        with clock.part('fit'):
          ens = api.fit(model, (np.stack(xs), sign * np.asarray(ys)), init=ens if warm else None, seed=seed,
                        **{'progress': False, **fields})
        if warm or n == evaluations - 1:  # kept once the evaluation is recorded: the next warm fit starts from it
          with clock.part('save'):
            record.stage(ens)
        with clock.part('acquire'):
          propose = propose or proposer(ens, acquisition, low, high, candidates, starts, steps)
          x, value = propose(ens, jax.random.fold_in(key, n), max(sign * y for y in ys))
        entry.update(acquisition=acquisition, acquisition_value=value)
      with clock.part('function'):
        y = float(record.answers([json.dumps(x.tolist())], lambda at, x=x: [evaluated(function, x)], 'function')[0])
      xs.append(x)
      ys.append(y)
      best = int(np.argmax(sign * np.asarray(ys)))
      with clock.part('loop'):
        host_memory.release_compiled_programs_if_many()  # a loop of many rounds compiles many programs
      record.add({**entry, 'x': x.tolist(), 'y': y, 'best': ys[best], 'seconds': clock.seconds()})
    if ens is None and acquisition != 'random':  # a finished loop run again: the ensemble its last fit kept
      ens = record.last_ensemble(None if isinstance(model, str) else model)
  best = int(np.argmax(sign * np.asarray(ys)))
  return Result(ens, record.rounds, np.stack(xs), np.asarray(ys), xs[best], float(ys[best]))
