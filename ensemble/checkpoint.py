"""orbax checkpoints of the ensemble in the canonical (K, ...) member layout, and the workdir's lock.

A checkpoint holds the train state (params, optimizer state, step counters) as
global arrays with the member axis first, plus a small JSON record of what it
is and the epoch's summary. Restoring gives the same layout on whatever
devices the current run uses, and a checkpoint that does not fit the config is
refused before anything in the workdir is touched.

No failure may cost a run a good checkpoint. orbax writes a checkpoint into a
temporary folder, renames it when complete, and only then removes the ones
beyond `max_to_keep`, so a save that fails (a full disk, lost permissions)
leaves the earlier ones as they were. A checkpoint that cannot be read back is
damaged, not incompatible: the trainer moves it aside into
`checkpoints_damaged/` (outside the folder orbax manages) and goes back to the
newest intact one. `WorkdirLock` keeps a second trainer off a workdir that a
running one writes.
"""

import contextlib
import errno
import fcntl
import functools
import gc
import hashlib
import json
import logging as py_logging
import os
import re
import shutil
import socket
import sys
import time
import traceback
import types
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import serialization, traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from ensemble import distributed
from ensemble.errors import UsageError

CHECKPOINTS_DIR = 'checkpoints'
# Where a run that checkpoints by epoch saves the step SIGTERM stopped it at: apart from the epochs' checkpoints,
# which evaluation and prediction read, so that none of them takes a part of an epoch for a whole one.
STOPPED_DIR = 'checkpoints_stopped'
DAMAGED_DIR = 'checkpoints_damaged'
LOCK_FILE = 'lock'
_MAX_FOUND_CHARS = 300  # what a warning quotes of the error that a damaged checkpoint raised
_TENSORSTORE_STATUS = re.compile(r'[A-Z]+(_[A-Z]+)*: ')  # how TensorStore's errors begin, e.g. 'DATA_LOSS: '


# TrainState fields a run sets for itself (`loop.with_run`): saved, so that a state restored is the state saved, but
# not in the signature, and restored as zeros (what a run sets again, what a member reads as its own) from a
# checkpoint written before they existed.
RUN_FIELDS = ('horizon', 'inputs')


def _run_fields_filled(abstract: dict[str, Any], restored: dict[str, Any]) -> dict[str, Any]:
  """`restored` with each `RUN_FIELDS` field it lacks as zeros of `abstract`'s (shapes and shardings)."""
  def zeros(x):
    values = np.zeros(x.shape, x.dtype)
    if getattr(x, 'sharding', None) is None:
      return jnp.asarray(values)
    return jax.make_array_from_callback(x.shape, x.sharding, lambda index: values[index])
  return {**restored, **{k: jax.tree.map(zeros, abstract[k]) for k in RUN_FIELDS
                         if k in abstract and k not in restored}}


def signature(state: Any) -> dict[str, list]:
  """{'params/Conv_0/kernel': [shape, dtype], ...}: what must match for a restore to make sense (not the run's own
  `RUN_FIELDS`)."""
  fields = {k: v for k, v in serialization.to_state_dict(state).items() if k not in RUN_FIELDS}
  flat = traverse_util.flatten_dict(fields, sep='/')
  return {path: [list(leaf.shape), str(leaf.dtype)] for path, leaf in sorted(flat.items())}


def _empty(node: Any) -> bool:
  return isinstance(node, dict) and not node


def _fit_to_disk(target: Any, on_disk: Any) -> Any:
  """`target` without the empty fields that `on_disk` lacks, so that checkpoints written before a field
  existed still restore: a field that holds nothing for them (`TrainState.snapshots` outside a snapshot
  ensemble) is no reason to set a checkpoint aside as damaged."""
  if not isinstance(target, dict) or not isinstance(on_disk, dict):
    return target
  return {key: _fit_to_disk(value, on_disk.get(key)) for key, value in target.items()
          if not ((_empty(value) or key in RUN_FIELDS) and key not in on_disk)}


