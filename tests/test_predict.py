"""`ensemble.load(workdir).predict(images)` and `python -m ensemble.predict` on every kind of input, good and bad."""

import csv
import gzip
import json
import logging
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

import ensemble
from conftest import COMPILE_FLAGS, compiles, linked_workdir, run_main, small_config, write_idx, write_mnist
from ensemble import api, calibration, checkpoint, data, evaluation, manifest, posthoc, predict, trainer, writers
from ensemble import trained as trained_lib
from ensemble.data import inputs
from ensemble.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
predict.define_flags()  # for the command line run in this process


@pytest.fixture(scope='module')
def trained(tmp_path_factory) -> dict:
  """An 8-member ensemble trained for one epoch on 8 devices, its test split, and the model restored from it."""
  root = tmp_path_factory.mktemp('predict')
  mnist, workdir = write_mnist(str(root / 'mnist')), str(root / 'run')
  trainer.train_and_evaluate(small_config(mnist, heldout_fraction=0.1), workdir)
  return {'workdir': workdir, 'test': data.load(data_dir=mnist).test, 'model': api.load(workdir), 'mnist': mnist}


def test_load_is_exported_lazily_and_import_stays_cheap():
  assert ensemble.load is api.load
  code = 'import sys, ensemble; assert "jax" not in sys.modules and "ensemble.predict" not in sys.modules'
  assert subprocess.run([sys.executable, '-c', code], cwd=REPO).returncode == 0


def test_predictions_agree_with_training_and_with_themselves(trained):
  model, test = trained['model'], trained['test']
  assert model.temperature == 1.0 and model.size == 8 and model.image_shape == (28, 28, 1)
  result = model.predict(test['image'], members=True)
  probs, member_probs = result['probs'], result['member_probs']
  assert probs.shape == (100, 10) and member_probs.shape == (8, 100, 10) and probs.dtype == np.float64
  # Probabilities, not log-probabilities: whatever Predictor returns, predict hands out distributions.
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)  # float32 log-probabilities
  assert (member_probs >= 0).all() and (member_probs <= 1).all()
  np.testing.assert_allclose(probs, member_probs.mean(0))
  assert (result['class'] == probs.argmax(-1)).all()
  # The same test set through the trainer's pmap eval step.
  trained_metrics = writers.read_jsonl(os.path.join(trained['workdir'], 'metrics.jsonl'))[-1]
  assert calibration.accuracy(probs, test['label']) == pytest.approx(trained_metrics['test_accuracy'], rel=1e-6)
  assert calibration.nll(probs, test['label']) == pytest.approx(trained_metrics['test_loss'], rel=1e-4)
  np.testing.assert_allclose(result['entropy'], result['aleatoric'] + result['mutual_information'], atol=1e-12)
  assert (result['mutual_information'] >= 0).all()
  assert ((0 <= result['disagreement']) & (result['disagreement'] <= 1)).all()
  assert 'member_probs' not in model.predict(test['image'][:2])
  # Any batch size gives each image the same answer: padding to a bucket changes nothing. To float32's rounding:
  # XLA:CPU picks its convolution kernels (and their order of summation) by batch shape, 3e-6 apart on a Zen 3.
  for n in (1, 3, 37):
    np.testing.assert_allclose(model.predict(test['image'][:n])['probs'], probs[:n], rtol=1e-5, atol=1e-9)
  # Float pixels in [0, 1] and (N, H, W) greyscale batches are the same images.
  as_float = model.predict(test['image'][:5, ..., 0].astype(np.float32) / 255)
  np.testing.assert_allclose(as_float['probs'], probs[:5], rtol=1e-5, atol=1e-9)  # a batch of 5: as above
  empty = model.predict(np.zeros((0, 28, 28, 1), np.uint8))
  assert empty['probs'].shape == (0, 10) and empty['entropy'].shape == (0,)


