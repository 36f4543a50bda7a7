"""Active learning: an ensemble chooses which inputs of an unlabelled pool to have labelled next.

  result = ensemble.active_learning(model, (x_seed, y_seed), pool=x_pool, label=ask_a_person, test=(x_test, y_test),
                                    acquisition='bald', batch=10, rounds=20, ensemble_size=4, epochs=50,
                                    workdir='/tmp/al')
  result.curve          # per round: labels so far, test accuracy and NLL (RMSE for regression), seconds
  result.ensemble       # the last round's ensemble

Each round fits the ensemble on the labelled rows (from the last round's
members with `warm=True`: `fit`'s `init=`), scores the test set, scores the
pool (or `candidates` inputs of it drawn at random) with `ensemble.acquire`,
asks `label` for the batch it chose, and records the round
(ensemble/loops/record.py): stopped (Ctrl-C, SIGTERM) and run again with the same
`workdir`, the loop goes on from where it was and never asks for a label
twice. A pool given with its labels, (x_pool, y_pool), simulates a labeller
that reveals them.
"""

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ensemble import acquire, data, host_memory, sigterm, standardise, tasks
from ensemble.loops import record as record_lib
from ensemble.errors import UsageError

__all__ = ['Result', 'active_learning']

# The tasks the loop takes: those with acquisitions (`Task.acquisitions`).
TASKS = tuple(name for name in tasks.NAMES if tasks.TASKS[name].acquisitions)
_LOOP_KEYWORDS = ('init', 'workdir', 'test', 'validation', 'early_stopping')


class Result(NamedTuple):
  ensemble: Any  # the last round's Ensemble
  curve: list[dict[str, Any]]  # one entry per round (record.Record)
  acquired: np.ndarray  # the pool's indices labelled, in the order they were acquired
  labels: np.ndarray  # what they were labelled


class Pool:
  """The unlabelled inputs, as arrays or a random-access source of inputs or of (input, label) pairs (a list, a
  `grain.MapDataset`), read only where a round asks for rows; with the labels a simulation reveals, if it has them."""

  def __init__(self, pool: Any, input_shape: tuple[int, ...]):
    self.inputs, self.labels, self.source = None, None, None
    if isinstance(pool, np.ndarray) or hasattr(pool, '__array__') and not isinstance(pool, (list, tuple)):
      self.inputs = np.asarray(pool)
    elif isinstance(pool, tuple) and len(pool) == 2 and hasattr(pool[0], '__array__'):
      self.inputs, self.labels = np.asarray(pool[0]), np.asarray(pool[1])
      if len(self.labels) != len(self.inputs):
        raise UsageError(f'pool= holds {len(self.inputs)} inputs and {len(self.labels)} labels: give one label per '
                         'input, or the inputs alone with label=')
    elif hasattr(pool, '__len__') and hasattr(pool, '__getitem__'):
      self.source = pool
    else:
      raise UsageError(f'pool={type(pool).__name__}: give the unlabelled inputs as an array, (inputs, labels) '
                       'arrays to simulate a labeller, or a random-access source of inputs')
    self.size = len(self.inputs) if self.source is None else len(self.source)
    if self.size == 0:
      raise UsageError('pool= is empty: give the inputs to choose from')
    first, first_label = self.read(np.arange(1))
    self.empty, shape, self.labelled = first[:0], first.shape[1:], first_label is not None
    if tuple(shape) != tuple(input_shape):
      raise UsageError(f'pool= holds inputs of shape {tuple(shape)}, and the labelled ones are '
                       f'{tuple(input_shape)}: give pool inputs of the labelled inputs\' shape')

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The inputs at `indices`, and their labels where the pool holds them."""
    if self.source is None:
      return self.inputs[indices], None if self.labels is None else self.labels[indices]
    if not len(indices) and hasattr(self, 'empty'):
      return self.empty, None
    items = [self.source[int(i)] for i in indices]
    if items and isinstance(items[0], dict):
      items = [(item['image'], item.get('label')) for item in items]
    if items and isinstance(items[0], tuple) and len(items[0]) == 2:
      inputs, labels = zip(*items)
      return np.stack([np.asarray(x) for x in inputs]), np.asarray(labels)
    return np.stack([np.asarray(x) for x in items]), None



def checked_labels(labels: Any, count: int, task: Any, num_classes: int, target_shape: tuple[int, ...]) -> np.ndarray:
  """What `label` returned for `count` inputs, read as the task reads labels (`Task.labels`), refused in one line
  where it is not one label per input of the seed labels' kind: classes the ensemble has outputs for, or numbers
  of the seed targets' shape."""
  array = np.asarray(labels)
  if len(array.shape) == 0 or array.shape[0] != count:
    raise UsageError(f'label= returned {array.shape[0] if array.ndim else "a scalar"} labels for {count} inputs: '
                     'return one label per index it is given')
  if task.has_classes:
    if not np.issubdtype(array.dtype, np.integer) or array.ndim != 1:
      raise UsageError(f'label= returned labels of dtype {array.dtype} and shape {array.shape}; a classification '
                       f'loop takes one integer class per input, shape ({count},)')
    if array.min() < 0 or array.max() >= num_classes:
      raise UsageError(f'label= returned class {int(array.min() if array.min() < 0 else array.max())}, and the '
                       f'ensemble has classes 0..{num_classes - 1} (an output each): seed the loop with a row of '
                       'every class, or give a model with an output for every class')
    return array.astype(np.int64)
  if not np.issubdtype(array.dtype, np.number) or array.shape[1:] != target_shape:
    raise UsageError(f'label= returned targets of dtype {array.dtype} and shape {array.shape}; this loop takes '
                     f'numbers of shape {(count, *target_shape)}, as its seed targets are')
  if not np.isfinite(array).all():
    raise UsageError('label= returned a target that is not finite (NaN or infinity): return a number for every '
                     'input')
  return array.astype(np.float64)


