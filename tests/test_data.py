import gzip
import os

import numpy as np
import pytest

from conftest import SHARED_MNIST, write_idx, write_mnist
from ensemble import data
from ensemble.errors import UsageError


@pytest.mark.parametrize('gz', [True, False])
def test_reads_idx_gzipped_or_not(tmp_path, gz):
  splits = data.load_idx(write_mnist(str(tmp_path), num_train=40, num_test=30, gz=gz))
  assert splits['train']['image'].shape == (40, 28, 28, 1)
  assert splits['train']['image'].dtype == np.float32
  assert 0.0 <= splits['train']['image'].min() and splits['train']['image'].max() == 1.0
  assert splits['test']['label'].shape == (30,) and splits['test']['label'].dtype == np.int32


def _corrupt(directory, name, writer):
  for f in os.listdir(directory):
    if f.startswith(name):
      os.remove(os.path.join(directory, f))
  writer(os.path.join(directory, name + '.gz'))


@pytest.mark.parametrize('name, writer, message', [
    ('train-labels-idx1-ubyte', None, 'missing file'),
    ('train-images-idx3-ubyte', lambda p: write_idx(p, np.zeros((40, 28, 28)), magic=0x0801),
     'wrong magic number 0x00000801, expected 0x00000803'),
    ('t10k-images-idx3-ubyte', lambda p: gzip.open(p, 'wb').write(
        b'\x00\x00\x08\x03' + (30).to_bytes(4, 'big') + (28).to_bytes(4, 'big') * 2 + b'\x00' * 100),
     'truncated file'),
    ('t10k-labels-idx1-ubyte', lambda p: write_idx(p, np.zeros(29)), '30 images but 29 labels'),
    ('train-images-idx3-ubyte', lambda p: write_idx(p, np.zeros((40, 32, 32))), 'wrong image size'),
    ('train-labels-idx1-ubyte', lambda p: open(p, 'wb').write(b'not gzip at all'), 'cannot be read'),
])
def test_bad_files_name_the_file_and_the_problem(tmp_path, name, writer, message):
  directory = write_mnist(str(tmp_path), num_train=40, num_test=30)
  _corrupt(directory, name, writer or (lambda p: None))
  with pytest.raises(data.DataError, match=message) as error:
    data.load_idx(directory)
  assert name in str(error.value) and '\n' not in str(error.value)
  assert isinstance(error.value, UsageError)


def test_missing_folder(tmp_path):
  with pytest.raises(data.DataError, match='not a folder'):
    data.load_idx(str(tmp_path / 'nope'))


def test_shuffle_order_is_a_function_of_seed_and_epoch():
  a = data.epoch_order(100, seed=0, epoch=1)
  assert np.array_equal(a, data.epoch_order(100, seed=0, epoch=1))
  assert not np.array_equal(a, data.epoch_order(100, seed=0, epoch=2))
  assert not np.array_equal(a, data.epoch_order(100, seed=1, epoch=1))
  assert sorted(a) == list(range(100))


def test_batch_indices_shared_and_shuffled():
  shared = data.train_batch_indices(100, 16, seed=0, epoch=1, ensemble_size=4, member_data='shared')
  assert shared.shape == (6, 16) and len(set(shared.ravel())) == 96
  shuffled = data.train_batch_indices(100, 16, seed=0, epoch=1, ensemble_size=4, member_data='shuffled')
  assert shuffled.shape == (6, 4, 16)
  assert not np.array_equal(shuffled[:, 0], shuffled[:, 1])
  # Member i's order does not depend on how many members there are.
  eight = data.train_batch_indices(100, 16, seed=0, epoch=1, ensemble_size=8, member_data='shuffled')
  assert np.array_equal(eight[:, :4], shuffled)


def test_eval_batches_cover_each_example_once():
  split = {'image': np.arange(10, dtype=np.float32), 'label': np.arange(10)}
  seen = [label[mask] for _, label, mask in data.eval_batches(split, 4)]
  assert np.array_equal(np.concatenate(seen), np.arange(10))


def test_tfds_path_under_mock_data():
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=24):
    splits = data.load_tfds()
  assert splits['train']['image'].shape == (24, 28, 28, 1)
  assert splits['train']['image'].dtype == np.float32 and splits['train']['image'].max() <= 1.0
  assert splits['test']['label'].shape == (24,)


def test_tfds_offline_says_how_to_use_idx_files(monkeypatch, tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path))
  monkeypatch.setattr(tfds.core.constants, 'DATA_DIR', str(tmp_path), raising=False)
  monkeypatch.setattr(data, '_reachable', lambda url: False)
  with pytest.raises(data.DataError, match='cannot be reached.*--config.data_dir'):
    data.load(None)


@pytest.mark.skipif(not os.path.isdir(SHARED_MNIST), reason='../shared/mnist is not present')
def test_real_mnist_from_shared():
  splits = data.load_idx(SHARED_MNIST)
  assert splits['train']['image'].shape == (60000, 28, 28, 1)
  assert splits['test']['image'].shape == (10000, 28, 28, 1)
  assert np.bincount(splits['test']['label']).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
