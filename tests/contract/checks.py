"""The invariants every cell of the matrix keeps: each a function of (cell, lab) that raises when the cell breaks it.

A check says what a user relies on, in its name and docstring, and compares what the cell gives with what the same
ensemble gives by another path (in memory, on arrays, with pmap): they must agree to float32's tolerance.
"""

import copy
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

import ensemble
from ensemble import features
from ensemble.uncertainty import conformal
from conftest import compiles, sigterm_at_step
from lab import (CALIBRATION_ROWS, CHAINS, CONFORMAL_ALPHA, STEPS_PER_EPOCH, TARGET_SCALES, WORKDIR_FIELDS, Cell, Lab,
                 as_source, assert_same_members, assert_same_summary, cut, folder_digest, leaves, problem, timeless,
                 train_folder)

# The methods whose members are K independent networks of one architecture: a warm start from one of them into
# another keeps each member's network (converted, as docs/python-api.md says). The other methods' members share
# weights or are built otherwise, and a warm start into or out of them is refused.
MEMBERWISE = ('independent', 'bagging', 'hyper', 'snapshot', 'multiswag', 'adversarial')


def same_members_as_in_memory(cell: Cell, lab: Lab):
  """Streamed, from a converted folder, in a workdir or on the jit backend: the members, their outputs and the
  summary are those of the same fit in memory on arrays with pmap."""
  got, want = lab.ensemble(cell), lab.ensemble(cell._replace(path='arrays', backend='pmap'))
  # Another backend's programs sum in another order, and Adam's steps make a weight with gradients near 0 move by
  # their sign: a few weights of 8 steps differ by 3e-5.
  tolerance = {'rtol': 1e-3, 'atol': 1e-4} if cell.backend != 'pmap' else {}
  assert_same_members(got, want, **tolerance)
  assert_same_summary(got.summary, want.summary, rtol=tolerance.get('rtol', 1e-4))


def summary_is_finite_in_one_unit(cell: Cell, lab: Lab):
  """Every figure of the summary is finite; the losses of real-valued targets are all in the targets' units: with
  the targets in a unit 1000 times smaller (the same members, standardised), every NLL grows by D log 1000, train
  and test, and every pinball loss 1000 times."""
  ens = lab.ensemble(cell)
  summary = ens.summary
  assert summary and all(math.isfinite(v) for v in summary.values()), summary
  if not ens.task.standardises_targets:
    return
  scaled = lab.ensemble(cell, scale=1000.0).summary
  losses = [key for key in summary if key.endswith('_loss') or '_loss/' in key]
  assert 'train_loss' in losses and 'test_loss' in losses, sorted(summary)
  for key in losses:
    if hasattr(ens.task, 'log_jacobian'):  # a density's NLL
      np.testing.assert_allclose(scaled[key] - summary[key], len(TARGET_SCALES) * math.log(1000.0), rtol=1e-3,
                                 err_msg=key)
    else:  # a loss in the targets' own units
      np.testing.assert_allclose(scaled[key] / summary[key], 1000.0, rtol=1e-3, err_msg=key)