def _with_empty_fields(target: Any, restored: Any) -> Any:
  """`restored` with the empty fields of `target` that `_fit_to_disk` left out put back."""
  if not isinstance(target, dict):
    return restored
  return {key: {} if _empty(value) and key not in restored else _with_empty_fields(value, restored[key])
          for key, value in target.items() if key in restored or _empty(value)}


class DamagedCheckpoint(Exception):
  """A checkpoint that cannot be read back (a file cut short, missing or garbled), as opposed to one that
  does not fit the config (a UsageError): the first is worked around, the second refused."""

  def __init__(self, path: str, found: str):
    super().__init__(f'checkpoint {path} is damaged ({found})')
    self.path, self.found = path, found


class NoIntactCheckpoint(UsageError):
  """Every checkpoint of the workdir is damaged: nothing to go back to."""


def describe(error: BaseException) -> str:
  """The innermost cause's first line, e.g. TensorStore's `OUT_OF_RANGE: ...` rather than orbax's wrapper,
  without the multi-kilobyte TensorStore spec that follows it."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  lines = str(error).strip().splitlines()
  text = re.split(r' \[tensorstore_spec|; See full TensorStore details', lines[0])[0] if lines else ''
  text = f'{type(error).__name__}: {text}' if text else type(error).__name__
  return text if len(text) <= _MAX_FOUND_CHARS else text[:_MAX_FOUND_CHARS - 3] + '...'


def is_dropped_io(unraisable) -> bool:
  """Whether an error that Python could not raise anywhere (`sys.unraisablehook`'s argument) is the debris of a
  checkpoint read or write that failed, which the one error or warning about that failure covers.

  When one TensorStore read or write fails, orbax closes its event loop and drops the operations still in flight:
  those that finish later raise 'Event loop is closed' in a TensorStore thread, and each dropped read coroutine,
  closed when it is collected, raises an orbax exception that quotes the whole TensorStore spec (dozens of lines,
  once per shard: hundreds for an ensemble of 8).
  """
  error, source = unraisable.exc_value, unraisable.object
  if isinstance(error, RuntimeError) and str(error) == 'Event loop is closed':
    return True
  code = getattr(source, 'cr_code', None)  # a coroutine
  return code is not None and '/orbax/' in code.co_filename


def drop_io_debris(hook):
  """`hook` (an unraisablehook) behind a filter that drops what `is_dropped_io` describes."""
  def filtered(unraisable):
    if not is_dropped_io(unraisable):
      hook(unraisable)
  return filtered


class DroppedTasks(py_logging.Filter):
  """For asyncio's logger: drops its report of an orbax task or future whose failure nobody retrieved, a sibling
  of the read or write that failed (one per shard when a file is missing; a `_GatheringFuture` over them), with a
  traceback each; and of a TensorStore read's own future, whose error TensorStore set from C++ (no Python
  traceback, a status code such as `OUT_OF_RANGE:` first)."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if not record.getMessage().partition('\n')[0].endswith(' exception was never retrieved') or not record.exc_info:
      return True
    frames = traceback.extract_tb(record.exc_info[2])
    if not frames:
      return not _TENSORSTORE_STATUS.match(str(record.exc_info[1]))
    return not any('/orbax/' in frame.filename for frame in frames)


@contextlib.contextmanager
def _quiet_failed_reads():
  """Drops the debris of a failed read (`is_dropped_io`, `DroppedTasks`) until its dropped operations are over.

  The caller's own hook and logger are as they were once the read is over: a
  library must not keep them changed. The debris comes late, so a failure waits
  for it first (`_settle`).
  """
  previous, tasks, asyncio_logger = sys.unraisablehook, DroppedTasks(), py_logging.getLogger('asyncio')
  quiet = drop_io_debris(previous)
  sys.unraisablehook = quiet
  asyncio_logger.addFilter(tasks)
  try:
    yield
  except BaseException:
    _settle()
    raise
  finally:
    asyncio_logger.removeFilter(tasks)
    if sys.unraisablehook is quiet:
      sys.unraisablehook = previous


