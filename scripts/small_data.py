"""What `ensemble.fit` costs on small data against a plain JAX loop of the same recipe, and on MNIST against the CLI.

  python scripts/small_data.py                                  # sections fixed, regression and bo (minutes on CPU)
  python scripts/small_data.py --section=fixed                  # ~10 s: what a call costs besides its compute
  python scripts/small_data.py --section=regression --repeats=10 --cold_repeats=3 --json=SMALL.json
  python scripts/small_data.py --section=mnist                  # ~5 minutes: fit against python -m ensemble.train

Why: `fit` is an in-memory trainer meant for loops of small fits (a Bayesian-optimisation loop refits a small
ensemble after every new observation). Its machinery (config checks, program cache, host-side standardisation,
padding to size buckets, a divergence check every dispatch) must cost little next to the JAX loop an expert writes
by hand; this script measures how little.

--section=fixed: the fixed cost of a call. Warm fits of 1 and of 40 epochs of 4 members on 100 rows (batch 25) and
`predict(x, levels=())` on 256 rows, against the plain loop below and the members' jitted forward pass, the two
alternating in this process (medians of --fixed_repeats calls); goals: fit <= 1.2x plain + 2 ms, predict <= the
forward pass + 1 ms.

--section=regression: 5 members of a 50-unit ReLU MLP (mean and raw scale out, Gaussian NLL), 450 generated rows
of 13 features (a fixed linear and nonlinear function plus heteroscedastic noise, numpy seed 0), 40 epochs of
batch 100 (4 steps, the last partial batch dropped), Adam at a constant 0.01, features and targets standardised by
the training split. `ensemble.fit` against `plain_fit` below: the members vmapped, an epoch one jitted program that
`lax.scan`s its steps, each member its own permutation per epoch drawn on the device, init jitted once at module
level so later fits reuse every compiled program. Cold: the first call in a fresh process (each in its own child
process, median of --cold_repeats; the imports and JAX's start-up are timed apart, before the clock starts). Warm:
the median of calls 2..--repeats in one process, the two alternating. Both are scored on 50 further rows.

--section=bo: a Bayesian-optimisation-style loop: --bo_fits fits on a training set that grows by one row per fit
from --bo_start rows (batch --bo_batch_size), each warm-started from the previous ensemble (`init=prev`; the plain
loop passes its previous parameters and starts Adam afresh), each followed by a prediction on 256 fixed candidate
rows: the mixture's mean and std, what an acquisition function needs (`predict(x, levels=())`: no intervals; the
plain loop computes the same two). Each loop runs in a fresh child process, so its totals include the first fit's
compiles. XLA compiles are counted with JAX's monitoring events ('/jax/core/compile/backend_compile_duration';
`jax_log_compiles` records if this JAX lacks them). The plain loop runs twice: with its natural shapes, so that it
compiles again for every new row count, and padded to the next power of two rows as `fit` pads (its members' orders
drawn over the real rows), which compiles again only when the bucket or the number of steps changes: later fits
within 1.2x of that one is the goal.

On a GPU host this process allocates the GPU's memory as it goes (XLA_PYTHON_CLIENT_PREALLOCATE=false), so that the
child processes, which keep JAX's default, find room.

--section=mnist: K=8 CNN members, 2 epochs of batch 128 on 8 simulated CPU devices, the full MNIST: `ensemble.fit`
in a child process against `python -m ensemble.train --config=configs/default.py` (fit starts from the same
ensemble/defaults.py; its own defaults hold nothing out and test after the last epoch only, where the CLI tests
after every epoch and writes checkpoints). Each child's wall clock is timed whole (imports, data, compiles),
both with an empty persistent compilation cache (XDG_CACHE_HOME in a fresh folder), with their test accuracies.
The CLI keeps freed host memory for XLA:CPU at start-up (ensemble/host_memory.py) and `fit` does not unless
asked; --keep_freed_memory has the fit child ask (`fit(keep_freed_memory=True)`). --data_dir (a folder of IDX
files or an .npz file) goes to both.

--section=all runs regression and bo; sections may be listed: --section=regression,mnist. Timings of a loaded
machine mean little: run it alone.
"""

import argparse
import functools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_STARTED = time.perf_counter()

