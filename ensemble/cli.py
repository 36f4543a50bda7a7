"""What the command-line programs share."""

import logging
import os
import sys
import tempfile
import traceback
from typing import Callable, Sequence

from absl import app, logging as absl_logging
import jax

from ensemble import console, host_memory
from ensemble.errors import UsageError


def run(argv: Sequence[str], program: str, body: Callable[[], None], exit_: Callable[[int], None] = sys.exit):
  """The frame of every program's `main`: no stray arguments, quiet libraries, the logging flags applied,
  then `body()`; a UsageError it raises ends the program with one `error:` line and exit status 2.

  `exit_` is how to exit (train.py's skips jax.distributed's shutdown barrier).
  """
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  absl_logging.get_absl_logger().addFilter(QuietLibraries())
  ignore_closed_event_loops()
  try:
    console.setup(program)
    body()
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr)
    exit_(2)


class QuietLibraries:
  """A filter for absl's logger that drops library INFO lines and keeps their warnings.

  orbax logs dozens per checkpoint; clu's ReportProgress logs "Setting work unit
  notes" from clu/platform, which `ensemble.console`'s progress replaces.
  Records carry Python's levels (WARNING is 30), not absl's (WARNING is 1).
  orbax also logs the traceback of a write that failed, then raises the same
  error to its caller, which reports it: one line when the file system
  refused the write, a traceback for a bug. The logged copy goes.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    if not any(library in record.pathname for library in ('/orbax/', '/clu/platform/')):
      return True
    return record.levelno >= logging.WARNING and not record.exc_info


def ignore_closed_event_loops():
  """Drops the 'Event loop is closed' errors that a failed checkpoint write or read leaves behind.

  When one TensorStore write (or read) fails, orbax closes its event loop; the
  operations still in flight then finish into it, and each raises one of these
  in a TensorStore thread, printed as dozens of tracebacks ahead of the one-line
  error that says what happened. Every other unraisable error is printed.
  The sibling writes that failed too, as the first did, can also reach asyncio's
  "Task exception was never retrieved" log with a traceback: those from orbax's
  serialization are dropped as well.
  """
  default = sys.unraisablehook

  def hook(unraisable):
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'):
      default(unraisable)
  sys.unraisablehook = hook
  logging.getLogger('asyncio').addFilter(_OrphanedCheckpointWrites())


class _OrphanedCheckpointWrites(logging.Filter):
  """Drops asyncio's report of an orbax write task whose failure nobody awaited (see above)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if not record.getMessage().startswith('Task exception was never retrieved') or not record.exc_info:
      return True
    frames = traceback.extract_tb(record.exc_info[2])
    return not any('/orbax/' in frame.filename for frame in frames)


def keep_freed_memory_on_cpu():
  """On CPU, glibc keeps the memory XLA frees (see `host_memory`); accelerators need nothing."""
  if jax.default_backend() == 'cpu' and host_memory.keep_freed_memory():
    absl_logging.info('Keeping freed host memory for XLA:CPU to reuse (ensemble/host_memory.py).')


def write_atomically(path: str, content: str | bytes):
  """Writes `content` to `path` whole or not at all: an error or an interrupt leaves no partial file behind.

  The file gets the permissions `open` would give it (mkstemp's are owner-only).
  """
  fd, partial = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f'.{os.path.basename(path)}.')
  try:
    with os.fdopen(fd, 'wb' if isinstance(content, bytes) else 'w') as f:
      f.write(content)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o666 & ~umask)
    os.replace(partial, path)
  except BaseException:
    os.remove(partial)
    raise
