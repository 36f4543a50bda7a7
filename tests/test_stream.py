"""Streamed splits (ensemble/data/stream.py) and training by steps: a folder read a batch at a time trains the same
members as in memory, a run resumes mid-epoch exactly, each process reads only its own rows, and a bad record or a
read that fails while training is one line naming the file."""

import logging
import os
import shutil
import types

import flax.linen as nn
import jax
import numpy as np
import pytest

import ensemble
from conftest import small_config, synthetic_mnist, timeless, write_mnist
from ensemble import checkpoint, data, distributed, evaluation, loop, optim, recipe as recipe_lib, trainer, writers
from ensemble.data import array_record, convert, stream
from ensemble.errors import UsageError


@pytest.fixture(scope='module')
def folder(tmp_path_factory) -> str:
  """64 / 32 synthetic digits converted 20 examples a file: several files per split, the last one short."""
  root = tmp_path_factory.mktemp('stream')
  output = str(root / 'converted')
  convert.convert(write_mnist(str(root / 'mnist'), 64, 32), output, examples_per_file=20)
  return output


def _config(folder: str, **overrides):
  """2 members of the classic CNN, 4 steps of 16 an epoch."""
  return small_config(folder, ensemble_size=2, num_devices=2, batch_size=16, **overrides)


def _assert_same_state(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.params, b.params)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.opt_state, b.opt_state)


def test_a_streamed_folder_trains_the_same_members_as_in_memory(folder, tmp_path):
  in_memory, memory_summary = trainer.train_and_evaluate(_config(folder, streaming='never'), str(tmp_path / 'a'))
  streamed, stream_summary = trainer.train_and_evaluate(_config(folder, streaming='always'), str(tmp_path / 'b'))
  _assert_same_state(streamed, in_memory)
  assert timeless([stream_summary]) == timeless([memory_summary])
  # The streamed workdir reads its held-out slice as the other does (`evaluation.heldout_split`): only that slice.
  assert ensemble.load(str(tmp_path / 'b')).flag_threshold() == ensemble.load(str(tmp_path / 'a')).flag_threshold()


def test_a_streamed_run_reads_its_held_out_and_test_rows_a_batch_at_a_time(folder, tmp_path, monkeypatch):
  """Memory flat in the data's size: the validation slice scored after each epoch, the test pass, the flag
  thresholds that `python -m ensemble.train` fits at the end and `ensemble.evaluate`'s temperature and conformal
  fits read the held-out rows (the last 16 of 64) and the test split at most `eval_batch_size` rows a read, never
  whole (the flag fit read its 16 held-out rows at once: 10% of the data in memory)."""
  reads = []
  read = array_record.FolderSource.read
  monkeypatch.setattr(array_record.FolderSource, 'read',
                      lambda self, rows: reads.append((self.name, np.array(rows))) or read(self, rows))
  workdir = str(tmp_path / 'run')
  trainer.train_and_evaluate(_config(folder, streaming='always', heldout_fraction=0.25, early_stopping=1,
                                     eval_batch_size=4), workdir)
  assert ensemble.load(workdir).flag_threshold()['examples'] == 16
  scored = [rows for name, rows in reads if name.endswith(' test') or rows.max() >= 48]
  assert {len(rows) for rows in scored} == {4}, [len(rows) for rows in scored]
  reads.clear()
  evaluation.evaluate(workdir, angles=(), ood_names=())  # reads the 32 test images whole to rotate and noise them
  heldout = [rows for name, rows in reads if name.endswith(' train')]
  assert heldout and {len(rows) for rows in heldout} == {4} and min(rows.min() for rows in heldout) == 48


class _Tiny(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x.reshape(len(x), -1))))


@pytest.mark.optimized
@pytest.mark.parametrize('fields', [{'member_data': 'shared'}, {'method': 'bagging'}])
def test_fit_trains_on_a_random_access_source_as_on_its_arrays(fields):
  """A grain MapDataset of (input, label) pairs streams; bagging's resamples are the same index sampling."""
  grain = pytest.importorskip('grain')
  rng = np.random.default_rng(0)
  x, y = rng.integers(0, 256, (96, 6, 6, 1), dtype=np.uint8), rng.integers(0, 3, 96).astype(np.int32)
  common = dict(ensemble_size=2, epochs=2, batch_size=16, progress=False, **fields)
  arrays = ensemble.fit(_Tiny(), (x, y), **common)
  source = grain.MapDataset.source([(x[i], y[i]) for i in range(len(x))])
  streamed = ensemble.fit(_Tiny(), source, **common)
  _assert_same_state(streamed.state, arrays.state)
  np.testing.assert_array_equal(streamed.predict(x[:8])['probs'], arrays.predict(x[:8])['probs'])