def acquisition_program(name: Any, task: Any, size: int) -> Callable[..., np.ndarray]:
  """f(outputs, key, best) -> the `size` indices acquired among the candidates whose member outputs are `outputs`:
  a batch acquisition's own choice, or the top of a per-input score (a callable `name` is a score of the user's,
  g(outputs, key) -> (N,) scores); `best`, the highest target labelled so far, is what regression's 'ei' and 'pi'
  improve on. Compiled once for each power of two of candidates: the outputs are padded to
  it, and the padding is never chosen."""
  if callable(name):
    score = functools.partial(lambda outputs, key, best, f: f(outputs, key), f=name)
  else:
    name = acquire.named(name, task)
    score = task.acquisitions.get(name)

  @jax.jit
  def choose(outputs, valid, key, best):
    if name in task.batch_acquisitions:
      return task.batch_acquisitions[name](outputs, size, key, valid=valid)
    return acquire.top(jnp.where(valid, score(outputs, key, best), -jnp.inf), size)

  def chosen(outputs, key, best=0.0):
    n = jax.tree.leaves(outputs)[0].shape[1]
    padded = max(64, 1 << (n - 1).bit_length())
    pad = lambda a: np.pad(np.asarray(a, np.float32), [(0, 0), (0, padded - n)] + [(0, 0)] * (a.ndim - 2), 'edge')
    return np.asarray(choose(jax.tree.map(pad, outputs), np.arange(padded) < n, key, jnp.float32(best)))
  return chosen


