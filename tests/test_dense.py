"""task='dense': a class per position, logits (N, *positions, C) (ensemble/tasks/dense.py). The contract
(tests/contract) runs it over every method, data path and chain of post-hoc steps on sequences; here, what one
ensemble shows: it learns, its maps and scores, the ignored label, images with the built-in segmenter, the command
line, and each bad input in one line."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ensemble
from conftest import assert_printed_as_the_page_says, run_guide_example
from ensemble import scoring
from ensemble.tasks import dense
from ensemble.errors import UsageError
from ensemble.uncertainty import conformal

FIT = {'task': 'dense', 'ensemble_size': 2, 'epochs': 8, 'batch_size': 32, 'optimizer': 'adamw',
       'learning_rate': 0.01, 'standardize_features': True, 'progress': False}
POSITIONS, CLASSES = 6, 3


def _rows(n: int, seed: int, ignore: int = -1):
  """Sequences of 6 positions of 2 features; a position's class is where its first feature falls, shifted by its
  left neighbour's second (context a per-position model cannot see); a tenth of the positions unlabelled."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, POSITIONS, 2)).astype(np.float32)
  y = np.digitize(x[..., 0], [-0.5, 0.5]).astype(np.int32)
  return x, np.where(rng.random(y.shape) < 0.1, ignore, y)