def test_one_program_per_bucket(trained):
  model = api.load(trained['workdir'], batch_size=16)
  images = trained['test']['image']
  assert [trained_lib.bucket(n, 16) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
  model.predict(images[:3])
  with compiles() as counts:
    model.predict(images[:4].astype(np.float32) / 255)  # bucket 4 again, and float: the same program
  assert not counts
  model.predict(images[:40])  # 16 + 16 + 8
  assert sorted(model._predictors) == [4, 8, 16]  # pylint: disable=protected-access
  # One jitted function for the ensemble's members, holding a program per bucket.
  programs = {id(p._log_probs) for p in model._predictors.values()}  # pylint: disable=protected-access
  assert len(programs) == 1 and model._predictors[4]._log_probs._cache_size() >= 3  # pylint: disable=protected-access
  # The same ensemble loaded again shares its member, and so its programs: a loop of loads compiles once.
  with compiles() as counts:
    api.load(trained['workdir'], batch_size=16).predict(images[:40])
  assert not counts


def test_the_temperature_fitted_by_evaluate_is_applied_to_its_checkpoint_and_data_only(trained, tmp_path, caplog):
  """Not after a retrain from scratch in the same workdir (the same epoch, another checkpoint), nor when evaluate
  fitted it on the held-out slice of other data (--data_dir)."""
  workdir = linked_workdir(trained['workdir'], str(tmp_path / 'run'))
  os.makedirs(os.path.join(workdir, 'eval'))
  config = evaluation.load_run_config(workdir)
  fitted = {'epoch': 1, 'checkpoint': checkpoint.checkpoint_id(workdir, 1), 'data_dir': config.data_dir,
            'temperature_scaling': {'temperature': 2.0}}

  def report(**changes):
    with open(os.path.join(workdir, 'eval', 'metrics.json'), 'w') as f:
      json.dump({**fitted, **changes}, f)
  report()
  images = trained['test']['image'][:10]
  raw = trained['model'].predict(images)
  scaled = api.load(workdir).predict(images)
  np.testing.assert_allclose(scaled['probs'], calibration.temperature_scale(raw['probs'], 2.0), rtol=1e-6)
  assert (scaled['class'] == raw['class']).all()
  assert scaled['entropy'] == pytest.approx(raw['entropy'])  # the split stays on the members' own probabilities
  for changes, why in [({'epoch': 7}, 'was fitted for epoch 7, not 1'),
                       ({'checkpoint': '0123456789abcdef'},
                        'was fitted for another checkpoint of epoch 1 (the run was trained again since)'),
                       ({'checkpoint': None}, 'does not record the checkpoint it was fitted for (an older version)'),
                       ({'data_dir': str(tmp_path)}, f'was fitted on the held-out slice of {tmp_path}, not of the '
                                                      f'data the run was trained on ({config.data_dir})')]:
    report(**changes)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      assert manifest.fitted_temperature(workdir, config, 1) is None
    assert [r.getMessage() for r in caplog.records] == [
        f'The temperature in {workdir}/eval/metrics.json {why}: predicting without temperature scaling; run python '
        f'-m ensemble.evaluate --workdir={workdir} --step=1 to fit one.']


@pytest.mark.parametrize('images, message', [
    (np.zeros((2, 32, 32, 3), np.uint8), 'predict: images of shape (2, 32, 32, 3), but {workdir} was trained on '
                                         '28x28x1 images; give a batch of shape (N, 28, 28, 1)'),
    (np.zeros((28, 28, 1), np.uint8), 'predict: images of shape (28, 28, 1)'),
    # The checks (and messages) of training's arrays (`data.base.as_images`): what fit refuses, predict refuses.
    (np.zeros((2, 28, 28, 1), np.int64), 'predict: images of dtype int64; store them as uint8 (0..255) or as float '
                                         'in [0, 1]'),
    (np.full((2, 28, 28, 1), 255.0), 'predict: float images must lie in [0, 1] but span [255, 255]; scale them to '
                                     '[0, 1] (x / 255 for 0..255 values)'),
    (np.full((2, 28, 28, 1), np.nan), 'predict: float images contain NaN; store uint8 (0..255) or float in [0, 1]'),
    ([np.zeros((28, 28)), np.zeros((27, 28))], 'predict: inputs cannot be made an array ('),
])
def test_bad_images_are_one_line_errors(trained, images, message):
  with pytest.raises(UsageError) as error:
    trained['model'].predict(images)
  assert str(error.value).startswith(message.format(workdir=trained['workdir']))
  assert '\n' not in str(error.value)


def test_a_batch_size_below_one_is_refused_however_it_is_set(trained):
  model = trained['model']
  with pytest.raises(UsageError, match=r'^batch_size=-8 must be a positive number of inputs per device program$'):
    api.Ensemble(model.workdir, model.config, model.member, model.state, model.devices, model.epoch, batch_size=-8)
  for bad in (0, -1, 2.5, True):
    with pytest.raises(UsageError, match='must be a positive number'):
      model.batch_size = bad
  assert model.batch_size == trained['model'].config.eval_batch_size


def test_the_flag_threshold_meets_its_target_on_the_held_out_slice(trained):
  fitted = trained['model'].flag_threshold(0.2)
  assert fitted['examples'] == 26 and not fitted['seen_in_training']  # the last 10% of 256
  assert fitted['risk'] <= 0.2 and 0 < fitted['coverage'] <= 1
  assert trained['model'].flag_threshold(-1.0)['threshold'] == -np.inf  # no error rate below 0: flag everything


def test_the_flag_threshold_is_fitted_once_per_checkpoint_and_settings(trained, monkeypatch):
  """Issue 67: predict on 4 images took 21 s, the threshold fitted on the held-out slice at every call. The fit is
  kept in the workdir, by checkpoint and settings: a later call reads no data; other settings fit again."""
  first = trained['model'].flag_threshold(0.15)
  def unread(*args, **kwargs):
    raise AssertionError('the held-out slice was read again')
  monkeypatch.setattr(data, 'load', unread)
  assert api.load(trained['workdir']).flag_threshold(0.15) == first
  with pytest.raises(AssertionError, match='read again'):
    trained['model'].flag_threshold(0.16)


# The command line.

def test_the_default_flag_catches_noise_and_rotated_digits(trained, tmp_path):
  """An accurate ensemble meets the 1% risk unflagged (the entropy test flags nothing); the members' disagreement
  beyond the held-out images' flags inputs unlike the training data: all noise, and rotated digits far more often
  than test digits.

  Three epochs: after one epoch of these 230 images, whether the members' disagreement alone flagged most rotated
  digits depended on the seed (over seeds 0-5 the share ranged from 0 to 1, before and after the data order's draw
  moved into the programs); after three, the whole flag took all of them at every seed, and disagreement alone at
  least a third (seed 1: 0.33; the others 0.86 or more).
  """
  test = trained['test']
  workdir = str(tmp_path / 'run')
  trainer.train_and_evaluate(small_config(trained['mnist'], heldout_fraction=0.1, num_epochs=3), workdir)
  model = api.load(workdir)
  fitted = model.flag_threshold()
  heldout_rate = fitted['ood_rate']
  noise = np.random.default_rng(0).integers(0, 256, (100, 28, 28, 1)).astype(np.uint8)
  rotated = np.rot90(test['image'], 1, axes=(1, 2))  # the digits' lit rows become columns
  disagreement_only = {**fitted, 'threshold': np.inf}  # what an accurate ensemble's entropy test leaves
  for thresholds in (fitted, disagreement_only):
    rates = {name: float(np.mean(posthoc.flagged(model.predict(images), thresholds)))
             for name, images in (('test', test['image']), ('noise', noise), ('rotated', rotated))}
    assert rates['noise'] > 0.5 and rates['rotated'] > rates['test'] + 0.2, rates
    assert rates['test'] < 0.2, rates
    if thresholds is fitted:
      assert rates['rotated'] > 0.5, rates
  heldout, _ = evaluation.heldout_split(data.load(data_dir=model.config.data_dir).train, model.config)
  assert np.mean(model.predict(heldout['image'])['mutual_information'] > fitted['ood_threshold']) <= heldout_rate
  assert heldout_rate == posthoc.DEFAULT_FLAG_OOD_RATE
  with pytest.raises(UsageError, match='ood_rate=1.0 must be a share'):
    model.flag_threshold(ood_rate=1.0)


def _main(*args):
  """Runs the CLI in this process (restores and compiles, but starts no interpreter)."""
  code = run_main(predict.main, 'predict', *args)
  if code:
    sys.exit(code)


def _read(path):
  with open(path) as f:
    return list(csv.DictReader(f)) if str(path).endswith('.csv') else [json.loads(line) for line in f]


def _png(path, array):
  Image.fromarray(array).save(path)  # uint8 (H, W): greyscale; (H, W, 3): RGB
  return str(path)


def _inputs(kind, test, tmp_path):
  """(--input and --array flags, the images the rows are of (None: resized), their names) for each input kind."""
  images = test['image'][:5]
  if kind == 'npy':
    np.save(tmp_path / 'x.npy', images[..., 0])
    return ['--input', str(tmp_path / 'x.npy')], images, ['0', '1', '2', '3', '4']
  if kind == 'npy_one_image':
    np.save(tmp_path / 'x.npy', images[0].astype(np.float32) / 255)
    return ['--input', str(tmp_path / 'x.npy')], images[:1], ['0']
  if kind == 'npz':
    np.savez(tmp_path / 'x.npz', images=images, labels=test['label'][:5])
    return ['--input', str(tmp_path / 'x.npz'), '--array=images'], images, ['0', '1', '2', '3', '4']
  if kind == 'idx_gz':
    write_idx(str(tmp_path / 'images-idx3-ubyte.gz'), images[..., 0])
    return ['--input', str(tmp_path / 'images-idx3-ubyte.gz')], images, ['0', '1', '2', '3', '4']
  if kind == 'png':
    return ['--input', _png(tmp_path / 'digit.png', images[0, ..., 0])], images[:1], ['digit.png']
  if kind == 'folder':
    os.makedirs(tmp_path / 'images')
    _png(tmp_path / 'images' / 'a.png', images[0, ..., 0])
    Image.fromarray(images[1, ..., 0]).save(tmp_path / 'images' / 'b.jpg', quality=100)
    big = np.kron(images[2, ..., 0], np.ones((3, 3), np.uint8))  # 84x84: resized back to 28x28
    _png(tmp_path / 'images' / 'c.png', np.stack([big] * 3, -1))  # colour: converted to greyscale
    (tmp_path / 'images' / 'notes.txt').write_text('not an image')
    return ['--input', str(tmp_path / 'images')], None, ['a.png', 'b.jpg', 'c.png']
  raise ValueError(kind)


@pytest.mark.parametrize('kind, output', [('npy', 'out.csv'), ('npy_one_image', 'out.jsonl'), ('npz', 'out.csv'),
                                          ('idx_gz', 'out.jsonl'), ('png', 'out.csv'), ('folder', 'out.jsonl')])
def test_cli_predicts_every_kind_of_input(trained, tmp_path, kind, output):
  args, images, names = _inputs(kind, trained['test'], tmp_path)
  flag = kind == 'npy'  # the flag needs a pass over the held-out slice: once is enough here
  _main('--workdir', trained['workdir'], *args, '--output', str(tmp_path / output), '--flag' if flag else '--noflag')
  rows = _read(tmp_path / output)
  assert [row['name'] for row in rows] == names
  assert list(rows[0]) == list(predict.COLUMNS if flag else predict.COLUMNS[:-1])
  if images is not None:
    expected = trained['model'].predict(images)
    assert [int(row['class']) for row in rows] == expected['class'].tolist()
    np.testing.assert_allclose([float(row['entropy']) for row in rows], expected['entropy'], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([float(row['probability']) for row in rows], expected['probs'].max(-1), rtol=1e-5)
  if flag:
    fitted = trained['model'].flag_threshold(predict.DEFAULT_FLAG_RISK)
    expected_flags = (expected['entropy'] > fitted['threshold']) | (expected['mutual_information'] >
                                                                    fitted['ood_threshold'])
    assert [int(row['flag']) for row in rows] == expected_flags.astype(int).tolist()
  assert not [name for name in os.listdir(tmp_path) if name.startswith('.')]  # no partial file left
  (tmp_path / 'reference').write_text('')
  assert os.stat(tmp_path / output).st_mode == os.stat(tmp_path / 'reference').st_mode  # as open() makes it


def test_cli_writes_csv_to_stdout_without_output(trained, tmp_path, capsys):
  args, _, _ = _inputs('npy', trained['test'], tmp_path)
  _main('--workdir', trained['workdir'], *args, '--noflag')
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == 'name,class,probability,entropy,mutual_information' and len(lines) == 6


def _png_header(path, width, height):
  """A PNG whose header says `width` x `height` and whose pixels are cut off: read only if it is decoded."""
  def chunk(kind, payload):
    return struct.pack('>I', len(payload)) + kind + payload + struct.pack('>I', zlib.crc32(kind + payload))
  header = chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, 8, 0, 0, 0, 0))
  path.write_bytes(b'\x89PNG\r\n\x1a\n' + header + chunk(b'IDAT', zlib.compress(bytes(width + 1))[:8]))
  return str(path)