def apply_is_a_function_of_params(cell: Cell, lab: Lab):
  """`apply(params, x)` gives the members' outputs that `predict` uses, and depends on `params`: a change of them
  changes it, and its gradient with respect to them is not zero."""
  ens = lab.ensemble(cell)
  x = problem(cell.task)[1][0][:5]

  def total(params):
    outputs = ens.apply(params, x)
    return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(outputs)), outputs
  (value, outputs), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(ens.params)
  # What the host computes predict from, the same members' outputs (a regression's components in the targets' units,
  # a quantile ensemble's quantiles), to float32's precision.
  host = ens.task.apply_outputs(ens.member_outputs(x))
  jax.tree.map(lambda traced, want: np.testing.assert_allclose(np.asarray(traced), want, rtol=1e-4,
                                                               atol=1e-6 * max(np.abs(want).max(), 1.0)),
               outputs, host)
  try:  # where the members give probabilities: those of `apply`'s outputs are `member_probs`
    probs = ens.member_probs(x)
  except ensemble.UsageError:
    probs = None
  if probs is not None:
    np.testing.assert_allclose(ens.task.member_probs(np.asarray(outputs, np.float64)), probs, rtol=1e-4, atol=1e-6)
  assert any(np.abs(leaf).max() > 0 for leaf in leaves(grads)), 'the gradient with respect to params is zero'
  nudged = jax.tree.map(lambda p: p * 1.05 + 0.01 if jnp.issubdtype(p.dtype, jnp.floating) else p, ens.params)
  (nudged_value, _), _ = jax.jit(jax.value_and_grad(total, has_aux=True))(nudged)
  assert not np.allclose(nudged_value, value), 'apply ignores its params'


def _moved(before, after) -> float:
  return max(float(np.abs(a - b).max()) for a, b in zip(leaves(before), leaves(after)))


def warm_start_continues(cell: Cell, lab: Lab):
  """`init=ens` trains on from the members, with and without the kept optimizer: the parameters move as a fresh
  fit's do, and the training loss goes on from where the first fit left it."""
  ens = lab.ensemble(cell)
  train, test = problem(cell.task)
  # The loss's own unit: nats (an NLL), or a loss in the targets' units (a pinball loss) in their standardised ones.
  unit = 1.0 if hasattr(ens.task, 'log_jacobian') or not ens.task.standardises_targets else np.mean(
      ens.task.target_std)
  for keep in (False, True):
    again = ensemble.fit('mlp', train, test=test, init=ens, keep_optimizer=keep, progress=False, **cell.fields())
    moved = _moved(ens.params, again.params)
    assert moved > 1e-4, f'keep_optimizer={keep}: the parameters moved by {moved:.2g}'
    assert math.isfinite(again.summary['train_loss'])
    assert (again.summary['train_loss'] - ens.summary['train_loss']) / unit < 0.5, (keep, again.summary, ens.summary)


def warm_start_under_every_schedule(cell: Cell, lab: Lab):
  """Every schedule, both `keep_optimizer` values: a warm start moves the parameters (a kept optimizer does not
  carry the schedule's end into the new fit)."""
  train, test = problem(cell.task)
  for schedule in ('constant', 'cosine', 'warmup_cosine'):
    fields = cell.fields(schedule=schedule, warmup_epochs=1 if schedule == 'warmup_cosine' else 0)
    first = ensemble.fit('mlp', train, test=test, progress=False, **fields)
    for keep in (False, True):
      again = ensemble.fit('mlp', train, test=test, init=first, keep_optimizer=keep, progress=False, **fields)
      moved = _moved(first.params, again.params)
      assert moved > 1e-4, f'schedule={schedule}, keep_optimizer={keep}: the parameters moved by {moved:.2g}'


def warm_start_across_methods(cell: Cell, lab: Lab):
  """From a deep ensemble into this method: trained on, member by member, where both are K independent networks;
  else refused in one line that names both methods."""
  deep = lab.ensemble(cell._replace(method='independent'))
  train, test = problem(cell.task)
  if cell.method in MEMBERWISE:
    again = ensemble.fit('mlp', train, test=test, init=deep, progress=False, **cell.fields())
    assert again.config.method == cell.fields().get('method', 'independent')
    assert _moved(deep.params, again.params) > 1e-4
    return
  with pytest.raises(ensemble.UsageError) as refused:
    ensemble.fit('mlp', train, test=test, init=deep, progress=False, **cell.fields())
  message = str(refused.value)
  named = 'shared' if 'shared' in cell.fields() else cell.method  # what the refusal must name: why none carries over
  assert '\n' not in message and named in message and ('independent' in message or 'init_params' in message), message


