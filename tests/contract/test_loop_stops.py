"""The contract's loops axis: every loop (active learning on classes and on targets; Bayesian optimisation one point
a round, in rounds of points chosen jointly, and with every other setting of its surrogate), cold and warm, stopped
at every point of a round (inside a round of several points too) and run again, records what a loop never stopped
records, never asks a labeller or a function the same question twice, and refuses other data and a busy workdir in
one line.

A stop is a KeyboardInterrupt (what SIGTERM becomes in a loop: ensemble/sigterm.py) raised at the point named:
before the round's fit, after it (its work lost), in the acquisition, in the labeller or the function (no answer
given), and after the answer (before the round is recorded).
"""

import json
import os

import numpy as np
import pytest

import ensemble
from ensemble import checkpoint
from ensemble.errors import UsageError
from ensemble.loops import active_learning as al_lib
from ensemble.loops import bayesian_optimization as bo_lib
from ensemble.loops import record as record_lib

LOOPS = ('classes', 'targets', 'optimisation', 'optimisation_batch', 'optimisation_options')
STOPS = ('before_fit', 'after_fit', 'acquisition', 'answer', 'after_answer')
FIT = {'ensemble_size': 2, 'epochs': 3, 'batch_size': 8}


def _blobs(n, seed):
  rng = np.random.default_rng(seed)
  centres = np.random.default_rng(7).normal(size=(3, 5)) * 3
  labels = np.arange(n) % 3 if seed == 0 else rng.integers(0, 3, n)
  return (centres[labels] + rng.normal(size=(n, 5))).astype(np.float32), labels.astype(np.int32)


def _curve(n, seed):
  x = np.random.default_rng(seed).uniform(-2, 2, (n, 2)).astype(np.float32)
  return x, np.sin(2 * x[:, 0]) + x[:, 1]


DATA = {'classes': (_blobs(9, 0), _blobs(40, 1), _blobs(30, 2)),
        'targets': (_curve(8, 0), _curve(40, 1), _curve(30, 2))}
BOUNDS = [(-1.0, 2.0), (0.0, 1.0)]
# Each optimisation's keywords besides the first's: rounds of 3 chosen jointly (5 initial points, then 3 and the 2
# left) in a trust region, stopped inside a round as between them; and every other setting of the surrogate at
# once, minimised.
OPTIMISATIONS = {'optimisation': {'evaluations': 8, 'epochs': 10},
                 'optimisation_batch': {'evaluations': 10, 'batch': 3, 'epochs': 10, 'trust_region': True},
                 'optimisation_options': {'evaluations': 8, 'noise': True, 'transform': 'log', 'prior': 0.0,
                                          'train_steps': 30, 'maximize': False, 'acquisition': 'thompson',
                                          'trust_region': True, 'batch': 2}}
# Where a stop in the function or after its answer fires: the first chosen point's (of a batch of 2, the first); the
# batch's second of its 3.
FIRST_CHOSEN = {'optimisation': 5, 'optimisation_batch': 6, 'optimisation_options': 5}


def _peak(x):
  return -float((x[0] - 1.2) ** 2 + (x[1] - 0.3) ** 2)


class Asked:
  """A labeller (or function) that counts what it answered, and can be told to stop instead of answering."""

  def __init__(self, kind):
    self.kind, self.answered, self.stop_at = kind, [], None

  def __call__(self, *args):
    if self.stop_at is not None and len(self.answered) == self.stop_at:
      self.stop_at = None
      raise KeyboardInterrupt('stopped in the labeller')
    if self.kind in OPTIMISATIONS:
      self.answered.append(json.dumps(args[0].tolist()))
      return _peak(args[0]) * (-1 if self.kind == 'optimisation_options' else 1)
    indices, inputs = args
    self.answered.extend(indices.tolist())
    pool = DATA[self.kind][1]
    return pool[1][indices]