@pytest.mark.optimized
def test_a_source_of_float_images_trains_on_their_pixels_as_arrays_do():
  """Float images in [0, 1] are read as float32 pixels, as `fit`'s arrays become; out of that range, one line."""
  rng = np.random.default_rng(1)
  x, y = rng.random((48, 6, 6, 1), dtype=np.float32), rng.integers(0, 3, 48).astype(np.int32)
  common = dict(ensemble_size=2, epochs=1, batch_size=16, progress=False)
  arrays = ensemble.fit(_Tiny(), (x, y), **common)
  streamed = ensemble.fit(_Tiny(), [(x[i], y[i]) for i in range(len(x))], **common)
  _assert_same_state(streamed.state, arrays.state)
  with pytest.raises(data.DataError, match=r'train= source: float images must lie in \[0, 1\] but span \['):
    ensemble.fit(_Tiny(), [(x[i] * 255, y[i]) for i in range(len(x))], **common)


@pytest.mark.parametrize('streaming', ['always', 'never'])
def test_a_mid_epoch_resume_equals_an_uninterrupted_run(folder, tmp_path, streaming, caplog):
  """7 steps of 4 an epoch, saved every 3: checkpoints at steps 3, 4 (epoch 1's end), 6 and 7 (the run's end, in
  epoch 2). A run resumed from step 6 reads epoch 2 from its third batch, as the uninterrupted one did."""
  config = _config(folder, streaming=streaming, num_train_steps=7, checkpoint_every_steps=3, checkpoints_to_keep=5)
  whole = str(tmp_path / 'whole')
  state, summary = trainer.train_and_evaluate(config, whole)
  lines = writers.read_jsonl(os.path.join(whole, 'metrics.jsonl'))
  assert [line['step'] for line in lines] == [3, 4, 6, 7] and [line['epoch'] for line in lines] == [1, 1, 2, 2]
  assert 'test_loss' in lines[1] and 'test_loss' not in lines[2]  # the test pass at each epoch's end only
  assert checkpoint.read_record(whole, 6)['position']['data_state'] == {'next_index': 2}

  resumed = str(tmp_path / 'resumed')
  shutil.copytree(whole, resumed)
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '7'))
  with caplog.at_level(logging.INFO, logger='absl'):
    again, again_summary = trainer.train_and_evaluate(config, resumed)
  assert 'at step 6, 2 steps into epoch 2' in caplog.text
  _assert_same_state(again, state)
  assert timeless([again_summary]) == timeless([summary])
  assert timeless(writers.read_jsonl(os.path.join(resumed, 'metrics.jsonl'))) == timeless(lines)
  if streaming == 'never':  # a step-numbered checkpoint is named as one
    caplog.clear()
    with caplog.at_level(logging.INFO, logger='absl'):
      loaded = ensemble.load(resumed)
    assert f'Restored step 7 of {resumed}' in caplog.text and ', step 7, ' in repr(loaded)


def test_num_train_steps_sets_the_epochs_and_the_schedule_spans_them(folder):
  dataset = data.load(data_dir=folder)
  recipe, devices = recipe_lib.resolve(_config(folder, num_train_steps=7, num_epochs=50, schedule='cosine'),
                                       jax.devices(), dataset=dataset)
  run = loop.prepare(recipe, devices, dataset)
  assert (run.steps_per_epoch, run.recipe.num_epochs) == (4, 2)
  rate = optim.schedule(run.recipe, run.steps_per_epoch)
  assert float(rate(0)) == pytest.approx(run.recipe.learning_rate) and float(rate(7)) == pytest.approx(0.0)


_TWO_PROCESSES = [types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1, 0, 0, 1, 1)]


def test_two_processes_read_disjoint_rows_that_cover_each_epoch(folder, monkeypatch):
  dataset = data.load(data_dir=folder, streaming='always')
  labels = data.load(data_dir=folder).train['label']
  indices = data.train_batch_indices(len(dataset.train), 16, 0, 1, 1, 'shared')
  rows = {}
  for process in (0, 1):
    monkeypatch.setattr(jax, 'process_index', lambda p=process: p)
    blocks = [distributed.process_block(_TWO_PROCESSES, batch) for batch in indices]
    before = dataset.train.source.rows_read
    read = np.concatenate([batch_labels for _, batch_labels in stream.batches(dataset.train, blocks)])
    assert dataset.train.source.rows_read - before == indices.size // 2  # half of the epoch's rows, no more
    np.testing.assert_array_equal(read, labels[np.concatenate(blocks)])  # the rows of its own devices
    rows[process] = set(np.concatenate(blocks).tolist())
  assert not rows[0] & rows[1] and rows[0] | rows[1] == set(indices.ravel().tolist())


