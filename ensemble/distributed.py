"""Several processes, one ensemble: start-up with `jax.distributed`, and each process's share of the data.

JAX's multi-controller model: every process (one per host) runs this same
program. After `jax.distributed.initialize`, `jax.devices()` lists the devices
of all processes, global arrays span them, and collectives (the ensemble mean)
cross process boundaries by themselves. What a process must still do itself is
join the others before JAX starts (`initialize`), feed only the rows of each
batch that its own devices hold (`process_rows`), and gather results that live
on other processes when it needs them on the host (`to_numpy`).
"""

import socket
import time
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from ensemble.errors import UsageError


def _parse_address(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise UsageError(f'--coordinator_address={address!r} is not HOST:PORT; give process 0\'s host '
                     'and a free port, e.g. 10.0.0.1:1234')
  return host.strip('[]'), int(port)


def _wait_for_coordinator(address: str, timeout_s: float) -> float:
  """Returns the seconds left once process 0's coordinator accepts connections.

  JAX itself would abort with a C++ stack trace that blames a dead task; a
  reachable port is checked here first so that a wrong address or a missing
  process 0 is reported as what it is.
  """
  host, port = _parse_address(address)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
      return deadline - time.monotonic()
    except socket.gaierror as e:
      raise UsageError(f'cannot resolve the coordinator host {host!r} ({e.strerror}); '
                       'fix --coordinator_address') from None
    except OSError:
      if time.monotonic() >= deadline:
        raise UsageError(f'cannot reach the coordinator at {address} within {timeout_s:g} s: start process 0 '
                         'there, check the address and that its port is open, or raise '
                         '--initialization_timeout') from None
      time.sleep(0.2)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, initialization_timeout: int = 300,
               heartbeat_timeout: int = 100):
  """Joins the other processes of a multi-process run; must come before anything uses a JAX device.

  With all three of `coordinator_address`, `num_processes` and `process_id`,
  joins the job they describe. With none, JAX looks for a cluster it knows
  (SLURM, Open MPI, Cloud TPU, Kubernetes) in the environment, and the run is a
  single process when it finds none. Start-up waits at most
  `initialization_timeout` seconds for the others; once running, a process that
  stops answering for `heartbeat_timeout` seconds ends the others too (JAX's
  coordination service), so a dead peer never leaves the rest hanging.
  """
  given = [value is not None for value in (coordinator_address, num_processes, process_id)]
  if any(given) and not all(given):
    raise UsageError('--coordinator_address, --num_processes and --process_id go together: give all three, '
                     'or none on a cluster that jax.distributed detects (SLURM, Open MPI, Cloud TPU)')
  for name, value in (('initialization_timeout', initialization_timeout), ('heartbeat_timeout', heartbeat_timeout)):
    if value < 1:
      raise UsageError(f'--{name}={value} must be at least 1 second')
  if all(given):
    if num_processes < 1:
      raise UsageError(f'--num_processes={num_processes} must be at least 1')
    if not 0 <= process_id < num_processes:
      raise UsageError(f'--process_id={process_id} is out of range for --num_processes={num_processes}: '
                       f'give each process its own id from 0 to {num_processes - 1}')
    _parse_address(coordinator_address)
    if process_id != 0:
      initialization_timeout = max(1, int(_wait_for_coordinator(coordinator_address, initialization_timeout)))
  # CPU devices of different processes reach each other through gloo; GPUs and TPUs bring their own.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  try:
    with warnings.catch_warnings():
      # Without flags, JAX warns about every cluster type it could not use (e.g. Kubernetes without
      # the kubernetes package), although finding none just means a single process here.
      if not any(given):
        warnings.simplefilter('ignore')
      jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                 initialization_timeout=initialization_timeout,
                                 heartbeat_timeout_seconds=heartbeat_timeout)
  except ValueError as e:
    if not any(given) and 'coordinator_address' in str(e):
      return  # No cluster in the environment: a single-process run.
    raise UsageError(f'jax.distributed could not start ({e}); give --coordinator_address, '
                     '--num_processes and --process_id') from None
  except jax.errors.JaxRuntimeError as e:  # process 0 could not start the coordinator service
    where = f' at {coordinator_address}' if coordinator_address else ''
    raise UsageError(f'jax.distributed could not start the coordinator{where} ({str(e).splitlines()[0]}); '
                     'is its port already in use? pick another port') from None


def spans_processes(devices: Sequence[jax.Device]) -> bool:
  return len({d.process_index for d in devices}) > 1


