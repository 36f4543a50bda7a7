import functools
import gzip
import hashlib
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

from conftest import COMPILE_FLAGS, SHARED_MNIST, python_module, write_idx, write_mnist
from ensemble import data
from ensemble.data import base, bundled, idx
from ensemble.errors import EnsembleWarning, UsageError


def _expect_error(message, *args, **kwargs) -> str:
  """Loads, expecting a one-line DataError that matches `message`; returns the message."""
  with pytest.raises(data.DataError, match=message) as error:
    data.load(*args, **kwargs)
  assert isinstance(error.value, UsageError) and '\n' not in str(error.value)
  return str(error.value)


# IDX folders.

@pytest.mark.parametrize('gz', [True, False])
def test_reads_idx_gzipped_or_not_as_uint8(tmp_path, gz):
  directory = write_mnist(str(tmp_path), num_train=40, num_test=30, gz=gz)
  dataset = data.load(data_dir=directory)
  train_images = gzip.open if gz else open
  with train_images(os.path.join(directory, 'train-images-idx3-ubyte' + ('.gz' if gz else '')), 'rb') as f:
    written = np.frombuffer(f.read()[16:], np.uint8).reshape(40, 28, 28, 1)
  assert dataset.train['image'].dtype == np.uint8 and np.array_equal(dataset.train['image'], written)
  assert dataset.test['image'].shape == (30, 28, 28, 1) and dataset.image_shape == (28, 28, 1)
  assert dataset.test['label'].shape == (30,) and dataset.test['label'].dtype == np.int32
  assert dataset.num_classes == dataset.train['label'].max() + 1
  assert dataset.source == f'{directory} (IDX)'


def _write_idx_dataset(directory, train, test):
  os.makedirs(directory, exist_ok=True)
  for prefix, (images, labels) in (('train', train), ('t10k', test)):
    write_idx(os.path.join(directory, f'{prefix}-images-idx3-ubyte.gz'), images)
    write_idx(os.path.join(directory, f'{prefix}-labels-idx1-ubyte.gz'), labels)
  return directory


def test_idx_of_any_image_size(tmp_path):
  rng = np.random.default_rng(0)
  train = rng.integers(0, 256, (12, 20, 24), dtype=np.uint8), np.arange(12) % 5
  test = rng.integers(0, 256, (7, 20, 24), dtype=np.uint8), np.arange(7) % 3
  dataset = data.load(data_dir=_write_idx_dataset(str(tmp_path / 'idx'), train, test))
  assert dataset.image_shape == (20, 24, 1) and dataset.num_classes == 5
  assert np.array_equal(dataset.train['image'][..., 0], train[0])
  assert np.array_equal(dataset.test['label'], test[1])


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
    ('train-images-idx3-ubyte', lambda p: write_idx(p, np.zeros((40, 32, 32))),
     'holds 32x32x1 images but .* holds 28x28x1; train and test images must have the same shape'),
    ('t10k-labels-idx1-ubyte', lambda p: write_idx(p, np.full(30, 10)), r'label 10 is outside 0\.\.9'),
    ('train-labels-idx1-ubyte', lambda p: open(p, 'wb').write(b'not gzip at all'), 'cannot be read'),
])
def test_bad_idx_files_name_the_file_and_the_problem(tmp_path, name, writer, message):
  directory = write_mnist(str(tmp_path), num_train=40, num_test=30)
  _corrupt(directory, name, writer or (lambda p: None))
  assert name in _expect_error(message, data_dir=directory)


def test_data_dir_that_is_neither_a_folder_nor_an_npz(tmp_path):
  _expect_error('.*nope: no such folder or .npz file', data_dir=str(tmp_path / 'nope'))
  (tmp_path / 'images.csv').write_text('1,2,3')
  assert 'images.csv' in _expect_error('neither a folder nor a .npz file', data_dir=str(tmp_path / 'images.csv'))


def test_split_names_are_refused_with_data_dir(mnist_dir):
  _expect_error(r'train\[:90%\].*tensorflow-datasets only', data_dir=mnist_dir, train_split='train[:90%]')


# .npz files.

def _npz(path, **arrays):
  rng = np.random.default_rng(1)
  defaults = {'x_train': rng.integers(0, 256, (10, 6, 5), dtype=np.uint8), 'y_train': np.arange(10) % 4,
              'x_test': rng.integers(0, 256, (8, 6, 5), dtype=np.uint8), 'y_test': np.arange(8) % 4}
  arrays = {k: v for k, v in {**defaults, **arrays}.items() if v is not None}
  np.savez(path, **arrays)
  return str(path)


