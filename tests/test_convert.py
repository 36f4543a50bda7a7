"""`python -m ensemble.data.convert` and the ArrayRecord folders it writes: every input kind round-trips to the
Dataset its own loader gives, training reads a folder by --config.data_dir alone, and bad files are one line."""

import json
import logging
import os

import numpy as np
import pytest

from conftest import run_main, small_config, synthetic_mnist, write_mnist
from ensemble import data, trainer
from ensemble.data import array_record, convert

convert.define_flags()


def _assert_same(got: data.Dataset, expected: data.Dataset):
  assert (got.num_classes, got.inputs, got.task) == (expected.num_classes, expected.inputs, expected.task)
  for split in ('train', 'test'):
    for key in ('image', 'label'):
      a, b = getattr(got, split)[key], getattr(expected, split)[key]
      assert a.dtype == b.dtype and a.shape == b.shape, (split, key, a.dtype, b.dtype, a.shape, b.shape)
      np.testing.assert_array_equal(a, b, err_msg=f'{split} {key}')


def _info(folder) -> dict:
  with open(os.path.join(folder, array_record.INFO), encoding='utf-8') as f:
    return json.load(f)


@pytest.fixture
def converted(tmp_path):
  """A 64 / 32 IDX folder converted 20 examples a file: several files per split, the last one short."""
  source = write_mnist(str(tmp_path / 'mnist'), 64, 32)
  output = str(tmp_path / 'out')
  convert.convert(source, output, examples_per_file=20)
  return source, output


def test_an_idx_folder_round_trips_across_several_files(converted):
  source, output = converted
  _assert_same(data.load(data_dir=output), data.load(data_dir=source))
  info = _info(output)
  assert [f['name'] for f in info['splits']['train']['files']] == [
      f'train-0000{i}-of-00004.array_record' for i in range(4)]
  assert [f['examples'] for f in info['splits']['train']['files']] == [20, 20, 20, 4]
  assert (info['task'], info['inputs'], info['num_classes']) == ('classification', 'images', 10)
  assert info['image'] == {'shape': [28, 28, 1], 'dtype': '|u1'} and info['label'] == {'shape': [], 'dtype': '<i4'}
  assert data.load(data_dir=output).source == f'{output} (ArrayRecord)'