def _bad_inputs(tmp_path):
  """name -> (arguments, the start of the error line) for each input the CLI must refuse."""
  np.save(tmp_path / 'colour.npy', np.zeros((3, 32, 32, 3), np.uint8))
  np.save(tmp_path / 'ints.npy', np.zeros((3, 28, 28), np.int64))
  np.save(tmp_path / 'bright.npy', np.full((3, 28, 28), 2.0))
  np.savez(tmp_path / 'two.npz', a=np.zeros((1, 28, 28)), b=np.zeros((1, 28, 28)))
  (tmp_path / 'notes.txt').write_text('hello')
  write_idx(str(tmp_path / 'labels-idx1-ubyte'), np.zeros(3))
  os.makedirs(tmp_path / 'empty')
  _png(tmp_path / 'wide.png', np.zeros((28, 56), np.uint8))
  (tmp_path / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not really')
  with gzip.open(tmp_path / 'truncated-idx3-ubyte.gz', 'wb') as f:
    f.write(b'\x00\x00\x08\x03\x00\x00\x00\x05\x00\x00\x00\x1c\x00\x00\x00\x1c' + bytes(100))
  with open(tmp_path / 'huge.npy', 'wb') as f:  # 128 bytes that ask for 784 GB
    np.lib.format.write_array_header_1_0(f, {'descr': '|u1', 'fortran_order': False, 'shape': (10**9, 28, 28)})
  # 2**22 * 2**21 * 2**21 = 2**64, which np.prod wraps to 0: the header alone looked complete.
  (tmp_path / 'overflow-idx3-ubyte').write_bytes(struct.pack('>4I', 0x803, 2**22, 2**21, 2**21))
  os.makedirs(tmp_path / 'mixed')
  _png(tmp_path / 'mixed' / 'a.png', np.zeros((28, 28), np.uint8))
  (tmp_path / 'mixed' / 'b.png').write_bytes(b'\x89PNG\r\n\x1a\n not really')
  _png_header(tmp_path / 'huge.png', 12000, 6000)
  os.makedirs(tmp_path / 'rows.csv')
  t = str(tmp_path)
  return {
      'no input': ([], 'error: --input is required'),
      'missing file': (['--input', f'{t}/nope.npy'], f'error: {t}/nope.npy: no such file or folder'),
      'unknown kind': (['--input', f'{t}/notes.txt'], f'error: {t}/notes.txt: not a file this reads'),
      'idx labels': (['--input', f'{t}/labels-idx1-ubyte'], f'error: {t}/labels-idx1-ubyte: an IDX labels file'),
      'truncated idx': (['--input', f'{t}/truncated-idx3-ubyte.gz'],
                        f'error: {t}/truncated-idx3-ubyte.gz: truncated file'),
      'wrong shape': (['--input', f'{t}/colour.npy'],
                      f'error: {t}/colour.npy: images of shape (3, 32, 32, 3), but'),
      'wrong dtype': (['--input', f'{t}/ints.npy'], f'error: {t}/ints.npy: images of dtype int64'),
      'out of range': (['--input', f'{t}/bright.npy'],
                       f'error: {t}/bright.npy: float images must lie in [0, 1]'),
      'several arrays': (['--input', f'{t}/two.npz'], f'error: {t}/two.npz: several arrays (it holds a, b); name'),
      'no such array': (['--input', f'{t}/two.npz', '--array=c'], f'error: {t}/two.npz: no array c (it holds a, b)'),
      'empty folder': (['--input', f'{t}/empty'], f'error: {t}/empty: no PNG or JPEG files in this folder'),
      'aspect ratio': (['--input', f'{t}/wide.png'], f'error: {t}/wide.png: 56x28 pixels, but the ensemble takes '
                                                    '28x28; resizing would distort it'),
      'broken image': (['--input', f'{t}/broken.png'], f'error: {t}/broken.png: cannot be read as an image'),
      'broken image in a folder': (['--input', f'{t}/mixed'], f'error: {t}/mixed/b.png: cannot be read as an image: '),
      # Refused from its header: decoded first, its cut-off pixels would be the error.
      'huge image': (['--input', f'{t}/huge.png'], f'error: {t}/huge.png: 12000x6000 pixels, but the ensemble takes '
                                                  '28x28; resizing would distort it'),
      'huge npy header': (['--input', f'{t}/huge.npy'], f'error: {t}/huge.npy: cut short or damaged: its header '
                                                       'describes a uint8 array of shape (1000000000, 28, 28) '
                                                       '(784,000,000,000 bytes) but it holds 0; save it again'),
      'overflowing idx header': (['--input', f'{t}/overflow-idx3-ubyte'],
                                 f'error: {t}/overflow-idx3-ubyte: truncated file, header (4194304, 2097152, 2097152) '
                                 'needs 18446744073709551632 bytes but the file has 16'),
      'batch size': (['--input', f'{t}/colour.npy', '--batch_size=-1'],
                     'error: --batch_size=-1: give a positive number of images per device program'),
      # Checked before the input, which is bad too: before any work.
      'output is a folder': (['--input', f'{t}/colour.npy', '--output', f'{t}/rows.csv'],
                             f'error: --output={t}/rows.csv: a folder; name a file in it'),
      'output folder missing': (['--input', f'{t}/colour.npy', '--output', f'{t}/nowhere/rows.csv'],
                                f'error: --output={t}/nowhere/rows.csv: no folder {t}/nowhere; create it first'),
      'output format': (['--input', f'{t}/colour.npy', '--output', f'{t}/out/x.txt'],
                        f'error: --output={t}/out/x.txt: unknown format .txt; end it in .csv'),
      'flag risk': (['--input', f'{t}/colour.npy', '--flag_risk=1.5'], 'error: --flag_risk=1.5 must be an error rate'),
  }


BAD_INPUTS = ['no input', 'missing file', 'unknown kind', 'idx labels', 'truncated idx', 'wrong shape', 'wrong dtype',
              'out of range', 'several arrays', 'no such array', 'empty folder', 'aspect ratio', 'broken image',
              'broken image in a folder', 'huge image', 'huge npy header', 'overflowing idx header', 'batch size',
              'output is a folder', 'output folder missing', 'output format', 'flag risk']


@pytest.mark.parametrize('case', BAD_INPUTS)
def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(trained, tmp_path, capsys, case):
  args, message = _bad_inputs(tmp_path)[case]
  os.makedirs(tmp_path / 'out')
  output = ['--output', str(tmp_path / 'out' / 'rows.csv')] if '--output' not in args else []
  with pytest.raises(SystemExit) as exit_:
    _main('--workdir', trained['workdir'], *args, *output, '--noflag')
  assert exit_.value.code == 2
  captured = capsys.readouterr()
  errors = captured.err.strip().splitlines()
  assert len(errors) == 1 and errors[0].startswith(message), errors
  assert os.listdir(tmp_path / 'out') == [] and captured.out == ''


def test_image_files_are_read_as_they_look(tmp_path):
  """16-bit greyscale scaled to 8 bits, transparency laid on white, EXIF orientation applied."""
  digit = np.zeros((28, 28), np.uint8)
  digit[4:24, 12:16] = 200  # a stroke
  digit[4:8, 8:20] = 255  # and a bar at the top, so that a half turn shows
  Image.fromarray(digit.astype(np.uint16) * 257).save(tmp_path / 'sixteen.png')  # mode I;16, 0..65535
  rgba = np.zeros((28, 28, 4), np.uint8)
  rgba[..., 3] = digit  # a black digit on a transparent background: RGB is black everywhere
  Image.fromarray(rgba).save(tmp_path / 'transparent.png')
  exif = Image.Exif()
  exif[0x0112] = 3  # orientation: stored upside down, shown turned by half a turn
  Image.fromarray(digit).save(tmp_path / 'turned.png', exif=exif)
  read = lambda name, shape=(28, 28, 1): inputs.read(str(tmp_path / name), shape).images[0]
  np.testing.assert_array_equal(read('sixteen.png')[..., 0], digit)
  np.testing.assert_array_equal(read('transparent.png')[..., 0], 255 - digit)  # as a viewer shows it on white
  np.testing.assert_array_equal(read('transparent.png', (28, 28, 3)), np.stack([255 - digit] * 3, -1))
  np.testing.assert_array_equal(read('turned.png')[..., 0], np.rot90(digit, 2))


def test_cli_skips_hidden_and_unreadable_files_when_asked_and_quotes_formulas(trained, tmp_path, caplog):
  folder = tmp_path / 'scans'
  os.makedirs(folder)
  images = trained['test']['image'][:2, ..., 0]
  _png(folder / 'a.png', images[0])
  _png(folder / '=1+2.png', images[1])  # a spreadsheet would run it as a formula
  (folder / '._a.png').write_bytes(b'\x00\x05\x16\x07 macOS resource fork')  # hidden: not an image
  (folder / 'cut.png').write_bytes((folder / 'a.png').read_bytes()[:60])
  args = ['--workdir', trained['workdir'], '--input', str(folder), '--noflag']
  assert run_main(predict.main, 'predict', *args, '--output', str(tmp_path / 'strict.csv')) == 2
  with caplog.at_level(logging.WARNING):
    assert run_main(predict.main, 'predict', *args, '--output', str(tmp_path / 'rows.csv'), '--skip_unreadable') == 0
  rows = _read(tmp_path / 'rows.csv')
  assert [row['name'] for row in rows] == ["'=1+2.png", 'a.png']
  assert [int(row['class']) for row in rows] == trained['model'].predict(images[::-1])['class'].tolist()
  skipped = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(skipped) == 1 and skipped[0].startswith(f'Skipped 1 files of {folder} that cannot be read '
                                                     '(--skip_unreadable): cut.png (cannot be read as an image: ')
  assert not os.path.exists(tmp_path / 'strict.csv')
  assert run_main(predict.main, 'predict', *args, '--output', str(tmp_path / 'rows.jsonl'), '--skip_unreadable') == 0
  assert [row['name'] for row in _read(tmp_path / 'rows.jsonl')] == ['=1+2.png', 'a.png']  # JSON keeps them as named


def test_an_unreadable_file_in_a_folder_names_the_flag_that_skips_it(trained, tmp_path, capsys):
  os.makedirs(tmp_path / 'scans')
  _png(tmp_path / 'scans' / 'a.png', np.zeros((28, 28), np.uint8))
  (tmp_path / 'scans' / 'b.png').write_bytes(b'\x89PNG\r\n\x1a\n not really')
  assert run_main(predict.main, 'predict', '--workdir', trained['workdir'], '--input', str(tmp_path / 'scans'),
                  '--noflag') == 2
  (error,) = capsys.readouterr().err.strip().splitlines()
  assert error.startswith(f'error: {tmp_path}/scans/b.png: cannot be read as an image: ')
  assert error.endswith('; replace or remove it, or pass --skip_unreadable to predict the others')


def test_the_flag_names_its_fixes_when_the_training_data_has_moved(trained, tmp_path, capsys):
  workdir = linked_workdir(trained['workdir'], str(tmp_path / 'run'), data_dir=str(tmp_path / 'moved'))
  np.save(tmp_path / 'x.npy', trained['test']['image'][:2])
  assert run_main(predict.main, 'predict', '--workdir', workdir, '--input', str(tmp_path / 'x.npy')) == 2
  (error,) = capsys.readouterr().err.strip().splitlines()
  assert error.startswith('error: the flag column is fitted on the held-out slice of the training data, which cannot '
                          f'be read ({tmp_path}/moved: no such folder or .npz file')
  assert error.endswith('; give --data_dir where that data is now, or --noflag to predict without the column')


def test_a_workdir_of_one_model_over_a_mesh_is_refused(trained, tmp_path, capsys):
  workdir = linked_workdir(trained['workdir'], str(tmp_path / 'run'), backend='fsdp', model='mlp', ensemble_size=1)
  np.save(tmp_path / 'x.npy', trained['test']['image'][:2])
  assert run_main(predict.main, 'predict', '--workdir', workdir, '--input', str(tmp_path / 'x.npy')) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"error: {workdir} holds one mlp model trained with backend 'fsdp', not an ensemble; evaluate, predict and "
      'export read ensembles trained with backend pmap or jit (its test loss and accuracy per epoch are in '
      f'{workdir}/metrics.jsonl)']