def process_rows(devices: Sequence[jax.Device], num_rows: int) -> np.ndarray:
  """The rows of a batch that this process reads and feeds.

  A process that holds every device feeds whole batches. Across processes, a
  batch's leading axis (examples, or members for per-member batches) is split
  evenly over `devices` in order, and a process feeds the blocks of its own
  devices, as `jax.make_array_from_process_local_data` and host-local pmap
  inputs expect.
  """
  if not spans_processes(devices):
    return np.arange(num_rows)
  per_device = num_rows // len(devices)
  return np.concatenate([np.arange(i * per_device, (i + 1) * per_device)
                         for i, device in enumerate(devices) if device.process_index == jax.process_index()])


def process_block(devices: Sequence[jax.Device], batch: np.ndarray) -> np.ndarray:
  """This process's block of a batch: shared (B, ...) rows, or per member (K, B, ...).

  A per-member batch's members are split over `devices` in order as the
  backends place them (`backends.ensemble_mesh`): with K >= D a block of
  members per device, each member's rows whole; with fewer members than
  devices, each member's rows split over its D/K devices, which may belong to
  several processes. A process feeds the members its devices hold and, of
  those, the rows its devices hold.
  """
  if not spans_processes(devices):
    return batch
  if batch.ndim == 1 or len(batch) >= len(devices):
    return batch[process_rows(devices, len(batch))]
  num_members, num_rows = batch.shape[:2]
  per_member = len(devices) // num_members
  mine = [i for i, device in enumerate(devices) if device.process_index == jax.process_index()]
  members = sorted({i // per_member for i in mine})
  rows = process_rows(devices[members[0] * per_member:(members[0] + 1) * per_member], num_rows)
  return batch[np.asarray(members)[:, None], rows[None, :]]


def to_numpy(tree: Any) -> Any:
  """Arrays as numpy on every process, including the parts that other processes hold."""
  def fetch(x):
    if getattr(x, 'is_fully_addressable', True):
      return np.asarray(x)
    return multihost_utils.process_allgather(x, tiled=True)
  return jax.tree.map(fetch, tree)


def all_processes(ok: bool) -> bool:
  """Whether `ok` holds on every process: for decisions that each process makes from what it alone saw
  (whether it could read its shards of a checkpoint) but that all must take alike."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def from_process_0(text: str, max_bytes: int = 1024) -> str:
  """Process 0's `text` on every process: for what only process 0 finds out (who holds the workdir's lock)."""
  if jax.process_count() == 1:
    return text
  data = np.zeros(max_bytes, np.uint8)
  encoded = text.encode()[:max_bytes]
  data[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  received = np.asarray(multihost_utils.broadcast_one_to_all(data))
  return bytes(received).rstrip(b'\0').decode(errors='replace')


def barrier(name: str):
  """Every process waits here for the others: after process 0 changed files that all of them read."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def preemption_synced() -> bool:
  """Whether SIGTERM reaches this run through JAX's preemption service: several processes under
  `jax.distributed`, whose coordination client catches the signal on any host and tells the others, so that all
  stop at one step (`reached_preemption_sync_point`). A handler of Python's own would take the signal from it."""
  return (jax.process_count() > 1 and jax.distributed.is_initialized()
          and bool(jax.config.jax_enable_preemption_service))


def stop_agreed(dispatch: int) -> bool:
  """Across processes: whether every process stops after `dispatch` (counted alike on all of them from the run's
  start) because one of them was sent SIGTERM. JAX's sync point is the dispatch after the furthest any process
  had reached when the notice came, so each process must ask after every dispatch."""
  return multihost_utils.reached_preemption_sync_point(dispatch)


def coordinator_last(timeout_s: float = 10.0):
  """On a stop every process makes (SIGTERM's, at one step), process 0 exits after the others.

  Process 0 hosts jax.distributed's coordination service: gone first, it takes
  the service with it, and a process still on its way out aborts (SIGABRT
  instead of its own status 143; the suite's SIGTERM test, now and then). So
  each other process says it is leaving (the service's key-value store), and
  process 0 waits for them, `timeout_s` at most: a peer that is not stopping
  (Ctrl-C on one host) costs that wait, not a hang.
  """
  try:
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
    client = jax_distributed.global_state.client  # JAX's own; where it moved, leave as before
    if jax.process_index() != 0:
      client.key_value_set(f'ensemble/leaving/{jax.process_index()}', 'yes')
      return
    deadline = time.monotonic() + timeout_s
    for index in range(1, jax.process_count()):
      client.blocking_key_value_get(f'ensemble/leaving/{index}', max(1, int(1000 * (deadline - time.monotonic()))))
    time.sleep(0.5)  # from their `key_value_set` to their exit
  except Exception:  # pylint: disable=broad-except
    pass  # a peer that did not say so in time, or a JAX without this client: leave as before
