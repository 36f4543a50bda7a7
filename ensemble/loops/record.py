"""The round engine the active-learning and the Bayesian-optimisation loops run on: a record of their rounds that
survives being stopped, whose answers are never asked for twice, and that refuses other data.

A loop's workdir holds `loop.json` (the settings that make its rounds
reproducible and fingerprints of the data they read: the seed rows, the
pool's inputs, the test set; written once), `answers.json` (every answer the
labeller or the function gave, written the moment it returns, before anything
can refuse it), `curve.jsonl` (one line per finished round: the labels or
evaluations so far, the test scores, what was acquired and what it was
labelled, the seconds each part took; an optimisation's, one per evaluation,
a round of several points' first staging its fit) and the last round's
ensemble (`ensemble/`). Each file is rewritten whole and renamed into place, so an
interruption at any moment leaves the rounds before it complete and never half
a line; a round's ensemble is staged (`ensemble.new/`) before its round is
recorded and takes the place of the last once it is, so that a warm loop
resumed anywhere starts each fit from the ensemble the round before it fitted.
The workdir is locked as `fit` locks its own (ensemble/checkpoint.py): a second
run on it is refused while the first lives. Run again with the same settings
and data, a loop replays what the record holds (recorded answers are read, not
asked for) and goes on from the first round it lacks.
"""

import contextlib
import json
import numbers
import os
import shutil
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ensemble import checkpoint, errors, files
from ensemble.errors import UsageError

SETTINGS, CURVE, LAST, ANSWERS = 'loop.json', 'curve.jsonl', 'ensemble', 'answers.json'
_STAGED, _ROUND = LAST + '.new', 'round.json'


class Record:
  """A loop's rounds in `workdir` (None: kept in memory only), locked while the loop runs (a `with` block).

  `data`: what the rounds read, name -> `fingerprint(...)` ('seed', 'pool',
  'test'): a resume over other data is refused in one line, where it would
  pair the recorded answers with other inputs. `since(kept) -> settings`:
  what a record's settings say as this version writes them, for a record
  written before some settings existed or moved (the values it ran with)."""

  def __init__(self, workdir: str | None, settings: dict[str, Any], data: dict[str, str] | None = None,
               since: Callable[[dict[str, Any]], dict[str, Any]] | None = None):
    self.workdir = None if workdir is None else os.path.abspath(os.path.expanduser(workdir))
    self.rounds: list[dict[str, Any]] = []
    self._answers: dict[str, Any] = {}
    if self.workdir is None:
      return
    settings = {**settings, 'data': dict(data or {})}
    path = os.path.join(self.workdir, SETTINGS)
    if not os.path.exists(path) and os.path.isdir(self.workdir) and set(os.listdir(self.workdir)) - {
        checkpoint.LOCK_FILE}:
      raise UsageError(f'workdir={workdir!r} holds other files and no loop ({SETTINGS}): give an empty or new '
                       'folder')
    checkpoint.lock_workdir(self.workdir)  # before anything is read: the record is this run's until it ends
    try:
      if os.path.exists(path):
        self._resume(workdir, path, settings, since or (lambda kept: kept))
      else:
        files.write_atomically(path, json.dumps(settings, indent=1) + '\n')
    except BaseException:
      self.close()
      raise

  def _resume(self, workdir: str, path: str, settings: dict[str, Any],
              since: Callable[[dict[str, Any]], dict[str, Any]]):
    with open(path) as f:
      kept = json.load(f)
    data = settings.pop('data')
    if 'data' not in kept:  # recorded before loop.json kept the data's fingerprints: this data is taken as its own
      errors.hint(f'{path} was written before loops recorded what data they read: this call\'s is recorded as its '
                  'own; resume it with the data it was started with')
      files.write_atomically(path, json.dumps({**kept, 'data': data}, indent=1) + '\n')
    kept_data = kept.pop('data', data)
    kept = since(kept)
    changed = [key for key in sorted(set(kept) | set(settings)) if kept.get(key) != settings.get(key)]
    if changed:
      key = changed[0]
      raise UsageError(f'workdir={workdir!r} holds a loop with {key}={kept.get(key)!r}, and this one has '
                       f'{key}={settings.get(key)!r}: give the settings it was started with to resume it, or '
                       'another workdir')
    for name in sorted(set(kept_data) | set(data)):
      if kept_data.get(name) != data.get(name):
        raise UsageError(f'workdir={workdir!r} holds a loop whose {name} differ from these ({kept_data.get(name)} '
                         f'there, {data.get(name)} here): its recorded answers belong to those; give the {name} it '
                         'was started with to resume it, or another workdir')
    for name, attribute in ((CURVE, 'rounds'), (ANSWERS, '_answers')):
      if os.path.exists(os.path.join(self.workdir, name)):
        with open(os.path.join(self.workdir, name)) as f:
          value = [json.loads(line) for line in f if line.strip()] if name == CURVE else json.load(f)
        setattr(self, attribute, value)
    staged = self._round_of(_STAGED)
    if staged is not None and staged == len(self.rounds) - 1:  # stopped between recording its round and keeping it
      self._promote()

  def __enter__(self) -> 'Record':
    return self

  def __exit__(self, *exc_info):
    self.close()

  def close(self):
    if self.workdir is not None:
      checkpoint.unlock_workdir(self.workdir)

  def answers(self, keys: Sequence[str], ask: Callable[[list[int]], Any], name: str = 'label=') -> Any:
    """The answers for `keys` (the pool's indices, the points, as strings): those recorded, and `ask(positions)`'s
    for the others (their positions in `keys`), recorded the moment it returns, before they are checked; as `ask`
    returned them where none was recorded. `ask` (`name` in a refusal) returns one answer per position; what it
    returns is refused here only where it cannot be told apart per key."""
    missing = [i for i, key in enumerate(keys) if key not in self._answers]
    if not missing:
      return [self._answers[key] for key in keys]
    given = np.asarray(ask(missing))
    if given.ndim == 0 or len(given) != len(missing) or given.dtype == object:
      raise UsageError(f'{name} returned {given.shape[0] if given.ndim else "a scalar"} answers of dtype '
                       f'{given.dtype} for {len(missing)} inputs: return one number (or row) per index it is given')
    self._answers.update({keys[i]: value for i, value in zip(missing, given.tolist())})
    if self.workdir is not None:
      files.write_atomically(os.path.join(self.workdir, ANSWERS), json.dumps(self._answers) + '\n')
    return given if len(missing) == len(keys) else [self._answers[key] for key in keys]

  def add(self, entry: dict[str, Any]):
    """Records a finished round: the file holds it once this returns; then the round's staged ensemble (`stage`)
    becomes the last."""
    self.rounds.append(entry)
    if self.workdir is None:
      return
    files.write_atomically(os.path.join(self.workdir, CURVE), ''.join(json.dumps(r) + '\n' for r in self.rounds))
    if self._round_of(_STAGED) == len(self.rounds) - 1:
      self._promote()

  def stage(self, ens: Any):
    """Saves `ens`, the ensemble the round being played fitted, beside the last: it becomes the last once its round
    is recorded (`add`), so that a loop stopped before then resumes from the ensemble before it."""
    if self.workdir is None:
      return
    path = os.path.join(self.workdir, _STAGED)
    for stale in (path, path + '.part'):
      shutil.rmtree(stale, ignore_errors=True)
    ens.save(path + '.part')
    files.write_atomically(os.path.join(path + '.part', _ROUND), json.dumps(len(self.rounds)) + '\n')
    os.replace(path + '.part', path)

  def _round_of(self, name: str) -> int | None:
    path = os.path.join(self.workdir, name, _ROUND)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)

  def _promote(self):
    path, old = os.path.join(self.workdir, LAST), os.path.join(self.workdir, LAST + '.old')
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
      os.replace(path, old)
    os.replace(os.path.join(self.workdir, _STAGED), path)
    shutil.rmtree(old, ignore_errors=True)

  def last_ensemble(self, model: Any = None, fitted_at: int | None = None) -> Any:
    """The ensemble the last recorded round fitted, as saved (`stage`), or None. `fitted_at`: the entry its round's
    fit was staged before (a round of several entries' first), the last entry's by default."""
    path = None if self.workdir is None else os.path.join(self.workdir, LAST)
    if path is None or not os.path.isdir(path) or not self.rounds:
      return None
    fitted_at = len(self.rounds) - 1 if fitted_at is None else fitted_at
    if self._round_of(LAST) not in (None, fitted_at):  # None: kept before ensembles recorded their round
      return None
    from ensemble import api  # pylint: disable=g-import-not-at-top
    return api.load(path, model=model)