def test_the_program_refuses_evaluates_flags(tmp_path):
  """evaluate's --ood, --alpha and --angles are not predict's: named, they end the program in one line."""
  result = subprocess.run([sys.executable, '-m', 'ensemble.predict', '--workdir', str(tmp_path), '--input',
                           str(tmp_path), '--ood=uniform_noise'], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "error: Unknown command line flag 'ood'; see --helpfull for the flags"], result.stderr[-2000:]


def test_cli_refuses_a_folder_that_was_never_trained(tmp_path, capsys):
  np.save(tmp_path / 'x.npy', np.zeros((1, 28, 28), np.uint8))
  with pytest.raises(SystemExit):
    _main('--workdir', str(tmp_path), '--input', str(tmp_path / 'x.npy'))
  assert capsys.readouterr().err.strip() == (f'error: {tmp_path}/config.json: missing; --workdir must name a folder '
                                             'written by python -m ensemble.train')


def test_the_program_runs_on_one_device_and_flags(trained, tmp_path):
  """`python -m ensemble.predict` as a user runs it, on 1 CPU device, batch by batch: the flag's held-out pass,
  progress lines, and the summary."""
  np.save(tmp_path / 'x.npy', trained['test']['image'])
  env = {**os.environ, 'XLA_FLAGS': COMPILE_FLAGS}
  result = subprocess.run([sys.executable, '-m', 'ensemble.predict', '--workdir', trained['workdir'], '--input',
                           str(tmp_path / 'x.npy'), '--output', str(tmp_path / 'rows.jsonl'), '--batch_size=32'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Restored epoch 1' in result.stderr and '8 members on 1 device;' in result.stderr
  assert 'Flag: entropy >' in result.stderr and 'Wrote 100 rows to' in result.stderr
  rows = _read(tmp_path / 'rows.jsonl')
  expected = trained['model'].predict(trained['test']['image'])
  assert [row['class'] for row in rows] == expected['class'].tolist()
  np.testing.assert_allclose([row['mutual_information'] for row in rows], expected['mutual_information'],
                             rtol=1e-4, atol=1e-6)
  assert {row['flag'] for row in rows} <= {0, 1}


@pytest.mark.parametrize('task', ['classification', 'regression', 'multilabel', 'quantile'])
def test_the_program_writes_the_chain_s_conformal_sets_or_intervals(task, tmp_path):
  """A saved ensemble whose chain ends in a conformal step: `python -m ensemble.predict`'s rows hold its sets (the
  classes in each, by spaces; a multi-label one's values per label) or its intervals, as `predict` gives them."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(160, 4)).astype(np.float32)
  targets = (x[:, 0] + 0.3 * rng.normal(size=160)).astype(np.float32)
  y = {'classification': ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)), 'regression': targets,
       'quantile': targets, 'multilabel': (x[:, :3] > 0).astype(np.int32)}[task]
  ens = ensemble.fit('mlp', (x[:100], y[:100]), task=task, ensemble_size=2, epochs=3, progress=False)
  saved = str(tmp_path / 'saved')
  ens = ens.conformal(x[100:140], y[100:140], alpha=0.2).save(saved)
  np.save(tmp_path / 'x.npy', x[140:])
  predict.predict_files(saved, str(tmp_path / 'x.npy'), str(tmp_path / 'rows.jsonl'), flag=False)
  with open(tmp_path / 'rows.jsonl') as f:
    rows = [json.loads(line) for line in f]
  result = ens.predict(x[140:])
  members_of = lambda held: ' '.join(map(str, np.flatnonzero(held)))
  if task == 'classification':
    assert [row['set'] for row in rows] == [members_of(held) for held in result['set']]
  elif task == 'multilabel':
    for label in range(3):
      assert [row[f'set_{label}'] for row in rows] == [members_of(held) for held in result['set'][:, label]]
  else:
    for key in ('conformal_lower', 'conformal_upper'):
      np.testing.assert_allclose([row[key] for row in rows], result[key], rtol=1e-5)