def active_learning(model: Any, train: Any, pool: Any, test: Any = None, *, acquisition: Any = 'bald',
                    batch: int = 10, rounds: int = 10, label: Callable | None = None,
                    candidates: int | None = None, warm: bool = False, workdir: str | None = None, seed: int = 0,
                    **fit_fields) -> Result:
  """Runs `rounds` rounds of fit, score, acquire `batch` inputs of `pool` and label them, then a last fit; returns
  the last ensemble, the curve and what was acquired.

  `model` and `fit_fields` are `ensemble.fit`'s (ensemble_size=, epochs=,
  task='regression', ...). `train`: the labelled seed rows, (inputs, labels)
  arrays. `pool`: the unlabelled inputs (see `Pool`). `label(indices,
  inputs) -> labels`: asked once a round for the pool's `indices` chosen;
  without it, `pool` must hold the labels, (inputs, labels). `acquisition`:
  a name of `ensemble.acquire` for the task ('bald', 'entropy',
  'variation_ratios', 'margin', 'random', 'batch_bald', 'power_bald';
  regression 'epistemic_std', 'ucb', 'ei', 'pi', 'thompson'), or f(outputs,
  key) -> scores. `candidates`: score that many of the unlabelled inputs,
  drawn at random each round, instead of all of them. `warm`: start each
  round's members from the last round's. `workdir`: where the record is kept
  and a stopped loop resumed from (ensemble/loops/record.py); None keeps it in
  memory. `seed` seeds the fits and every random choice.
  """
  from ensemble import api  # pylint: disable=g-import-not-at-top
  from ensemble.trained import check_flag  # pylint: disable=g-import-not-at-top
  for key in _LOOP_KEYWORDS:
    if key in fit_fields:
      raise UsageError(f'{key}= is set by the loop for each round\'s fit (warm=True starts each from the last); '
                       'leave it out')
  task = fit_fields.get('task', tasks.DEFAULT)
  if task not in TASKS:
    raise UsageError(f'task={task!r}: the active-learning loop takes a {" or ".join(TASKS)} ensemble')
  task = tasks.named(task)
  whole = record_lib.whole_number
  batch, rounds, seed = whole('batch', batch, 1), whole('rounds', rounds, 0), whole('seed', seed, 0)
  check_flag('warm', warm)
  if candidates is not None:
    candidates = whole('candidates', candidates, batch)
  if not callable(acquisition):
    acquire.named(acquisition, task)
  if label is not None and not callable(label):
    raise UsageError(f'label={type(label).__name__}: give a function f(indices, inputs) -> labels, or leave it out '
                     'and give pool=(inputs, labels) to simulate a labeller')
  x_seed, y_seed = _seed_rows(train)
  target_shape = y_seed.shape[1:]
  pool = Pool(pool, x_seed.shape[1:])
  if label is None and not pool.labelled:
    raise UsageError('pool= holds inputs without labels and no label= is given: give label=f(indices, inputs) -> '
                     'labels, or pool=(inputs, labels) (a source of (input, label) pairs) to simulate a labeller')
  if batch * rounds > pool.size:
    raise UsageError(f'batch={batch} x rounds={rounds} acquires {batch * rounds} labels, and the pool holds '
                     f'{pool.size} inputs: give fewer rounds or a smaller batch')
  test = None if test is None else tuple(np.asarray(a) for a in test)
  settings = {'loop': 'active_learning', 'acquisition': getattr(acquisition, '__name__', acquisition),
              'batch': batch, 'rounds': rounds, 'candidates': candidates, 'warm': warm, 'seed': seed,
              'pool': pool.size, 'seed_rows': len(y_seed),
              'fit': record_lib.recorded(fit_fields)}
  record = record_lib.Record(workdir, settings)
  fields = record_lib.fit_fields(fit_fields, len(y_seed))
  acquired = [i for entry in record.rounds for i in entry['acquired']]
  labels = [y for entry in record.rounds for y in entry['acquired_labels']]
  ens = record.last_ensemble(None if isinstance(model, str) else model) if record.rounds else None
  program, key = acquisition_program(acquisition, task, batch), jax.random.key(seed)
  with sigterm.interrupting(), _fixed_image_stats(x_seed, pool, seed):
    for r in range(len(record.rounds), rounds + 1):
      clock = record_lib.Clock()
      with clock.part('read'):
        x_new, _ = pool.read(np.asarray(acquired, np.int64))
        x_train = np.concatenate([x_seed, x_new.astype(x_seed.dtype, copy=False)])
        y_train = np.concatenate([y_seed, np.asarray(labels, y_seed.dtype).reshape(-1, *target_shape)])
      with clock.part('fit'):
        ens = api.fit(model, (x_train, y_train), init=ens if warm else None, seed=seed,
                      **{'progress': False, **fields})
      entry = {'round': r, 'labels': len(y_train)}
      if test is not None:
        with clock.part('test'):
          entry.update(ens.task.curve_scores(ens, *test))
      picked, picked_labels = [], []
      if r < rounds:
        round_key = jax.random.fold_in(key, r)
        unlabelled = np.setdiff1d(np.arange(pool.size), np.asarray(acquired, np.int64), assume_unique=True)
        if candidates is not None and candidates < len(unlabelled):
          unlabelled = np.sort(np.random.default_rng([seed, r]).choice(unlabelled, candidates, replace=False))
        with clock.part('pool'):
          x_candidates, y_candidates = pool.read(unlabelled)
          outputs = ens.task.acquisition_outputs(ens, ens.member_outputs(x_candidates))
        with clock.part('acquire'):
          chosen = program(outputs, round_key, task.best(y_train))
        picked = unlabelled[chosen]
        with clock.part('label'):
          given = y_candidates[chosen] if label is None else label(picked.copy(), x_candidates[chosen])
          picked_labels = checked_labels(given, batch, task, ens.num_classes, target_shape).tolist()
      if warm or r == rounds:
        with clock.part('save'):
          record.keep(ens)
      acquired += picked.tolist() if len(picked) else []
      labels += picked_labels
      with clock.part('loop'):
        host_memory.release_compiled_programs_if_many()  # a loop of many rounds compiles many programs
      record.add({**entry, 'acquired': [int(i) for i in picked], 'acquired_labels': picked_labels,
                  'seconds': clock.seconds()})
  return Result(ens, record.rounds, np.asarray(acquired, np.int64), np.asarray(labels))


def _fixed_image_stats(x_seed: np.ndarray, pool: Pool, seed: int):
  """Images normalised the same way in every round (by the seed rows' and up to 2,000 of the pool's statistics:
  unlabelled inputs tell the inputs' scale as well), so that each round's fit keeps the programs compiled for the
  last; other inputs as `fit` takes them."""
  if data.arrays.kind_of(x_seed) != 'images':
    return contextlib.nullcontext()
  sample = np.random.default_rng(seed).choice(pool.size, min(pool.size, 2000), replace=False)
  images = np.concatenate([x_seed, pool.read(np.sort(sample))[0].astype(x_seed.dtype)])
  return standardise.image_stats(*data.channel_stats(data.base.as_images(images, 'the seed rows and the pool')))


def _seed_rows(train: Any) -> tuple[np.ndarray, np.ndarray]:
  """The labelled seed rows as arrays; the loop adds the acquired rows to them each round."""
  if not (isinstance(train, tuple) and len(train) == 2):
    raise UsageError(f'train={type(train).__name__}: give the labelled seed rows as (inputs, labels) arrays')
  inputs, labels = np.asarray(train[0]), np.asarray(train[1])
  if len(inputs) != len(labels) or len(inputs) == 0:
    raise UsageError(f'train= holds {len(inputs)} inputs and {len(labels)} labels: give at least one labelled '
                     'row, one label per input')
  return inputs, labels