@pytest.mark.parametrize('layout', ['uint8 HxW', 'uint8 HxWxC', 'float32 in [0, 1]', 'float64 in [0, 1]'])
def test_npz_images_and_labels(tmp_path, layout):
  rng = np.random.default_rng(2)
  channels = 1 if layout == 'uint8 HxW' else 3
  train = rng.integers(0, 256, (10, 6, 5, channels), dtype=np.uint8)
  test = rng.integers(0, 256, (8, 6, 5, channels), dtype=np.uint8)
  stored = {
      'uint8 HxW': lambda x: x[..., 0],
      'uint8 HxWxC': lambda x: x,
      'float32 in [0, 1]': lambda x: x.astype(np.float32) / 255,
      'float64 in [0, 1]': lambda x: x / 255.0,
  }[layout]
  # Labels as Keras's CIFAR arrays come: int64 (N, 1).
  path = _npz(tmp_path / 'd.npz', x_train=stored(train), x_test=stored(test),
              y_train=(np.arange(10) % 7)[:, None].astype(np.int64))
  dataset = data.load(data_dir=path)
  if layout.startswith('uint8'):
    assert dataset.train['image'].dtype == np.uint8 and dataset.test['image'].dtype == np.uint8
    assert np.array_equal(dataset.train['image'], train) and np.array_equal(dataset.test['image'], test)
  else:  # float images keep their precision, as float32
    assert dataset.train['image'].dtype == np.float32 and dataset.test['image'].dtype == np.float32
    np.testing.assert_array_equal(dataset.train['image'], (train / 255.0).astype(np.float32))
  assert dataset.image_shape == (6, 5, channels) and dataset.num_classes == 7
  assert dataset.train['label'].dtype == np.int32 and np.array_equal(dataset.train['label'], np.arange(10) % 7)
  assert dataset.source == path


def test_float_images_keep_their_precision_and_their_statistics():
  """A float image is not rounded to 8 bits (a class that lives below one 8-bit step would be lost): float32 on
  the host, and the per-channel statistics of its own values."""
  x = np.linspace(0, 1, 10 * 30).reshape(10, 6, 5)
  images = base.as_images(x, 'x')
  assert images.dtype == np.float32 and images.shape == (10, 6, 5, 1)
  np.testing.assert_array_equal(images[..., 0], x.astype(np.float32))
  mean, std = data.channel_stats(images)
  np.testing.assert_allclose(mean, [x.mean()], rtol=1e-6)
  np.testing.assert_allclose(std, [x.std()], rtol=1e-5)


@pytest.mark.parametrize('arrays, message', [
    ({'y_test': None}, r'no array y_test \(it holds x_train, y_train, x_test\)'),
    ({'y_train': np.arange(9) % 4}, r'x_train / .*y_train: 10 images but 9 labels'),
    ({'y_train': np.arange(10) - 1}, 'y_train: negative label -1'),
    # C from the training labels: a test label above the largest has no output.
    ({'y_test': np.arange(8) % 5}, r'y_test: label 4 is outside 0\.\.3 \(C = the largest training label \+ 1\); '
                                   'labels must be class indices 0..C-1, and the largest class must appear in '
                                   'training$'),
    ({'y_train': np.arange(10) % 4 + 0.0}, 'y_train: labels of dtype float64, expected integers'),
    ({'y_train': np.eye(4)[np.arange(10) % 4]}, r'y_train: labels of shape \(10, 4\)'),
    ({'x_train': np.full((10, 6, 5), 255.0)}, r'x_train: float images must lie in \[0, 1\] but span \[255, 255\]'),
    ({'x_test': np.full((8, 6, 5), -0.5)}, r'x_test: float images must lie in \[0, 1\]'),
    ({'x_test': np.full((8, 6, 5), np.nan)}, 'x_test: float images contain NaN'),
    ({'x_train': np.zeros((10, 6, 5), np.int64)}, 'x_train: images of dtype int64'),
    ({'x_test': np.zeros((8, 5, 6), np.uint8)}, 'x_train holds 6x5x1 images but .*x_test holds 5x6x1'),
    ({'x_train': np.zeros((10, 6, 5, 3, 1), np.uint8)}, 'x_train: .* each example must be 2-D or 3-D'),
    ({'x_test': np.zeros((8, 30), np.uint8)}, 'x_test: .* each example must be 2-D or 3-D'),
    ({'x_train': np.zeros((10, 3, 6, 5), np.uint8)}, 'x_train: shape .* looks channels-first'),
    ({'x_test': np.zeros((0, 6, 5), np.uint8), 'y_test': np.zeros(0, np.int64)}, 'x_test: no examples'),
])
def test_bad_npz_names_the_array_and_the_fix(tmp_path, arrays, message):
  path = _npz(tmp_path / 'bad.npz', **arrays)
  assert path in _expect_error(message, data_dir=path)