def fingerprint(*arrays: Any) -> str:
  """Arrays' shapes and dtypes and a hash of their bytes (`files.fingerprint`): what `loop.json` records."""
  return files.fingerprint([('', np.asarray(array), True) for array in arrays])


def whole_number(name: str, value: Any, low: int) -> int:
  """A loop's count (`rounds`, `batch`, `evaluations`, ...), checked in one line."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise UsageError(f'{name}={value!r} must be a whole number >= {low}')
  return int(value)


def recorded(fields: dict[str, Any]) -> dict[str, Any]:
  """`fit`'s keywords as loop.json records them: a resume with other ones is refused. A number is recorded as
  one, whatever its type (numpy's 4 is 4), a model object or a config by its repr."""
  def value(v):
    if isinstance(v, (bool, str)):
      return v
    if isinstance(v, numbers.Integral):
      return int(v)
    return float(v) if isinstance(v, numbers.Real) else repr(v)
  return {k: value(v) for k, v in fields.items()}


def fit_fields(fields: dict[str, Any], first_rows: int) -> dict[str, Any]:
  """`fit`'s keywords for every round: without a `batch_size`, batches of the first round's rows (or the recipe's
  batch, if fewer). `fit` takes all the rows as one batch while there are fewer than its batch, so each round's
  one more row or batch would change the programs' shapes and compile them again (1-5 s a round here); a fixed
  batch changes them once per batch of rows."""
  if 'batch_size' in fields:
    return dict(fields)
  from ensemble import api  # pylint: disable=g-import-not-at-top
  recipe = api.fit_recipe(fields.get('config'), {'task': fields.get('task')})
  return {**fields, 'batch_size': min(recipe.batch_size, first_rows)}


class Clock:
  """Seconds spent in each part of a round, for the record: what the loop itself costs is the round's time less
  its fit, its forward passes and the callback's."""

  def __init__(self):
    self.start, self.parts = time.perf_counter(), {}

  @contextlib.contextmanager
  def part(self, name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - start

  def seconds(self) -> dict[str, float]:
    total = time.perf_counter() - self.start
    own = total - sum(v for k, v in self.parts.items() if k != 'loop')  # a part named 'loop' is the loop's too
    return {**{k: round(v, 4) for k, v in self.parts.items()}, 'loop': round(own, 4), 'round': round(total, 4)}
