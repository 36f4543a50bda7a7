"""Evaluation of a trained workdir: the report's numbers, files, and refusals of bad input."""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import COMPILE_FLAGS, linked_workdir, run_main, small_config, synthetic_mnist, write_idx, write_mnist
from ensemble import calibration, checkpoint, data, evaluate, evaluation, predictor, recipe as recipe_lib, trainer
from ensemble import manifest, report as report_lib, scoring, writers

evaluate.define_flags()  # for the command lines run in this process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def workdir(tmp_path_factory) -> str:
  """An 8-member ensemble trained for one epoch on 8 devices, shared by the tests here."""
  root = tmp_path_factory.mktemp('evaluate')
  workdir = str(root / 'run')
  trainer.train_and_evaluate(small_config(write_mnist(str(root / 'mnist')), heldout_fraction=0.1), workdir)
  return workdir


def _run(*args, module=('scripts/evaluate.py',)):
  env = {**os.environ, 'XLA_FLAGS': COMPILE_FLAGS}  # one CPU device: the 8-device checkpoint is restored elsewhere
  return subprocess.run([sys.executable, *module, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)


def test_script_writes_a_report_that_agrees_with_training(workdir, tmp_path):
  out = tmp_path / 'eval'
  result = _run('--workdir', workdir, '--angles=0,90', '--output_dir', str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Restored epoch 1' in result.stderr and 'rotation  90 deg' in result.stderr  # progress
  assert 'checkpoint_manager.py' not in result.stderr  # orbax's INFO lines are filtered out
  # The built-in out-of-distribution sets are scored without --ood.
  assert sorted(os.listdir(out)) == ['ensemble_size.png', 'gaussian_noise.png', 'metrics.json', 'ood_scores.png',
                                     'reliability.png', 'report.md', 'risk_coverage.png', 'rotation.png']
  assert not os.path.exists(os.path.join(workdir, 'eval'))
  for png in ('ensemble_size.png', 'gaussian_noise.png', 'reliability.png', 'rotation.png'):
    assert (out / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and (out / png).stat().st_size > 10_000

  results = json.loads((out / 'metrics.json').read_text())
  ensemble, members = results['ensemble'], results['members']
  assert results['epoch'] == 1 and results['ensemble_size'] == 8 and results['test_examples'] == 100
  assert list(results['ood']) == list(evaluation.DEFAULT_OOD) == ['uniform_noise', 'permuted_pixels']
  # What the temperature was fitted for: predict and export apply it to this checkpoint of a run on this data only.
  assert results['checkpoint'] == checkpoint.checkpoint_id(workdir, 1)
  assert results['data_dir'] == evaluation.load_run_config(workdir).data_dir

  # The same test set through the trainer's path (pmap eval step on 8 devices, clu metrics).
  trained = writers.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))[-1]
  np.testing.assert_allclose(ensemble['accuracy'], trained['test_accuracy'], rtol=1e-6)
  np.testing.assert_allclose(ensemble['nll'], trained['test_loss'], rtol=1e-4)
  np.testing.assert_allclose([m['accuracy'] for m in members], trained['member_test_accuracy'], rtol=1e-6)
  np.testing.assert_allclose([m['nll'] for m in members], trained['member_test_loss'], rtol=1e-4)

  # Averaging probabilities can only lower NLL and Brier below the members' mean (both are convex).
  assert ensemble['nll'] <= results['mean_member']['nll']
  assert ensemble['brier'] <= results['mean_member']['brier']
  for name in ('accuracy', 'nll', 'brier', 'ece'):
    assert results['mean_member'][name] == pytest.approx(np.mean([m[name] for m in members]))
  assert results['gain_over_mean_member']['nll'] == pytest.approx(results['mean_member']['nll'] - ensemble['nll'])
  assert results['best_member']['accuracy'] == max(m['accuracy'] for m in members)
  assert 0 <= ensemble['disagreement'] <= 1 and 0 < ensemble['entropy'] < np.log(10)

  curve = results['ensemble_size_curve']
  assert [row['members'] for row in curve] == list(range(1, 9))
  assert curve[0]['nll'] == pytest.approx(members[0]['nll']) and curve[-1]['nll'] == pytest.approx(ensemble['nll'])

  rotation = {row['angle']: row for row in results['rotation']}
  assert sorted(rotation) == [0, 90]
  assert rotation[0]['ensemble']['nll'] == pytest.approx(ensemble['nll'])
  assert rotation[90]['ensemble']['accuracy'] < rotation[0]['ensemble']['accuracy'] - 0.2
  noise = results['gaussian_noise']
  assert [row['severity'] for row in noise] == [1, 2, 3, 4, 5]
  assert [row['std'] for row in noise] == [0.04, 0.06, 0.08, 0.09, 0.10]
  # Noise costs confidence on the right class: the NLL rises from the clean set's to the worst severity's.
  assert noise[-1]['ensemble']['nll'] > ensemble['nll']

  temperature = results['temperature_scaling']
  # The last 10% of the 256 training examples, which the trainer left out: 230 examples, 7 steps of 32.
  assert temperature['fit_examples'] == 26 and not temperature['seen_in_training'] and trained['step'] == 7
  assert temperature['before']['nll'] == pytest.approx(ensemble['nll'])
  assert 0.05 < temperature['temperature'] < 20 and np.isfinite(temperature['after']['nll'])
  assert sum(results['reliability']['ensemble']['count']) == 100

  report = (out / 'report.md').read_text()
  assert f'| **ensemble** | {ensemble["accuracy"]:.4f} | {ensemble["nll"]:.4f} |' in report
  assert '| 90 |' in report and '![rotation](rotation.png)' in report
  assert '## Test set with Gaussian noise' in report and '| 5 | 0.1000 |' in report

  # A report that fails to render leaves the one before as it was: nothing is written until all of it is rendered.
  before = {name: (out / name).read_bytes() for name in os.listdir(out)}
  with pytest.raises(TypeError):
    report_lib.write({**results, 'epoch': 2, 'ensemble_size_curve': None}, str(out))
  assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def _with_config(workdir, tmp_path, **changes):
  """A workdir with `workdir`'s checkpoints whose config.json says `changes`."""
  return ['--workdir', linked_workdir(workdir, str(tmp_path / 'copy'), **changes)]


def _ood_of_another_shape(workdir, tmp_path):
  np.savez(tmp_path / 'colour.npz', x_train=np.zeros((2, 8, 8, 3), np.uint8), y_train=np.arange(2),
           x_test=np.zeros((2, 8, 8, 3), np.uint8), y_test=np.arange(2))
  return ['--workdir', workdir, f'--ood=uniform_noise,{tmp_path}/colour.npz']


def _untrained(workdir, tmp_path):
  os.makedirs(tmp_path / 'fresh')
  shutil.copy(os.path.join(workdir, 'config.json'), tmp_path / 'fresh')
  return ['--workdir', str(tmp_path / 'fresh')]


@pytest.mark.parametrize('make_args, message', [
    (lambda w, t: ['--workdir', str(t)], 'error: {tmp}/config.json: missing; --workdir must name'),
    (_untrained, 'error: {tmp}/fresh/checkpoints: no checkpoint; train first'),
    (functools.partial(_with_config, ensemble_size=4),
     'error: {tmp}/copy/config.json does not describe its checkpoint: checkpoint '
     '{tmp}/copy/checkpoints/1 holds ensemble_size=8 but the config asks for ensemble_size=4'),
    (lambda w, t: ['--workdir', w, '--data_dir=/nonexistent'], 'error: /nonexistent: no such folder or .npz file'),
    (lambda w, t: ['--workdir', w, '--step=3'], 'error: --step=3: no such checkpoint in {workdir}/checkpoints; '
                                                 'choose one of [1]'),
    (lambda w, t: ['--workdir', w, '--angles=0,ninety'], 'error: --angles=0,ninety: give whole degrees'),
    (functools.partial(_with_config, heldout_fraction=0.001), 'error: heldout_fraction=0.001 of 256 training '
                                                                'examples holds out none'),
    (functools.partial(_with_config, backend='dp', model='classifier', ensemble_size=1),
     "error: {tmp}/copy holds one classifier model trained with backend 'dp', not an ensemble; evaluate, predict "
     'and export read ensembles trained with backend pmap or jit (its test loss and accuracy per epoch are in '
     '{tmp}/copy/metrics.jsonl)'),
    (lambda w, t: ['--workdir', w, '--alpha=0.05,2'], 'error: --alpha=0.05,2: give miscoverage levels between 0 and 1'),
    (lambda w, t: ['--workdir', w, '--ood=/nonexistent.npz'], 'error: --ood=/nonexistent.npz: /nonexistent.npz: no '
                                                               'such file'),
    (_ood_of_another_shape, 'error: --ood={tmp}/colour.npz: 8x8x3 images, but the ensemble takes 28x28x1'),
    # Not --config.dataset's words: evaluate has no such flag.
    (lambda w, t: ['--workdir', w, '--ood=uniform_nois'], 'error: --ood=uniform_nois: no such set (did you mean '
                                                           'uniform_noise'),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(workdir, tmp_path, capsys, make_args, message):
  args = [*make_args(workdir, tmp_path), '--output_dir', str(tmp_path / 'eval')]
  assert run_main(evaluate.main, 'evaluate', *args) == 2
  errors = capsys.readouterr().err.strip().splitlines()
  assert len(errors) == 1 and errors[0].startswith(message.format(tmp=tmp_path, workdir=workdir)), errors
  assert not (tmp_path / 'eval').exists()


def test_an_empty_ood_flag_scores_no_out_of_distribution_set():
  from absl import flags  # pylint: disable=g-import-not-at-top
  try:
    flags.FLAGS(['evaluate', '--workdir=w'])
    assert flags.FLAGS.ood == list(evaluation.DEFAULT_OOD)
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['evaluate', '--workdir=w', '--ood='])
    assert flags.FLAGS.ood == []
  finally:
    flags.FLAGS.unparse_flags()


def test_cli_refuses_a_folder_that_was_never_trained(tmp_path):
  result = _run('--workdir', str(tmp_path), module=('-m', 'ensemble.evaluate'))
  assert result.returncode == 2
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert errors == [f'error: {tmp_path}/config.json: missing; --workdir must name a folder written by '
                    'python -m ensemble.train'], result.stderr[-2000:]
  assert 'Traceback' not in result.stderr


@pytest.mark.parametrize('saved, fit_examples, seen', [
    ({'heldout_fraction': 0.2}, 51, False),
    ({'heldout_fraction': 0.0}, 26, True),
    ({}, 26, True),  # a run from before heldout_fraction existed
])
def test_the_temperature_is_fitted_on_the_slice_the_trainer_held_out(saved, fit_examples, seen):
  train = {'image': np.zeros((256, 28, 28, 1)), 'label': np.arange(256)}
  heldout, seen_in_training = evaluation.heldout_split(train, recipe_lib.from_record(saved))
  assert heldout['label'].tolist() == list(range(256 - fit_examples, 256)) and seen_in_training == seen


def test_the_temperature_is_fitted_on_the_held_out_slices_ensemble_mean(tmp_path):
  """Not on the test set, not on one member: on the mean of all members over the slice the trainer held out.

  A quarter of the labels are wrong, so that no set is classified perfectly: on a set without mistakes the
  NLL falls as the temperature falls, every fit lands on the search's bound (1/20), and the fits could not be
  told apart.
  """
  mnist = tmp_path / 'mnist'
  mnist.mkdir()
  rng = np.random.default_rng(1)
  for (images, labels), (images_name, labels_name) in zip(synthetic_mnist(), data.idx.FILES.values()):
    noisy = np.where(rng.random(len(labels)) < 0.25, rng.integers(0, 10, len(labels)), labels)
    write_idx(str(mnist / images_name), images)
    write_idx(str(mnist / labels_name), noisy)
  workdir = str(tmp_path / 'run')
  trainer.train_and_evaluate(small_config(str(mnist), heldout_fraction=0.1, num_epochs=2), workdir)
  results = evaluation.evaluate(workdir, angles=[0], output_dir=str(tmp_path / 'eval'))
  config = evaluation.load_run_config(workdir)
  member, state, _ = evaluation.restore(workdir, config, None, jax.devices())
  predict = predictor.Predictor(member, state, jax.devices(), config.eval_batch_size)
  dataset = data.load(data_dir=config.data_dir)
  _, heldout = data.hold_out(dataset.train, config.heldout_fraction)
  heldout_probs = predict(heldout)
  on_heldout_mean = calibration.fit_temperature(heldout_probs.mean(0), heldout['label'])
  on_test_mean = calibration.fit_temperature(predict(dataset.test).mean(0), dataset.test['label'])
  on_members = [calibration.fit_temperature(probs, heldout['label']) for probs in heldout_probs]
  assert results['temperature_scaling']['temperature'] == pytest.approx(on_heldout_mean, rel=1e-9)
  # Far apart, so a fit on the wrong predictions (the test set's, a member's: the one furthest off, as some
  # member's fit may land near the mean's) would fail the line above.
  assert abs(on_test_mean - on_heldout_mean) > 0.01 and max(abs(t - on_heldout_mean) for t in on_members) > 0.01


def test_ood_detection_selective_prediction_and_conformal_sets(workdir, tmp_path):
  out = tmp_path / 'eval'
  assert run_main(evaluate.main, 'evaluate', '--workdir', workdir, '--output_dir', str(out), '--angles=0',
                  '--ood=uniform_noise,permuted_pixels', '--alpha=0.2,0.01') == 0
  text = (out / 'metrics.json').read_text()
  results = json.loads(text, parse_constant=lambda name: pytest.fail(f'metrics.json holds {name}, not JSON'))
  for png in ('ood_scores.png', 'risk_coverage.png'):
    assert (out / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

  assert list(results['ood']) == ['uniform_noise', 'permuted_pixels']
  for result in results['ood'].values():
    assert result['examples'] == 100
    assert list(result['ensemble']) == list(scoring.OOD_SCORES)
    assert list(result['mean_member']) == ['max_probability', 'entropy']  # one member has no mutual information
    for figures in [*result['ensemble'].values(), *result['mean_member'].values()]:
      assert set(figures) == {'auroc', 'aupr', 'fpr95'} and all(0 <= v <= 1 for v in figures.values())
    for histogram in result['histogram'].values():
      assert sum(histogram['test']) == 100 and sum(histogram['ood']) == 100
      assert len(histogram['edges']) == scoring.OOD_HISTOGRAM_BINS + 1

  selective = results['selective']
  assert selective['table'][0]['coverage'] == 1.0
  assert selective['table'][0]['ensemble'] == pytest.approx(1 - results['ensemble']['accuracy'])
  assert selective['table'][0]['mean_member'] == pytest.approx(1 - results['mean_member']['accuracy'])
  assert len(selective['ensemble']['curve']['risk']) == 100 and 0 <= selective['ensemble']['aurc'] <= 1

  conformal = results['conformal']
  assert conformal['calibration_examples'] == 26 and not conformal['seen_in_training']
  rows = {(row['alpha'], row['score']): row for row in conformal['rows']}
  assert sorted(rows) == [(0.01, 'aps'), (0.01, 'thr'), (0.2, 'aps'), (0.2, 'thr')]
  assert rows[0.2, 'thr']['guaranteed'] == [0.8, pytest.approx(0.8 + 1 / 27)]
  # At alpha 0.01, 26 examples are too few (rank ceil(27 * 0.99) = 27 > 26): every set is every class.
  for score in ('thr', 'aps'):
    row = rows[0.01, score]
    assert row['ensemble'] == {'quantile': None, 'coverage': 1.0, 'mean_size': 10.0}
    assert row['mean_member'] == {'coverage': 1.0, 'mean_size': 10.0}
    assert 0 < rows[0.2, score]['ensemble']['mean_size'] < 10

  report = (out / 'report.md').read_text()
  for section in ('## Selective prediction', '## Conformal prediction sets', '## Out-of-distribution detection'):
    assert section in report
  assert 'What this guarantees, in plain words' in report and '| 0.2 | 1 - p(class) | 0.8000 to 0.8370 |' in report
  assert '| uniform_noise | mutual information |' in report and '| permuted_pixels | predictive entropy |' in report
  assert '![ood_scores](ood_scores.png)' in report


def test_permuted_pixels_keep_each_images_intensities():
  images = np.random.default_rng(0).integers(0, 256, (3, 5, 4, 2), dtype=np.uint8)
  permuted = scoring.permute_pixels(images)
  assert permuted.shape == images.shape and not (permuted == images).all()
  for original, shuffled in zip(images, permuted):
    pixels = lambda image: sorted(map(tuple, image.reshape(-1, 2)))  # a pixel's channels move together
    assert pixels(original) == pixels(shuffled)
  assert (scoring.permute_pixels(images) == permuted).all()  # the same set every evaluation


def _assert_same_numbers(got, want, path='results'):
  """Two reports' numbers alike, to float32's rounding of a forward pass in other batch shapes."""
  if isinstance(want, dict):
    assert sorted(got) == sorted(want), (path, sorted(got), sorted(want))
    for key in want:
      _assert_same_numbers(got[key], want[key], f'{path}.{key}')
  elif isinstance(want, list):
    assert len(got) == len(want), path
    for i, (a, b) in enumerate(zip(got, want)):
      _assert_same_numbers(a, b, f'{path}[{i}]')
  elif isinstance(want, float):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7, err_msg=path)
  else:
    assert got == want, (path, got, want)


@pytest.mark.optimized
def test_the_python_report_is_the_command_line_s_on_the_same_examples(workdir, tmp_path):
  """Issue 76: `Ensemble.report` gives what `python -m ensemble.evaluate` gives (one implementation,
  `Task.report`): on the same test set and held-out slice, the same numbers, the same files."""
  import ensemble  # pylint: disable=g-import-not-at-top
  cli = evaluation.evaluate(workdir, angles=[0, 90], output_dir=str(tmp_path / 'cli'))
  config = evaluation.load_run_config(workdir)
  dataset = data.load(data_dir=config.data_dir)
  heldout, _ = evaluation.heldout_split(dataset.train, config)
  mine = ensemble.load(workdir).report(dataset.test['image'], dataset.test['label'],
                                       calibration=(heldout['image'], heldout['label']), angles=[0, 90],
                                       output_dir=str(tmp_path / 'python'))
  about = ('workdir', 'data', 'data_dir', 'checkpoint', 'calibration')  # where the examples came from
  _assert_same_numbers({k: v for k, v in mine.items() if k not in about},
                       {k: v for k, v in cli.items() if k not in about})
  assert sorted(os.listdir(tmp_path / 'python')) == sorted(os.listdir(tmp_path / 'cli'))
  assert 'calibrated on the 26 calibration examples given' in (tmp_path / 'python' / 'report.md').read_text()


def test_evaluate_predicts_each_set_once_and_scores_what_it_is_asked(workdir, tmp_path, monkeypatch):
  """Issue 76: the 0 degree rotation predicted the test set a second time, the held-out slice was predicted twice
  (temperature, conformal sets) and a third time after "Done" (the flag thresholds); the noise sweep had no switch
  and a subset could not be scored. Now each set is predicted once, `--nonoise`, `--angles=` and `--max_examples`
  say what is scored, and the flag thresholds come from the held-out outputs already predicted."""
  calls = []
  log_probs = predictor.Predictor.log_probs

  def counted(self, split):
    calls.append(len(split['label']))
    return log_probs(self, split)
  monkeypatch.setattr(predictor.Predictor, 'log_probs', counted)
  copy = linked_workdir(workdir, str(tmp_path / 'run'))
  results = evaluation.evaluate(copy, angles=[0], noise=False, ood_names=(), max_examples=40)  # into copy/eval
  assert sorted(calls) == [26, 40]  # the held-out slice, the test set's first 40: once each
  assert results['test_examples'] == 40 and [row['angle'] for row in results['rotation']] == [0]
  assert 'gaussian_noise' not in results and 'ood' not in results
  assert results['rotation'][0]['ensemble']['nll'] == pytest.approx(results['ensemble']['nll'])
  kept = json.loads((tmp_path / 'run' / manifest.FLAG_THRESHOLDS_FILE).read_text())
  assert list(kept.values()) == [results['flags']]
  calls.clear()
  # What predict then applies costs no pass over the held-out slice: it reads them, for this temperature.
  assert ensemble_load(copy).flag_threshold() == results['flags'] and not calls


def ensemble_load(path):
  import ensemble  # pylint: disable=g-import-not-at-top
  return ensemble.load(path)


def test_a_report_from_python_never_takes_the_place_of_the_run_s_own(workdir, tmp_path):
  """`python -m ensemble.evaluate` keeps the temperature `load` applies in WORKDIR/eval; `Ensemble.report` written
  there took its place, and `load` dropped the temperature (a regression's variance scale alike). Refused in one
  line, and `load` returns what it did."""
  import ensemble  # pylint: disable=g-import-not-at-top
  run = linked_workdir(workdir, str(tmp_path / 'run'))
  evaluation.evaluate(run, angles=[], noise=False, ood_names=[])
  before = ensemble.load(run)
  assert before.temperature != 1.0
  test = data.load(data_dir=evaluation.load_run_config(run).data_dir).test
  with pytest.raises(ensemble.UsageError, match=r'output_dir=.*eval is the eval folder of the run in .*; write the '
                                                'report to another folder') as refused:
    before.report(test['image'][:20], test['label'][:20], angles=[], noise=False, ood={},
                  output_dir=os.path.join(run, 'eval'))
  assert '\n' not in str(refused.value)
  assert ensemble.load(run).temperature == before.temperature


@pytest.mark.parametrize('calibration, named', [('given', 'the calibration examples given and the test set differ'),
                                                 ('heldout', "the training split's held-out slice and the test set")])
def test_the_conformal_note_names_the_data_the_sets_were_calibrated_on(calibration, named):
  """A coverage outside its bounds is blamed on the data the sets were calibrated on: the rows given with
  `calibration=`, or the held-out slice (issue 89: it named the held-out slice for rows given)."""
  from ensemble import report  # pylint: disable=g-import-not-at-top
  row = {'alpha': 0.1, 'score': 'thr', 'guaranteed': [0.9, 0.91], 'bounds': [0.88, 0.92], 'within_bounds': False,
         'ensemble': {'coverage': 0.81, 'mean_size': 1.1}, 'mean_member': {'coverage': 0.8, 'mean_size': 1.2}}
  results = {'calibration': calibration, 'test_examples': 500,
             'conformal': {'calibration_examples': 200, 'seen_in_training': False, 'rows': [row]}}
  text = '\n'.join(report.uncertainty_markdown(results))
  assert named in text and '1 of the 1 rows measure a coverage outside their 99% bounds' in text


def test_the_command_line_judges_a_saved_ensemble_s_own_conformal_sets_per_class(workdir, tmp_path):
  """A saved ensemble whose chain ends in a class-conditional conformal step: `python -m ensemble.evaluate`'s report
  (as `Ensemble.report`'s) gives its sets' coverage per class beside the marginal, each class's calibration rows and
  bounds; a report of an ensemble without one has no such section."""
  import ensemble  # pylint: disable=g-import-not-at-top
  config = evaluation.load_run_config(workdir)
  dataset = data.load(data_dir=config.data_dir)
  chained = ensemble.load(workdir).conformal(dataset.train['image'], dataset.train['label'], alpha=0.3,
                                             class_conditional=True)
  saved = chained.save(str(tmp_path / 'saved'))
  cli = evaluation.evaluate(saved.workdir, angles=[], noise=False, ood_names=(), output_dir=str(tmp_path / 'cli'))
  mine = saved.report(dataset.test['image'], dataset.test['label'], angles=(), noise=False, ood={})
  assert cli['posthoc_conformal'] == mine['posthoc_conformal']
  found = cli['posthoc_conformal']
  sets = saved.predict(dataset.test['image'])['set']
  assert found['coverage'] == pytest.approx(sets[np.arange(len(sets)), dataset.test['label']].mean())
  assert found['class_conditional'] and found['step'] == 'conformal thr alpha 0.3 per class'
  assert [g['calibration_examples'] for g in found['groups']] == [
      saved.conformal_calibration['class_examples'][g['class']] for g in found['groups']]
  assert '## The ensemble\'s conformal sets' in (tmp_path / 'cli' / 'report.md').read_text()
  assert 'posthoc_conformal' not in ensemble.load(workdir).report(dataset.test['image'], dataset.test['label'],
                                                                  angles=(), noise=False, ood={})
