"""Metric writers: TensorBoard event files and a JSON-lines file; the console shows its own digest.

The event files are written with tensorboard's protobufs and record framing, not
clu's `SummaryWriter`: that one imports TensorFlow, 4 of the 6 seconds it took to
import `ensemble.train` (`python -X importtime`, 2026-11-23), for a few scalars per epoch.
"""

import json
import math
import os
import socket
import time
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from ensemble import files


class MetricWriter(Protocol):
  """What the trainer writes to: clu's `MetricWriter` interface, for the scalars it writes."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]): ...

  def flush(self): ...

  def close(self): ...


class JsonlWriter:
  """Appends one JSON object per `write_scalars` call to a file.

  TensorBoard wants one scalar per tag, so per-member values arrive as
  `name/0`, `name/1`, ...; a JSON reader wants them as one list, so those keys
  are folded into `name: [...]` in member order. Non-scalar summaries are not
  written here.
  """

  def __init__(self, path: str):
    self._path = path
    self._file = open(path, 'a', encoding='utf-8')

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    record: dict[str, Any] = {'step': int(step)}
    members: dict[str, dict[int, float]] = {}
    for key, value in scalars.items():
      name, _, index = key.rpartition('/')
      if name and index.isdigit():
        members.setdefault(name, {})[int(index)] = _json_number(value)
      else:
        record[key] = _json_number(value)
    for name, values in members.items():
      record[name] = [values[i] for i in sorted(values)]
    self._file.write(json.dumps(record, allow_nan=False) + '\n')

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


class TensorBoardWriter:
  """Scalars as TensorBoard reads them: one events.out.tfevents.* file per run (or resume) in `logdir`."""

  def __init__(self, logdir: str):
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    name = f'events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{id(self)}.v2'
    self._records = RecordWriter(open(os.path.join(logdir, name), 'wb'))
    self._records.write(self._event(wall_time=time.time(), file_version='brain.Event:2').SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    values = [self._summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
    event = self._event(wall_time=time.time(), step=int(step), summary=self._summary(value=values))
    self._records.write(event.SerializeToString())

  def flush(self):
    self._records.flush()

  def close(self):
    self._records.close()


class MultiWriter:
  """Writes to each of `writers` (none: writes nothing)."""

  def __init__(self, writers: Sequence[MetricWriter]):
    self._writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    for writer in self._writers:
      writer.write_scalars(step, scalars)

  def flush(self):
    for writer in self._writers:
      writer.flush()

  def close(self):
    for writer in self._writers:
      writer.close()


class ProgressReport:
  """Steps per second and uptime to `writer` every `every_secs`, as clu's `periodic_actions.ReportProgress` does
  (without importing TensorFlow through clu's writers)."""

  def __init__(self, writer: MetricWriter, every_secs: float = 60.0):
    self._writer, self._every = writer, every_secs
    self._start = self._last = time.monotonic()
    self._last_step = None

  def __call__(self, step: int):
    now = time.monotonic()
    if self._last_step is None:
      self._last_step, self._last = step, now
    elif now - self._last >= self._every:
      self._writer.write_scalars(step, {'steps_per_sec': (step - self._last_step) / (now - self._last),
                                        'uptime': now - self._start})
      self._writer.flush()
      self._last_step, self._last = step, now


def _json_number(value: Any) -> Any:
  value = np.asarray(value).item()
  return None if isinstance(value, float) and not math.isfinite(value) else value


def drop_lines_after(path: str, step: int) -> set[int]:
  """Removes the lines of steps after `step` from a metrics.jsonl; returns the steps of the lines kept.

  A resume that went back past lost checkpoints trains those steps again and
  writes their lines anew. A line cut short (a crash or a full disk while
  writing it) goes too; the resume writes it again from its checkpoint. The
  file is replaced whole, so a crash leaves the old one or the new one.
  """
  if not os.path.exists(path):
    return set()
  with open(path, encoding='utf-8') as f:
    lines = [line for line in f if line.strip()]
  kept = []
  for line in lines:
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if record.get('step', 0) <= step:
      kept.append(record)
  if len(kept) < len(lines):
    strict = lambda v: [_json_number(x) for x in v] if isinstance(v, list) else _json_number(v)
    files.write_atomically(path, ''.join(json.dumps({k: strict(v) for k, v in record.items()}, allow_nan=False)
                                         + '\n' for record in kept))
  return {record.get('step') for record in kept}


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


class Writers(NamedTuple):
  epoch: MetricWriter  # per-epoch summaries: TensorBoard and metrics.jsonl
  progress: MetricWriter  # steps/s and uptime: TensorBoard only


def create_writers(workdir: str, is_main_process: bool = True) -> Writers:
  """Only process 0 writes files; the others write nothing.

  No clu `LoggingWriter`: it logged every scalar, member by member, on one
  line. `ensemble.console` logs one line per epoch instead.
  """
  if not is_main_process:
    nothing = MultiWriter([])
    return Writers(epoch=nothing, progress=nothing)
  events = TensorBoardWriter(workdir)
  return Writers(epoch=MultiWriter([events, JsonlWriter(os.path.join(workdir, 'metrics.jsonl'))]), progress=events)
