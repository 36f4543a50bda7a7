"""Early stopping from Python (`fit(validation=..., early_stopping=N)`): the members of the best epoch by validation
NLL, the epochs it trained, the one-line refusals; and the note a run that ends still falling gets."""

import logging
import os
import warnings

import numpy as np
import pytest

import ensemble
from ensemble import checkpoint, trainer, writers
from ensemble.errors import EnsembleWarning, UsageError
from conftest import sigterm_at_step

RECIPE = {'task': 'regression', 'ensemble_size': 2, 'batch_size': 50, 'schedule': 'constant', 'progress': False}


def _toy(n: int, seed: int):
  rng = np.random.default_rng(seed)
  x = rng.uniform(-3, 3, (n, 1)).astype(np.float32)
  return x, (np.sin(x[:, 0]) + (0.1 + 0.2 * np.abs(x[:, 0])) * rng.normal(size=n)).astype(np.float32)


def test_early_stopping_returns_the_best_epoch_s_members():
  """The members returned are those of the epoch with the lowest validation NLL: the same as a fit of that many
  epochs (a constant rate: the schedule does not depend on the length), bit for bit; training stopped `patience`
  epochs after it, and the test pass scored them."""
  (x, y), validation, test = _toy(300, 0), _toy(200, 1), _toy(200, 2)
  stopped = ensemble.fit('mlp', (x, y), test=test, epochs=400, validation=validation, early_stopping=5, **RECIPE)
  summary = stopped.summary
  best = summary['best_epoch']
  assert summary['epochs_trained'] == best + 5 < 400, summary
  assert summary['epoch'] == best and 'test_loss' in summary and np.isfinite(summary['validation_loss'])
  again = ensemble.fit('mlp', (x, y), test=test, epochs=best, **RECIPE)
  for a, b in zip(jax_leaves(stopped.params), jax_leaves(again.params), strict=True):
    np.testing.assert_array_equal(a, b)
  assert summary['test_loss'] == pytest.approx(again.summary['test_loss'], rel=1e-6)
  assert summary['validation_loss'] == pytest.approx(again.evaluate(*validation)['ensemble']['nll'], rel=1e-5)
  # A later epoch's members score no better on the validation rows: the epoch kept is the best one seen.
  later = ensemble.fit('mlp', (x, y), epochs=best + 2, **RECIPE)
  assert later.evaluate(*validation)['ensemble']['nll'] >= summary['validation_loss'] - 1e-9


def test_a_workdir_keeps_the_best_epoch_as_its_last_checkpoint_and_does_not_train_it_again(tmp_path, caplog):
  """Early stopping in a workdir (what the CLI runs): the epochs that lower the validation NLL are checkpointed, the
  others only write their metrics line (each says the best epoch so far), so the last checkpoint is the best and
  `load` gives the members the in-memory fit returns; the same fit again trains nothing. Without validation=, the
  held-out slice is scored (the CLI's `--config.early_stopping=N`)."""
  (x, y), validation = _toy(300, 0), _toy(200, 1)
  settings = dict(epochs=400, early_stopping=5, **RECIPE)
  in_memory = ensemble.fit('mlp', (x, y), validation=validation, **settings)
  best = in_memory.summary['best_epoch']
  workdir = str(tmp_path / 'run')
  saved = ensemble.fit('mlp', (x, y), validation=validation, workdir=workdir, **settings)
  assert saved.epoch == best and max(checkpoint.Checkpointer(workdir).epochs()) == best
  for a, b in zip(jax_leaves(saved.params), jax_leaves(in_memory.params), strict=True):
    np.testing.assert_array_equal(a, b)
  lines = writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  assert [line['epoch'] for line in lines] == list(range(1, best + 6))
  assert [line['best_epoch'] for line in lines][best - 1:] == [best] * 6
  with caplog.at_level(logging.INFO, logger='absl'):
    again = ensemble.fit('mlp', (x, y), validation=validation, workdir=workdir, **settings)
  assert any('stopped early' in r.getMessage() and 'nothing to train' in r.getMessage() for r in caplog.records)
  assert len(writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))) == len(lines) and again.epoch == best
  # The held-out slice: its last fifth scored, as a validation set of those rows is.
  held = ensemble.fit('mlp', (x, y), heldout_fraction=0.2, **settings)
  rows = ensemble.fit('mlp', (x[:240], y[:240]), validation=(x[240:], y[240:]), **settings)
  assert held.summary['best_epoch'] == rows.summary['best_epoch']
  assert held.summary['validation_loss'] == pytest.approx(rows.summary['validation_loss'], rel=1e-6)


