"""The one exception type for mistakes a user can fix.

The CLIs print it as a single line and exit non-zero; anything else is a bug
and keeps its traceback.
"""


class UsageError(Exception):
  """Bad config, bad data or an incompatible workdir; the message says the fix."""
