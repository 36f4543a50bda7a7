"""Files that a later command reads: written whole, durably, with the permissions `open` gives, the umask untouched."""

import os
import stat

import pytest

from ensemble import files
from ensemble.errors import UsageError


@pytest.fixture
def syncs(monkeypatch):
  """The kind of every descriptor `os.fsync` is called on ('file' or 'folder'), in order."""
  kinds = []
  real = os.fsync

  def fsync(fd):
    kinds.append('folder' if stat.S_ISDIR(os.fstat(fd).st_mode) else 'file')
    real(fd)
  monkeypatch.setattr(os, 'fsync', fsync)
  return kinds


def test_a_file_is_flushed_renamed_and_its_folder_flushed_without_touching_the_umask(tmp_path, monkeypatch, syncs):
  umask = os.umask(0o027)
  try:
    def no_umask(_):
      raise AssertionError('the umask changed: a race with the other threads of a host program')
    monkeypatch.setattr(os, 'umask', no_umask)
    files.write_atomically(str(tmp_path / 'config.json'), '{"a": 1}')
    files.write_atomically(str(tmp_path / 'model.jax'), b'\x00\x01')
  finally:
    monkeypatch.undo()
    os.umask(umask)
  assert (tmp_path / 'config.json').read_text() == '{"a": 1}' and (tmp_path / 'model.jax').read_bytes() == b'\x00\x01'
  assert stat.S_IMODE(os.stat(tmp_path / 'config.json').st_mode) == 0o666 & ~0o027  # as open() would make it
  assert syncs == ['file', 'folder', 'file', 'folder']
  assert sorted(os.listdir(tmp_path)) == ['config.json', 'model.jax']


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
  path = tmp_path / 'metrics.json'
  path.write_text('old')

  def full_disk(fd):
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(os, 'fsync', full_disk)
  with pytest.raises(OSError):
    files.write_atomically(str(path), 'new')
  assert path.read_text() == 'old' and os.listdir(tmp_path) == ['metrics.json']


@pytest.mark.parametrize('name, message', [
    ('', '--output={path}: a folder; name a file in it'),
    ('missing/rows.csv', '--output={path}: no folder {tmp}/missing; create it first'),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, name, message):
  path = str(tmp_path / name) if name else str(tmp_path)
  with pytest.raises(UsageError) as error:
    files.check_output('--output', path)
  assert str(error.value) == message.format(path=path, tmp=tmp_path)
