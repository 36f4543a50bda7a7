"""The one exception type for mistakes a user can fix.

The library raises it (a ValueError, as Python's own bad-argument errors
are); the CLIs print it as a single `error:` line and exit 2; anything else
is a bug and keeps its traceback.
"""

import os
import sys
import warnings
from typing import Callable


class UsageError(ValueError):
  """Bad config, bad data or an incompatible workdir; the message says the fix."""


class DataError(UsageError):
  """A data file, dataset or array that is missing or malformed."""


class EnsembleWarning(UserWarning):
  """What the library does as asked but says may not be what was meant (members with no source of diversity, a
  batch larger than the data, a loss still falling at the end, members still at chance), in one line with the fix
  (`hint`); `warnings.filterwarnings('ignore', category=EnsembleWarning)` silences it. `origin` is the library's
  (file, line) that gave it, where the warning itself points at the caller's code."""
  origin: tuple[str, int] | None = None


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def hint(message: str):
  """Says what a user should act on, in one line (`message` names the problem and the fix): an `EnsembleWarning`,
  which a script sees without logging set up, attributed to the caller's first line outside the package (its
  `ensemble.fit(...)`), so Python shows each once per line that caused it. The programs show it as one log line
  instead (ensemble/console.py's `hints_logged`, in ensemble/cli.py's `run`)."""
  caller = sys._getframe(1)  # pylint: disable=protected-access
  warning = EnsembleWarning(message)
  warning.origin = (caller.f_code.co_filename, caller.f_lineno)
  frame, level = caller, 2  # stacklevel 2: `hint`'s caller
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
    frame, level = frame.f_back, level + 1
  warnings.warn(warning, stacklevel=level)


def exit_with_error(message: str, exit_: Callable[[int], None] = sys.exit):
  """How every program ends on a mistake the user can fix: one `error:` line and exit status 2, where argparse's
  own report adds a usage line and a bare `sys.exit(message)` exits 1."""
  print(f'error: {message}', file=sys.stderr)
  exit_(2)
