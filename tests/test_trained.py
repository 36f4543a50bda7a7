"""The trained ensemble as one immutable value (ensemble/trained.py): its post-hoc chain in order, what each step
was fitted on, its one manifest (ensemble/manifest.py), the workdirs of earlier versions, and every array it is
given checked for its role. The contract (tests/contract, `test_life_after_fit_keeps_the_contract`) runs the chains
over every method and task; here, what one ensemble shows."""

import json
import os
import re
import shutil

import numpy as np
import pytest

import ensemble
from ensemble import manifest, posthoc, trainer
from ensemble.errors import UsageError

from conftest import DURATION

FIT = {'ensemble_size': 2, 'epochs': 2, 'batch_size': 16, 'optimizer': 'adamw', 'learning_rate': 0.01,
       'standardize_features': True, 'progress': False}


def _rows(task: str, n: int, seed: int):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype(np.float32)
  if task == 'regression':
    return x, (np.sin(x[:, 0]) + 0.3 * rng.normal(size=n)).astype(np.float32)
  return x, np.digitize(x[:, 0] + 0.5 * rng.normal(size=n), [-0.5, 0.5]).astype(np.int32)


@pytest.fixture(scope='module')
def fitted():
  return {task: ensemble.fit('mlp', _rows(task, 64, 0), task=task, **FIT) for task in ('classification', 'regression')}


def test_an_ensemble_is_immutable_and_its_steps_return_new_values(fitted):
  ens = fitted['classification']
  x, y = _rows('classification', 200, 1)
  calibrated = ens.calibrate(x, y)
  assert ens.posthoc == () and len(calibrated.posthoc) == 1 and calibrated.state is ens.state
  for name, value in (('temperature', 2.0), ('state', None), ('epoch', 3), ('workdir', '/tmp'), ('posthoc', ())):
    with pytest.raises(UsageError, match=f'^an Ensemble is immutable: {name} cannot be set') as refused:
      setattr(calibrated, name, value)
    assert '\n' not in str(refused.value)
  summary = calibrated.summary
  summary['temperature'] = 5.0  # a copy
  assert calibrated.summary['temperature'] != 5.0


def test_the_repr_shows_the_chain_in_order_with_the_conformal_score(fitted):
  ens = fitted['classification']
  x, y = _rows('classification', 300, 2)
  chained = ens.conformal(x, y, alpha=0.2, score='aps').calibrate(x, y).flags(x, y, target_risk=0.3)
  shown = re.search(r'epoch 2, (.*), in memory\)$', repr(chained)).group(1)
  assert re.fullmatch(r'conformal aps alpha 0\.2 -> temperature [0-9.]+ -> flags risk 0\.3 ood_rate 0\.02',
                      shown), shown
  steps = chained.posthoc
  assert [step.kind for step in steps] == ['conformal', 'temperature', 'flags']
  # Each records what it was fitted on: the members' checkpoint, the steps before it, the examples.
  assert [step.fitted_on.after for step in steps] == [(), (steps[0].id,), (steps[0].id, steps[1].id)]
  assert {step.fitted_on.epoch for step in steps} == {2} and {step.fitted_on.examples for step in steps} == {300}
  assert steps[0].fitted_on.sha256 == posthoc.digest(x, y) != posthoc.digest(x[:-1], y[:-1])


def test_a_step_applies_to_the_outputs_it_was_fitted_on_whatever_follows(fitted):
  """Issue 75: `conformal().calibrate()` kept a quantile fitted on other probabilities, covering 0.60 where it
  promised 0.90. Its sets are now those of the probabilities the quantile was fitted on, and its probabilities
  are calibrated; `calibrate().conformal()` calibrates the sets of the scaled ones."""
  for task in ('classification', 'regression'):
    ens = fitted[task]
    x, y = _rows(task, 400, 3)
    sets_first = ens.conformal(x, y).predict(x)
    both = ens.conformal(x, y).calibrate(x, y).predict(x)
    key = 'set' if task == 'classification' else 'conformal_lower'
    np.testing.assert_array_equal(both[key], sets_first[key])
    scaled = 'probs' if task == 'classification' else 'std'
    np.testing.assert_allclose(both[scaled], ens.calibrate(x, y).predict(x)[scaled], rtol=1e-9)