def test_npz_that_cannot_be_read(tmp_path):
  _expect_error('no such file', data_dir=str(tmp_path / 'absent.npz'))
  (tmp_path / 'text.npz').write_text('not a zip')
  _expect_error('cannot be read as .npz', data_dir=str(tmp_path / 'text.npz'))
  # Object arrays need pickle, which a data file must not get to run.
  path = _npz(tmp_path / 'objects.npz', y_train=np.array([1, 'a', None] * 3 + [2], dtype=object))
  _expect_error('cannot be read as .npz.*allow_pickle', data_dir=path)


# The bundled MNIST.

# The official MD5s of the four uncompressed files, as published with MNIST (and in ../shared/mnist/README.md).
OFFICIAL_MNIST_MD5 = {
    'train-images-idx3-ubyte': '6bbc9ace898e44ae57da46a324031adb',
    'train-labels-idx1-ubyte': 'a25bea736e30d166cdddb491f175f624',
    't10k-images-idx3-ubyte': '2646ac647ad5339dbf082846283269ea',
    't10k-labels-idx1-ubyte': '27ae3e4e09519cfbb04c329615203637',
}


@pytest.fixture(scope='module')
def bundled_mnist():
  return data.load('mnist')


def test_bundled_mnist_files_are_the_official_ones():
  directory = bundled.DATASETS['mnist']
  assert sorted(f for f in os.listdir(directory) if f.endswith('.gz')) == sorted(f + '.gz' for f in OFFICIAL_MNIST_MD5)
  for name, md5 in OFFICIAL_MNIST_MD5.items():
    with gzip.open(os.path.join(directory, name + '.gz'), 'rb') as f:
      assert hashlib.md5(f.read()).hexdigest() == md5, name
  credit = open(os.path.join(directory, 'README.md')).read()
  assert all(author in credit for author in ('Yann LeCun', 'Corinna Cortes', 'Christopher J. C. Burges'))
  assert 'CC BY-SA 3.0' in credit


def test_default_dataset_is_the_bundled_mnist(bundled_mnist):
  dataset = bundled_mnist
  assert dataset.source.startswith('mnist (bundled copy') and dataset.num_classes == 10
  assert dataset.train['image'].shape == (60000, 28, 28, 1) and dataset.test['image'].shape == (10000, 28, 28, 1)
  # The class counts of the official files (TFDS's mnist holds the same examples, in another order).
  assert np.bincount(dataset.train['label']).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
  assert np.bincount(dataset.test['label']).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
  assert data.load().source == dataset.source  # load()'s defaults name it too


@pytest.mark.skipif(not os.path.isdir(SHARED_MNIST), reason='../shared/mnist is not present')
def test_bundled_mnist_equals_the_shared_copy(bundled_mnist):
  shared = data.load(data_dir=SHARED_MNIST)
  for split in ('train', 'test'):
    for key in ('image', 'label'):
      assert np.array_equal(getattr(bundled_mnist, split)[key], getattr(shared, split)[key])


def test_bundled_mnist_loads_without_tensorflow():
  code = ("import sys; from ensemble import data; dataset = data.load('mnist', ''); "
          "assert 'bundled' in dataset.source, dataset.source; "
          "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tensorflow_datasets')); "
          "assert not loaded, loaded")
  result = subprocess.run([sys.executable, '-c', code], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]


