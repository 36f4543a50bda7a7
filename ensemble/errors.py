"""The one exception type for mistakes a user can fix.

The library raises it (a ValueError, as Python's own bad-argument errors
are); the CLIs print it as a single `error:` line and exit 2; anything else
is a bug and keeps its traceback.
"""

import sys
from typing import Callable


class UsageError(ValueError):
  """Bad config, bad data or an incompatible workdir; the message says the fix."""


class EnsembleWarning(UserWarning):
  """What the library trains as asked but says may not be what was meant (members with no source of diversity),
  in one line with the fix; `warnings.filterwarnings('ignore', category=EnsembleWarning)` silences it."""


def exit_with_error(message: str, exit_: Callable[[int], None] = sys.exit):
  """How every program ends on a mistake the user can fix: one `error:` line and exit status 2, where argparse's
  own report adds a usage line and a bare `sys.exit(message)` exits 1."""
  print(f'error: {message}', file=sys.stderr)
  exit_(2)
