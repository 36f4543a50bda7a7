"""What a script sees without logging set up (issue 76): each hint of `fit` that a user should act on is one
`EnsembleWarning` of one line (ensemble/errors.py's `hint`), pointing at the caller's line; the programs show it as
one log line (tests/test_cli.py)."""

import warnings

import numpy as np
import pytest

import ensemble
from ensemble.errors import EnsembleWarning

SMALL = {'ensemble_size': 2, 'optimizer': 'adamw', 'learning_rate': 0.01, 'weight_decay': 0.0, 'progress': False}


def _classes(n: int, seed: int = 0, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
  """Learnable features (4 of them): the class is the largest of three of their sums."""
  x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
  return x, np.argmax(x[:, :classes] + 0.5 * x[:, 3:], axis=1)


def _hints(caught) -> list[str]:
  return [str(w.message) for w in caught if issubclass(w.category, EnsembleWarning)]


def test_a_batch_larger_than_the_rows_is_a_warning_at_the_caller_s_line():
  """Issue 76: an info line a script never saw. The warning points at the `fit` call (Python shows it once per line
  that caused it), and names no row count, so a loop whose rows grow shows it once."""
  with pytest.warns(EnsembleWarning, match=r'^batch_size=64 exceeds the training rows: each step takes all of them, '
                                           r'one step an epoch; give a batch_size below') as caught:
    ens = ensemble.fit('mlp', _classes(20), epochs=1, batch_size=64, **SMALL)
  assert ens.config.batch_size == 20
  hint, = [w for w in caught if issubclass(w.category, EnsembleWarning)]
  assert hint.filename == __file__ and '\n' not in str(hint.message)


def test_members_still_at_chance_are_named_in_one_warning_with_the_likely_causes():
  """A learning rate that moves nothing: after epoch 2 (50 steps) both members' training loss is log 3's; one
  warning names them, the learning rate and the features' scale, the same from the loop (a bar shown) and from the
  whole run as one program (`loop._train_at_once`). A healthy run of the same steps says nothing."""
  data = _classes(200)
  fields = {**SMALL, 'epochs': 3, 'batch_size': 8, 'learning_rate': 1e-9}
  messages = []
  for progress in (False, True):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      ensemble.fit('mlp', data, **{**fields, 'progress': progress})
    messages.append(_hints(caught))
  assert messages[0] == messages[1] and len(messages[0]) == 1, messages
  assert messages[0][0].startswith('members [0, 1] of 2: training loss still at or above chance after epoch 2 (')
  assert messages[0][0].endswith('; uniform probabilities over 3 classes score log 3 = 1.1): likely a learning rate '
                                 'too low or too high for them, learning_rate=1e-09 (adamw); or features on another '
                                 'scale than the model expects (standardize_features=True)')
  with warnings.catch_warnings():
    warnings.simplefilter('error', EnsembleWarning)
    ensemble.fit('mlp', data, **{**fields, 'learning_rate': 0.01})


def test_a_run_resumed_says_still_falling_over_all_its_epochs(tmp_path):
  """Issue 76: a run resumed for 4 more epochs said "over the last 1 of 4 epochs", its own; the note speaks of the
  run's 10 epochs, the earlier ones from metrics.jsonl."""
  from test_early_stopping import RECIPE, _toy  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / 'run')
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', EnsembleWarning)
    ensemble.fit('mlp', _toy(300, 0), epochs=6, workdir=workdir, **RECIPE)
  with pytest.warns(EnsembleWarning, match='still falling') as caught:
    ensemble.fit('mlp', _toy(300, 0), epochs=10, workdir=workdir, **RECIPE)
  note, = [message for message in _hints(caught) if 'still falling' in message]
  assert ' over the last 2 of 10 epochs)' in note, note