def test_the_core_install_trains_without_tensorflow(tmp_path):
  """`pip install -e .` has no TensorFlow: with it hidden, the bundled MNIST, IDX, .npz and .csv data load, `fit`
  trains, and `python -m ensemble.train` trains and writes its TensorBoard events (tensorboard's protobufs)."""
  mnist = write_mnist(str(tmp_path / 'mnist'), num_train=64, num_test=16)
  np.savez(tmp_path / 'x.npz', x_train=np.zeros((4, 8, 8), np.uint8), y_train=np.arange(4), x_test=np.zeros((2, 8, 8),
           np.uint8), y_test=np.arange(2))
  (tmp_path / 't.csv').write_text('a,b,y\n' + ''.join(f'{i},{i % 3},{2 * i}\n' for i in range(20)))
  hide = "import sys; sys.modules['tensorflow'] = None"  # import tensorflow raises ImportError, as uninstalled
  library = f"""
import numpy as np
import ensemble
from ensemble import data
assert 'bundled' in data.load('mnist').source
data.load(data_dir={str(tmp_path / 'x.npz')!r}); data.load(task='regression', data_dir={str(tmp_path / 't.csv')!r},
                                                      target='y')
x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
ens = ensemble.fit('mlp', (x, x[:, 0]), task='regression', ensemble_size=2, epochs=1, batch_size=16, progress=False)
assert ens.predict(x[:4])['mean'].shape == (4,) and sys.modules['tensorflow'] is None
"""
  train = python_module('ensemble.train', f'--workdir={tmp_path / "run"}', '--config=configs/default.py',
                        f'--config.data_dir={mnist}', '--config.num_epochs=1', '--config.batch_size=16',
                        '--config.ensemble_size=2', first=hide)
  for command in ([sys.executable, '-c', f'{hide}; {library}'], train):
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS})
    assert result.returncode == 0, result.stderr[-3000:]
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(tmp_path / 'run'))


def test_bundled_mnist_missing_a_file_names_the_fix(tmp_path, monkeypatch):
  write_mnist(str(tmp_path), num_train=8, num_test=8)
  os.remove(tmp_path / 't10k-labels-idx1-ubyte.gz')
  monkeypatch.setitem(bundled.DATASETS, 'mnist', str(tmp_path))
  _expect_error('the bundled mnist copy lacks t10k-labels-idx1-ubyte.gz .*reinstall the package', 'mnist')


# tensorflow-datasets.

# 'mnist' with the default splits is the bundled copy (below): these use other names to reach tensorflow-datasets.
@pytest.mark.parametrize('name, image_shape', [('fashion_mnist', (28, 28, 1)), ('cifar10', (32, 32, 3))])
def test_tfds_under_mock_data(name, image_shape):
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=24):
    dataset = data.load(name)
  assert dataset.train['image'].shape == (24, *image_shape) and dataset.test['image'].shape == (24, *image_shape)
  assert dataset.train['image'].dtype == np.uint8 and dataset.image_shape == image_shape
  assert dataset.train['label'].dtype == np.int32 and dataset.test['label'].shape == (24,)
  assert dataset.num_classes == 10 and dataset.source == f'tfds {name}'


def test_tfds_reads_through_data_source_without_tensorflow(monkeypatch):
  """Without TensorFlow a tfds dataset is read by `tfds.data_source` (random access to ArrayRecord files)."""
  tfds = pytest.importorskip('tensorflow_datasets')
  monkeypatch.setattr(data.tfds, 'has_tensorflow', lambda: False)
  with tfds.testing.mock_data(num_examples=24):
    dataset = data.load('cifar10')
  assert dataset.train['image'].shape == (24, 32, 32, 3) and dataset.train['image'].dtype == np.uint8
  assert dataset.test['label'].shape == (24,) and dataset.num_classes == 10 and dataset.source == 'tfds cifar10'


@functools.cache
def _tiny_builder_class():
  """A real (not mocked) dataset, prepared from memory: tfds knows its splits, as for a downloaded one."""
  tfds = pytest.importorskip('tensorflow_datasets')

  class EnsembleTinyImages(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          'image': tfds.features.Image(shape=(6, 5, 3)), 'label': tfds.features.ClassLabel(num_classes=4)}))

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples(12), 'test': self._generate_examples(8)}

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {'image': np.full((6, 5, 3), 10 * i, np.uint8), 'label': i % 3}

  return EnsembleTinyImages


@pytest.fixture(scope='module')
def tiny_tfds_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('tfds'))
  _tiny_builder_class()(data_dir=directory).download_and_prepare()
  return directory


