"""What the command-line programs share."""

import logging

from absl import logging as absl_logging
import jax

from ensemble import host_memory


class QuietLibraries:
  """A filter for absl's logger that drops orbax's INFO lines (dozens per checkpoint) and keeps its warnings.

  Records carry Python's levels (WARNING is 30), not absl's (WARNING is 1).
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or '/orbax/' not in record.pathname


def keep_freed_memory_on_cpu():
  """On CPU, glibc keeps the memory XLA frees (see `host_memory`); accelerators need nothing."""
  if jax.default_backend() == 'cpu' and host_memory.keep_freed_memory():
    absl_logging.info('Keeping freed host memory for XLA:CPU to reuse (ensemble/host_memory.py).')