# On a GPU host JAX takes 75% of the GPU's memory at its start, which would leave the child processes (the cold
# fits, the BO loops) too little to start: this process allocates as it goes, and the children keep JAX's default.
_PREALLOCATE = os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')
if '--_child' not in ' '.join(sys.argv):
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import ensemble
from ensemble import files
from ensemble.errors import UsageError, exit_with_error
from ensemble.tasks import mixture

_IMPORTED = time.perf_counter()

SECTIONS = ('fixed', 'regression', 'bo', 'mnist')
ALL = ('fixed', 'regression', 'bo')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The small-data recipe, for both trainers.
NUM_FEATURES = 13
NUM_TRAIN, NUM_TEST, NUM_CANDIDATES = 450, 50, 256
ENSEMBLE_SIZE = 5
HIDDEN = 50
EPOCHS = 40
BATCH_SIZE = 100
LEARNING_RATE = 0.01
VARIANCE_FLOOR = 1e-6  # as ensemble/tasks/regression.py's
FIT_RECIPE = {'task': 'regression', 'ensemble_size': ENSEMBLE_SIZE, 'epochs': EPOCHS, 'optimizer': 'adamw',
              'learning_rate': LEARNING_RATE, 'weight_decay': 0.0, 'schedule': 'constant',
              'standardize_features': True, 'progress': False}
GOALS = {'cold': 1.3, 'warm': 1.2, 'bo_total': 1.5, 'bo_later_padded': 1.2, 'bo_compiles_after_first': 3}
COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


class MLP(nn.Module):
  """One regression member: a hidden ReLU layer, then a mean and a raw scale."""
  hidden: int = HIDDEN

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.relu(nn.Dense(self.hidden)(x)))


# The plain loop: what an expert writes by hand, its programs jitted once at module level.
MODEL = MLP()
OPTIMIZER = optax.adam(LEARNING_RATE)
init_members = jax.jit(jax.vmap(lambda key: MODEL.init(key, jnp.zeros((1, NUM_FEATURES), jnp.float32))['params']))
init_adam = jax.jit(jax.vmap(OPTIMIZER.init))
predict_members = jax.jit(jax.vmap(lambda params, x: MODEL.apply({'params': params}, x), in_axes=(0, None)))


def _gaussian_nll(params, x, y):
  out = MODEL.apply({'params': params}, x)
  mean, variance = out[:, 0], jax.nn.softplus(out[:, 1]) + VARIANCE_FLOOR
  return jnp.mean(0.5 * (jnp.log(2 * jnp.pi * variance) + (y - mean) ** 2 / variance))


@functools.partial(jax.jit, static_argnames=('batch_size', 'steps'))
def train_epoch(params, opt_state, x, y, key, epoch, batch_size: int, rows=None, steps: int | None = None):
  """One epoch of every member, each its own permutation of the rows, the last partial batch dropped. With `rows`
  (traced) and `steps`, the arrays are padded past `rows` and the permutation is of the first `rows` only: the
  program stays the same while the set grows within its padding."""
  steps = len(y) // batch_size if steps is None else steps
  size = jax.tree.leaves(params)[0].shape[0]

  def member(params, opt_state, key):
    if rows is None:
      order = jax.random.permutation(key, len(y))
    else:
      order = jnp.argsort(jnp.where(jnp.arange(len(y)) < rows, jax.random.uniform(key, (len(y),)), 2.0))
    order = order[:steps * batch_size].reshape(steps, batch_size)

    def step(carry, rows):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(_gaussian_nll)(params, x[rows], y[rows])
      updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss
    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), order)
    return params, opt_state, losses
  return jax.vmap(member)(params, opt_state, jax.random.split(jax.random.fold_in(key, epoch), size))