def test_the_cli_refuses_early_stopping_without_a_held_out_slice(make_config, tmp_path):
  with pytest.raises(UsageError, match=r'early_stopping=2 scores the held-out slice .* heldout_fraction=0 holds out '
                                       'none: set --config.heldout_fraction'):
    trainer.train_and_evaluate(make_config(early_stopping=2), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def jax_leaves(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize('fields, message', [
    ({'early_stopping': 3}, r'early_stopping=3 needs validation=\(x_val, y_val\)'),
    ({'validation': 'v'}, 'validation= is what early_stopping=N scores'),
    ({'early_stopping': -1, 'validation': 'v'}, 'early_stopping=-1 must be a whole number of epochs'),
    ({'early_stopping': True, 'validation': 'v'}, 'early_stopping=True must be a whole number'),
    ({'early_stopping': 3, 'validation': 'v', 'checkpoint_every_steps': 2},
     'early_stopping=3 keeps the best epoch as the last checkpoint, and checkpoint_every_steps=2'),
    ({'early_stopping': 3, 'validation': 'wide'}, r'validation= holds inputs \(2,\)'),
])
def test_early_stopping_is_refused_in_one_line_without_what_it_needs(fields, message, tmp_path):
  x, y = _toy(100, 0)
  given = {'v': (x, y), 'wide': (np.concatenate([x, x], 1), y)}
  fields = {k: given.get(v, v) if k == 'validation' else (str(tmp_path / v) if k == 'workdir' else v)
            for k, v in fields.items()}
  with pytest.raises(UsageError, match=message):
    ensemble.fit('mlp', (x, y), epochs=2, **{**RECIPE, **fields})


def test_a_run_that_ends_still_falling_says_so_in_one_line():
  """10 epochs of the regression recipe on 300 rows leave the loss falling (the flat model of the issue); 80 do
  not. One warning a script sees (an EnsembleWarning, issue 76; an info line before) says which."""
  x, y = _toy(300, 0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    ensemble.fit('mlp', (x, y), epochs=10, **RECIPE)
    short = [str(w.message) for w in caught if issubclass(w.category, EnsembleWarning)]
    del caught[:]
    ensemble.fit('mlp', (x, y), epochs=80, **RECIPE)
    long = [str(w.message) for w in caught if 'still falling' in str(w.message)]
  assert len(short) == 1 and 'still falling' in short[0] and 'early_stopping=N with validation=' in short[0], short
  assert ' over the last 2 of 10 epochs)' in short[0] and '\n' not in short[0], short
  assert not long, long


def test_a_run_stopped_by_sigterm_and_resumed_leaves_no_step_saved_apart_when_it_stops_early(tmp_path):
  """Issue 75: `checkpoints_stopped/` stayed after an early-stopped run resumed from SIGTERM finished: its removal
  waited for an epoch's checkpoint, and under early stopping an epoch that does not lower the validation NLL writes
  none. The epoch's end that passes the step saved apart removes it, checkpoint or not."""
  x, y = _toy(300, 0)
  validation = (x, -y)  # the members learn y: the NLL of -y is lowest after the first epoch, and rises after it
  settings = dict(epochs=20, early_stopping=2, steps_per_dispatch=2, workdir=str(tmp_path / 'run'), **RECIPE)
  # SIGTERM in epoch 2 (6 steps an epoch), after epoch 1's checkpoint.
  with sigterm_at_step(8), pytest.raises(trainer.Interrupted, match='stopped on SIGTERM at step 8, in epoch 2'):
    ensemble.fit('mlp', (x, y), validation=validation, **settings)
  assert os.listdir(tmp_path / 'run' / checkpoint.STOPPED_DIR) == ['8']
  resumed = ensemble.fit('mlp', (x, y), validation=validation, **settings)
  assert resumed.summary['best_epoch'] == 1 and resumed.summary['epochs_trained'] == 3, resumed.summary
  assert not os.path.exists(tmp_path / 'run' / checkpoint.STOPPED_DIR)
