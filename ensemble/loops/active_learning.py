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

import functools
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ensemble import acquire, data, errors, host_memory, sigterm, tasks
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

  def fingerprint(self) -> str:
    """What `loop.json` records of the pool: its inputs' hash, whole for arrays; a source's length and the hash of up
    to 64 of its inputs spread over it (reading a source whole to resume would cost what the loop spares)."""
    if self.source is None:
      return record_lib.fingerprint(self.inputs)
    sample = np.unique(np.linspace(0, self.size - 1, min(self.size, 64)).astype(np.int64))
    return f'{self.size} inputs, {record_lib.fingerprint(self.read(sample)[0])} at {len(sample)} of them'

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



def checked_labels(labels: Any, count: int, task: Any, target_shape: tuple[int, ...]) -> np.ndarray:
  """What `label` returned for `count` inputs, read as the task reads labels (`Task.read_labels`: class indices, a
  class the seed rows lack being a new output of the next round's members; finite targets), and refused in one line
  where it is not one label per input of the seed labels' shape."""
  array = np.asarray(labels)
  if len(array.shape) == 0 or array.shape[0] != count:
    raise UsageError(f'label= returned {array.shape[0] if array.ndim else "a scalar"} labels for {count} inputs: '
                     'return one label per index it is given')
  read = task.read_labels(array, 'the labels label= returned')
  width = int(np.prod(target_shape))
  if read.size != count * width:
    raise UsageError(f'label= returned labels of shape {array.shape}; this loop takes {(count, *target_shape)}, as '
                     'its seed labels are')
  return read.reshape(count, *target_shape)


def acquisition_program(name: Any, task: Any, size: int) -> Callable[..., np.ndarray]:
  """f(outputs, key, best) -> the `size` indices acquired among the candidates whose member outputs are `outputs`:
  a batch acquisition's own choice, or the top of a per-input score; `best`, the highest target labelled so far,
  is what regression's 'ei' and 'pi' improve on. The package's own are compiled once for each power of two of
  candidates (the outputs padded to it, the padding never chosen). A callable `name` is a score of the user's,
  g(outputs, key) -> (N,) scores, called as it is, outside any program, on the candidates' outputs as
  `Ensemble.member_outputs` gives them (numpy arrays, unpadded): numpy or JAX, as it likes."""
  if callable(name):
    return functools.partial(_own_choice, name, size)
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


def _own_choice(function: Callable, size: int, outputs: Any, key: jax.Array, best: float = 0.0) -> np.ndarray:
  """The `size` candidates `function`, a user's acquisition, scores highest (ties: the first)."""
  del best
  n = jax.tree.leaves(outputs)[0].shape[1]
  name = getattr(function, '__name__', 'acquisition')
  try:
    scores = np.asarray(function(outputs, key), np.float64)
  except (TypeError, ValueError) as error:
    raise UsageError(f'acquisition={name} returned what is not an array of numbers ({error}): return (N,) scores, '
                     'one per candidate') from None
  if scores.shape != (n,):
    raise UsageError(f'acquisition={name} returned scores of shape {scores.shape} for {n} candidates: return one '
                     f'score per candidate, shape ({n},)')
  if np.isnan(scores).any():
    raise UsageError(f'acquisition={name} returned NaN for {int(np.isnan(scores).sum())} of {n} candidates: return '
                     'a number for every candidate (-inf for one never to acquire)')
  return np.argsort(-scores, kind='stable')[:size]


@sigterm.stops_in_one_line
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
  test = _checked(model, x_seed, y_seed, test, task, fit_fields)
  settings = {'loop': 'active_learning', 'acquisition': getattr(acquisition, '__name__', acquisition),
              'batch': batch, 'rounds': rounds, 'candidates': candidates, 'warm': warm, 'seed': seed,
              'fit': record_lib.recorded(fit_fields)}
  fingerprints = {'seed rows': record_lib.fingerprint(x_seed, y_seed), 'pool inputs': pool.fingerprint(),
                  'test rows': 'none' if test is None else record_lib.fingerprint(*test)}
  fields = record_lib.fit_fields(fit_fields, len(y_seed))
  program, key = acquisition_program(acquisition, task, batch), jax.random.key(seed)
  with record_lib.Record(workdir, settings, fingerprints) as record, sigterm.interrupting():
    acquired = [i for entry in record.rounds for i in entry['acquired']]
    labels = [y for entry in record.rounds for y in entry['acquired_labels']]
    ens = record.last_ensemble(None if isinstance(model, str) else model) if warm and record.rounds else None
    for r in range(len(record.rounds), rounds + 1):
      clock = record_lib.Clock()
      with clock.part('read'):
        x_new, _ = pool.read(np.asarray(acquired, np.int64))
        x_train = np.concatenate([x_seed, x_new.astype(x_seed.dtype, copy=False)])
        y_train = np.concatenate([y_seed, np.asarray(labels, y_seed.dtype).reshape(-1, *target_shape)])
      with clock.part('fit'):
        ens = api.fit(model, (x_train, y_train), init=_start(ens, warm, task, y_train), seed=seed,
                      **{'progress': False, **fields})
      if warm or r == rounds:  # kept once the round is recorded: a warm loop's next fit starts from it
        with clock.part('save'):
          record.stage(ens)
      entry = {'round': r, 'labels': len(y_train)}
      if test is not None:
        with clock.part('test'):
          entry.update(ens.task.curve_scores(ens, *test))
      picked, picked_labels = np.zeros(0, np.int64), []
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
          given = record.answers([str(int(i)) for i in picked],
                                 _labeller(label, picked, x_candidates[chosen], y_candidates, chosen))
          fixed = None if isinstance(model, str) else ens.num_classes  # a model object's outputs do not grow
          picked_labels = _recorded_labels(record, given, batch, task, target_shape, fixed).tolist()
      acquired += picked.tolist()
      labels += picked_labels
      with clock.part('loop'):
        host_memory.release_compiled_programs_if_many()  # a loop of many rounds compiles many programs
      record.add({**entry, 'acquired': [int(i) for i in picked], 'acquired_labels': picked_labels,
                  'seconds': clock.seconds()})
    if ens is None:  # a finished loop run again: the ensemble its last round kept
      ens = record.last_ensemble(None if isinstance(model, str) else model)
  return Result(ens, record.rounds, np.asarray(acquired, np.int64), np.asarray(labels))