def _run(kind, warm, workdir, asked, **changes):
  if kind in OPTIMISATIONS:
    settings = {'initial': 5, 'acquisition': 'ei', 'candidates': 64, 'steps': 5, 'ensemble_size': 2,
                **OPTIMISATIONS[kind], **changes}
    return ensemble.bayesian_optimization('mlp', asked, BOUNDS, warm=warm, workdir=workdir, **settings)
  rows = dict(zip(('seed_rows', 'pool_rows', 'test_rows'), DATA[kind]))
  rows.update({key: changes.pop(key) for key in list(changes) if key in rows})
  settings = {'acquisition': 'bald' if kind == 'classes' else 'epistemic_std', 'batch': 3, 'rounds': 2, **FIT,
              **({'task': 'regression'} if kind == 'targets' else {}), **changes}
  return ensemble.active_learning('mlp', rows['seed_rows'], rows['pool_rows'][0], rows['test_rows'], label=asked,
                                  warm=warm, workdir=workdir, **settings)


def _timeless(curve):
  return [{k: v for k, v in entry.items() if k not in ('seconds', 'acquisition_value')} for entry in curve]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """Each loop, cold and warm, never stopped: what every stopped one must record."""
  runs = {}

  def get(kind, warm):
    if (kind, warm) not in runs:
      asked = Asked(kind)
      result = _run(kind, warm, str(tmp_path_factory.mktemp('whole') / 'loop'), asked)
      runs[kind, warm] = result, asked.answered
    return runs[kind, warm]
  return get


def _stopping(monkeypatch, kind, stop, asked):
  """Arms the stop: it fires once, in the first round that fits (the second of a pool loop, the first chosen point
  of an optimisation)."""
  optimisation = kind in OPTIMISATIONS
  loop = bo_lib if optimisation else al_lib
  fits = {'n': 0}
  real_fit = ensemble.api.fit

  def fit(*args, **kwargs):
    fits['n'] += 1
    if stop == 'before_fit' and fits['n'] == 2:
      raise KeyboardInterrupt('stopped before the fit')
    result = real_fit(*args, **kwargs)
    if stop == 'after_fit' and fits['n'] == 2:
      raise KeyboardInterrupt('stopped after the fit')
    return result
  monkeypatch.setattr(ensemble.api, 'fit', fit)
  if stop == 'acquisition':
    batched = OPTIMISATIONS.get(kind, {}).get('batch', 1) > 1
    name = 'batch_proposer' if batched else 'proposer' if optimisation else 'acquisition_program'
    real = getattr(loop, name)
    calls = {'n': 0}

    def program(*args, **kwargs):
      run = real(*args, **kwargs)

      def stopped(*a, **k):
        calls['n'] += 1
        if calls['n'] == (1 if optimisation else 2):
          raise KeyboardInterrupt('stopped in the acquisition')
        return run(*a, **k)
      return stopped
    monkeypatch.setattr(loop, name, program)
  if stop == 'answer':
    asked.stop_at = FIRST_CHOSEN[kind] if optimisation else 3  # the second batch's in a pool loop
  if stop == 'after_answer':
    real_add, adds = record_lib.Record.add, {'n': 0}

    def add(self, entry):
      adds['n'] += 1
      if adds['n'] == (FIRST_CHOSEN[kind] + 1 if optimisation else 2):
        raise KeyboardInterrupt('stopped after the answer')
      return real_add(self, entry)
    monkeypatch.setattr(record_lib.Record, 'add', add)