def _settle(timeout_s: float = 10.0):
  """Waits until the orbax coroutines that a failed read left behind are collected, `timeout_s` at most.

  They are tasks of the closed event loop, each waiting on a TensorStore read
  still in flight: when that read ends it reports 'Event loop is closed', the
  task lets go of its coroutine, and the collector closes the coroutine, which
  reports its own error. Reads of a local file end within milliseconds.
  """
  dropped = [weakref.ref(o) for o in gc.get_objects()
             if isinstance(o, types.CoroutineType) and '/orbax/' in o.cr_code.co_filename]
  deadline = time.monotonic() + timeout_s
  while True:
    gc.collect()
    if all(ref() is None for ref in dropped) or time.monotonic() > deadline:
      return
    time.sleep(0.01)


def _storage_error(error: BaseException) -> str | None:
  """Why a write failed, when the file system refused it (disk full, file too large, permission denied);
  None for anything else, which is a bug and keeps its traceback.

  TensorStore reports the OS error inside a ValueError's text (`[os_error_code='28']`).
  """
  while error is not None:
    if isinstance(error, OSError) and error.errno is not None:
      return f'{os.strerror(error.errno)} ({errno.errorcode.get(error.errno, error.errno)})'
    code = re.search(r"os_error_code='?(\d+)", str(error))
    if code:
      number = int(code.group(1))
      return f'{os.strerror(number)} ({errno.errorcode.get(number, number)})'
    error = error.__cause__ or error.__context__
  return None


def read_record(workdir: str, epoch: int) -> dict[str, Any]:
  """The JSON record of checkpoint `epoch` of `workdir` (`Checkpointer.meta`), read by this process alone.

  For what one process reads by itself (the summary that process 0 prints, a
  checkpoint's id): making a `Checkpointer` waits for every process, since
  orbax's manager syncs them as it starts. Raises what orbax raises for a
  record that cannot be read.
  """
  handler = ocp.JsonCheckpointHandler()
  try:
    return handler.restore(epath.Path(workdir) / CHECKPOINTS_DIR / str(epoch) / 'meta')
  finally:
    handler.close()



def checkpoint_id(workdir: str, epoch: int) -> str:
  """What tells this checkpoint from any other of its epoch: a hash of its record, which holds the epoch's
  summary (its timings too), so a run trained again in the same workdir gets other ids. A copy keeps its id."""
  record = read_record(workdir, epoch)
  return hashlib.sha256(json.dumps(record, sort_keys=True).encode('utf-8')).hexdigest()[:16]

def _writes_shared_once(method: Any) -> bool:
  """Whether checkpoints hold the members' shared parameters once: those `shared=` names (ensemble/sharing.py).
  BatchEnsemble's checkpoints have always held a copy per member, and keep doing so."""
  return bool(getattr(method, 'shared_filters', ()))


def shared_once(method: Any, state: Any) -> Any:
  """The canonical state ((K, ...) per leaf; arrays or their shapes) as checkpoints hold it: the leaves that all
  members share (`method.map_shared`) once, (1, ...), replicated."""
  if not _writes_shared_once(method):
    return state

  def once(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      sharding = x.sharding
      if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec())
      return jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype, sharding=sharding)
    return _first(x)
  return method.map_shared(once, state)


@jax.jit
def _first(x):
  return x[:1]


def shared_repeated(method: Any, state: Any, like: Any) -> Any:
  """Undoes `shared_once`: each shared leaf repeated for the members, laid out as `like`'s leaf."""
  if not _writes_shared_once(method):
    return state
  shapes = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(like)}

  def repeated(path, x):
    if not method.is_shared_path(path):
      return x
    full = shapes[jax.tree_util.keystr(path)]
    return _repeat(tuple(full.shape), full.sharding)(x)
  return jax.tree_util.tree_map_with_path(repeated, state)


@functools.lru_cache(maxsize=256)
def _repeat(shape: tuple[int, ...], sharding: Any):
  """A program that broadcasts a (1, ...) leaf to `shape`, laid out by `sharding`: one per leaf's shape."""
  return jax.jit(lambda y: jax.numpy.broadcast_to(y, shape), out_shardings=sharding)