@pytest.fixture
def tiny_tfds(tiny_tfds_dir, monkeypatch):
  tfds = pytest.importorskip('tensorflow_datasets')
  monkeypatch.setattr(tfds.core.constants, 'DATA_DIR', tiny_tfds_dir)
  return 'ensemble_tiny_images'


def test_tfds_prepared_as_array_record_streams_what_it_reads_whole(tiny_tfds, tmp_path, monkeypatch):
  """Streamed through tfds.data_source, a batch of rows at a time; a dataset of TFRecord files cannot be."""
  tfds = pytest.importorskip('tensorflow_datasets')
  _expect_error(r'^streaming=always: tfds ensemble_tiny_images, prepared as tfrecord files, is read whole',
                tiny_tfds, streaming='always')
  array_record = str(tmp_path / 'array_record')
  _tiny_builder_class()(data_dir=array_record, file_format='array_record').download_and_prepare()
  monkeypatch.setattr(tfds.core.constants, 'DATA_DIR', array_record)
  whole, streamed = (data.load(tiny_tfds, streaming=streaming) for streaming in ('never', 'always'))
  assert data.stream.is_streamed(streamed.train) and streamed.source == 'tfds ensemble_tiny_images, streamed'
  assert streamed.num_classes == whole.num_classes == 4 and streamed.image_shape == whole.image_shape
  for split in ('train', 'test'):
    rows = np.arange(len(getattr(whole, split)['label']))[::-1]
    images, labels = getattr(streamed, split).take(rows)
    np.testing.assert_array_equal(images, getattr(whole, split)['image'][rows])
    np.testing.assert_array_equal(labels, getattr(whole, split)['label'][rows])
    assert labels.dtype == np.int32


def test_tfds_prepared_as_array_record_reads_the_same_without_tensorflow(tiny_tfds, tmp_path, monkeypatch):
  """The same dataset prepared as ArrayRecord reads, without TensorFlow, what tf.data reads from its TFRecords; a
  dataset that needs TensorFlow (to prepare it, or TFRecord files) is one line naming the extra."""
  tfds = pytest.importorskip('tensorflow_datasets')
  with_tensorflow = data.load(tiny_tfds, train_split='train[:50%]')
  monkeypatch.setattr(data.tfds, 'has_tensorflow', lambda: False)
  _expect_error(r"^tfds ensemble_tiny_images: reading its tfrecord files needs TensorFlow, which this install has "
                r"not: pip install -e '\.\[tfds\]'", tiny_tfds)
  array_record = str(tmp_path / 'array_record')
  _tiny_builder_class()(data_dir=array_record, file_format='array_record').download_and_prepare()
  monkeypatch.setattr(tfds.core.constants, 'DATA_DIR', array_record)
  without = data.load(tiny_tfds, train_split='train[:50%]')
  for split in ('train', 'test'):
    for key in ('image', 'label'):
      assert np.array_equal(getattr(without, split)[key], getattr(with_tensorflow, split)[key])
  monkeypatch.setattr(tfds.core.constants, 'DATA_DIR', str(tmp_path / 'empty'))
  _expect_error('^tfds ensemble_tiny_images: downloading and preparing it .* needs TensorFlow', tiny_tfds)


def test_tfds_prepared_dataset_with_sliced_splits(tiny_tfds):
  dataset = data.load(tiny_tfds, train_split='train[:50%]', test_split='test+train[:2]')
  assert dataset.train['image'].shape == (6, 6, 5, 3) and dataset.test['image'].shape == (10, 6, 5, 3)
  assert dataset.num_classes == 4  # from the features: label 3 never occurs
  assert dataset.source == 'tfds ensemble_tiny_images (train[:50%], test+train[:2])'
  whole = data.load(tiny_tfds)
  assert sorted(whole.train['image'][:, 0, 0, 0]) == [10 * i for i in range(12)]
  assert np.array_equal(whole.train['label'], whole.train['image'][:, 0, 0, 0] // 10 % 3)


@pytest.mark.parametrize('splits, message', [
    ({'train_split': 'tst'}, "--config.train_split=tst: not a split of ensemble_tiny_images .*splits are train, test"),
    ({'test_split': 'test[:0]'}, r'--config.test_split=test\[:0\]: selects no examples'),
    ({'train_split': 'train[:x]'}, r'--config.train_split=train\[:x\]: not a split'),
])
def test_tfds_bad_split_lists_the_splits(tiny_tfds, splits, message):
  _expect_error(message, tiny_tfds, **splits)


@pytest.mark.parametrize('name, message', [
    ('cifar1', r'--config.dataset=cifar1: no such tensorflow-datasets dataset \(did you mean cifar10.*data_dir'),
    ('imdb_reviews', 'not an image-classification dataset .*features: label, text'),
    ('tf_flowers', r'images of shape \(None, None, 3\), not one fixed'),
    ('emnist/nope', 'emnist/nope: tensorflow-datasets cannot build it'),
])
def test_tfds_unknown_or_unsuitable_dataset(name, message):
  pytest.importorskip('tensorflow_datasets')
  _expect_error(message, name)


@pytest.fixture
def empty_tfds_dir(monkeypatch, tmp_path):
  tfds = pytest.importorskip('tensorflow_datasets')
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path))
  monkeypatch.setattr(tfds.core.constants, 'DATA_DIR', str(tmp_path))
  return tfds