def save_load_predicts_the_same(cell: Cell, lab: Lab, cells: list[Cell]):
  """`save` then `load` (a workdir run's: `load`): the same state and summary here, and for what `save` wrote, the
  same members' outputs in a new process."""
  ens = lab.ensemble(cell)
  loaded = ensemble.load(lab.saved(cell))
  for a, b in zip(leaves(loaded.state), leaves(ens.state), strict=True):
    np.testing.assert_array_equal(a, b)
  assert_same_summary(loaded.summary, ens.summary)
  if cell in cells:
    fresh = lab.fresh_predictions(cells)[cell.id]
    x = problem(cell.task)[1][0]
    np.testing.assert_allclose(fresh, ens.member_outputs(x), rtol=1e-6, atol=1e-6)


def refit_compiles_nothing(cell: Cell, lab: Lab):
  """A loop of fits on other data of the same shapes and with another seed each, each with a test set and
  predictions: after the first, they compile nothing (the seed is an argument of the programs, for every method,
  those whose members share weights drawn from it too). A program of the first fit's `apply_variables` (what a
  loop's acquisition is) answers for the second as its own `apply` does."""
  data_of = (lambda split: split) if cell.path == 'arrays' else (lambda split: [(a, b) for a, b in zip(*split)])

  def fit_and_predict(seed):
    (x, y), (x_test, y_test) = problem(cell.task, seed=seed)
    ens = ensemble.fit('mlp', data_of((x, y)), test=data_of((x_test, y_test)), progress=False,
                       **cell.fields(seed=seed))
    ens.predict(x_test)
    return ens, x_test[:8]
  first, _ = fit_and_predict(1)
  with compiles() as counts:
    second, x = fit_and_predict(2)
  assert not counts, f'{sum(counts.values())} programs compiled'
  apply = jax.jit(lambda variables, params, x: first.apply_variables(variables, params, x))
  jax.tree.map(lambda got, want: np.testing.assert_allclose(  # a program's float32 rounding against eager's
      got, want, rtol=1e-4, atol=1e-6 * max(float(np.abs(want).max()), 1.0)),
               apply(second.variables, second.params, x), second.apply(second.params, x))


