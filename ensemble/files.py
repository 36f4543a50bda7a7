"""Writing the files that a later command reads: whole or not at all, and still there after a power cut.

config.json (a resume checks it), metrics.json (predict and export take the
temperature from it), report.md, the plots, the predictions and the exported
model all go through `write_atomically`. It imports nothing heavy, so that
the report and the trainer can share it.
"""

import hashlib
import os
import secrets
from typing import Any, Sequence

import numpy as np

from ensemble.errors import UsageError

# What `open(path, 'w')` asks for; the kernel takes the umask off, as it does for `open`.
_MODE = 0o666


def check_output(flag: str, path: str):
  """Refuses, before any work, an output file that could not be written at the end of it: a folder, a path in a
  folder that does not exist, or in one this process may not write to. `flag` names it in the message."""
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise UsageError(f'{flag}={path}: a folder; name a file in it')
  if not os.path.isdir(folder):
    raise UsageError(f'{flag}={path}: no folder {folder}; create it first')
  if not os.access(folder, os.W_OK | os.X_OK):
    raise UsageError(f'{flag}={path}: cannot write in {folder}; choose a folder you may write to')


def partial_folder(path: str) -> str:
  """A new empty folder beside `path`, to fill and rename to `path` when complete. `os.mkdir` gives it the mode
  the umask says (tempfile.mkdtemp's 0700 would outlive the rename)."""
  folder, name = os.path.split(os.path.abspath(path))
  while True:
    partial = os.path.join(folder, f'.{name}.{secrets.token_hex(4)}.partial')
    try:
      os.mkdir(partial)
      return partial
    except FileExistsError:
      continue


def write_atomically(path: str, content: str | bytes):
  """Writes `content` to `path` whole or not at all: an error, an interrupt or a crash leaves the old file or
  the new one, never a part.

  The new file is written beside `path`, flushed to disk, renamed over it, and
  the folder is flushed too, so that the rename itself survives a crash. It
  gets the permissions `open` would give it: the kernel applies the umask when
  the file is created, so the process's umask is never changed (setting it,
  even for a moment, races with the other threads of a host program).
  """
  path = os.path.abspath(path)
  folder, name = os.path.split(path)
  data = content.encode('utf-8') if isinstance(content, str) else content
  while True:
    partial = os.path.join(folder, f'.{name}.{secrets.token_hex(4)}.partial')
    try:
      fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _MODE)
      break
    except FileExistsError:
      continue
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(partial, path)
  except BaseException:
    if os.path.exists(partial):
      os.remove(partial)
    raise
  _sync_folder(folder)


def _sync_folder(folder: str):
  """Flushes the folder's entries (the rename); a file system that cannot (some network mounts) is left to itself."""
  try:
    fd = os.open(folder, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def fingerprint(columns: Sequence[tuple[str, Any, bool]]) -> str:
  """(name, array, hashed) columns -> their names, shapes and dtypes, and a hash of the bytes of those `hashed`: what
  a workdir records of the data it read (`fit`'s config.json, a loop's loop.json), to refuse other data."""
  digest, shapes = hashlib.sha256(), []
  for name, array, hashed in columns:
    shapes.append(f'{name + " " if name else ""}{"x".join(map(str, array.shape))} {array.dtype}')
    if hashed and array.size:
      digest.update(memoryview(np.ascontiguousarray(array)).cast('B'))
  return f'{", ".join(shapes)}; sha256 {digest.hexdigest()[:16]}'