@pytest.mark.parametrize('name, splits, host', [
    ('cifar10', {}, 'www.cs.toronto.edu'),
    ('fashion_mnist', {}, 'fashion-mnist.s3-website.eu-central-1.amazonaws.com'),
    ('mnist', {'train_split': 'train[:50%]'}, 'storage.googleapis.com'),  # a slice: tfds's mnist, not the bundled
])
def test_tfds_offline_fails_fast_with_the_data_dir_hint(empty_tfds_dir, monkeypatch, name, splits, host):
  probed = []

  def unreachable(host, port):
    probed.append(host)
    return False
  monkeypatch.setattr(data.tfds, '_reachable', unreachable)
  monkeypatch.setattr(empty_tfds_dir.core.DatasetBuilder, 'download_and_prepare',
                      lambda *a, **k: pytest.fail('tried to download offline'))
  message = _expect_error(f'tfds {name}: not prepared .* {host} cannot be reached.*--config.data_dir', name, **splits)
  assert probed == [host] and 'tfds build' in message


def test_tfds_failed_download_is_one_line(empty_tfds_dir, monkeypatch):
  monkeypatch.setattr(data.tfds, '_reachable', lambda host, port: True)

  def fail(*args, **kwargs):
    raise OSError('connection reset\nand a long traceback-like tail')
  monkeypatch.setattr(empty_tfds_dir.core.DatasetBuilder, 'download_and_prepare', fail)
  _expect_error(r'tfds cifar10: download and preparation failed \(OSError: connection reset\);.*--config.data_dir',
                'cifar10')


def test_tfds_not_installed_is_one_line(monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)  # `import` raises ImportError
  _expect_error("dataset 'cifar10' is read with tensorflow-datasets, which does not import here .*pip install "
                'tensorflow-datasets, or give a folder of IDX files or an .npz file as data_dir', 'cifar10')


# channel_stats and the Dataset contract.

@pytest.mark.parametrize('channels', [1, 3])
def test_channel_stats_match_numpy(monkeypatch, channels):
  monkeypatch.setattr(data, '_STATS_CHUNK_BYTES', 100)  # several chunks
  images = np.random.default_rng(3).integers(0, 256, (7, 4, 5, channels), dtype=np.uint8)
  mean, std = data.channel_stats(images)
  x = images / 255.0
  assert len(mean) == len(std) == channels
  np.testing.assert_allclose(mean, x.mean(axis=(0, 1, 2)), rtol=1e-12)
  np.testing.assert_allclose(std, x.std(axis=(0, 1, 2)), rtol=1e-12)
  with pytest.raises(ValueError, match='uint8'):
    data.channel_stats(x)


def test_blank_images_train_rather_than_diverge():
  """A channel of one value has a standard deviation of 0, which made every standardised input NaN and the run
  'diverge' at its first step (lower the learning rate, it said): its scale is 1, as a constant feature's."""
  images = np.zeros((32, 4, 4, 2), np.uint8)
  images[..., 1] = np.random.default_rng(0).integers(0, 256, (32, 4, 4))
  assert data.channel_stats(images)[1][0] == 1.0
  import ensemble  # pylint: disable=g-import-not-at-top
  ens = ensemble.fit('cnn', (images, np.arange(32) % 2), ensemble_size=2, epochs=1, batch_size=8, progress=False)
  assert np.isfinite(ens.summary['train_loss'])