def resume_equals_uninterrupted(cell: Cell, lab: Lab):
  """A run stopped at an epoch's end or mid-epoch, and run again, ends with the members and the metrics.jsonl of
  the run that was never stopped."""
  whole = lab.ensemble(cell)
  lines = _lines(whole.workdir)
  # Mid-epoch, and (where the data is not streamed: a streamed epoch's start is its own first read) epoch 1's end.
  for step in (STEPS_PER_EPOCH // 2,) + ((STEPS_PER_EPOCH,) if cell.path != 'folder' else ()):
    copy = cut(whole.workdir, lab.workdir(cell, f'resumed-{step}'), step)
    if cell.path == 'folder':
      train_folder(cell, lab.folder(cell.task), copy, **WORKDIR_FIELDS)
      resumed = ensemble.load(copy)
    else:
      train, test = problem(cell.task)
      resumed = ensemble.fit('mlp', train, test=test, workdir=copy, progress=False,
                             **cell.fields(**WORKDIR_FIELDS))
    assert_same_members(resumed, whole)
    assert [timeless(line) for line in _lines(copy)] == [timeless(line) for line in lines]


def _lines(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def workdir_knows_its_data(cell: Cell, lab: Lab):
  """A workdir (a run's, or `save`'s) trained on some arrays refuses a fit on others in one line, and is left
  byte-for-byte as it was."""
  path = lab.saved(cell)
  before = folder_digest(path)
  train, test = problem(cell.task, seed=2)
  with pytest.raises(ensemble.UsageError) as refused:
    ensemble.fit('mlp', train, test=test, workdir=path, progress=False,
                 **cell.fields(**(WORKDIR_FIELDS if cell.path == 'workdir' else {})))
  assert '\n' not in str(refused.value) and 'other' in str(refused.value), refused.value
  assert folder_digest(path) == before


def calibration_is_kept(cell: Cell, lab: Lab):
  """`calibrate` then `conformal` on other labelled rows: a copy with a finite positive temperature (variance
  scale), sets or intervals from `predict` that hold what they must (an interval around the mean, a set with at
  least the most probable class where the threshold allows), the original untouched, and `save` then `load` the
  same predictions and the same calibration."""
  ens = lab.ensemble(cell)
  (x_cal, y_cal), (x, _) = problem(cell.task, seed=5)
  if ens.task.calibration is None:  # refused in one line that names the task, and conformal alone
    with pytest.raises(ensemble.UsageError, match=f'a {cell.task} ensemble has no temperature or scale to fit'):
      ens.calibrate(x_cal, y_cal)
    calibrated = ens.conformal(x_cal, y_cal, alpha=0.25)
  else:
    calibrated = ens.calibrate(x_cal, y_cal).conformal(x_cal, y_cal, alpha=0.25)
    name = 'variance_scale' if ens.task.calibration == 'variance_scale' else 'temperature'
    assert 0 < calibrated.summary[name] < math.inf, calibrated.summary
    assert f'{name} ' in repr(calibrated), repr(calibrated)
  assert ens.temperature == 1.0 and ens.conformal_calibration is None, 'calibrate changed the original'
  assert calibrated.summary['conformal_alpha'] == 0.25, calibrated.summary
  got = calibrated.predict(x)
  if 'conformal_lower' in got:  # intervals: finite, around the mean (the quantile pair's middle)
    assert np.isfinite(got['conformal_lower']).all() and np.isfinite(got['conformal_upper']).all()
    middle = got['mean'] if 'mean' in got else (got['lower'] + got['upper']) / 2
    assert (got['conformal_lower'] <= middle).all() and (middle <= got['conformal_upper']).all()
  elif got['set'].shape == (*got['probs'].shape, 2):  # per label, a set that holds a value holds the more probable
    held = got['set'].any(-1)
    assert np.take_along_axis(got['set'], got['labels'][..., None], -1)[..., 0][held].all(), got['set']
  else:  # a set may be empty (no class scores within the threshold); one that is not holds the most probable (at
    # each position of a dense task's)
    assert got['set'].shape == got['probs'].shape
    held = got['set'].any(-1)
    assert np.take_along_axis(got['set'], got['probs'].argmax(-1)[..., None], -1)[..., 0][held].all(), got['set']
  path = os.path.join(lab.workdir(cell, 'calibrated'))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if not os.path.exists(path):
    calibrated.save(path)
  loaded = ensemble.load(path)
  assert loaded.conformal_calibration == calibrated.conformal_calibration
  assert loaded.temperature == calibrated.temperature
  np.testing.assert_allclose(loaded.member_outputs(x), calibrated.member_outputs(x), rtol=1e-5, atol=1e-6)
  again = loaded.predict(x)
  for key, value in got.items():  # in the targets' units: float32's precision of the largest of them
    np.testing.assert_allclose(again[key], value, rtol=1e-4, atol=1e-5 * np.abs(value).max(), err_msg=key)


def early_stopping_keeps_the_best_epoch(cell: Cell, lab: Lab):
  """`early_stopping=N` with `validation=`: the summary names the best epoch, no later than the epochs trained, and
  the members returned score on the validation rows the validation NLL it reports (they are that epoch's); in a
  workdir, the last checkpoint is that epoch and holds the members and the summary the same fit in memory returns
  (the test pass on them, the epochs trained); streamed (from
  a source, or from a folder by the command line, which scores the held-out slice), the same members as in
  memory."""
  train, test = problem(cell.task)
  validation = problem(cell.task, seed=7)[0]
  fields = cell.fields(epochs=4, early_stopping=1)
  if cell.path == 'source':
    in_memory = lab.early_stopped(cell._replace(path='arrays'))
    ens = ensemble.fit('mlp', as_source(train), test=as_source(test), validation=validation, progress=False,
                       **fields)
    assert_same_members(ens, in_memory)
    assert_same_summary(ens.summary, in_memory.summary)
    return
  if cell.path == 'folder':  # the command line scores the held-out slice of the streamed training split
    held_out = {'epochs': 4, 'early_stopping': 1, 'heldout_fraction': 0.25}
    in_memory = ensemble.fit('mlp', train, test=test, progress=False, **cell.fields(**held_out))
    workdir = lab.workdir(cell, 'early-stopped')
    train_folder(cell, lab.folder(cell.task), workdir, **held_out)
    ens = ensemble.load(workdir)
    assert ens.epoch == in_memory.summary['best_epoch'], (ens.epoch, in_memory.summary)
    assert_same_members(ens, in_memory)
    return
  if cell.path == 'workdir':
    in_memory = lab.early_stopped(cell._replace(path='arrays'))
    ens = ensemble.fit('mlp', train, test=test, validation=validation, progress=False,
                       workdir=lab.workdir(cell, 'early-stopped'), **fields)
    assert ens.epoch == in_memory.summary['best_epoch'], (ens.epoch, in_memory.summary)
    assert_same_members(ens, in_memory)
    assert_same_summary(ens.summary, in_memory.summary)  # the test pass on the best members, the epochs trained
    return
  ens = lab.early_stopped(cell)
  summary = ens.summary
  assert 1 <= summary['best_epoch'] <= summary['epochs_trained'] <= 4 and summary['epoch'] == summary['best_epoch']
  assert math.isfinite(summary['validation_loss']) and 'test_loss' in summary, summary
  scored = ens.evaluate(*validation)['ensemble'][ens.task.loss_score]
  np.testing.assert_allclose(scored, summary['validation_loss'], rtol=1e-4, atol=1e-5)


def sigterm_resumes_exactly(cell: Cell, lab: Lab):
  """SIGTERM mid-epoch in a run that checkpoints by epoch: the run stops with the step saved apart
  (checkpoints_stopped/, which no reader of epochs sees), and the same fit resumes from that step to the members
  and the epochs' metrics of the run never stopped; the step saved apart is removed once an epoch passes it."""
  from ensemble import checkpoint, trainer  # pylint: disable=g-import-not-at-top
  whole = lab.ensemble(cell)
  train, test = problem(cell.task)
  fields = cell.fields(steps_per_dispatch=2)  # dispatches end mid-epoch, where SIGTERM is taken
  workdir = lab.workdir(cell, 'terminated')
  with sigterm_at_step(2), pytest.raises(trainer.Interrupted, match='stopped on SIGTERM at step 2, in epoch 1'):
    ensemble.fit('mlp', train, test=test, workdir=workdir, progress=False, **fields)
  assert os.listdir(os.path.join(workdir, checkpoint.STOPPED_DIR)) == ['2']
  assert not os.path.exists(os.path.join(workdir, checkpoint.CHECKPOINTS_DIR))
  resumed = ensemble.fit('mlp', train, test=test, workdir=workdir, progress=False, **fields)
  assert_same_members(resumed, whole)
  epochs = lambda path: [timeless(line) for line in _lines(path) if line['step'] % STEPS_PER_EPOCH == 0]
  assert epochs(workdir) == epochs(whole.workdir)
  assert not os.path.exists(os.path.join(workdir, checkpoint.STOPPED_DIR))


def _log_mean_exp(log_values: np.ndarray, axis: int = 0) -> np.ndarray:
  return special.logsumexp(log_values, axis=axis) - math.log(log_values.shape[axis])


def _classes_nll(log_probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """-log of the members' mean probability of each label: (K, ..., C) log-probabilities, labels (...)."""
  picked = np.take_along_axis(log_probs, np.broadcast_to(labels[None, ..., None], (*log_probs.shape[:-1], 1)), -1)
  return -_log_mean_exp(picked[..., 0])


# Each task's test loss, computed from the members' outputs (`member_outputs`, the prediction program's, not the
# test pass's) by numpy and scipy alone: what the task's own code is judged against.
def _classification_loss(ens, x, y):
  return _classes_nll(ens.member_outputs(x), y).mean()


def _dense_loss(ens, x, y):  # the labelled positions pooled, each counted once
  labelled = y != -1
  return _classes_nll(ens.member_outputs(x), np.where(labelled, y, 0))[labelled].mean()


def _multilabel_loss(ens, x, y):  # the mean of the members' probabilities, label by label
  logits = ens.member_outputs(x)
  log_p = _log_mean_exp(special.log_expit(logits))
  log_not = _log_mean_exp(special.log_expit(-logits))
  return -(y * log_p + (1 - y) * log_not).mean()


def _regression_loss(ens, x, y):  # the uniform mixture of the members' Gaussians, in the targets' units
  means, variances = ens.components(x)  # (K M, N, D)
  log_density = stats.norm.logpdf(y[None], means, np.sqrt(variances)).sum(-1)
  return -_log_mean_exp(log_density).mean()


def _quantile_loss(ens, x, y):  # the pinball loss of the members' mean quantiles, over the levels and targets
  quantiles = ens.predict(x)['quantiles'].reshape(len(x), y.shape[1], -1)  # (N, D, Q)
  levels = np.asarray(ens.task.levels)
  error = y[..., None] - quantiles
  return np.maximum(levels * error, (levels - 1) * error).mean()


REFERENCE_LOSS = {'classification': _classification_loss, 'dense': _dense_loss, 'multilabel': _multilabel_loss,
                  'regression': _regression_loss, 'quantile': _quantile_loss}


def the_test_loss_is_the_reference_computation(cell: Cell, lab: Lab):
  """The summary's test loss (the test pass, in the programs) and `evaluate`'s on the same rows (on the host) are
  the task's loss computed independently from the members' outputs (`REFERENCE_LOSS`): a task whose label kind
  or units were wrong would be consistent everywhere else and fail here."""
  ens = lab.ensemble(cell)
  x, y = problem(cell.task)[1]
  assert cell.task in REFERENCE_LOSS, f'no reference loss for task {cell.task!r}: add one to REFERENCE_LOSS'
  want = REFERENCE_LOSS[cell.task](ens, x, np.asarray(y, np.float64) if ens.task.standardises_targets else y)
  np.testing.assert_allclose(ens.summary['test_loss'], want, rtol=2e-4, atol=1e-5)
  np.testing.assert_allclose(ens.evaluate(x, y)['ensemble'][ens.task.loss_score], want, rtol=2e-4, atol=1e-5)


ALL = {check.__name__: check for check in (
    same_members_as_in_memory, summary_is_finite_in_one_unit, apply_is_a_function_of_params, warm_start_continues,
    warm_start_under_every_schedule, warm_start_across_methods, save_load_predicts_the_same, refit_compiles_nothing,
    resume_equals_uninterrupted, workdir_knows_its_data, calibration_is_kept, early_stopping_keeps_the_best_epoch,
    sigterm_resumes_exactly, the_test_loss_is_the_reference_computation)}


# --- life after fit: a chain of post-hoc steps (lab.POSTHOC), wherever the value goes ------------------------------

def _refused_for_the_task(cell: Cell, lab: Lab, steps: tuple[str, ...]) -> bool:
  """Whether a step of `steps` serves the other task (flags: classification's) or other methods (distance: not
  snapshot's, multiswag's or mimo's): then it is refused in one line that names the task or the method, and the
  chain has nothing more to keep."""
  try:
    lab.chained(lab.ensemble(cell), steps)
  except ensemble.UsageError as refused:
    message = str(refused)
    named = cell.method in message if 'distance' in steps and cell.method in features.REFUSED else cell.task in message
    assert '\n' not in message and named, message
    return True
  return False


def _assert_same_answers(got: dict, want: dict, exact: bool = False):
  """`predict`'s answers, key by key: figures to float32's precision of the largest of them (exactly, for two
  values restored from disk), decisions (a conformal set, a flag) the same but for an input within rounding of a
  threshold."""
  assert sorted(got) == sorted(want), (sorted(got), sorted(want))
  for key, value in want.items():
    value, other = np.asarray(value), np.asarray(got[key]).reshape(np.shape(value))
    if value.dtype == bool:
      agree = np.mean(other == value)
      assert agree == 1.0 if exact else agree >= 0.995, (key, agree)
    elif exact:
      np.testing.assert_array_equal(other, value, err_msg=key)
    else:
      np.testing.assert_allclose(other, value, rtol=1e-4, atol=1e-5 * max(np.abs(value).max(), 1e-30), err_msg=key)


def _assert_same_value(got: 'ensemble.Ensemble', want: 'ensemble.Ensemble', x: np.ndarray, exact: bool = False):
  """The same value: checkpoint, chain (every step and what it was fitted on), summary, and answers."""
  assert (got.epoch, got.posthoc) == (want.epoch, want.posthoc), (repr(got), repr(want))
  assert repr(got).split(', workdir=')[0] == repr(want).split(', in memory')[0].split(', workdir=')[0]
  assert_same_summary(got.summary, want.summary)
  _assert_same_answers(got.predict(x), want.predict(x), exact)


def the_value_is_the_same_wherever_it_goes(cell: Cell, lab: Lab, chain: str):
  """The cell's ensemble after a chain of post-hoc steps is one value: saved and loaded it is the same (its
  checkpoint, its chain, its summary, every answer of `predict`: probabilities, sets, flags, means, intervals);
  loaded at an earlier checkpoint, chained, saved and loaded, it is that checkpoint's, not the newest; exported, the
  artifact answers as `predict` does."""
  from ensemble import export  # pylint: disable=g-import-not-at-top
  steps = CHAINS[chain]
  if _refused_for_the_task(cell, lab, steps):
    return
  chained = lab.chained(lab.ensemble(cell), steps)
  x = lab.calibration_rows(cell.task, 'fresh')[0][:512]
  _assert_same_value(ensemble.load(lab.save(chained, f'{cell.id}-{chain}')), chained, x)
  earlier = lab.chained(lab.earlier(cell), steps)
  again = ensemble.load(lab.save(earlier, f'{cell.id}-{chain}-earlier'))
  assert again.epoch == STEPS_PER_EPOCH and earlier.epoch == STEPS_PER_EPOCH, (again.epoch, earlier.epoch)
  _assert_same_value(again, earlier, x, exact=True)
  served = export.export(chained, ['cpu']).call(x)
  whole = copy.copy(chained)  # the artifact takes the rows as one batch: MC dropout's masks depend on the batch
  whole.batch_size = len(x)
  want = whole.predict(x)
  _assert_same_answers({key: served[key] for key in want if key in served},
                       {key: value for key, value in want.items() if key in served})


def conformal_covers_fresh_data(cell: Cell, lab: Lab, chain: str):
  """Every chain with a conformal step, on the cell's ensemble and at an earlier checkpoint: on fresh rows its sets
  hold the class (its intervals the target, each target) of a share within the beta-binomial bounds of 1 - alpha
  (`conformal.coverage_bounds`, at a probability of 1 - 1e-6), whatever step comes after it (a temperature fitted
  later leaves the outputs its quantile was fitted on)."""
  steps = CHAINS[chain]
  if _refused_for_the_task(cell, lab, steps):
    return
  x, y = lab.calibration_rows(cell.task, 'fresh')
  low, high = conformal.coverage_bounds(CALIBRATION_ROWS['conformal'][0], len(y), CONFORMAL_ALPHA,
                                        probability=1 - 1e-6)
  for ens in (lab.chained(lab.ensemble(cell), steps), lab.chained(lab.earlier(cell), steps)):
    # Each target's, each label's, or marginal over the examples (a dense task's labelled positions).
    coverage = np.atleast_1d(ens.task.covered(ens.predict(x), y).mean(0))
    assert ((low <= coverage) & (coverage <= high)).all(), (repr(ens), coverage, (low, high))
    if ens.conformal_calibration.get('class_conditional'):  # and each class's, within its own bounds
      for hits, examples in _each_class(ens, x, y):
        low_c, high_c = conformal.coverage_bounds(examples, hits.size, CONFORMAL_ALPHA, probability=1 - 1e-6)
        assert low_c <= hits.mean() <= high_c, (repr(ens), examples, hits.mean(), (low_c, high_c))


def _each_class(ens: 'ensemble.Ensemble', x: np.ndarray, y: np.ndarray) -> list[tuple[np.ndarray, int]]:
  """(whether each fresh example of the class is covered, the class's calibration examples) of each class with a
  quantile of its own: a multi-label ensemble's each label and value."""
  covered, found = ens.task.covered(ens.predict(x), y), ens.conformal_calibration
  examples, pooled = np.asarray(found['class_examples']), [tuple(np.atleast_1d(g)) for g in found['pooled']]
  if covered.ndim == 1:
    classes = ens.task.labelled(y)
    groups = [((c,), covered[classes == c]) for c in range(len(examples))]
  else:
    groups = [((label, value), covered[y[:, label] == value, label]) for label in range(len(examples))
              for value in (0, 1)]
  return [(hits, int(examples[group])) for group, hits in groups if group not in pooled and hits.size]


def the_report_gives_predict_s_numbers(cell: Cell, lab: Lab, chain: str):
  """`report` after every chain, in every order, writes its report.md (out-of-distribution figures included, where
  the chain's distance step or the members' probabilities score unfamiliar rows) with the numbers the ensemble
  answers for the same rows: `evaluate`'s test scores, and the chain's conformal coverage that `predict`'s sets or
  intervals give (the report once ended in a KeyError after a chain, with an out-of-distribution set on a dense
  ensemble)."""
  steps = CHAINS[chain]
  if _refused_for_the_task(cell, lab, steps):
    return
  chained = lab.chained(lab.ensemble(cell), steps)
  x, y = (rows[:300] for rows in lab.calibration_rows(cell.task, 'fresh'))
  ood = {'far': x * 30} if 'distance' in steps or chained.task.detects_ood else None
  out = os.path.join(lab.root, 'reports', f'{cell.id}-{chain}')
  results = chained.report(x, y, ood=ood, output_dir=out)
  assert os.path.getsize(os.path.join(out, 'report.md')) > 0
  want = chained.evaluate(x, y)['ensemble']
  for key, value in want.items():
    if isinstance(value, float):
      np.testing.assert_allclose(results['ensemble'][key], value, rtol=1e-6, atol=1e-9, err_msg=key)
  if ood:
    figures = [figure for scores in results['ood']['far']['ensemble'].values() for figure in scores.values()
               if isinstance(figure, float)]
    assert figures and all(math.isfinite(f) for f in figures), results['ood']
  if {'conformal', 'class_conditional'} & set(steps):
    covered = chained.task.covered(chained.predict(x), y)
    np.testing.assert_allclose(results['posthoc_conformal']['coverage'], np.mean(covered), rtol=1e-9)
  else:
    assert 'posthoc_conformal' not in results, sorted(results)


AFTER_FIT = {check.__name__: check for check in (the_value_is_the_same_wherever_it_goes, conformal_covers_fresh_data,
                                                 the_report_gives_predict_s_numbers)}