@pytest.mark.parametrize('task', ['classification', 'regression'])
def test_a_loaded_ensemble_has_a_fitted_one_s_variables_and_answers_in_its_programs(fitted, task, tmp_path):
  """Saved and loaded, an ensemble on standardised features takes them standardised by its statistics as the one
  `fit` returned does: the same `variables`, so that a program of a fit's `apply_variables` (what a loop's
  acquisition is) answers for a loaded one (a loop's kept ensemble) as its own `apply` does, never standardising
  twice; and the same predictions."""
  import jax  # pylint: disable=g-import-not-at-top
  ens = fitted[task]
  loaded = ensemble.load(ens.save(str(tmp_path / task)).workdir)
  x = _rows(task, 8, 1)[0]
  assert sorted(loaded.variables['statistics']) == sorted(ens.variables['statistics'])
  program = jax.jit(ens.apply_variables)
  close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  jax.tree.map(close, program(loaded.variables, loaded.params, x), loaded.apply(loaded.params, x))
  jax.tree.map(close, program(loaded.variables, loaded.params, x), ens.apply(ens.params, x))
  np.testing.assert_array_equal(loaded.member_outputs(x), ens.member_outputs(x))


def test_save_writes_the_value_and_load_at_a_step_then_save_gives_that_step(tmp_path):
  """Issue 75: `load(w, step=2)`, calibrated, then `save` copied the whole workdir: `load(copy)` gave epoch 3
  without the calibration. `save` writes the one checkpoint the value is, with its chain."""
  x, y = _rows('classification', 64, 0)
  workdir = str(tmp_path / 'run')
  ensemble.fit('mlp', (x, y), workdir=workdir, **{**FIT, 'epochs': 3})
  early = ensemble.load(workdir, step=2)
  xc, yc = _rows('classification', 300, 4)
  calibrated = early.calibrate(xc, yc).conformal(xc, yc)
  saved = calibrated.save(str(tmp_path / 'copy'))
  assert saved.workdir == str(tmp_path / 'copy') and calibrated.workdir == workdir  # the value saved is not changed
  assert sorted(os.listdir(tmp_path / 'copy' / 'checkpoints')) == ['2']
  loaded = ensemble.load(str(tmp_path / 'copy'))
  assert loaded.epoch == 2 and loaded.posthoc == calibrated.posthoc
  for key, value in calibrated.predict(xc).items():
    np.testing.assert_array_equal(loaded.predict(xc)[key], value, err_msg=key)
  # A saved ensemble is one value: no run trains on in it, and a checkpoint replaced under its manifest is refused.
  with pytest.raises(UsageError, match='holds a saved ensemble') as refused:
    ensemble.fit('mlp', (x, y), workdir=str(tmp_path / 'copy'), **FIT)
  assert '\n' not in str(refused.value)
  record = tmp_path / 'copy' / manifest.MANIFEST_FILE
  found = json.loads(record.read_text())
  record.write_text(json.dumps({**found, 'checkpoint': '0' * 16}))
  with pytest.raises(UsageError, match='names another checkpoint 2 than the one in'):
    ensemble.load(str(tmp_path / 'copy'))


def test_a_chain_fitted_on_other_members_or_after_other_steps_is_refused(fitted, tmp_path):
  ens = fitted['regression']
  x, y = _rows('regression', 300, 5)
  path = ens.calibrate(x, y).conformal(x, y).save(str(tmp_path / 'saved')).workdir
  record = os.path.join(path, manifest.MANIFEST_FILE)
  found = json.loads(open(record, encoding='utf-8').read())
  for change, message in ((lambda steps: steps[0]['fitted_on'].update(epoch=7),
                           'was fitted on the members of checkpoint 7, not 2'),
                          (lambda steps: steps.pop(0), 'was fitted after other steps than those before it')):
    steps = json.loads(json.dumps(found['posthoc']))
    change(steps)
    with open(record, 'w', encoding='utf-8') as f:
      json.dump({**found, 'posthoc': steps}, f)
    with pytest.raises(UsageError, match=message) as refused:
      ensemble.load(path)
    assert '\n' not in str(refused.value)


