"""The one exception type for mistakes a user can fix.

The library raises it (a ValueError, as Python's own bad-argument errors
are); the CLIs print it as a single `error:` line and exit 2; anything else
is a bug and keeps its traceback.
"""


class UsageError(ValueError):
  """Bad config, bad data or an incompatible workdir; the message says the fix."""