def test_an_npz_of_colour_images_round_trips(tmp_path):
  rng = np.random.default_rng(0)
  x, x_test = rng.random((40, 6, 6, 3)), rng.random((12, 6, 6, 3))  # floats in [0, 1]: become uint8
  y, y_test = rng.integers(0, 4, 40), rng.integers(0, 3, 12)
  np.savez(tmp_path / 'colour.npz', x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  convert.convert(str(tmp_path / 'colour.npz'), str(tmp_path / 'out'))
  _assert_same(data.load(data_dir=str(tmp_path / 'out')), data.load(data_dir=str(tmp_path / 'colour.npz')))
  assert _info(tmp_path / 'out')['image']['shape'] == [6, 6, 3]


def test_an_npz_with_float_targets_converts_as_regression(tmp_path):
  rng = np.random.default_rng(1)
  x, x_test = rng.normal(size=(30, 5)).astype(np.float32), rng.normal(size=(10, 5)).astype(np.float32)
  y, y_test = rng.normal(size=(30, 2)), rng.normal(size=(10, 2))  # float64 targets stay float64
  np.savez(tmp_path / 'reg.npz', x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  output = str(tmp_path / 'out')
  convert.convert(str(tmp_path / 'reg.npz'), output)  # no --task: float y_train says regression
  got = data.load(data_dir=output, task='regression')
  _assert_same(got, data.load(data_dir=str(tmp_path / 'reg.npz'), task='regression'))
  assert got.train['label'].dtype == np.float64 and got.num_classes == 2
  info = _info(output)
  assert (info['task'], info['inputs'], info['num_targets'], info['label']) == (
      'regression', 'features', 2, {'shape': [2], 'dtype': '<f8'})
  # The default task reads it no further than dataset.json, and says what to set.
  with pytest.raises(data.DataError, match='holds regression data .* set --config.task=regression') as e:
    data.load(data_dir=output)
  assert len(str(e.value).splitlines()) == 1


def test_a_csv_with_a_target_round_trips_with_its_split(tmp_path):
  rows = ['a,b,y'] + [f'{i},{i * i % 7},{0.5 * i:.2f}' for i in range(20)]
  (tmp_path / 'table.csv').write_text('\n'.join(rows) + '\n')
  output = str(tmp_path / 'out')
  convert.convert(str(tmp_path / 'table.csv'), output, target='y')
  _assert_same(data.load(data_dir=output, task='regression'),
               data.load(data_dir=str(tmp_path / 'table.csv'), task='regression', target='y'))
  assert _info(output)['targets'] == ['y'] and _info(output)['splits']['test']['examples'] == 4


def _png(path, array):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(array).save(path)


def test_a_folder_of_pngs_in_class_folders_round_trips(tmp_path):
  rng = np.random.default_rng(2)
  expected = {'train': ([], []), 'test': ([], [])}
  for split, count in (('train', 3), ('test', 2)):
    for label, name in enumerate(('cat', 'dog')):
      for i in range(count):
        image = rng.integers(0, 256, (5, 7), dtype=np.uint8)
        _png(str(tmp_path / 'pets' / split / name / f'{i}.png'), image)
        expected[split][0].append(image[..., None])
        expected[split][1].append(label)
  output = str(tmp_path / 'out')
  convert.convert(str(tmp_path / 'pets'), output)
  got = data.load(data_dir=output)
  for split, (images, labels) in expected.items():
    np.testing.assert_array_equal(getattr(got, split)['image'], np.stack(images))
    np.testing.assert_array_equal(getattr(got, split)['label'], np.array(labels, np.int32))
  assert got.num_classes == 2 and _info(output)['class_names'] == ['cat', 'dog']
  assert _info(output)['image'] == {'shape': [5, 7, 1], 'dtype': '|u1'}


def test_the_cli_writes_the_folder_and_logs_a_line(tmp_path, caplog):
  source = write_mnist(str(tmp_path / 'mnist'), 32, 16)
  output = str(tmp_path / 'out')
  with caplog.at_level(logging.INFO, logger='absl'):  # whatever verbosity an earlier program's flags left
    assert run_main(convert.main, 'convert', f'--input={source}', f'--output={output}', '--verbosity=0') == 0
  _assert_same(data.load(data_dir=output), data.load(data_dir=source))
  assert f'Wrote {output}: train 32, test 16 examples (10 classes, images 28x28x1)' in caplog.text
  assert [name for name in os.listdir(tmp_path) if name.endswith('.partial')] == []


@pytest.mark.parametrize('task', ['classification', 'regression'])
def test_training_reads_a_converted_folder_by_data_dir(tmp_path, task):
  output = str(tmp_path / 'out')
  if task == 'classification':
    convert.convert(write_mnist(str(tmp_path / 'mnist'), 64, 32), output)
    config = small_config(output, ensemble_size=2, num_devices=2)
  else:
    rng = np.random.default_rng(3)
    x, x_test = rng.normal(size=(64, 3)).astype(np.float32), rng.normal(size=(32, 3)).astype(np.float32)
    np.savez(tmp_path / 'reg.npz', x_train=x, y_train=x.sum(1), x_test=x_test, y_test=x_test.sum(1))
    convert.convert(str(tmp_path / 'reg.npz'), output)
    config = small_config(output, ensemble_size=2, num_devices=2, task='regression', model='user_models:Regressor',
                          augment='none')
  _, summary = trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert np.isfinite(summary['test_loss'])
  with open(tmp_path / 'run' / 'config.json', encoding='utf-8') as f:
    assert json.load(f)['data_dir'] == output


def _one_error_line(capsys) -> str:
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), lines
  return lines[0]


def test_an_unreadable_input_is_one_line(tmp_path, capsys):
  assert run_main(convert.main, 'convert', f'--input={tmp_path / "nothing"}', f'--output={tmp_path / "a"}') == 2
  assert 'no such file or folder' in _one_error_line(capsys)
  (tmp_path / 'broken.npz').write_bytes(b'not a zip file')
  assert run_main(convert.main, 'convert', f'--input={tmp_path / "broken.npz"}', f'--output={tmp_path / "b"}') == 2
  assert 'broken.npz: cannot be read as .npz' in _one_error_line(capsys)
  assert sorted(os.listdir(tmp_path)) == ['broken.npz']  # nothing written, no partial folder left


def test_an_existing_output_folder_is_refused_and_left_as_it_was(tmp_path, capsys):
  source = write_mnist(str(tmp_path / 'mnist'), 32, 16)
  (tmp_path / 'out').mkdir()
  (tmp_path / 'out' / 'mine.txt').write_text('keep')
  assert run_main(convert.main, 'convert', f'--input={source}', f'--output={tmp_path / "out"}') == 2
  assert 'already exists' in _one_error_line(capsys)
  assert os.listdir(tmp_path / 'out') == ['mine.txt'] and (tmp_path / 'out' / 'mine.txt').read_text() == 'keep'


def test_an_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
  source = write_mnist(str(tmp_path / 'mnist'), 32, 16)

  def interrupt(*_):
    raise KeyboardInterrupt
  monkeypatch.setattr(convert.files, 'write_atomically', interrupt)  # after every record, before dataset.json
  with pytest.raises(KeyboardInterrupt):
    convert.convert(source, str(tmp_path / 'out'))
  assert sorted(os.listdir(tmp_path)) == ['mnist']


def _load_error(folder: str) -> str:
  with pytest.raises(data.DataError) as e:
    data.load(data_dir=folder)
  assert len(str(e.value).splitlines()) == 1
  assert 'python -m ensemble.data.convert' in str(e.value)
  return str(e.value)


@pytest.mark.parametrize('keep', [0.5, 0.0])
def test_a_truncated_file_is_one_line_naming_it(converted, keep):
  _, output = converted
  path = os.path.join(output, 'train-00001-of-00004.array_record')
  raw = open(path, 'rb').read()
  with open(path, 'wb') as f:
    f.write(raw[:int(len(raw) * keep)])
  assert _load_error(output).startswith(f'{path}: cut short or damaged')


def test_a_file_of_too_few_records_is_one_line_naming_it(converted):
  _, output = converted
  path = os.path.join(output, 'train-00001-of-00004.array_record')
  os.replace(os.path.join(output, 'train-00003-of-00004.array_record'), path)  # intact, but 4 records of 20
  assert _load_error(output).startswith(f'{path}: cut short or damaged: dataset.json lists 20 records but the file '
                                        'has 4')


def test_a_missing_file_is_one_line_naming_it(converted):
  _, output = converted
  path = os.path.join(output, 'test-00001-of-00002.array_record')
  os.remove(path)
  assert _load_error(output).startswith(f'{path}: missing')


def test_a_record_of_the_wrong_length_is_one_line_naming_it(converted):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  _, output = converted
  path = os.path.join(output, 'test-00001-of-00002.array_record')
  os.remove(path)
  writer = array_record_module.ArrayRecordWriter(path, array_record.WRITER_OPTIONS)
  (images, labels), _ = synthetic_mnist(12, 1)
  for i in range(12):  # as many records as dataset.json lists; the third one a pixel short
    image = images[i].tobytes()[:-1] if i == 2 else images[i].tobytes()
    writer.write(image + np.int32(labels[i]).tobytes())
  writer.close()
  assert _load_error(output).startswith(f'{path}: record 2 holds 787 bytes but dataset.json describes 788')


@pytest.mark.parametrize('text', ['{"format": "ensemble.array_record", ', '[]', '{"format": "other"}'])
def test_a_corrupt_dataset_json_is_one_line_naming_it(converted, text):
  _, output = converted
  with open(os.path.join(output, array_record.INFO), 'w', encoding='utf-8') as f:
    f.write(text)
  assert _load_error(output).startswith(f'{os.path.join(output, array_record.INFO)}: cannot be read')