def test_dataset_takes_uint8_and_float32_images_and_refuses_others():
  for dtype in (np.uint8, np.float32):
    split = {'image': np.zeros((2, 3, 3, 1), dtype), 'label': np.zeros(2, np.int32)}
    data.Dataset(train=split, test=split, source='test', num_classes=2)
  split = {'image': np.zeros((2, 3, 3, 1), np.float64), 'label': np.zeros(2, np.int32)}
  with pytest.raises(ValueError, match='uint8 or float32'):
    data.Dataset(train=split, test=split, source='test', num_classes=2)


# Batches (plain numpy on indices, whatever the images' dtype).

def test_shuffle_order_is_a_function_of_seed_and_epoch():
  order = lambda seed=0, epoch=1: data.train_batch_indices(100, 100, seed, epoch, 1, 'shared')[0]
  a = order()
  assert np.array_equal(a, order())
  assert not np.array_equal(a, order(epoch=2))
  assert not np.array_equal(a, order(seed=1))
  assert not np.array_equal(a, order(seed=2**32 - 1))
  assert sorted(a) == list(range(100))


def test_the_draw_on_a_padded_set_never_reaches_the_padding():
  """A resident set is padded to its size bucket, and the programs draw on it: the examples come first, in the
  order the host draws for the same set (its bucket's rows, 128), and only the last partial batch's rows are left
  out."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  host = data.train_batch_indices(100, 16, seed=7, epoch=3, ensemble_size=4, member_data='shuffled')
  for rows in (128, 512):
    drawn = np.asarray(data.epoch_indices(np.uint32(7), 3, 100, jnp.arange(4), rows=rows, steps=6, batch_size=16))
    assert drawn.max() < 100
    for member in range(4):
      assert len(set(drawn[member].ravel())) == 96
    if rows == data.bucket_rows(100):
      np.testing.assert_array_equal(drawn.transpose(1, 0, 2), host)


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
  split = {'image': np.arange(10, dtype=np.uint8), 'label': np.arange(10)}
  seen = [label[mask] for _, label, mask in data.eval_batches(split, 4)]
  assert np.array_equal(np.concatenate(seen), np.arange(10))


def test_batches_keep_uint8(mnist_dir):
  train, heldout = data.hold_out(data.load(data_dir=mnist_dir).train, 0.25)
  assert len(heldout['label']) == 64 and train['image'].dtype == np.uint8
  images, labels = next(data.train_batches(train, 32, seed=0, epoch=1, ensemble_size=8, member_data='shared'))
  assert images.shape == (32, 28, 28, 1) and images.dtype == np.uint8 and labels.dtype == np.int32


@pytest.mark.skipif(not os.path.isdir(SHARED_MNIST), reason='../shared/mnist is not present')
def test_real_mnist_from_shared():
  dataset = data.load(data_dir=SHARED_MNIST)
  assert dataset.train['image'].shape == (60000, 28, 28, 1) and dataset.train['image'].dtype == np.uint8
  assert dataset.test['image'].shape == (10000, 28, 28, 1) and dataset.num_classes == 10
  assert np.bincount(dataset.test['label']).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
  mean, std = data.channel_stats(dataset.train['image'])
  assert abs(mean[0] - 0.1307) < 1e-4 and abs(std[0] - 0.3081) < 1e-4  # the figures every MNIST recipe uses


# Issue 56: CSV headers, classes absent from training, empty splits and held-out slices.

_CSV_ROWS = '1,2,3\n4,5,6\n7,8,9\n10,11,12\n'


def _load_csv(path, header: str, encoding: str = 'utf-8') -> data.Dataset:
  path.write_text(header + '\n' + _CSV_ROWS, encoding=encoding)
  return data.load(data_dir=str(path), task='regression', target='y')


def test_csv_with_a_repeated_column_name_is_refused(tmp_path):
  """`a,y,y` would train with a copy of the target among the features."""
  with pytest.raises(data.DataError, match=r"dup\.csv: column 'y' appears 2 times in the header; give every column its "
                                           'own name$'):
    _load_csv(tmp_path / 'dup.csv', 'a,y,y')


def test_csv_saved_with_a_byte_order_mark_reads_its_first_column(tmp_path):
  """Spreadsheets save UTF-8 with a BOM before the first column's name."""
  dataset = _load_csv(tmp_path / 'bom.csv', 'y,a,b', encoding='utf-8-sig')
  rows = np.concatenate([np.concatenate([split['label'], split['image']], 1)
                         for split in (dataset.train, dataset.test)])
  assert sorted(rows.tolist()) == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]  # y the target, a and b features


