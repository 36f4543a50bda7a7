"""A task is one object (ensemble/tasks/): the rest of the package asks it and compares no names; what a dense
task's post-hoc steps count; uint8 masks; and the fifth task, quantile regression with CQR, which joined through it.

The quantile task also runs every check of the contract (tests/contract, one line of its TASKS).
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import scipy.special

import ensemble
from ensemble import data, evaluation, export, posthoc, predict, tasks
from ensemble.data import convert
from ensemble.errors import UsageError
from ensemble.tasks import base, quantile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIT = dict(ensemble_size=2, epochs=4, batch_size=16, optimizer='adamw', learning_rate=0.01, weight_decay=0.0,
           standardize_features=True, progress=False)
# What a line that decides by a task's name looks like: its name quoted.
QUOTED_TASK = re.compile(r"'(%s)'" % '|'.join(tasks.NAMES))


def test_no_module_outside_the_tasks_compares_task_names():
  """A task's rules live in its own module: outside ensemble/tasks/, at most 15 lines of code hold a quoted task
  name (147 lines of 21 files did, each a room a new task had to visit)."""
  found = []
  for folder, _, names in os.walk(os.path.join(REPO, 'ensemble')):
    if os.path.basename(folder) == 'tasks':
      continue
    for name in sorted(n for n in names if n.endswith('.py')):
      path = os.path.join(folder, name)
      with open(path, encoding='utf-8') as f:
        for number, line in enumerate(f, 1):
          if not line.lstrip().startswith('#') and QUOTED_TASK.search(line):
            found.append(f'{os.path.relpath(path, REPO)}:{number}: {line.strip()}')
  assert len(found) <= 15, '\n'.join(found)


def test_every_task_is_registered_once_and_says_what_it_decides():
  for name, task in tasks.TASKS.items():
    assert task.name == name and tasks.named(name).name == name
    assert task.conformal_scores, name
  assert tasks.DEFAULT == 'classification' and tasks.named('quantile').calibration is None


def test_a_task_without_a_step_refuses_it_in_one_line():
  """What a task declares decides which post-hoc steps it takes: a new task with no conformal score (and no
  calibration) refuses both by name, where `conformal` ended in an IndexError."""
  class Counts(quantile.Quantile):
    name = 'counts'
    conformal_scores = ()
  task = Counts()
  assert task.refuses('conformal') and task.refuses('calibrate') == 'has no temperature or scale to fit'
  with pytest.raises(UsageError, match=r'^conformal: a counts ensemble has no conformal score'):
    posthoc.conformal_settings(task, 0.1, None, False)
  assert [tasks.named(name).refuses('conformal') for name in tasks.NAMES] == [None] * len(tasks.NAMES)
  assert [name for name in tasks.NAMES if tasks.named(name).refuses('calibrate')] == ['quantile']
  assert 'conformal(x, y, alpha) (cqr)' in tasks.named('quantile').refuses('calibrate')


# --- the task interface, declared and checked -------------------------------------------------------------------

def test_every_task_keeps_the_interface_check_task_runs():
  """`check_task` on every registered task, and on tasks of other settings (two targets, other quantile levels)."""
  for name in tasks.NAMES:
    tasks.check_task(tasks.named(name))
  tasks.check_task(tasks.TASKS['regression'](target_mean=(1.0, -5.0), target_std=(2.0, 300.0)))
  tasks.check_task(quantile.Quantile(levels=(0.1, 0.5, 0.9), target_mean=(0.0, 1.0), target_std=(1.0, 10.0)))


class _NoEnsembleScore(tasks.TASKS['classification']):
  name = 'no_ensemble_score'

  def eval_outputs(self, logits, labels, *, axis_name):
    scores = super().eval_outputs(logits, labels, axis_name=axis_name)
    return {key: value for key, value in scores.items() if key != 'ensemble_correct'}


class _NaNLoss(tasks.TASKS['classification']):
  name = 'nan_loss'

  def loss(self, logits, labels):
    loss, metrics = super().loss(logits, labels)
    return loss * float('nan'), metrics


class _TakesAnything(tasks.TASKS['multilabel']):
  name = 'takes_anything'

  def read_labels(self, labels, name, ignore=-1):
    return labels if labels.dtype.kind == 'U' else super().read_labels(labels, name, ignore)


class _NoTestLoss(tasks.TASKS['regression']):
  name = 'no_test_loss'

  def summary(self, train, test=None):
    return {key: value for key, value in super().summary(train, test).items() if not key.startswith('test_')}


class _FlatGradient(tasks.TASKS['regression']):
  name = 'flat_gradient'

  def loss(self, outputs, labels):
    loss, metrics = super().loss(outputs, labels)
    return loss * 0.0, metrics


@pytest.mark.parametrize('broken, invariant', [
    (_NoEnsembleScore, "eval_outputs_give_every_score: eval_outputs gives no 'ensemble_correct'"),
    (_NaNLoss, 'loss_is_a_finite_scalar_it_can_descend: the loss holds NaN'),
    (_FlatGradient, "loss_is_a_finite_scalar_it_can_descend: the loss's gradient with respect to the outputs is 0"),
    (_TakesAnything, 'refuses_other_labels_in_one_line: read_labels took labels of strings'),
    (_NoTestLoss, "summary_is_finite_in_the_data_units: summary has no 'test_loss'"),
])
def test_check_task_names_the_invariant_a_task_breaks(broken, invariant):
  with pytest.raises(UsageError, match=rf'^check_task\({broken.name}\): {re.escape(invariant)}'):
    tasks.check_task(broken())


def test_a_task_that_leaves_out_part_of_the_interface_is_refused_when_it_is_defined():
  """Every method the package calls is declared in tasks/base.py; a task class that lacks one, or declares no kind
  of labels the package knows, is one line when it is defined, where it failed at its first test pass."""
  with pytest.raises(UsageError, match=r"^task 'counts' does not answer read_labels, member_output, loss, "
                                       r'eval_outputs, combine_snapshots, summary, .*, exported'):
    type('Counts', (tasks.Task,), {'name': 'counts', 'label_kind': 'targets'})
  with pytest.raises(UsageError, match=r"^task 'counts' declares label_kind='counts'; declare one of classes, "):
    type('Counts', (tasks.TASKS['regression'],), {'name': 'counts', 'label_kind': 'counts'})
  with pytest.raises(UsageError, match=r"^task 'sets' does not answer fit_conformal, apply_conformal, covered"):
    type('Sets', (tasks.Task,), {'name': 'sets', 'label_kind': 'classes', 'conformal_scores': ('lac',),
                                 **{name: tasks.TASKS['classification'].__dict__.get(name, lambda *a: None)
                                    for name in ('read_labels', 'member_output', 'loss', 'eval_outputs',
                                                 'combine_snapshots', 'summary', 'view', 'predict', 'evaluate',
                                                 'report', 'exported', 'table')}})
  # What the package reads of a task outside ensemble/tasks/ is declared in tasks/base.py: on `Task`, or on the
  # family of real-valued targets (`Targets`) where only those are asked.
  read = set()
  for folder, _, names in os.walk(os.path.join(REPO, 'ensemble')):
    if os.path.basename(folder) != 'tasks':
      for name in (n for n in names if n.endswith('.py')):
        with open(os.path.join(folder, name), encoding='utf-8') as f:
          read |= set(re.findall(r'\btask\.([a-z_]+)\b', f.read()))
  assert sorted(name for name in read if not hasattr(tasks.Task, name) and not hasattr(base.Targets, name)) == []


# --- a dense task's post-hoc steps count labelled positions --------------------------------------------------------

def _dense_rows(n: int, seed: int, labelled: float = 0.8):
  """Sequences of 4 positions of 3 features, a class 0..2 at each, -1 at a share of them."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 4, 3)).astype(np.float32)
  y = np.digitize(x[..., 0] + x[..., 1], [-0.5, 0.5]).astype(np.int32)
  return x, np.where(rng.random(y.shape) < labelled, y, -1)