def _images(n: int, seed: int):
  """8x8 greyscale images of a bright square on noise: the square's pixels class 1 (its left half) or 2, the rest
  0."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 60, (n, 8, 8), np.uint8)
  labels = np.zeros((n, 8, 8), np.int32)
  for i, (top, left) in enumerate(rng.integers(0, 5, (n, 2))):
    images[i, top:top + 4, left:left + 4] = 220
    labels[i, top:top + 4, left:left + 2], labels[i, top:top + 4, left + 2:left + 4] = 1, 2
  return images, labels


@pytest.fixture(scope='module')
def fitted():
  return ensemble.fit('mlp', _rows(400, 0), test=_rows(200, 1), **FIT)


def test_it_learns_and_scores_the_labelled_positions(fitted):
  x, y = _rows(300, 2)
  scores = fitted.evaluate(x, y)
  labelled = y != -1
  assert scores['labelled_positions'] == labelled.sum() < y.size
  ensemble_scores = scores['ensemble']
  assert ensemble_scores['accuracy'] > 0.85 and ensemble_scores['miou'] > 0.7, ensemble_scores
  assert len(ensemble_scores['iou']) == CLASSES and np.isclose(np.mean(ensemble_scores['iou']),
                                                               ensemble_scores['miou'])
  # The scores are a classifier's over the labelled positions, pooled.
  probs = fitted.predict(x)['probs'][labelled]
  np.testing.assert_allclose(ensemble_scores['accuracy'], np.mean(probs.argmax(-1) == y[labelled]))
  iou = scoring.intersection_over_union(probs, y[labelled])
  np.testing.assert_allclose(iou, ensemble_scores['iou'])
  # The training summary pools them as evaluate does: each labelled position counted once.
  test_x, test_y = _rows(200, 1)
  np.testing.assert_allclose(fitted.summary['test_loss'], fitted.evaluate(test_x, test_y)['ensemble']['nll'],
                             rtol=1e-4)


def test_predict_gives_maps_of_the_input_s_positions(fitted):
  x, _ = _rows(20, 3)
  got = fitted.predict(x, members=True)
  assert got['probs'].shape == (20, POSITIONS, CLASSES) and got['member_probs'].shape == (2, 20, POSITIONS, CLASSES)
  for key in ('class', 'entropy', 'aleatoric', 'mutual_information', 'disagreement'):
    assert got[key].shape == (20, POSITIONS), key
  np.testing.assert_allclose(got['entropy'], got['aleatoric'] + got['mutual_information'], atol=1e-12)
  np.testing.assert_array_equal(got['class'], got['probs'].argmax(-1))


def test_a_temperature_shared_over_positions_and_conformal_sets_per_position(fitted):
  chained = fitted.calibrate(*_rows(300, 4)).conformal(*_rows(600, 5), alpha=0.1)
  x, y = _rows(2000, 6)
  sets = chained.predict(x)['set']
  labelled = y != -1
  covered = np.take_along_axis(sets, np.where(labelled, y, 0)[..., None], -1)[..., 0][labelled]
  assert sets.shape == (2000, POSITIONS, CLASSES) and 0.87 < covered.mean() < 0.95, covered.mean()
  assert 'temperature ' in repr(chained) and chained.temperature != 1.0
  scaled = chained.evaluate(x, y)['temperature_scaled']
  assert np.isfinite(scaled['nll']) and scaled['nll'] <= fitted.evaluate(x, y)['ensemble']['nll'] + 0.01


def test_another_ignored_label_is_read_as_none(fitted):
  """ignore_label=255 (a segmentation's usual): those positions leave the loss and the scores as -1's do."""
  (x, y), (x_test, y_test) = _rows(400, 0, ignore=255), _rows(200, 1, ignore=255)
  ens = ensemble.fit('mlp', (x, y), test=(x_test, y_test), ignore_label=255, **FIT)
  assert ens.num_classes == CLASSES
  np.testing.assert_allclose(ens.evaluate(x_test, y_test)['ensemble']['nll'],
                             fitted.evaluate(*_rows(200, 1))['ensemble']['nll'], rtol=1e-5)


def test_images_train_the_built_in_segmenter_and_give_maps_of_their_pixels():
  ens = ensemble.fit('segmenter', _images(256, 0), test=_images(64, 1), task='dense', ensemble_size=2, epochs=6,
                     batch_size=32, optimizer='adamw', learning_rate=0.003, progress=False)
  x, y = _images(64, 2)
  got = ens.predict(x)
  assert got['probs'].shape == (64, 8, 8, 3) and got['mutual_information'].shape == (64, 8, 8)
  assert ens.evaluate(x, y)['ensemble']['miou'] > 0.6


@pytest.mark.parametrize('call, message', [
    (lambda: ensemble.fit('mlp', (_rows(50, 0)[0], _rows(50, 0)[1][:, :4]), task='dense'),
     r"labels of shape \(50, 4\) for inputs of shape \(50, 6, 2\); task='dense' takes a label per position"),
    (lambda: ensemble.fit('mlp', (_rows(50, 0)[0], np.maximum(_rows(50, 0)[1], 0)), task='dense', ignore_label=1),
     r'ignore_label=1 is also a class of arrays \(labels 0..2\)'),
    (lambda: ensemble.fit('mlp', (_rows(50, 0)[0], _rows(50, 0)[1] - 3), task='dense'),
     'a label of -4, neither a class 0..C-1 nor the ignored label -1; set ignore_label=-4'),
    (lambda: ensemble.fit('resnet', _images(32, 0), task='dense', epochs=1),
     r'the model maps inputs .* to \(batch, 3\), not to \(batch, 8, 8, 3\) logits, a class per position'),
    (lambda: ensemble.fit('segmenter', _images(32, 0), task='dense', augment='shift'),
     "augment='shift' moves the pixels of an image but not its labels"),
    (lambda: ensemble.fit('mlp', (_rows(50, 0)[0], _rows(50, 0)[1].astype(np.float32) + 0.5), task='dense'),
     "labels of shape .* and dtype float32; task='dense' takes integer class indices per position"),
])
def test_bad_input_is_one_line(call, message):
  with pytest.raises(UsageError, match=message) as raised:
    call()
  assert '\n' not in str(raised.value)


def test_every_mismatch_after_fit_is_one_line(fitted):
  x, y = _rows(20, 7)
  for call, message in [
      (lambda: fitted.evaluate(x, y[:, :3]), r'labels of shape \(20, 3\), but the ensemble predicts a class at each '
                                             r'of the \(6\) positions'),
      (lambda: fitted.evaluate(x, np.where(y == 2, 5, y)), r'labels span \[0, 5\], outside the 3 classes'),
      (lambda: fitted.flags(x, y), 'flags is for classification ensembles'),
      (lambda: fitted.predict(x, threshold=0.3), 'threshold=0.3 decides the labels of a multilabel ensemble'),
  ]:
    with pytest.raises(UsageError, match=message) as raised:
      call()
    assert '\n' not in str(raised.value)


def test_it_distils_into_one_network_on_the_ensemble_s_maps(fitted):
  x, _ = _rows(400, 0)
  student = ensemble.distill(fitted, 'mlp', x, test=_rows(200, 8), epochs=30, progress=False,
                             standardize_features=True, learning_rate=0.01, optimizer='adamw')
  assert student.task.name == 'dense' and student.size == 1
  report = student.distillation
  assert report.student_nll < report.ensemble_nll + 0.1, report


def test_the_command_line_trains_evaluates_and_writes_maps(tmp_path):
  (x, y), (x_test, y_test) = _images(256, 0), _images(64, 1)
  path = tmp_path / 'segments.npz'
  np.savez(path, x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  workdir = tmp_path / 'run'
  env = {**os.environ, 'PYTHONPATH': os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
  run = lambda *args: subprocess.run([sys.executable, '-m', *args], capture_output=True, text=True, env=env,
                                     timeout=600)
  trained = run('ensemble.train', f'--workdir={workdir}', '--config=configs/default.py', '--config.task=dense',
                f'--config.data_dir={path}', '--config.num_epochs=2', '--config.ensemble_size=2',
                '--config.augment=none', '--config.heldout_fraction=0.25', '--config.compilation_cache=',
                '--cpu_devices=2')
  assert trained.returncode == 0, trained.stderr[-3000:]
  loaded = ensemble.load(str(workdir))
  assert loaded.task.name == 'dense' and loaded.config.model == 'segmenter'
  evaluated = run('ensemble.evaluate', f'--workdir={workdir}')
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  results = json.loads((workdir / 'eval' / 'metrics.json').read_text())
  assert results['labelled_positions'] == y_test.size and 'conformal' in results and 'flags' not in results
  np.testing.assert_allclose(results['ensemble']['miou'], loaded.evaluate(x_test, y_test)['ensemble']['miou'])
  assert '(dense)' in (workdir / 'eval' / 'report.md').read_text()
  inputs = tmp_path / 'inputs.npy'
  np.save(inputs, x_test[:5])
  maps = tmp_path / 'maps.npz'
  predicted = run('ensemble.predict', f'--workdir={workdir}', f'--input={inputs}', f'--output={maps}')
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  with np.load(maps) as written:
    np.testing.assert_array_equal(written['class'], loaded.predict(x_test[:5])['class'])
    assert written['mutual_information'].shape == (5, 8, 8) and len(written['name']) == 5
  refused = run('ensemble.predict', f'--workdir={workdir}', f'--input={inputs}', f'--output={tmp_path / "maps.csv"}')
  assert refused.returncode == 2 and 'a dense ensemble predicts a map per input' in refused.stderr, refused.stderr


def test_the_guide_s_example_runs_as_written(capsys):
  """docs/python-api.md's dense example runs as written and prints what the page shows (to 0.01)."""
  assert_printed_as_the_page_says(*run_guide_example('## Dense classification', capsys))


def test_a_converted_folder_keeps_the_positions_and_reads_the_ignored_label(tmp_path):
  """python -m ensemble.data.convert --task=dense --ignore_label=255: the folder holds the labels per position, the
  ignored ones as every reader hands them over (-1), and its classes those of the labelled positions."""
  from ensemble.data import array_record, convert  # pylint: disable=g-import-not-at-top
  (x, y), (x_test, y_test) = _images(32, 0), _images(16, 1)
  y[:, 0, 0] = y_test[:, 0, 0] = 255
  np.savez(tmp_path / 'segments.npz', x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  convert.convert(str(tmp_path / 'segments.npz'), str(tmp_path / 'folder'), task='dense', ignore=255)
  loaded = array_record.load(str(tmp_path / 'folder'), 'dense')
  assert loaded.task == 'dense' and loaded.num_classes == 3
  np.testing.assert_array_equal(loaded.train['label'], np.where(y == 255, -1, y))
  (tmp_path / 'table.csv').write_text('a,y\n1,0\n2,1\n')
  with pytest.raises(UsageError, match=r'a .csv input is regression, multilabel or quantile data; drop --task=dense'):
    convert.convert(str(tmp_path / 'table.csv'), str(tmp_path / 'again'), task='dense', target='y')


@pytest.mark.parametrize('class_conditional', [False, True])
def test_the_program_writes_the_chain_s_conformal_sets_per_position(fitted, tmp_path, class_conditional):
  """A saved dense ensemble with a conformal step (one quantile, or one per class): `python -m ensemble.predict`'s
  maps hold its 'set' per position (N, positions, C), as `predict` gives it."""
  from ensemble import predict  # pylint: disable=g-import-not-at-top
  saved = str(tmp_path / 'saved')
  chained = fitted.conformal(*_rows(300, 5), alpha=0.1, class_conditional=class_conditional).save(saved)
  x, _ = _rows(12, 6)
  np.save(tmp_path / 'x.npy', x)
  predict.predict_files(saved, str(tmp_path / 'x.npy'), str(tmp_path / 'maps.npz'))
  with np.load(tmp_path / 'maps.npz') as maps:
    np.testing.assert_array_equal(maps['set'], chained.predict(x)['set'])
    assert maps['set'].shape == (12, POSITIONS, CLASSES)


def test_class_conditional_sets_cover_each_class_of_the_labelled_positions(fitted, tmp_path):
  """A quantile per class, fitted on the labelled positions of that class (the ignored ones never count): each
  class's coverage of fresh labelled positions within its beta-binomial bounds; the report gives it beside the
  marginal, and the coverage of boundary positions (a neighbour labelled otherwise) and interior ones."""
  x, y = _rows(600, 5)
  per_class = fitted.conformal(x, y, alpha=0.1, class_conditional=True)
  found = per_class.conformal_calibration
  labelled = y[y != -1]
  assert found['class_examples'] == tuple(int((labelled == c).sum()) for c in range(CLASSES))
  assert found['examples'] == labelled.size and len(found['quantile']) == CLASSES
  new_x, new_y = _rows(3000, 6)
  sets, mask = per_class.predict(new_x)['set'], new_y != -1
  covered = np.take_along_axis(sets[mask], new_y[mask][:, None], -1)[:, 0]
  for c in range(CLASSES):
    low, high = conformal.coverage_bounds(found['class_examples'][c], int((new_y[mask] == c).sum()), 0.1,
                                          probability=1 - 1e-6)
    assert low <= covered[new_y[mask] == c].mean() <= high, (c, covered[new_y[mask] == c].mean(), (low, high))
  report = per_class.report(new_x[:1000], new_y[:1000], output_dir=str(tmp_path))['posthoc_conformal']
  boundary = dense.boundary_positions(new_y[:1000])[new_y[:1000] != -1]
  first = covered[:int(mask[:1000].sum())]
  assert report['coverage'] == pytest.approx(first.mean()) and [g['class'] for g in report['groups']] == [0, 1, 2]
  assert report['regions']['boundary']['coverage'] == pytest.approx(first[boundary].mean())
  assert report['regions']['interior']['test_examples'] == (~boundary).sum() > 0 < boundary.sum()
  assert 'boundary' in (tmp_path / 'report.md').read_text()


def test_boundary_positions_are_those_with_a_neighbour_labelled_otherwise():
  labels = np.array([[[0, 0, 1],
                      [0, 0, 1],
                      [-1, 0, 0]]])
  np.testing.assert_array_equal(dense.boundary_positions(labels), [[[0, 1, 1],
                                                                       [1, 1, 1],
                                                                       [0, 1, 1]]])
  np.testing.assert_array_equal(dense.boundary_positions(np.array([[2, 2, 2, -1, 2]])), [[0, 0, 1, 0, 1]])