def _copy(folder: str, tmp_path) -> str:
  copied = str(tmp_path / 'copy')
  shutil.copytree(folder, copied)
  return copied


def test_a_file_damaged_while_training_is_one_line_naming_it(folder, tmp_path):
  """Opened intact (every file's index checked), then cut short under the run: the read that meets it in grain's
  thread stops the epoch with one line, and nothing hangs."""
  copied = _copy(folder, tmp_path)
  dataset = data.load(data_dir=copied, streaming='always')
  path = os.path.join(copied, 'train-00001-of-00004.array_record')
  raw = open(path, 'rb').read()
  with open(path, 'wb') as f:
    f.write(raw[:len(raw) // 2])
  indices = data.train_batch_indices(len(dataset.train), 16, 0, 1, 1, 'shared')
  with pytest.raises(data.DataError) as e:
    list(stream.batches(dataset.train, list(indices)))
  assert str(e.value).startswith(f'{path}: cut short or damaged') and len(str(e.value).splitlines()) == 1


def test_a_source_that_fails_in_a_worker_thread_is_one_line():
  class Failing(list):
    def __getitem__(self, i):
      if i == 50:
        raise OSError('the network file system went away\nand a traceback')
      return super().__getitem__(i)
  source = stream.Records(stream.RandomAccessSource(Failing([(np.zeros((2, 2, 1), np.uint8), 1)] * 64), 'train='))
  blocks = list(np.arange(64).reshape(8, 8))
  with pytest.raises(data.DataError) as e:
    list(stream.batches(source, blocks))
  assert str(e.value) == ('train=: reading the rows of step 6 of the epoch failed (OSError: the network file system '
                          'went away); check the source')


def test_a_record_of_the_wrong_length_is_one_line_when_streamed(folder, tmp_path):
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  copied = _copy(folder, tmp_path)
  path = os.path.join(copied, 'train-00003-of-00004.array_record')
  writer = array_record_module.ArrayRecordWriter(path, array_record.WRITER_OPTIONS)
  (images, labels), _ = synthetic_mnist(4, 1)
  for i in range(4):  # as many records as dataset.json lists; the second one a pixel short
    writer.write((images[i].tobytes()[:-1] if i == 1 else images[i].tobytes()) + np.int32(labels[i]).tobytes())
  writer.close()
  dataset = data.load(data_dir=copied, streaming='always')
  with pytest.raises(data.DataError, match=f'^{path}: record 1 holds 787 bytes but dataset.json describes 788'):
    dataset.train.take(np.arange(60, 64))


def test_a_label_beyond_the_model_outputs_is_one_line_when_streamed(monkeypatch):
  monkeypatch.setattr(stream, 'SAMPLE_ROWS', 10)  # rows 0, 4, 8, 13, ..., 34, 39 give the classes: not row 33
  # Images that train (all-zero ones have no spread to standardise by): the epoch reads every row, row 33 in its turn.
  x = np.random.default_rng(0).integers(0, 256, (40, 4, 4, 1)).astype(np.uint8)
  y = np.arange(40).astype(np.int32) % 3
  source = [(x[i], 7 if i == 33 else y[i]) for i in range(40)]
  with pytest.raises(data.DataError, match=r'a label of 7 but the model has 3 class outputs'):
    ensemble.fit(_Tiny(), source, ensemble_size=2, epochs=1, batch_size=8, progress=False)


def test_streaming_always_refuses_a_source_read_whole(tmp_path):
  idx = write_mnist(str(tmp_path / 'mnist'), 32, 16)
  with pytest.raises(data.DataError, match=r'^streaming=always: .* is read whole; streaming reads a folder of '
                                           r'ArrayRecord files'):
    data.load(data_dir=idx, streaming='always')
  with pytest.raises(data.DataError, match=r"^streaming='sometimes': set --config.streaming to one of"):
    data.load(data_dir=idx, streaming='sometimes')


def test_auto_streams_a_folder_beyond_a_quarter_of_the_memory(folder, monkeypatch):
  assert not stream.is_streamed(data.load(data_dir=folder, streaming='auto').train)
  monkeypatch.setattr(stream, 'AUTO_FRACTION', 1e-12)
  assert stream.is_streamed(data.load(data_dir=folder, streaming='auto').train)


def test_a_streamed_set_refuses_the_resident_fast_path(folder):
  with pytest.raises(UsageError, match='steps_per_dispatch=4 keeps the training set on the devices'):
    recipe_lib.resolve(_config(folder, steps_per_dispatch=4), jax.devices(),
                       dataset=data.load(data_dir=folder, streaming='always'))
