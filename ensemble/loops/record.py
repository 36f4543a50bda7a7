"""What the active-learning and the Bayesian-optimisation loops share: a record of their rounds that survives
being stopped, and the stop itself.

A loop's workdir holds `loop.json` (the settings that make its rounds
reproducible, written once) and `curve.jsonl` (one line per finished round:
the labels or evaluations so far, the test scores, what was acquired and what
it was labelled, the seconds each part took), rewritten whole and renamed
into place after every round, so that an interruption at any moment leaves
the rounds before it complete and never half a line. A warm loop keeps the
last round's ensemble beside them (`ensemble/`, saved the same way) to start
the next round's fit from. Run again with the same settings, a loop replays
what the record holds (the labels a person gave are never asked for again)
and goes on from the first round it lacks.
"""

import contextlib
import json
import numbers
import os
import shutil
import time
from typing import Any, Iterator

from ensemble import files
from ensemble.errors import UsageError

SETTINGS, CURVE, LAST = 'loop.json', 'curve.jsonl', 'ensemble'


class Record:
  """A loop's rounds in `workdir` (None: kept in memory only)."""

  def __init__(self, workdir: str | None, settings: dict[str, Any]):
    self.workdir = None if workdir is None else os.path.abspath(os.path.expanduser(workdir))
    self.rounds: list[dict[str, Any]] = []
    if self.workdir is None:
      return
    path = os.path.join(self.workdir, SETTINGS)
    if os.path.exists(path):
      with open(path) as f:
        kept = json.load(f)
      changed = [key for key in sorted(set(kept) | set(settings)) if kept.get(key) != settings.get(key)]
      if changed:
        key = changed[0]
        raise UsageError(f'workdir={workdir!r} holds a loop with {key}={kept.get(key)!r}, and this one has '
                         f'{key}={settings.get(key)!r}: give the settings it was started with to resume it, or '
                         'another workdir')
      curve = os.path.join(self.workdir, CURVE)
      if os.path.exists(curve):
        with open(curve) as f:
          self.rounds = [json.loads(line) for line in f if line.strip()]
    elif os.path.isdir(self.workdir) and os.listdir(self.workdir):
      raise UsageError(f'workdir={workdir!r} holds other files and no loop ({SETTINGS}): give an empty or new '
                       'folder')
    else:
      os.makedirs(self.workdir, exist_ok=True)
      files.write_atomically(path, json.dumps(settings, indent=1) + '\n')

  def add(self, entry: dict[str, Any]):
    """Records a finished round: the file holds it once this returns."""
    self.rounds.append(entry)
    if self.workdir is not None:
      files.write_atomically(os.path.join(self.workdir, CURVE), ''.join(json.dumps(r) + '\n' for r in self.rounds))

  def last_ensemble(self, model: Any = None) -> Any:
    """The ensemble the last recorded round fitted, as saved (`keep`), or None."""
    path = None if self.workdir is None else os.path.join(self.workdir, LAST)
    if path is None or not os.path.isdir(path) or not self.rounds:
      return None
    from ensemble import api  # pylint: disable=g-import-not-at-top
    return api.load(path, model=model)

  def keep(self, ens: Any):
    """Saves `ens` as the last round's ensemble, replacing the one before only once it is complete."""
    if self.workdir is None:
      return
    path, fresh = os.path.join(self.workdir, LAST), os.path.join(self.workdir, LAST + '.new')
    shutil.rmtree(fresh, ignore_errors=True)
    ens.save(fresh)
    old = os.path.join(self.workdir, LAST + '.old')
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
      os.replace(path, old)
    os.replace(fresh, path)
    shutil.rmtree(old, ignore_errors=True)


def whole_number(name: str, value: Any, low: int) -> int:
  """A loop's count (`rounds`, `batch`, `evaluations`, ...), checked in one line."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise UsageError(f'{name}={value!r} must be a whole number >= {low}')
  return int(value)


def recorded(fields: dict[str, Any]) -> dict[str, Any]:
  """`fit`'s keywords as loop.json records them: a resume with other ones is refused. A model object or a config
  is recorded by its repr."""
  return {k: v if isinstance(v, (int, float, str, bool)) else repr(v) for k, v in fields.items()}


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