def test_a_workdir_saved_by_the_earlier_version_still_loads_calibrated(fitted, tmp_path):
  """A folder `save` wrote before the manifest: its calibration.json (temperature, conformal quantile) is the
  chain, a temperature then a conformal step, as its predictions applied them."""
  ens = fitted['classification']
  x, y = _rows('classification', 300, 6)
  calibrated = ens.calibrate(x, y).conformal(x, y)
  path = calibrated.save(str(tmp_path / 'new')).workdir
  old = str(tmp_path / 'old')
  shutil.copytree(path, old)
  os.remove(os.path.join(old, manifest.MANIFEST_FILE))
  found = calibrated.conformal_calibration
  with open(os.path.join(old, manifest.CALIBRATION_FILE), 'w', encoding='utf-8') as f:
    json.dump({'epoch': 2, 'temperature': calibrated.temperature, 'conformal': found}, f)
  loaded = ensemble.load(old)
  assert [step.kind for step in loaded.posthoc] == ['temperature', 'conformal']
  assert loaded.temperature == calibrated.temperature and loaded.conformal_calibration['quantile'] == found['quantile']
  new, _ = _rows('classification', 300, 60)  # not the calibration rows, one of which lies on the threshold
  for key, value in calibrated.predict(new).items():
    np.testing.assert_allclose(loaded.predict(new)[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_load_s_temperature_replaces_the_chain_s_only_where_nothing_was_fitted_after_it(fitted, tmp_path):
  ens = fitted['classification']
  x, y = _rows('classification', 300, 7)
  conformal_last = ens.calibrate(x, y).conformal(x, y).save(str(tmp_path / 'a')).workdir
  with pytest.raises(UsageError, match=r'^temperature=2 would replace the temperature .* that the conformal thr '
                                       r'alpha 0\.1 after it was fitted on'):
    ensemble.load(conformal_last, temperature=2.0)
  temperature_last = ens.conformal(x, y).calibrate(x, y).save(str(tmp_path / 'b')).workdir
  loaded = ensemble.load(temperature_last, temperature=2.0)
  assert [s.kind for s in loaded.posthoc] == ['conformal', 'temperature'] and loaded.temperature == 2.0


def test_load_names_its_own_keywords(fitted, tmp_path):
  """Issue 75: `load(step=6)` from Python said `--step=6`."""
  path = fitted['classification'].save(str(tmp_path / 'saved')).workdir
  with pytest.raises(UsageError, match=r'^step=6: no such checkpoint in .*; choose one of \[2\]$'):
    ensemble.load(path, step=6)


@pytest.mark.parametrize('task', ['classification', 'regression'])
def test_every_array_is_checked_for_its_role_and_named_by_it(fitted, task):
  """Issue 75: each input role had its own checks (a bad validation= was reported as 'train: ...'). One checker
  (ensemble/data/arrays.py) names the role in every message."""
  ens = fitted[task]
  x, y = _rows(task, 40, 8)
  bad_inputs, bad_labels = x.copy(), (y + 0.5 if task == 'classification' else y.copy())
  bad_inputs[3, 1] = np.nan
  if task == 'regression':
    bad_labels[5] = np.inf
  calls = {
      'train': lambda xs, ys: ensemble.fit('mlp', (xs, ys), task=task, **FIT),
      'test': lambda xs, ys: ensemble.fit('mlp', (x, y), test=(xs, ys), task=task, **FIT),
      'validation': lambda xs, ys: ensemble.fit('mlp', (x, y), validation=(xs, ys), early_stopping=1, task=task,
                                                **FIT),
      'calibrate': ens.calibrate,
      'conformal': lambda xs, ys: ens.conformal(xs, ys, alpha=0.2),
      'evaluate': ens.evaluate,
      'predict': lambda xs, _: ens.predict(xs),
  }
  if task == 'classification':
    calls['flags'] = ens.flags
  for role, call in calls.items():
    for xs, ys in ((bad_inputs, y), (x, bad_labels)):
      if role == 'predict' and xs is x:
        continue
      with pytest.raises(UsageError) as refused:
        call(xs, ys)
        pytest.fail(f'{role} took {"inputs" if xs is bad_inputs else "labels"} it must refuse')
      assert str(refused.value).startswith(f'{role}') and '\n' not in str(refused.value), (role, str(refused.value))


def test_validation_labels_outside_the_classes_are_refused():
  """Issue 75: labels 0..4 given as validation= of a 3-class problem were taken, the validation NLL was NaN every
  epoch, and early stopping kept epoch 1."""
  x, y = _rows('classification', 64, 0)
  with pytest.raises(UsageError, match=r'^validation: labels span \[0, 4\], outside the 3 classes 0\.\.2'):
    ensemble.fit('mlp', (x, y), validation=(x, np.arange(64) % 5), early_stopping=1, **FIT)


def test_a_validation_nll_that_is_not_finite_stops_the_fit_in_one_line():
  """A validation row the members give NaN for: no epoch can be told the best (NaN < best never holds), so early
  stopping refuses to keep the first one silently."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  class RootOfTheFirstFeature(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(x) * jnp.sqrt(x[:, :1])

  x, y = _rows('classification', 64, 0)
  x = np.abs(x)
  with pytest.raises(UsageError, match=r'^validation: the NLL after epoch 1 is nan') as refused:
    ensemble.fit(RootOfTheFirstFeature(), (x, y), validation=(-x - 1, y), early_stopping=1,
                 **{**FIT, 'standardize_features': False})
  assert '\n' not in str(refused.value)


def test_integer_features_are_tokens_only_to_a_model_that_embeds_them():
  """Issue 75: int64 count features with a Dense model trained as token ids (a loss of 14.3 where floats gave
  1.22), the only trace 'from 6 tokens' in the repr. Now one line asks which was meant."""
  rng = np.random.default_rng(0)
  counts = rng.poisson(3, (64, 6)).astype(np.int64)
  y = (counts[:, 0] > 3).astype(np.int32)
  with pytest.raises(UsageError, match=r"^train: the inputs are integers, .* set inputs=features if they are "
                                       r"numbers") as refused:
    ensemble.fit('mlp', (counts, y), **FIT)
  assert '\n' not in str(refused.value)
  ens = ensemble.fit('mlp', (counts, y), inputs='features', **FIT)
  assert ens.member.inputs == 'features' and 'from 6 features' in repr(ens)


def test_a_regression_ensemble_has_one_conformal_score(fitted):
  """Issue 75: `conformal(score='bogus')` on a regression ensemble was accepted and ignored."""
  x, y = _rows('regression', 100, 9)
  with pytest.raises(UsageError, match=r"^score='bogus': give one of \['normalised'\]"):
    fitted['regression'].conformal(x, y, score='bogus')
  assert fitted['regression'].conformal(x, y, score='normalised').conformal_calibration['score'] == 'normalised'


def test_too_many_labels_for_the_model_name_the_batch():
  """Issue 75: labels 0..4 for a 3-output model said '(1, 3)' where they meant '(batch, 3)'."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class ThreeOutputs(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(x)

  x, _ = _rows('classification', 64, 0)
  with pytest.raises(UsageError, match=r'maps inputs \(batch, 3\) float32 to \(batch, 3\), not to \(batch, 5\)'):
    ensemble.fit(ThreeOutputs(), (x, np.arange(64) % 5), **FIT)


def test_a_saved_ensemble_is_not_trained_in_place_and_stays_as_it_was(fitted, tmp_path):
  path = fitted['regression'].save(str(tmp_path / 'saved')).workdir
  before = sorted(os.listdir(path))
  with pytest.raises(UsageError, match='holds a saved ensemble'):
    trainer.check_workdir(path)
  assert sorted(os.listdir(path)) == before


def test_a_saved_ensemble_s_flags_step_is_what_the_command_line_flags_by(fitted, tmp_path):
  """`python -m ensemble.predict` flags by the chain's flags step where there is one (fitted on the rows given),
  without the held-out slice an ensemble trained on arrays in memory cannot read."""
  from ensemble import predict  # pylint: disable=g-import-not-at-top
  x, y = _rows('classification', 300, 10)
  flagged = fitted['classification'].flags(x, y, target_risk=0.05)
  path = flagged.save(str(tmp_path / 'saved')).workdir
  new, _ = _rows('classification', 50, 11)
  np.save(tmp_path / 'new.npy', new)
  summary = predict.predict_files(path, str(tmp_path / 'new.npy'), str(tmp_path / 'rows.csv'))
  assert summary['flagged'] == int(flagged.predict(new)['flag'].sum())
  assert summary['threshold'] == flagged.posthoc[-1]['threshold']


@pytest.mark.parametrize('task', ['classification', 'regression'])
def test_the_report_of_an_ensemble_in_memory(fitted, task, tmp_path):
  """Issue 76: from Python, the full report of an ensemble trained on arrays (`Ensemble.report`), as one nested
  dict and, with output_dir=, report.md and its plots: the members against the ensemble, the size curve, selective
  prediction; with calibration rows the temperature (variance scale) and conformal sets (intervals) with their
  coverage and its bounds; out-of-distribution detection against the inputs given."""
  ens = fitted[task]
  x, y = _rows(task, 400, 12)
  xc, yc = _rows(task, 300, 13)
  ood = {'far': x * 50} if task == 'classification' else None
  report = ens.report(x, y, calibration=(xc, yc), ood=ood, output_dir=str(tmp_path / 'report'))
  assert report['test_examples'] == 400 and report['ensemble_size'] == 2 and len(report['members']) == 2
  assert 'rotation' not in report and 'gaussian_noise' not in report  # features: no image shifts
  rows = report['conformal']['rows']
  assert report['conformal']['calibration_examples'] == 300 and rows
  for row in rows:  # a classification row's coverage is its ensemble's (beside the mean member's)
    low, high = row['bounds']
    coverage = row['ensemble']['coverage'] if task == 'classification' else row['coverage']
    assert 0 < low < 1 - row['alpha'] < high <= 1 and row['within_bounds'] == (low <= coverage <= high)
  written = sorted(os.listdir(tmp_path / 'report'))
  if task == 'classification':
    scores = report['ood']['far']['ensemble']
    assert sorted(scores) == ['entropy', 'max_probability', 'mutual_information']
    assert all(0 <= figures['auroc'] <= 1 for figures in scores.values())
    assert report['flags']['examples'] == 300 and 0 < report['temperature_scaling']['temperature'] < 20
    assert report['ensemble']['nll'] == pytest.approx(ens.evaluate(x, y)['ensemble']['nll'], rel=1e-9)
    assert written == ['ensemble_size.png', 'metrics.json', 'ood_scores.png', 'reliability.png', 'report.md',
                       'risk_coverage.png']
  else:
    assert 0 < report['variance_scaling']['scale'] and report['selective'][0]['coverage'] == 1.0
    assert report['ensemble']['rmse'] == pytest.approx(ens.evaluate(x, y)['ensemble']['rmse'], rel=1e-9)
    assert written == ['coverage.png', 'metrics.json', 'report.md']
  bare = ens.report(x, y)  # without calibration rows: what needs them is left out, and the report says so
  assert 'conformal' not in bare and 'temperature_scaling' not in bare and 'variance_scaling' not in bare


@pytest.mark.parametrize('task, stages', [
    ('classification', ['test pass', 'calibration pass', 'test scores', 'temperature', 'conformal', 'flags',
                        'selective', 'out-of-distribution sets (1)']),
    ('regression', ['test pass', 'calibration pass', 'test scores', 'selective', 'variance scale', 'conformal'])])
def test_report_shows_its_stages_as_fit_shows_its_epochs(fitted, task, stages, capfd):
  """Issue 89: `report` ran two minutes without a word where `python -m ensemble.evaluate` logs every stage. With
  progress=True (its default, as fit's) each stage writes one line to stderr with its seconds, in the order it ran;
  with False nothing is written; the numbers are the same either way, and a progress that is not a bool is refused
  in one line."""
  ens = fitted[task]
  x, y = _rows(task, 200, 12)
  options = {'calibration': _rows(task, 100, 13), 'ood': {'far': x * 50} if task == 'classification' else None}
  capfd.readouterr()
  shown = ens.report(x, y, **options)
  out, err = capfd.readouterr()
  assert out == ''
  lines = err.splitlines()
  assert [re.fullmatch(rf'report: (.+) {DURATION}', line)[1] for line in lines] == stages, err
  quiet = ens.report(x, y, progress=False, **options)
  assert capfd.readouterr() == ('', '')
  assert json.dumps(quiet, sort_keys=True) == json.dumps(shown, sort_keys=True)
  with pytest.raises(UsageError, match=r"^progress='yes' must be True or False$"):
    ens.report(x, y, progress='yes')