class PlainEnsemble:
  """The plain loop's members and the statistics its data was standardised by."""

  def __init__(self, params, x_stats, y_stats):
    self.params, self.x_stats, self.y_stats = params, x_stats, y_stats

  def components(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(means, variances), each (K, N, 1) in the targets' units, as `Ensemble.components` gives them."""
    out = np.asarray(predict_members(self.params, _standardise(x, *self.x_stats)), np.float64)
    (mean, std) = self.y_stats
    means = out[..., :1] * std + mean
    variances = (np.logaddexp(0.0, out[..., 1:]) + VARIANCE_FLOOR) * std ** 2
    return means, variances

  def predict(self, x: np.ndarray) -> dict[str, np.ndarray]:
    """The mixture's mean and std per row (what an acquisition function needs)."""
    return {k: v[:, 0] for k, v in mixture.mixture_moments(*self.components(x)).items()}

  def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    return mixture.score(*self.components(x), y.astype(np.float64)[:, None])


def _stats(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  a = a.astype(np.float64)
  std = a.std(0)
  return a.mean(0), np.where(std > 0, std, 1.0)


def _standardise(a: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
  return ((a.astype(np.float64) - mean) / std).astype(np.float32)


def plain_fit(x: np.ndarray, y: np.ndarray, *, batch_size: int = BATCH_SIZE, seed: int = 0,
              init: PlainEnsemble | None = None, ensemble_size: int = ENSEMBLE_SIZE, epochs: int = EPOCHS,
              padded: bool = False) -> PlainEnsemble:
  """The recipe in plain JAX: standardise on the host, init (or start from `init`'s members, Adam afresh), then
  one dispatch per epoch, waiting only for the end. `padded`: the rows padded to the next power of two, as `fit`
  pads them, so that a growing set compiles again only when its bucket (or its number of steps) changes."""
  x_stats, y_stats = _stats(x), _stats(y)
  key = jax.random.key(seed)
  params = init_members(jax.random.split(key, ensemble_size)) if init is None else init.params
  opt_state = init_adam(params)
  x, y = _standardise(x, *x_stats), _standardise(y, *y_stats)
  rows = {}
  if padded:
    rows = {'rows': np.int32(len(y)), 'steps': len(y) // batch_size}
    pad = (1 << (len(y) - 1).bit_length()) - len(y)
    x, y = np.pad(x, ((0, pad), (0, 0))), np.pad(y, (0, pad))
  x, y = jnp.asarray(x), jnp.asarray(y)
  for epoch in range(epochs):
    params, opt_state, _ = train_epoch(params, opt_state, x, y, key, epoch, batch_size=batch_size, **rows)
  return PlainEnsemble(jax.block_until_ready(params), x_stats, y_stats)


def fit(x: np.ndarray, y: np.ndarray, *, batch_size: int = BATCH_SIZE, init=None, **recipe):
  return ensemble.fit(MLP(), (x, y), batch_size=batch_size, init=init, **{**FIT_RECIPE, **recipe})


TRAINERS = {'fit': fit, 'plain': plain_fit}
# The BO loop's: the plain loop also padded, which compiles again only when the set changes bucket, as `fit` does.
BO_TRAINERS = {**TRAINERS, 'padded': functools.partial(plain_fit, padded=True)}


def make_data(rows: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """`rows` rows of features ~ N(0, 1) and their target: a fixed linear function of all 13 features plus a sine and
  a product of three, plus noise whose scale grows with a fourth. The rows are a fixed pool: slice it."""
  rng = np.random.default_rng(seed)
  weights = rng.normal(size=NUM_FEATURES) / np.sqrt(NUM_FEATURES)
  x = rng.normal(size=(rows, NUM_FEATURES))
  signal = x @ weights + np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]
  noise = (0.2 + 0.3 * np.abs(x[:, 3])) * rng.normal(size=rows)
  return x.astype(np.float32), (signal + noise).astype(np.float32)


def test_rows(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The pool's test rows: after every training row either section uses."""
  return x[NUM_TRAIN:NUM_TRAIN + NUM_TEST], y[NUM_TRAIN:NUM_TRAIN + NUM_TEST]


def candidates() -> np.ndarray:
  """The BO loop's fixed grid of candidate rows."""
  return np.random.default_rng(1).normal(size=(NUM_CANDIDATES, NUM_FEATURES)).astype(np.float32)


class CompileCounter:
  """Counts XLA compiles: JAX's monitoring event for each backend compile, or (where this JAX emits none) the
  'Finished XLA compilation' records of `jax_log_compiles`."""

  def __init__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._event)
    probe = jax.jit(lambda a: a * 3 + 1)
    probe(np.float32(time.time())).block_until_ready()  # a fresh function: one compile
    self.method = 'monitoring event'
    if not self.count:
      self.method = 'jax_log_compiles records'
      jax.config.update('jax_log_compiles', True)
      handler = logging.Handler(logging.DEBUG)
      handler.emit = self._record
      logging.getLogger('jax').addHandler(handler)
    self.count = 0

  def _event(self, name: str, _secs: float, **_):
    if name == COMPILE_EVENT:
      self.count += 1

  def _record(self, record: logging.LogRecord):
    if record.getMessage().startswith('Finished XLA compilation'):
      self.count += 1


# Child processes: each writes its figures to --_out as JSON.


def child_cold(trainer: str) -> dict:
  """The first call of `trainer` in this fresh process, imports and JAX's start-up timed apart."""
  x, y = make_data()
  jax.devices()  # JAX's start-up, apart from the first call
  if trainer == 'fit':
    _ = ensemble.fit  # ensemble.api's import, on first use
  startup = time.perf_counter() - _STARTED
  start = time.perf_counter()
  trained = TRAINERS[trainer](x[:NUM_TRAIN], y[:NUM_TRAIN])
  first = time.perf_counter() - start
  scores = trained.evaluate(*test_rows(x, y))
  scores = scores['ensemble'] if trainer == 'fit' else scores
  return {'import_s': _IMPORTED - _STARTED, 'startup_s': startup, 'first_call_s': first,
          'rmse': scores['rmse'], 'nll': scores['nll']}


def child_bo(trainer: str, fits: int, start_rows: int, batch_size: int) -> dict:
  """The BO loop with `trainer`: per fit, its seconds and compiles, and the prediction's."""
  x, y = make_data()
  grid = candidates()
  jax.devices()
  if trainer == 'fit':
    _ = ensemble.fit
  counter = CompileCounter()
  train, previous, iterations = BO_TRAINERS[trainer], None, []
  for i in range(fits):
    rows = start_rows + i
    counter.count, start = 0, time.perf_counter()
    previous = train(x[:rows], y[:rows], batch_size=batch_size, init=previous)
    fit_s, fit_compiles = time.perf_counter() - start, counter.count
    counter.count, start = 0, time.perf_counter()
    prediction = previous.predict(grid, **({'levels': ()} if trainer == 'fit' else {}))
    predict_s, predict_compiles = time.perf_counter() - start, counter.count
    assert prediction['mean'].shape == prediction['std'].shape == (NUM_CANDIDATES,), prediction['mean'].shape
    iterations.append({'rows': rows, 'fit_s': fit_s, 'fit_compiles': fit_compiles, 'predict_s': predict_s,
                       'predict_compiles': predict_compiles})
  scores = previous.evaluate(*test_rows(x, y))
  scores = scores['ensemble'] if trainer == 'fit' else scores
  return {'compile_count_method': counter.method, 'iterations': iterations, 'rmse': scores['rmse'],
          'nll': scores['nll']}


def child_mnist_fit(data_dir: str, keep_freed_memory: bool) -> dict:
  ensemble.cpu_devices(8)  # before anything uses JAX
  from ensemble import data  # pylint: disable=g-import-not-at-top
  _ = ensemble.fit  # ensemble.api's import, before the fit call's clock (the process's clock counts it)
  dataset = data.load('mnist', data_dir)
  train, test = dataset.train, dataset.test
  start = time.perf_counter()
  ens = ensemble.fit('cnn', (train['image'], train['label']), test=(test['image'], test['label']), ensemble_size=8,
                     epochs=2, batch_size=128, progress=False, keep_freed_memory=keep_freed_memory)
  return {'fit_s': time.perf_counter() - start, 'test_accuracy': ens.summary['test_accuracy'],
          'devices': len(jax.devices())}


def run_child(args, kind: str, *extra: str) -> dict:
  """This script as a child process doing `kind`; its figures."""
  with tempfile.TemporaryDirectory() as folder:
    out = os.path.join(folder, 'out.json')
    command = [sys.executable, os.path.abspath(__file__), f'--_child={kind}', f'--_out={out}', *extra]
    done = subprocess.run(command, capture_output=True, text=True, env=_child_env(folder), check=False)
    if done.returncode:
      sys.exit(f'{" ".join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}')
    with open(out, encoding='utf-8') as f:
      return json.load(f)


def _child_env(folder: str) -> dict[str, str]:
  """The environment with an empty persistent compilation cache: none set for JAX, the user's cache folder (where
  `python -m ensemble.train` keeps one by default) a fresh one."""
  env = {k: v for k, v in os.environ.items() if k not in ('JAX_COMPILATION_CACHE_DIR', 'XLA_PYTHON_CLIENT_PREALLOCATE')}
  if _PREALLOCATE is not None:  # the user's own setting
    env['XLA_PYTHON_CLIENT_PREALLOCATE'] = _PREALLOCATE
  env['XDG_CACHE_HOME'] = os.path.join(folder, 'cache')
  return env


# Sections: each returns its figures and prints its table.


def _ratio(a: float, b: float) -> float:
  return a / b if b else float('inf')


def _verdict(value: float, goal: float) -> str:
  return f'<= {goal:g}x: {"met" if value <= goal else "MISSED"}'


def section_regression(args) -> dict:
  cold = {trainer: [run_child(args, f'cold_{trainer}') for _ in range(args.cold_repeats)] for trainer in TRAINERS}
  cold = {trainer: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
          for trainer, runs in cold.items()}
  x, y = make_data()
  x_train, y_train, (x_test, y_test) = x[:NUM_TRAIN], y[:NUM_TRAIN], test_rows(x, y)
  seconds, trained = {trainer: [] for trainer in TRAINERS}, {}
  for _ in range(args.repeats):  # alternating: the machine's drift falls on both alike
    for trainer, train in TRAINERS.items():
      start = time.perf_counter()
      trained[trainer] = train(x_train, y_train)
      seconds[trainer].append(time.perf_counter() - start)
  warm = {trainer: statistics.median(times[1:]) for trainer, times in seconds.items()}
  scores = {'fit': trained['fit'].evaluate(x_test, y_test)['ensemble'],
            'plain': trained['plain'].evaluate(x_test, y_test)}
  result = {'cold': cold, 'warm_s': warm, 'calls_s': seconds, 'test': scores,
            'cold_ratio': _ratio(cold['fit']['first_call_s'], cold['plain']['first_call_s']),
            'warm_ratio': _ratio(warm['fit'], warm['plain'])}

  print(f'\n## regression: {ENSEMBLE_SIZE} MLP members, {NUM_TRAIN} rows x {NUM_FEATURES} features, {EPOCHS} epochs '
        f'of batch {BATCH_SIZE}, Adam {LEARNING_RATE}\n')
  print('| | ensemble.fit | plain JAX | fit / plain | goal |')
  print('| --- | --- | --- | --- | --- |')
  print(f"| cold: the script's imports (s) | {cold['fit']['import_s']:.2f} | {cold['plain']['import_s']:.2f} | | |")
  print(f"| cold: start-up, those, ensemble.api (fit) and JAX's devices (s) | {cold['fit']['startup_s']:.2f} | "
        f"{cold['plain']['startup_s']:.2f} | | |")
  print(f"| cold: first call in a fresh process, median of {args.cold_repeats} (s) | "
        f"{cold['fit']['first_call_s']:.3f} | {cold['plain']['first_call_s']:.3f} | {result['cold_ratio']:.2f}x | "
        f"{_verdict(result['cold_ratio'], GOALS['cold'])} |")
  print(f"| warm: median of calls 2..{args.repeats} (s) | {warm['fit']:.4f} | {warm['plain']:.4f} | "
        f"{result['warm_ratio']:.2f}x | {_verdict(result['warm_ratio'], GOALS['warm'])} |")
  for key in ('rmse', 'nll'):
    print(f"| test {key.upper()} ({NUM_TEST} rows) | {scores['fit'][key]:.4f} | {scores['plain'][key]:.4f} | | |")
  return result


def section_bo(args) -> dict:
  extra = (f'--bo_fits={args.bo_fits}', f'--bo_start={args.bo_start}', f'--bo_batch_size={args.bo_batch_size}')
  loops = {trainer: run_child(args, f'bo_{trainer}', *extra) for trainer in BO_TRAINERS}
  rows = {}
  for trainer, loop in loops.items():
    first, later = loop['iterations'][0], loop['iterations'][1:]
    rows[trainer] = {
        'total_s': sum(it['fit_s'] + it['predict_s'] for it in loop['iterations']),
        'fits_s': sum(it['fit_s'] for it in loop['iterations']),
        'predicts_s': sum(it['predict_s'] for it in loop['iterations']),
        'first_s': first['fit_s'] + first['predict_s'],
        'later_median_fit_s': statistics.median(it['fit_s'] for it in later) if later else float('nan'),
        'later_median_predict_s': statistics.median(it['predict_s'] for it in later) if later else float('nan'),
        'first_compiles': first['fit_compiles'] + first['predict_compiles'],
        'later_fit_compiles': sum(it['fit_compiles'] for it in later),
        'later_predict_compiles': sum(it['predict_compiles'] for it in later)}
    rows[trainer]['later_compiles'] = rows[trainer]['later_fit_compiles'] + rows[trainer]['later_predict_compiles']
  fit_rows, plain_rows, padded_rows = rows['fit'], rows['plain'], rows['padded']
  result = {'loops': loops, 'summary': rows, 'total_ratio': _ratio(fit_rows['total_s'], plain_rows['total_s']),
            'later_fit_ratio_padded': _ratio(fit_rows['later_median_fit_s'], padded_rows['later_median_fit_s'])}

  last = args.bo_start + args.bo_fits - 1
  print(f'\n## bo: {args.bo_fits} fits on {args.bo_start}..{last} rows (batch {args.bo_batch_size}), each warm-started '
        f'from the last and followed by a prediction on {NUM_CANDIDATES} candidates; compiles counted by '
        f"{loops['fit']['compile_count_method']}. The plain loop as it is (its shapes change every fit) and padded "
        'to a power of two, as fit pads\n')
  print('| | ensemble.fit | plain JAX | plain, padded | fit / plain | fit / padded | goal |')
  print('| --- | --- | --- | --- | --- | --- | --- |')

  def line(name, key, fmt, goal=''):
    print(f'| {name} | {fit_rows[key]:{fmt}} | {plain_rows[key]:{fmt}} | {padded_rows[key]:{fmt}} | '
          f'{_ratio(fit_rows[key], plain_rows[key]):.2f}x | {_ratio(fit_rows[key], padded_rows[key]):.2f}x | {goal} |')
  line(f'whole loop: {args.bo_fits} fits and predictions (s)', 'total_s', '.2f',
       f"fit / plain {_verdict(result['total_ratio'], GOALS['bo_total'])}")
  line('of which fits (s)', 'fits_s', '.2f')
  line('of which predictions (s)', 'predicts_s', '.3f')
  line('first fit and prediction (s)', 'first_s', '.2f')
  line('later fits, median (s)', 'later_median_fit_s', '.4f',
       f"fit / padded {_verdict(result['later_fit_ratio_padded'], GOALS['bo_later_padded'])}")
  line('later predictions, median (s)', 'later_median_predict_s', '.4f')
  compiles = lambda r: f"{r['later_fit_compiles']} + {r['later_predict_compiles']}"
  print(f"| compiles: first fit and prediction | {fit_rows['first_compiles']} | {plain_rows['first_compiles']} | "
        f"{padded_rows['first_compiles']} | | | |")
  goal = GOALS['bo_compiles_after_first']
  print(f'| compiles after the first: fits + predictions | {compiles(fit_rows)} | {compiles(plain_rows)} | '
        f"{compiles(padded_rows)} | | | fit <= {goal}: {'met' if fit_rows['later_compiles'] <= goal else 'MISSED'} |")
  for key in ('rmse', 'nll'):
    print(f"| last fit's test {key.upper()} ({NUM_TEST} rows) | {loops['fit'][key]:.4f} | "
          f"{loops['plain'][key]:.4f} | {loops['padded'][key]:.4f} | | | |")
  return result


# The fixed-cost section's recipe: a call so small that what is not compute shows.
FIXED_MEMBERS, FIXED_ROWS, FIXED_BATCH, FIXED_EPOCHS = 4, 100, 25, (1, 40)
FIXED_GOAL = (1.2, 0.002)  # fit <= 1.2x plain + 2 ms
PREDICT_GOAL = 0.001  # predict <= the forward pass + 1 ms


def _median_pair(calls: dict, repeats: int) -> dict[str, float]:
  """Each of `calls` (name -> function) called `repeats` times, alternating, after one call each to compile;
  the median seconds of each."""
  for call in calls.values():
    call()
  seconds = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      call()
      seconds[name].append(time.perf_counter() - start)
  return {name: statistics.median(times) for name, times in seconds.items()}


def section_fixed(args) -> dict:
  """What a call costs besides its compute: warm fits of 1 and of 40 epochs on 100 rows, and a prediction on 256
  rows, against the plain loop and the members' jitted forward pass, side by side in this process."""
  x, y = make_data()
  x, y = x[:FIXED_ROWS], y[:FIXED_ROWS]
  grid = candidates()
  rows, result = [], {}
  for epochs in FIXED_EPOCHS:
    recipe = {'ensemble_size': FIXED_MEMBERS, 'epochs': epochs}
    times = _median_pair({
        'fit': functools.partial(fit, x, y, batch_size=FIXED_BATCH, **recipe),
        'plain': functools.partial(plain_fit, x, y, batch_size=FIXED_BATCH, ensemble_size=FIXED_MEMBERS,
                                   epochs=epochs)},
        args.fixed_repeats)
    ratio, goal = times['fit'] / times['plain'], FIXED_GOAL[0] * times['plain'] + FIXED_GOAL[1]
    result[f'fit_{epochs}_epochs'] = {**times, 'ratio': ratio, 'goal_s': goal}
    rows.append((f'warm fit, {epochs} epoch{"s" * (epochs > 1)}', times['fit'], times['plain'],
                 f'{ratio:.2f}x', f'<= {FIXED_GOAL[0]:g}x + {FIXED_GOAL[1] * 1e3:g} ms: '
                 f'{"met" if times["fit"] <= goal else "MISSED"}'))
  trained = fit(x, y, batch_size=FIXED_BATCH, ensemble_size=FIXED_MEMBERS, epochs=1)
  params = jax.tree.map(jnp.asarray, trained.params)
  inputs = jnp.asarray(grid)
  times = _median_pair({'predict': lambda: trained.predict(grid, levels=()),
                        'forward': lambda: np.asarray(predict_members(params, inputs))}, args.fixed_repeats)
  goal = times['forward'] + PREDICT_GOAL
  result['predict'] = {**times, 'goal_s': goal}
  rows.append((f'predict(x, levels=()) on {NUM_CANDIDATES} rows, against the jitted forward pass', times['predict'],
               times['forward'], f'+{(times["predict"] - times["forward"]) * 1e3:.2f} ms',
               f'<= +{PREDICT_GOAL * 1e3:g} ms: {"met" if times["predict"] <= goal else "MISSED"}'))

  print(f'\n## fixed cost of a call: {FIXED_MEMBERS} MLP members, {FIXED_ROWS} rows, batch {FIXED_BATCH}, Adam '
        f'{LEARNING_RATE}, progress=False; medians of {args.fixed_repeats} calls, alternating\n')
  print('| | ensemble | plain JAX | difference | goal |')
  print('| --- | --- | --- | --- | --- |')
  for name, ours, plain, difference, verdict in rows:
    print(f'| {name} (ms) | {ours * 1e3:.2f} | {plain * 1e3:.2f} | {difference} | {verdict} |')
  return result


def section_mnist(args) -> dict:
  with tempfile.TemporaryDirectory() as folder:
    workdir = os.path.join(folder, 'workdir')
    command = [sys.executable, '-m', 'ensemble.train', f'--workdir={workdir}',
               f'--config={os.path.join(REPO, "configs", "default.py")}', '--cpu_devices=8',
               '--config.num_epochs=2', '--config.heldout_fraction=0']
    if args.data_dir:
      command.append(f'--config.data_dir={args.data_dir}')
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=_child_env(folder), cwd=REPO, check=False)
    cli_s = time.perf_counter() - start
    if done.returncode:
      sys.exit(f'{" ".join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}')
    with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
      lines = [json.loads(line) for line in f if line.strip()]
    cli_accuracy = lines[-1]['test_accuracy']
    shutil.rmtree(workdir)
  start = time.perf_counter()
  child = run_child(args, 'mnist_fit', f'--data_dir={args.data_dir}',
                    *(['--keep_freed_memory'] if args.keep_freed_memory else []))
  fit_s = time.perf_counter() - start
  result = {'cli_s': cli_s, 'cli_test_accuracy': cli_accuracy, 'fit_process_s': fit_s, **child,
            'ratio': _ratio(fit_s, cli_s)}

  kept = ', the fit child keeping freed memory' if args.keep_freed_memory else ''
  print(f"\n## mnist: 8 CNN members, 2 epochs of batch 128, {child['devices']} simulated CPU devices, "
        f"{args.data_dir or 'the bundled MNIST'}{kept}\n")
  print('| | ensemble.fit | python -m ensemble.train | fit / CLI |')
  print('| --- | --- | --- | --- |')
  print(f'| whole process (s) | {fit_s:.1f} | {cli_s:.1f} | {result["ratio"]:.2f}x |')
  print(f"| of which the fit call (s) | {child['fit_s']:.1f} | | |")
  print(f"| test accuracy | {child['test_accuracy']:.4f} | {cli_accuracy:.4f} | |")
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--section', default='all', help=f"'all' ({','.join(ALL)}) or a list of {', '.join(SECTIONS)}")
  parser.add_argument('--repeats', type=int, default=10, help='regression: warm calls in one process (median of 2..N)')
  parser.add_argument('--fixed_repeats', type=int, default=50, help='fixed: calls of each kind (median)')
  parser.add_argument('--cold_repeats', type=int, default=3, help='regression: fresh processes per cold timing')
  parser.add_argument('--bo_fits', type=int, default=20, help='bo: fits in the loop')
  parser.add_argument('--bo_start', type=int, default=100, help="bo: the first fit's training rows")
  parser.add_argument('--bo_batch_size', type=int, default=32, help='bo: batch size')
  parser.add_argument('--data_dir', default='',
                      help='mnist: a folder of IDX files or an .npz file, for both (default: the bundled MNIST)')
  parser.add_argument('--keep_freed_memory', action='store_true',
                      help="mnist: the fit child keeps freed host memory, as the CLI does at start-up "
                      '(ensemble/host_memory.py)')
  parser.add_argument('--json', default='', help='also write the figures to this file')
  parser.add_argument('--_child', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_out', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()

  if args._child:  # pylint: disable=protected-access
    kind, _, trainer = args._child.partition('_')  # pylint: disable=protected-access
    if kind == 'cold':
      figures = child_cold(trainer)
    elif kind == 'bo':
      figures = child_bo(trainer, args.bo_fits, args.bo_start, args.bo_batch_size)
    else:
      figures = child_mnist_fit(args.data_dir, args.keep_freed_memory)
    with open(args._out, 'w', encoding='utf-8') as f:  # pylint: disable=protected-access
      json.dump(figures, f)
    return

  sections = ALL if args.section == 'all' else tuple(s.strip() for s in args.section.split(','))
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    exit_with_error(f"--section={args.section}: no section {', '.join(map(repr, unknown))}; give 'all' or a list "
                    f"of {', '.join(SECTIONS)}")
  if args.repeats < 2 or args.cold_repeats < 1:
    exit_with_error(f'--repeats={args.repeats} and --cold_repeats={args.cold_repeats}: warm timings need at least 2 '
                    'calls (the first compiles) and cold ones at least 1 process')
  if args.bo_fits < 1 or args.bo_batch_size < 1 or args.bo_start < args.bo_batch_size:
    exit_with_error(f'--bo_fits={args.bo_fits}, --bo_start={args.bo_start}, --bo_batch_size={args.bo_batch_size}: '
                    'give at least one fit, and at least a batch of rows to start from')
  if args.bo_start + args.bo_fits - 1 > NUM_TRAIN:
    exit_with_error(f'--bo_start + --bo_fits exceeds the {NUM_TRAIN} generated training rows: lower them')
  if args.json:
    try:
      files.check_output('--json', args.json)  # before the minutes of timing, not after
    except UsageError as e:
      exit_with_error(str(e))

  print(f'# {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), {os.cpu_count()} host cores, '
        f'jax {jax.__version__}', flush=True)
  results = {'platform': jax.devices()[0].platform, 'jax': jax.__version__, 'host_cores': os.cpu_count()}
  for name in sections:
    results[name] = {'fixed': section_fixed, 'regression': section_regression, 'bo': section_bo,
                     'mnist': section_mnist}[name](args)
  if args.json:
    files.write_atomically(args.json, json.dumps(results, indent=2))
    print(f'\nwrote {args.json}')


if __name__ == '__main__':
  main()
