"""SIGTERM (a preemptible VM's notice, a scheduler's end of the job) turned into a stop a run or a loop can take.

A workdir's training reads a flag after each dispatch (`stop_on_sigterm`, `stopping`), so that it stops between
steps with its position saved; a loop of fits raises KeyboardInterrupt at once (`interrupting`), as Ctrl-C does,
its record written whole each round. Only the main thread takes signals: elsewhere nothing changes.
"""

import contextlib
import functools
import signal
import threading
from typing import Callable, Iterator

from ensemble import distributed


class Stopped(KeyboardInterrupt):
  """SIGTERM asked the run to stop: raised at the end of the dispatch in progress, once the hooks have saved where
  it stands (`stop_on_sigterm`, `loop.Hook.stop_point`)."""


_STOP = threading.Event()


@contextlib.contextmanager
def _handled(handler: Callable) -> Iterator[None]:
  """SIGTERM handled by `handler` within the block, in the main thread; the previous handler back after it."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
  """While a workdir trains: SIGTERM sets a flag that `loop.train` reads after each dispatch, where Python's default
  would end the process at once and lose the epoch (a handler that raised at once, as Ctrl-C does, could cut a save
  in half). Across processes, JAX's preemption service takes the signal (`stopping`)."""
  if distributed.preemption_synced():
    yield
    return
  _STOP.clear()
  try:
    with _handled(lambda *_: _STOP.set()):
      yield
  finally:
    _STOP.clear()


def requested() -> bool:
  """Whether this process was sent SIGTERM within `stop_on_sigterm`."""
  return _STOP.is_set()


def stopping(dispatch: int) -> bool:
  """Whether SIGTERM asked the run to stop after `dispatch`: this process's flag, or across processes the dispatch
  they all agreed on (`distributed.stop_agreed`), so that none waits in a collective the others left."""
  if distributed.preemption_synced():
    return distributed.stop_agreed(dispatch)
  return requested()


# What a stopped loop says after how it was stopped: how to go on (with a workdir), or that nothing was kept.
_TO_GO_ON = 'the loop stopped; run it again with the same workdir to go on'
_NOTHING_KEPT = 'the loop stopped, and without a workdir it kept no round; give workdir= to make it resumable'


def _interrupt(*_):
  raise KeyboardInterrupt(f'SIGTERM: {_TO_GO_ON}')


def interrupting() -> contextlib.AbstractContextManager:
  """While a loop of fits runs: SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so that either stops the loop
  where it is, with every round its record holds kept and no file half-written (each is renamed into place)."""
  return _handled(_interrupt)


def stops_in_one_line(loop: Callable) -> Callable:
  """A loop of fits whose stop (SIGTERM or Ctrl-C, a KeyboardInterrupt) ends in its message and the caller's line:
  raised wherever the signal came, mostly inside a JAX call compiling or running a fit, its traceback ran through
  some sixty lines of JAX's frames before the one that says how to go on; `python -m ensemble.train` prints that one
  line alone (`cli.run`). Raised again here without those frames or the exception it interrupted (its traceback
  starts afresh at this frame); a bare Ctrl-C's gets the words of SIGTERM's, and a loop without a `workdir` says
  that it kept nothing to go on from."""
  @functools.wraps(loop)
  def wrapped(*args, **kwargs):
    try:
      return loop(*args, **kwargs)
    except KeyboardInterrupt as e:
      message = str(e) or f'Ctrl-C: {_TO_GO_ON}'
      if kwargs.get('workdir') is None:
        message = message.replace(_TO_GO_ON, _NOTHING_KEPT)
      raise KeyboardInterrupt(message).with_traceback(None) from None
  return wrapped
