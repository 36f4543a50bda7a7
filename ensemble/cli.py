"""What the command-line programs share."""

import logging


class QuietLibraries:
  """A filter for absl's logger that drops orbax's INFO lines (dozens per checkpoint) and keeps its warnings.

  Records carry Python's levels (WARNING is 30), not absl's (WARNING is 1).
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or '/orbax/' not in record.pathname
