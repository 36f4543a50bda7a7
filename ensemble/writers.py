"""Metric writers: clu's TensorBoard writer and a JSON-lines file; the console shows its own digest."""

import json
import math
import os
from typing import Any, Mapping, NamedTuple

import numpy as np
from clu import metric_writers

from ensemble import files


class JsonlWriter(metric_writers.MetricWriter):
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

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    pass

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


def _json_number(value: Any) -> Any:
  value = np.asarray(value).item()
  return None if isinstance(value, float) and not math.isfinite(value) else value


def drop_epochs_after(path: str, epoch: int) -> set[int]:
  """Removes the lines of epochs after `epoch` from a metrics.jsonl; returns the epochs of the lines kept.

  A resume that went back past lost checkpoints trains those epochs again and
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
    if record.get('epoch', 0) <= epoch:
      kept.append(record)
  if len(kept) < len(lines):
    strict = lambda v: [_json_number(x) for x in v] if isinstance(v, list) else _json_number(v)
    files.write_atomically(path, ''.join(json.dumps({k: strict(v) for k, v in record.items()}, allow_nan=False)
                                         + '\n' for record in kept))
  return {record.get('epoch') for record in kept}


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


class Writers(NamedTuple):
  epoch: metric_writers.MetricWriter  # per-epoch summaries: TensorBoard and metrics.jsonl
  progress: metric_writers.MetricWriter  # steps/s and uptime: TensorBoard only


def create_writers(workdir: str, is_main_process: bool = True) -> Writers:
  """Only process 0 writes files; the others write nothing.

  No clu `LoggingWriter`: it logged every scalar, member by member, on one
  line. `ensemble.console` logs one line per epoch instead.
  """
  if not is_main_process:
    nothing = metric_writers.MultiWriter([])
    return Writers(epoch=nothing, progress=nothing)
  events = metric_writers.SummaryWriter(workdir)
  return Writers(epoch=metric_writers.MultiWriter([events, JsonlWriter(os.path.join(workdir, 'metrics.jsonl'))]),
                 progress=events)