class Checkpointer:
  """Saves one checkpoint per epoch (or step) under `workdir/checkpoints/<epoch>` and keeps the last few."""

  def __init__(self, workdir: str, max_to_keep: int = 3, asynchronous: bool = False, folder: str = CHECKPOINTS_DIR,
               method: Any = None):
    """`asynchronous`: `save(..., wait=False)` returns once the state is on the host and writes the files in the
    background (orbax's async checkpointing), so that training goes on meanwhile. `folder`: STOPPED_DIR for the
    step SIGTERM stopped a run at. `method`: the members' (`shared_once`)."""
    self.workdir = os.path.abspath(workdir)
    self.method = method
    self.directory = os.path.join(self.workdir, folder)
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_names=('state', 'meta'),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=False, enable_async_checkpointing=asynchronous))
    self._in_flight = None  # the epoch whose checkpoint is being written in the background
    # Restores go through the handlers, not the manager: the manager ends a restore with a barrier
    # across processes, which a process whose read failed would never reach.
    self._state_handler = ocp.StandardCheckpointHandler()
    self._meta_handler = ocp.JsonCheckpointHandler()

  def latest_epoch(self) -> int | None:
    return self._manager.latest_step()

  def epochs(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def path(self, epoch: int) -> str:
    return os.path.join(self.directory, str(epoch))

  def _read(self, epoch: int, item: str, read) -> Any:
    """`read(path of the item)`, with any failure to read it reported as a DamagedCheckpoint."""
    with _quiet_failed_reads():
      try:
        return read(epath.Path(self.path(epoch)) / item)
      except (UsageError, MemoryError):
        raise
      except Exception as e:  # orbax and TensorStore raise Exception, ValueError, KeyError, OSError, ...
        found = describe(e)
      # Raised outside the handler: the orbax error, whose traceback holds the dropped reads, is gone, so the
      # collection on the way out closes them.
      raise DamagedCheckpoint(self.path(epoch), found)

  def _read_meta(self, epoch: int) -> dict[str, Any]:
    return self._read(epoch, 'meta', self._meta_handler.restore)

  def summary(self, epoch: int) -> tuple[int, dict[str, float]] | None:
    """(step, scalars) of the epoch summary saved with the checkpoint; None if it has none or cannot be read."""
    try:
      saved = self._read_meta(epoch).get('summary')
    except DamagedCheckpoint:
      return None
    return (saved['step'], saved['scalars']) if saved else None

  def meta(self, epoch: int) -> dict[str, Any]:
    """The JSON record saved beside the state: model, ensemble size, data description, epoch summary."""
    return self._read_meta(epoch)

  def restore(self, epoch: int, abstract_state: Any, meta: dict[str, Any]) -> Any:
    """Restores the state saved at `epoch` onto the shardings of `abstract_state`'s leaves.

    `meta` describes what the current config expects; a checkpoint that differs
    raises a UsageError naming the difference, one that cannot be read a
    DamagedCheckpoint.
    """
    saved = self._read_meta(epoch)
    on_disk = shared_once(self.method, abstract_state)
    self._check_compatible(epoch, saved, {**meta, 'signature': signature(on_disk)})
    target = serialization.to_state_dict(on_disk)

    def read(path):
      fitted = _fit_to_disk(target, self._state_handler.metadata(path).tree)
      return _with_empty_fields(target, self._state_handler.restore(path, args=ocp.args.StandardRestore(fitted)))
    restored = _run_fields_filled(target, self._read(epoch, 'state', read))
    return shared_repeated(self.method, serialization.from_state_dict(on_disk, restored), abstract_state)

  def check_fits(self, abstract_state: Any, meta: dict[str, Any]):
    """Refuses a config that the workdir's checkpoints do not fit, from their small JSON records alone.

    Cheap, and it writes nothing, so a run can be refused before it takes the
    workdir's lock; the restore checks every checkpoint it reads again.
    """
    expected = {**meta, 'signature': signature(shared_once(self.method, abstract_state))}
    for epoch in reversed(self.epochs()):
      try:
        saved = self._read_meta(epoch)
      except DamagedCheckpoint:
        continue  # the restore finds it again, reports it and goes back further
      self._check_compatible(epoch, saved, expected)
      return

  def restore_newest_intact(self, abstract_state: Any, meta: dict[str, Any],
                            move_aside: bool) -> tuple[int, Any]:
    """(epoch, state) of the newest checkpoint that every process reads back whole; (0, None) if there is none.

    Each damaged checkpoint newer than that costs one warning line; with
    `move_aside` (the trainer, which holds the workdir's lock) it is moved to
    `checkpoints_damaged/<epoch>` for a person to look at, so the epochs after
    the intact one can be saved again. A checkpoint that does not fit the
    config raises the UsageError of `restore` and stays where it is. With
    checkpoints but none intact, raises NoIntactCheckpoint and moves nothing.
    """
    damaged = []
    for epoch in reversed(self.epochs()):
      destination = self._aside_path(epoch)  # named before the processes agree, i.e. before anything moves
      try:
        state, found = self.restore(epoch, abstract_state, meta), None
      except DamagedCheckpoint as e:
        state, found = None, e.found
      # Processes read their own shards, so one may fail where another does not; all must go back alike.
      if distributed.all_processes(found is None):
        self._set_aside(damaged, epoch, move_aside)
        return epoch, state
      damaged.append((epoch, found or 'unreadable on another process', destination))
    if damaged:
      epochs = ', '.join(str(epoch) for epoch, _, _ in damaged)
      raise NoIntactCheckpoint(f'no intact checkpoint in {self.directory}: epochs {epochs} are damaged (epoch '
                               f'{damaged[0][0]}: {damaged[0][1]}); copy intact ones back from a backup, or train '
                               'afresh in a new --workdir')
    return 0, None

  def _aside_path(self, epoch: int) -> str:
    root, name, n = os.path.join(self.workdir, DAMAGED_DIR), str(epoch), 1
    while os.path.exists(os.path.join(root, name)):
      name, n = f'{epoch}.{n}', n + 1
    return os.path.join(root, name)

  def _set_aside(self, damaged: list[tuple[int, str, str]], intact: int, move_aside: bool):
    for epoch, found, destination in damaged:
      problem = f'checkpoint {self.path(epoch)} is damaged ({found})'
      if not move_aside:
        logging.warning('%s; left in place, using epoch %d instead', problem, intact)
        continue
      logging.warning('%s; moved it to %s and went back to epoch %d', problem, destination, intact)
      if jax.process_index() == 0:
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.rename(self.path(epoch), destination)
    if damaged and move_aside:
      distributed.barrier('ensemble:damaged_checkpoints_moved')
      self._manager.reload()  # orbax lists the steps it saw at start-up

  def _check_compatible(self, epoch: int, saved: dict[str, Any], expected: dict[str, Any]):
    where = f'checkpoint {self.directory}/{epoch}'
    fix = 'use a fresh --workdir, or the config this workdir was trained with'
    for key in ('model', 'ensemble_size'):
      if saved.get(key) != expected[key]:
        raise UsageError(f'{where} holds {key}={saved.get(key)!r} but the config asks for '
                         f'{key}={expected[key]!r}; {fix}')
    saved_sig, expected_sig = saved.get('signature', {}), expected['signature']
    for path in sorted(set(saved_sig) | set(expected_sig)):
      if saved_sig.get(path) != expected_sig.get(path):
        raise UsageError(f'{where} holds {path} as {saved_sig.get(path)} but the config builds '
                         f'{expected_sig.get(path)}; {fix}')

  def save(self, epoch: int, state: Any, meta: dict[str, Any], summary: tuple[int, dict[str, float]] | None = None,
           wait: bool = True):
    """Writes atomically (orbax renames a finished temporary folder), so a crash never leaves half a checkpoint.

    `summary`, (step, scalars) of the epoch, is kept beside the state: the
    metrics.jsonl line that a crash right after the save would lose can be
    written again on resume. A write that the file system refuses raises a
    UsageError naming the checkpoint and the cause; the checkpoints before it
    stay as they were. With `wait=False` (and an `asynchronous` checkpointer)
    the write goes on after the return: `wait`, the next save and `close`
    complete it, and raise its error.
    """
    self.wait()
    state = shared_once(self.method, state)
    record = {**meta, 'epoch': epoch, 'signature': signature(state)}
    if summary is not None:
      record['summary'] = {'step': summary[0], 'scalars': summary[1]}
    with self._writing(epoch):
      os.makedirs(self.directory, exist_ok=True)
      self._in_flight = epoch
      self._manager.save(epoch, args=ocp.args.Composite(
          state=ocp.args.StandardSave(serialization.to_state_dict(state)), meta=ocp.args.JsonSave(record)))
    if wait:
      self.wait()

  def wait(self):
    """Returns once the checkpoint being written (if any) is complete on disk."""
    epoch, self._in_flight = self._in_flight, None
    if epoch is not None:
      with self._writing(epoch):
        self._manager.wait_until_finished()

  @contextlib.contextmanager
  def _writing(self, epoch: int):
    """Turns a write of `epoch` that the file system refuses into a UsageError, and frees what it wrote."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      self._in_flight = None
      cause = _storage_error(e)
      if cause is None:
        raise
      self._remove_partial(epoch)
      raise UsageError(f'cannot save checkpoint {self.path(epoch)}: {cause}; free space or restore write access '
                       f'in {self.directory}, then re-run the same command to resume from the last checkpoint '
                       f'({self.latest_epoch() or "none yet"})') from None

  def _remove_partial(self, epoch: int):
    """Frees what a failed save wrote (orbax ignores it, and would replace it on the next save of `epoch`).

    Across processes the others may still be writing into it; there it stays. In one process, TensorStore
    writes that were in flight when the first one failed can still land after a removal (the CI run of
    tests/test_checkpoint.py once found the folder back), so it is removed until it stays gone.
    """
    if jax.process_count() > 1:
      return
    prefix = f'{epoch}.orbax-checkpoint-tmp'  # orbax's TMP_DIR_SUFFIX
    for _ in range(50):
      partial = [name for name in os.listdir(self.directory) if name.startswith(prefix)]
      if not partial:
        return
      for name in partial:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      time.sleep(0.1)

  def close(self):
    """Completes the checkpoint being written, then lets orbax's threads go."""
    try:
      self.wait()
    finally:
      self._manager.close()
    self._state_handler.close()
    self._meta_handler.close()


class WorkdirLock:
  """An exclusive `fcntl.flock` on `WORKDIR/lock`, which records who holds it.

  The kernel drops the lock when its holder exits, however it exits, so a
  crashed run never leaves the workdir stuck. The file itself stays: removing
  it could let two runs lock two different files.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
    self._file = None

  def acquire(self) -> str | None:
    """Takes the lock; returns None, or who holds it (e.g. 'process 1234 on host-a') when another does."""
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    f = open(self.path, 'a+', encoding='utf-8')  # pylint: disable=consider-using-with
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      holder = f.read().strip() or 'another process'
      f.close()
      return holder
    f.truncate(0)
    f.write(f'process {os.getpid()} on {socket.gethostname()}\n')
    f.flush()
    self._file = f
    return None

  def release(self):
    if self._file is not None:
      self._file.close()  # closing the file drops the flock
      self._file = None


_HELD: dict[str, WorkdirLock] = {}  # the workdirs this process has locked, by absolute path


def lock_workdir(workdir: str):
  """Takes `workdir` for this run, or raises a UsageError naming the process that has it.

  Across processes only process 0 locks (the workdir is shared); the others
  learn its answer, so every process stops alike.
  """
  workdir = os.path.abspath(workdir)
  holder = ''
  if jax.process_index() == 0 and workdir in _HELD:
    holder = f'process {os.getpid()} on {socket.gethostname()} (this one)'
  elif jax.process_index() == 0:
    lock = WorkdirLock(workdir)
    holder = lock.acquire() or ''
    if not holder:
      _HELD[workdir] = lock
  holder = distributed.from_process_0(holder)
  if holder:
    raise UsageError(f'{workdir} is in use by {holder} (it holds {os.path.join(workdir, LOCK_FILE)}); wait for '
                     'that run to end or stop it, or train in another --workdir')


def holds_workdir(workdir: str) -> bool:
  return os.path.abspath(workdir) in _HELD


def unlock_workdir(workdir: str):
  lock = _HELD.pop(os.path.abspath(workdir), None)
  if lock is not None:
    lock.release()