def _labeller(label: Callable | None, picked: np.ndarray, inputs: np.ndarray, pool_labels: np.ndarray | None,
              chosen: np.ndarray) -> Callable[[list[int]], Any]:
  """f(positions) -> the labels of the picked inputs at those positions: `label`'s answer, or the pool's own."""
  if label is None:
    return lambda at: pool_labels[chosen][at]
  return lambda at: label(picked[at].copy(), inputs[at])


def _start(ens: Any, warm: bool, task: Any, labels: np.ndarray) -> Any:
  """What a round's fit starts from: the last round's members where `warm`, unless the answers brought a class they
  have no output for (the members grow one: a fresh start, said in a hint)."""
  if not warm or ens is None:
    return None
  if task.has_classes and labels.size and labels.max() >= ens.num_classes:
    errors.hint(f'the labels now hold class {int(labels.max())}, and the last round\'s members have outputs for '
                f'0..{ens.num_classes - 1}: this round fits afresh, with an output per class')
    return None
  return ens


def _recorded_labels(record: record_lib.Record, given: list[Any], count: int, task: Any,
                     target_shape: tuple[int, ...], classes: int | None = None) -> np.ndarray:
  """`checked_labels` of answers already recorded, and within a model object's `classes` outputs (a built-in
  model grows one for a new class; a model object cannot, and the next fit would refuse what this round already
  kept): a refusal says where they are kept, to correct."""
  try:
    labels = checked_labels(given, count, task, target_shape)
    if classes is not None and task.has_classes and labels.size and labels.max() >= classes:
      raise UsageError(f'label= answered class {int(labels.max())}, and the model object has outputs for classes '
                       f'0..{classes - 1}: give a model with an output for each class the labeller may answer')
    return labels
  except UsageError as error:
    if record.workdir is None:
      raise
    raise UsageError(f'{error} (the answers are kept in {os.path.join(record.workdir, record_lib.ANSWERS)}: correct '
                     'them there, or remove them to be asked again)') from None


def _checked(model: Any, x_seed: np.ndarray, y_seed: np.ndarray, test: Any, task: Any, fields: dict[str, Any]
             ) -> Any:
  """The seed rows and `test` through `fit`'s checker with their roles, before the first fit: a test class the
  seed rows lack an output for (a built-in model has one for each class up to its rows' largest) refused in one
  line."""
  kind = fields.get('inputs', 'auto')
  kind = data.arrays.kind_of(x_seed) if kind == 'auto' else kind
  ignore = fields.get('ignore_label', data.base.IGNORED)
  seed_split = data.arrays.split((x_seed, y_seed), kind, 'seed rows', task.name, ignore=ignore)
  if test is None:
    return None
  test = data.arrays.pair(test, 'test')
  test_split = data.arrays.split(test, kind, 'test', task.name, ignore=ignore)
  if test_split['image'].shape[1:] != seed_split['image'].shape[1:]:
    raise UsageError(f'test= holds inputs of shape {test_split["image"].shape[1:]}, and the seed rows '
                     f'{seed_split["image"].shape[1:]}: give test inputs of the seed rows\' shape')
  if task.has_classes and isinstance(model, str) and 'num_classes' not in (fields.get('model_kwargs') or {}):
    tested, seeded = task.labelled(test_split['label']), task.labelled(seed_split['label'])
    if tested.size and seeded.size and tested.max() > seeded.max():
      top = int(tested.max())
      raise UsageError(f'test= holds class {top}, and the seed rows\' classes end at {int(seeded.max())}: the first '
                       'round\'s members have an output for each class up to the largest labelled one; seed the loop '
                       f'with a row of class {top}')
  elif not task.has_classes and test_split['label'].shape[1:] != seed_split['label'].shape[1:]:
    raise UsageError(f'test= holds targets of shape {test_split["label"].shape[1:]}, and the seed rows '
                     f'{seed_split["label"].shape[1:]}: give test targets of the seed rows\' shape')
  return test


def _seed_rows(train: Any) -> tuple[np.ndarray, np.ndarray]:
  """The labelled seed rows as arrays; the loop adds the acquired rows to them each round."""
  if not (isinstance(train, tuple) and len(train) == 2):
    raise UsageError(f'train={type(train).__name__}: give the labelled seed rows as (inputs, labels) arrays')
  inputs, labels = np.asarray(train[0]), np.asarray(train[1])
  if len(inputs) != len(labels) or len(inputs) == 0:
    raise UsageError(f'train= holds {len(inputs)} inputs and {len(labels)} labels: give at least one labelled '
                     'row, one label per input')
  return inputs, labels