def _hints(caught) -> list[str]:
  return [str(w.message) for w in caught if issubclass(w.category, EnsembleWarning)]


@pytest.mark.parametrize('y_train, warning', [
    (np.arange(10) % 3 + 1, 'class 0 never appears in the training labels: the members will never predict it; '
                            'relabel to 0..C-1 if that is not meant'),
    (np.arange(10) % 2 * 3, '2 classes 1, 2 never appear in the training labels: the members will never predict '
                            'them; relabel to 0..C-1 if that is not meant'),
])
def test_classes_absent_from_training_are_kept_and_named(tmp_path, y_train, warning):
  """The class ids are the user's (C = the largest training label + 1), and a class never trained on is said, in
  a warning a script sees (issue 76: a log line before)."""
  path = _npz(tmp_path / 'd.npz', y_train=y_train, y_test=np.arange(8) % 4)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    dataset = data.load(data_dir=path)
  assert dataset.num_classes == 4 and np.array_equal(dataset.train['label'], y_train)
  assert _hints(caught) == [warning]


def test_every_class_in_training_warns_of_nothing(tmp_path):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    data.load(data_dir=_npz(tmp_path / 'd.npz'))
  assert _hints(caught) == []


def _empty_split_files(tmp_path, source: str, empty: str) -> dict:
  """data.load's arguments for a `source` file whose `empty` split has no rows."""
  rng = np.random.default_rng(0)
  if source == 'idx':
    images, labels = rng.integers(0, 256, (10, 6, 5), dtype=np.uint8), np.arange(10) % 4
    for split, (images_file, labels_file) in idx.FILES.items():
      rows = 0 if split == empty else 10
      write_idx(str(tmp_path / images_file), images[:rows])
      write_idx(str(tmp_path / labels_file), labels[:rows])
    return {'data_dir': str(tmp_path)}
  if source == 'npz':
    return {'data_dir': _npz(tmp_path / 'd.npz', **{f'x_{empty}': np.zeros((0, 6, 5), np.uint8),
                                                    f'y_{empty}': np.zeros(0, np.int64)})}
  x, y = rng.normal(size=(10, 3)).astype(np.float32), rng.normal(size=10).astype(np.float32)
  splits = {f'x_{split}': x[:0] if split == empty else x for split in ('train', 'test')}
  splits.update({f'y_{split}': y[:0] if split == empty else y for split in ('train', 'test')})
  np.savez(tmp_path / 'r.npz', **splits)
  return {'data_dir': str(tmp_path / 'r.npz'), 'task': 'regression'}


@pytest.mark.parametrize('source', ['idx', 'npz', 'regression npz'])
@pytest.mark.parametrize('empty', ['train', 'test'])
def test_an_empty_split_is_refused_by_every_loader(tmp_path, source, empty):
  """Zero rows would fail later in numpy (`zero-size array to reduction operation maximum`) or score NaN."""
  _expect_error('no examples, the split is empty; give it at least one example$',
                **_empty_split_files(tmp_path, source, empty))


@pytest.mark.parametrize('fraction, rows, message', [
    (0.001, 300, 'heldout_fraction=0.001 of the 300 training examples holds out none; set '
                 '--config.heldout_fraction to at least 0.0033, or to 0 to hold out nothing'),
    (0.9, 3, 'heldout_fraction=0.9 of the 3 training examples holds out all of them, leaving none to train on; '
             'lower it: --config.heldout_fraction=0.66 or less, or 0 to hold out nothing'),
    (0.9, 1, 'heldout_fraction=0.9 of the 1 training examples holds out all of them, leaving none to train on; '
             'lower it: --config.heldout_fraction=0, to hold out nothing'),
])
def test_a_heldout_slice_of_no_rows_or_all_is_refused(fraction, rows, message):
  split = {'image': np.zeros((rows, 2), np.float32), 'label': np.zeros(rows, np.int32)}
  with pytest.raises(data.DataError, match=f'^{re.escape(message)}$'):
    data.hold_out(split, fraction)
  rest, heldout = data.hold_out(split, 0.5 if rows > 1 else 0.0)  # a fraction that rounds to some rows, or none
  assert len(rest['label']) + len(heldout['label']) == rows and len(rest['label'])