@pytest.fixture(scope='module')
def dense():
  return ensemble.fit('mlp', _dense_rows(64, 0), task='dense', **FIT)


def test_dense_post_hoc_steps_count_labelled_positions_and_refuse_none(dense):
  """Rows whose every position is ignored fitted a temperature of 0.493 from nothing, scored NaN and made sets of
  every class; a conformal step counted 60 rows where 5 positions carried a label. Each counts labelled positions."""
  x, y = _dense_rows(60, 1)
  none = np.full_like(y, -1)
  for call in (dense.calibrate, dense.conformal, dense.evaluate, dense.report):
    with pytest.raises(UsageError, match='none of the 60 inputs carries a label') as refused:
      call(x, none)
    assert '\n' not in str(refused.value)
  few = none.copy()
  few[:5, 0] = y[:5, 0].clip(0)
  with pytest.raises(UsageError, match=r'alpha=0.1 needs at least 9 labelled positions .* and 5 were given'):
    dense.conformal(x, few, alpha=0.1)
  chained = dense.calibrate(x, y).conformal(x, y, alpha=0.2)
  assert [step.fitted_on.examples for step in chained.posthoc] == [int((y != -1).sum())] * 2
  assert chained.evaluate(x, y)['labelled_positions'] == int((y != -1).sum())