@pytest.mark.parametrize('stop', STOPS)
@pytest.mark.parametrize('warm', [False, True], ids=['cold', 'warm'])
@pytest.mark.parametrize('kind', LOOPS)
def test_a_stopped_loop_resumes_to_the_same_record_and_asks_nothing_twice(kind, warm, stop, uninterrupted, tmp_path):
  whole, whole_answered = uninterrupted(kind, warm)
  workdir, asked = str(tmp_path / 'loop'), Asked(kind)
  with pytest.MonkeyPatch.context() as patch:
    _stopping(patch, kind, stop, asked)
    with pytest.raises(KeyboardInterrupt, match='stopped'):
      _run(kind, warm, workdir, asked)
  resumed = _run(kind, warm, workdir, asked)
  assert _timeless(resumed.curve) == _timeless(whole.curve)
  if kind in OPTIMISATIONS:
    np.testing.assert_array_equal(resumed.x, whole.x)
  else:
    np.testing.assert_array_equal(resumed.acquired, whole.acquired)
    np.testing.assert_array_equal(resumed.labels, whole.labels)
  assert len(asked.answered) == len(set(asked.answered)), 'a question was answered twice'
  assert sorted(asked.answered) == sorted(whole_answered)
  assert _predicted(kind, resumed.ensemble) == pytest.approx(_predicted(kind, whole.ensemble), rel=1e-5)
  again = _run(kind, warm, workdir, asked)  # finished: replays, asks nothing, returns the kept ensemble
  assert _timeless(again.curve) == _timeless(whole.curve) and len(asked.answered) == len(whole_answered)
  # The kept ensemble, loaded, standardises its inputs on the host as the fitted one did (api.read): the same values.
  assert _predicted(kind, again.ensemble) == _predicted(kind, resumed.ensemble)


def _predicted(kind, ens):
  inputs = np.array([[0.0, 0.5], [1.5, 0.2]], np.float32) if kind in OPTIMISATIONS else DATA[kind][2][0][:5]
  return ens.predict(inputs)['probs' if kind == 'classes' else 'mean'].ravel().tolist()


def _other(kind, what):
  """The loop's data with `what` replaced by other rows of the same shapes (what a count would not tell apart)."""
  seed, pool, test = DATA[kind]
  other = lambda pair: (pair[0][::-1].copy(), pair[1][::-1].copy())
  return {'seed_rows': {'seed_rows': (seed[0] + 1, seed[1])}, 'pool': {'pool_rows': other(pool)},
          'test': {'test_rows': other(test)}}[what]


@pytest.mark.parametrize('what, name', [('seed_rows', 'seed rows'), ('pool', 'pool inputs'), ('test', 'test rows')])
@pytest.mark.parametrize('kind', LOOPS[:2])
def test_a_resume_over_other_data_is_refused_in_one_line(kind, what, name, uninterrupted, tmp_path):
  workdir = str(tmp_path / 'loop')
  _run(kind, False, workdir, Asked(kind), rounds=0)
  with pytest.raises(UsageError, match=f"holds a loop whose {name} differ from these") as raised:
    _run(kind, False, workdir, Asked(kind), rounds=0, **_other(kind, what))
  assert '\n' not in str(raised.value)


def test_an_optimisation_with_other_settings_is_refused_in_one_line(tmp_path):
  workdir = str(tmp_path / 'loop')
  _run('optimisation', False, workdir, Asked('optimisation'), evaluations=2)
  with pytest.raises(UsageError, match=r'holds a loop with bounds=.*give the settings it was started with') as raised:
    ensemble.bayesian_optimization('mlp', _peak, [(-1.0, 2.5), (0.0, 1.0)], evaluations=2, initial=5,
                                   candidates=64, steps=5, ensemble_size=2, epochs=10, workdir=workdir)
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('kind', LOOPS)
def test_a_busy_workdir_is_refused_before_anything_is_asked(kind, tmp_path):
  workdir = str(tmp_path / 'loop')
  held = checkpoint.WorkdirLock(workdir)
  assert held.acquire() is None  # as another process's loop holds it
  asked = Asked(kind)
  try:
    with pytest.raises(UsageError, match=r'is in use by process \d+ on .*wait for that run to end') as raised:
      _run(kind, False, workdir, asked)
  finally:
    held.release()
  assert '\n' not in str(raised.value) and not asked.answered
  assert not os.path.exists(os.path.join(workdir, record_lib.SETTINGS))