def test_uint8_masks_with_255_for_none_train_and_score_their_classes(tmp_path):
  """The case the docs name: uint8 labels, 255 where a position has none. np.where(labels == 255, -1, labels) on
  uint8 wrapped -1 back to 255: fit refused '255 is also a class' and convert wrote 256 classes."""
  x, y = _dense_rows(64, 2)
  mask = np.where(y == -1, 255, y).astype(np.uint8)
  ens = ensemble.fit('mlp', (x, mask), task='dense', ignore_label=255, **FIT)
  assert ens.num_classes == 3
  assert ens.evaluate(x, mask)['labelled_positions'] == int((mask != 255).sum())
  assert ens.calibrate(x, mask).conformal(x, mask, alpha=0.2).predict(x)['set'].shape == (64, 4, 3)
  np.savez(tmp_path / 'masks.npz', x_train=x, y_train=mask, x_test=x[:16], y_test=mask[:16])
  info = convert.convert(str(tmp_path / 'masks.npz'), str(tmp_path / 'folder'), task='dense', ignore=255)
  assert info['num_classes'] == 3
  loaded = data.load(data_dir=str(tmp_path / 'folder'), task='dense')
  np.testing.assert_array_equal(loaded.train['label'], y)


def test_labels_at_the_inputs_positions_name_the_dense_task():
  x, y = _dense_rows(32, 3, labelled=1.0)
  with pytest.raises(UsageError, match=r"a class per position is task='dense'"):
    ensemble.fit('mlp', (x, y), **FIT)


def test_report_takes_one_set_of_unfamiliar_inputs_as_an_array():
  """`report(x, y, ood=far_rows)` ended in numpy's 'truth value of an array is ambiguous'; {name: inputs} worked."""
  rng = np.random.default_rng(4)
  x = rng.normal(size=(96, 3)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  ens = ensemble.fit('mlp', (x[:64], y[:64]), **FIT)
  far = (x[64:] * 6).astype(np.float32)
  results = ens.report(x[64:], y[64:], ood=far)
  assert set(results['ood']) == {'ood'} and results['ood']['ood']['examples'] == len(far)
  assert results['ood'] == ens.report(x[64:], y[64:], ood={'ood': far})['ood']


# --- quantile regression ------------------------------------------------------------------------------------------

def _targets(n: int, seed: int, targets: int = 1):
  """Heteroscedastic targets of 3 features: the spread grows with the first."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype(np.float32)
  y = np.sin(x[:, :1]) * 10 + 100 + rng.normal(size=(n, targets)) * (1 + np.abs(x[:, :1])) * 2
  y[:, 1:] *= 1000
  return x, y.astype(np.float32)[:, 0] if targets == 1 else y.astype(np.float32)


@pytest.fixture(scope='module')
def quantiles():
  return ensemble.fit('mlp', _targets(256, 0), test=_targets(64, 1), task='quantile', **FIT)


def test_member_quantiles_never_cross_whatever_the_model_gives():
  raw = np.random.default_rng(0).normal(size=(5, 7, 2 * 2 * 4)) * 10  # (K, N, M D Q): 2 components, 2 targets
  q = quantile.member_quantiles(raw, targets=2, levels=4, xp=np)
  assert q.shape == (5, 2, 7, 2, 4) and (np.diff(q, axis=-1) >= 0).all()


def test_the_pinball_loss_is_least_at_the_quantile():
  y = np.random.default_rng(1).standard_normal(20000)
  grid = np.linspace(-3, 3, 601)
  for tau in (0.05, 0.5, 0.9):
    losses = [quantile.pinball(np.full((1, 1), q), y[:, None], [tau], xp=np).mean() for q in grid]
    assert abs(grid[int(np.argmin(losses))] - np.quantile(y, tau)) <= 0.02


def test_crps_from_many_quantiles_is_the_gaussian_s_closed_form():
  """2 int rho_tau dtau over 399 levels against CRPS(N(0, s^2), y) = s (z (2 Phi(z) - 1) + 2 phi(z) - 1 / sqrt(pi))."""
  levels = (np.arange(1, 400) - 0.5) / 399
  s, y = 2.0, np.array([[-3.0], [0.5], [4.0]])
  q = np.broadcast_to(s * scipy.special.ndtri(levels), (3, 1, 399))
  z = y[:, 0] / s
  exact = s * (z * (2 * scipy.special.ndtr(z) - 1) + 2 * np.exp(-z ** 2 / 2) / np.sqrt(2 * np.pi) - 1 / np.sqrt(np.pi))
  got = [quantile.scores(q[i:i + 1], y[i:i + 1], levels)['crps'] for i in range(3)]
  np.testing.assert_allclose(got, exact, rtol=0.01)


def test_the_ensemble_s_quantiles_are_the_mean_of_its_members(quantiles):
  x, _ = _targets(32, 2)
  result = quantiles.predict(x, members=True)
  assert result['quantiles'].shape == (32, 3) and result['member_quantiles'].shape == (2, 32, 1, 3)
  np.testing.assert_allclose(result['quantiles'], result['member_quantiles'].mean(0)[:, 0], rtol=1e-12)
  assert (np.diff(result['quantiles'], axis=-1) >= 0).all()
  np.testing.assert_array_equal(result['lower'], result['quantiles'][:, 0])
  np.testing.assert_array_equal(result['upper'], result['quantiles'][:, -1])
  np.testing.assert_allclose(result['epistemic_std'], result['member_quantiles'].std(0)[:, 0].mean(-1))


def test_evaluate_gives_the_pinball_loss_coverage_and_width_of_its_quantiles(quantiles):
  x, y = _targets(64, 3)
  scores = quantiles.evaluate(x, y)
  q = quantiles.predict(x)['quantiles']
  levels = np.asarray(quantile.DEFAULT_LEVELS)
  error = y[:, None] - q
  np.testing.assert_allclose(scores['ensemble']['pinball'], np.maximum(levels * error, (levels - 1) * error).mean())
  assert scores['ensemble']['coverage'] == np.mean((q[:, 0] <= y) & (y <= q[:, -1]))
  np.testing.assert_allclose(scores['ensemble']['width'], np.mean(q[:, -1] - q[:, 0]))
  assert len(scores['members']) == 2 and 0 < scores['ensemble']['crps'] < np.inf
  assert scores['ensemble']['calibration'] == [float(np.mean(y <= q[:, i])) for i in range(3)]
  # The summary's test loss is the same pinball loss, in the targets' units.
  np.testing.assert_allclose(quantiles.summary['test_loss'],
                             quantiles.evaluate(*_targets(64, 1))['ensemble']['pinball'], rtol=1e-4)


def test_quantiles_of_two_targets_and_other_levels():
  x, y = _targets(128, 5, targets=2)
  ens = ensemble.fit('mlp', (x, y), task='quantile', quantiles=(0.1, 0.25, 0.75, 0.9), **FIT)
  result = ens.predict(x[:8])
  assert result['quantiles'].shape == (8, 2, 4) and result['lower'].shape == (8, 2)
  assert np.abs(np.median(result['quantiles'][:, 1, 1:3], 0)).min() > 1000  # each target in its own units
  conformal = ens.conformal(*_targets(128, 6, targets=2), alpha=0.2)
  assert conformal.conformal_calibration['score'] == 'cqr' and len(conformal.conformal_calibration['quantile']) == 2


@pytest.mark.parametrize('levels, fix', [((0.5,), 'at least two levels'), ((0.9, 0.1), 'increasing'),
                                         ((0.0, 0.5), 'in \\(0, 1\\)')])
def test_bad_quantile_levels_are_refused_in_one_line(levels, fix):
  with pytest.raises(UsageError, match=f'quantiles={re.escape(repr(levels))} must be .*{fix}') as refused:
    ensemble.fit('mlp', _targets(64, 0), task='quantile', quantiles=levels, **FIT)
  assert '\n' not in str(refused.value)


def test_a_quantile_student_learns_the_teacher_s_quantiles(quantiles):
  x, y = _targets(256, 0)
  fields = {key: value for key, value in FIT.items() if key != 'ensemble_size'}
  student = ensemble.distill(quantiles, 'mlp', x, test=_targets(64, 1), **{**fields, 'epochs': 8})
  assert student.task.levels == quantiles.task.levels and student.size == 1
  assert student.predict(x[:4])['quantiles'].shape == (4, 3) and student.distillation.student_nll > 0


def test_the_command_line_trains_evaluates_predicts_and_exports_a_quantile_ensemble(tmp_path):
  """`--config.task=quantile` on a .csv; python -m ensemble.evaluate's report, predict's columns (a quantile per
  level), the exported artifact's answers; an .npz of the same rows loads as quantile data."""
  x, y = _targets(200, 7)
  rows = ['a,b,c,y'] + [','.join(f'{v:.6f}' for v in (*features, target)) for features, target in zip(x, y)]
  (tmp_path / 'rows.csv').write_text('\n'.join(rows) + '\n')
  workdir = str(tmp_path / 'run')
  done = subprocess.run(
      [sys.executable, '-m', 'ensemble.train', f'--workdir={workdir}', '--config=configs/regression.py',
       '--config.task=quantile', f'--config.data_dir={tmp_path / "rows.csv"}', '--config.target=y', '--cpu_devices=2',
       '--config.ensemble_size=2', '--config.num_epochs=2', '--config.batch_size=32', '--config.compilation_cache='],
      cwd=REPO, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'ensemble pinball loss' in done.stderr and 'interval coverage' in done.stderr, done.stderr[-2000:]
  results = evaluation.evaluate(workdir, alphas=(0.1, 0.2))
  assert results['task'] == 'quantile' and len(results['conformal']['rows']) == 2
  assert 'Quantile ensemble' in open(os.path.join(workdir, 'eval', 'report.md'), encoding='utf-8').read()
  with pytest.raises(UsageError, match='leave --ood out'):
    evaluation.evaluate(workdir, ood_names=['uniform_noise'])
  np.save(tmp_path / 'x.npy', x[:5])
  predict.predict_files(workdir, str(tmp_path / 'x.npy'), str(tmp_path / 'out.csv'))
  lines = (tmp_path / 'out.csv').read_text().splitlines()
  assert lines[0] == 'name,q5,q50,q95,epistemic_std' and len(lines) == 6
  loaded = ensemble.load(workdir)
  served = export.export(loaded, ['cpu']).call(x[:5])
  want = loaded.predict(x[:5])
  for key in ('quantiles', 'lower', 'upper'):
    np.testing.assert_allclose(np.asarray(served[key])[:, 0], want[key], rtol=1e-4, atol=1e-3, err_msg=key)
  np.savez(tmp_path / 'rows.npz', x_train=x[:150], y_train=y[:150], x_test=x[150:], y_test=y[150:])
  assert data.load(data_dir=str(tmp_path / 'rows.npz'), task='quantile').describe() == '1 target, features 3'


def test_the_guide_s_quantile_example_prints_what_it_says(capsys):
  from conftest import assert_printed_as_the_page_says, run_guide_example  # pylint: disable=g-import-not-at-top
  assert_printed_as_the_page_says(*run_guide_example('## Quantile regression', capsys))
