"""What a person sees while `ensemble.train` and `ensemble.evaluate` run.

The console carries what a person can act on: a progress bar on a terminal
(plain log lines at a steady interval elsewhere), one line per epoch, and a
summary that says where the results are and what to run next. Per-member
figures stay in metrics.jsonl and TensorBoard.

Everything except the bar goes through absl logging, so `--verbosity`,
`--log_dir`, `--alsologtostderr` and `--stderrthreshold` work on it as absl
users expect.

This module must not import jax or TensorFlow at the top: the CLIs import it
first so that `quiet_libraries` runs before those libraries load.
"""

import contextlib
import contextvars
import json
import logging as py_logging
import os
import shlex
import sys
import time
import warnings
from typing import Any, Iterable, Iterator, Mapping, TextIO

import numpy as np
from absl import flags, logging
from tqdm.auto import tqdm  # a widget in a notebook, text on a terminal

from ensemble.errors import EnsembleWarning, UsageError, exit_with_error

FLAGS = flags.FLAGS

# The console module is imported first by the CLIs, so this is close enough to the command's start.
_STARTED = time.monotonic()

# Python loggers whose INFO lines report nothing a person can act on; their warnings still show.
# jax._src.xla_bridge: "Unable to initialize backend 'tpu'" (or 'cuda') on every machine without one.
QUIET_LOGGERS = ('jax._src.xla_bridge',)

# Whether a library call's stages are shown (`stages_shown`): None outside one (the CLIs: their log shows what it
# shows), True or False as its `progress=` says.
_STAGES_SHOWN: contextvars.ContextVar[bool | None] = contextvars.ContextVar('ensemble_stages_shown', default=None)

# How often, in seconds, progress is drawn on a terminal and logged elsewhere (clu's ReportProgress logs every 60 s).
BAR_EVERY_SECS = 0.5
LOG_EVERY_SECS = 60.0


@contextlib.contextmanager
def root_logging_kept():
  """Leaves the root logger's handlers as they were: absl's first log call (orbax's, at import) adds a stream
  handler to an unconfigured root logger (`logging.basicConfig`), after which the caller's own `basicConfig`
  would do nothing. Warnings logged meanwhile still show."""
  root = py_logging.getLogger()
  before = list(root.handlers)
  try:
    yield
  finally:
    for handler in root.handlers:
      if handler not in before:
        root.removeHandler(handler)


@contextlib.contextmanager
def hints_logged():
  """While a program runs: each `EnsembleWarning` (`errors.hint`) is one WARNING line of its log, at the library's
  line that gave it, where Python would print it as a warning beside that log (two lines, then the source line of
  the caller). The warnings filters still apply (shown once per line that caused it; `-W ignore::...` silences
  them); other warnings print as before, and all is as it was afterwards."""
  with warnings.catch_warnings():
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
      if not issubclass(category, EnsembleWarning):
        return shown(message, category, filename, lineno, file, line)
      logger = logging.get_absl_logger()
      if logger.isEnabledFor(py_logging.WARNING):
        origin = getattr(message, 'origin', None) or (filename, lineno)
        logger.handle(logger.makeRecord(logger.name, py_logging.WARNING, origin[0], origin[1], '%s', (str(message),),
                                        None))
    warnings.showwarning = show
    yield


def quiet_libraries():
  """Silences the start-up notices of TensorFlow and XLA's C++ code; call it before either is imported.

  Only the CLIs call it: importing `ensemble` must not change a caller's environment.
  A value the user has set wins.

  - TensorFlow (loaded only to read tensorflow-datasets)
    logs "oneDNN custom operations are on" when it loads, ahead of absl's "All
    log messages before absl::InitializeLog() is called" preface, and
    TF_CPP_MIN_LOG_LEVEL does not reach that line. TensorFlow computes nothing
    here (JAX does, and jaxlib does not read this variable), so its oneDNN
    kernels are turned off, and with them the notice.
  - TF_CPP_MIN_LOG_LEVEL=1 drops the C++ INFO lines of TensorFlow and XLA
    ("This TensorFlow binary is optimized to use...", "PjRt-IFRT device
    count", GPU start-up) and keeps their warnings and errors.
  """
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')


# The file a run's lock is on (ensemble/checkpoint.py's LOCK_FILE, which imports jax).
WORKDIR_LOCK = 'lock'


def refuse_a_busy_workdir(argv: list[str]):
  """Ends the program with the `error:` line a busy workdir gets (ensemble/checkpoint.py's `lock_workdir`) before
  JAX and the data load, where that refusal came after seconds of them: the --workdir on the command line has a lock
  file that another live process holds. The lock is not taken here, only asked for shared and let go at once (a
  file that is not there is not made); the run takes it as before, and refuses there whatever this let pass."""
  workdir = next((arg.split('=', 1)[1] for arg in argv if arg.startswith(('--workdir=', '-workdir='))), None)
  if workdir is None:
    workdir = next((value for arg, value in zip(argv, argv[1:]) if arg in ('--workdir', '-workdir')), None)
  if not workdir:
    return
  import fcntl  # pylint: disable=g-import-not-at-top  # POSIX only, as the run's own lock
  path = os.path.join(os.path.abspath(workdir), WORKDIR_LOCK)
  try:
    with open(path, encoding='utf-8') as f:
      try:
        fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let go when the file closes
      except BlockingIOError:
        holder = f.read().strip() or 'another process'
        exit_with_error(f'{os.path.abspath(workdir)} is in use by {holder} (it holds {path}); wait for that run to end '
                        'or stop it, or train in another --workdir')
  except OSError:  # no lock file (a new workdir), or a file system without flock: the run's own check decides
    return


def setup(program_name: str):
  """Applies the logging flags once they are parsed; call it first in `main`, before JAX picks its backend.

  absl's `app.run` leaves `--log_dir` unused; here it sends the log to a file
  there, as absl's C++ logging does (stderr then gets `--stderrthreshold` and
  up, or everything with `--alsologtostderr`). At `--verbosity=1` (debug) and
  for loggers named in `--logger_levels`, the libraries' INFO lines stay.
  """
  if FLAGS.verbosity < logging.DEBUG:
    for name in QUIET_LOGGERS:
      if name not in FLAGS.logger_levels:
        py_logging.getLogger(name).setLevel(py_logging.WARNING)
  if FLAGS.log_dir and not FLAGS.logtostderr:
    try:
      os.makedirs(FLAGS.log_dir, exist_ok=True)
      logging.get_absl_handler().use_absl_log_file(program_name, FLAGS.log_dir)
    except OSError as e:
      raise UsageError(f'--log_dir={FLAGS.log_dir}: cannot write logs there ({e.strerror or e}); '
                       'choose a writable folder') from None


def interactive(file: TextIO | None = None) -> bool:
  """Whether a live bar can be drawn: on a terminal, or in a notebook (where tqdm.auto draws a widget)."""
  file = sys.stderr if file is None else file
  return getattr(file, 'isatty', lambda: False)() or 'ipykernel' in sys.modules


def _is_main_process() -> bool:
  import jax  # pylint: disable=g-import-not-at-top  # here, not at the top: see the module docstring
  return jax.process_index() == 0


def plural_of(noun: str) -> str:
  """'steps', 'severities', 'batches': an English noun's plural by its ending (progress lines name their units)."""
  if noun.endswith('y') and noun[-2:-1] not in ('', 'a', 'e', 'i', 'o', 'u'):
    return noun[:-1] + 'ies'
  return noun + ('es' if noun.endswith(('s', 'x', 'z', 'ch', 'sh')) else 's')


def count(number: int, noun: str, plural: str = '') -> str:
  """'1 member', '8 members' ('1 class', '2 classes' with `plural`): a log line that reads as written."""
  return f'{number} {noun if number == 1 else plural or plural_of(noun)}'


def _duration(seconds: float) -> str:
  if seconds < 60:
    return f'{seconds:#.4g} s'
  minutes, seconds = divmod(round(seconds), 60)
  if minutes < 60:
    return f'{minutes}m {seconds:02d}s'
  return f'{minutes // 60}h {minutes % 60:02d}m'


def _figure(value: float) -> str:
  return f'{value:#.4g}'


def _local_values(array: Any) -> list[np.ndarray]:
  """The values this process holds, fetched without a collective: a multi-process run shows its own members."""
  shards = getattr(array, 'addressable_shards', None)
  if shards is None:
    return [np.asarray(array)]
  return [np.asarray(shard.data) for shard in shards]


class _Bar(tqdm):
  """tqdm whose postfix is computed when the bar is drawn, so the loss is fetched from the devices only then."""
  monitor_interval = 0  # no monitor thread: drawing fetches device arrays and stays on the caller's thread

  def __init__(self, *args, describe, **kwargs):
    self._describe = describe
    super().__init__(*args, **kwargs)

  @property
  def format_dict(self):
    values = super().format_dict
    rate = values['rate']
    if rate is None and values['elapsed'] and values['n'] > values['initial']:
      rate = (values['n'] - values['initial']) / values['elapsed']  # as tqdm shows it before its average warms up
    values['postfix'] = self._describe(rate)
    return values


class _AboveTheBar(py_logging.Handler):
  """Hands records to another handler with the bar cleared and redrawn below, so log lines do not tear it."""

  def __init__(self, inner: py_logging.Handler, file: TextIO):
    super().__init__(inner.level)
    self.inner, self._file = inner, file

  def handle(self, record):
    with _Bar.external_write_mode(file=self._file):
      return self.inner.handle(record)

  def emit(self, record):
    self.handle(record)


class Progress:
  """Progress through `total` steps of a long pass: a live bar on a terminal, a log line every minute elsewhere.

  Shared by training (a bar per epoch), evaluation (the rotations) and any
  later pass over many batches. Shows on process 0 only, and not below
  `--verbosity=0`; `bar` forces the bar on or off (`ensemble.fit` shows it in
  a notebook, where tqdm draws a widget). `items_per_step` adds a throughput in items (member-images:
  batch size times members); metrics passed to `update` add the running mean
  loss, fetched only when progress is shown: `loss` says which metric, and
  what to add to it (a task's, `reported_loss`: a regression's NLL in the
  targets' units, as the epoch's summary reports it); a dict of metrics and their weights names a weighted sum of
  them (a quantile task's pinball losses per target, each in its target's units).
  """

  def __init__(self, total: int, desc: str, *, unit: str = 'step', items_per_step: int = 0,
               items: str = 'member-images', every_secs: float | None = None, file: TextIO | None = None,
               show: bool | None = None, bar: bool | None = None,
               loss: tuple[str | dict[str, float], float] = ('loss', 0.0)):
    self.total, self.desc, self.unit, self.units = total, desc, unit, plural_of(unit)
    self._loss_key, self._loss_offset = loss
    self._items_per_step, self._items = items_per_step, items
    self._file = sys.stderr if file is None else file
    shown = _STAGES_SHOWN.get()  # inside a library call (`stages_shown`), its `progress=` decides
    self._show = (_is_main_process() and shown is not False) if show is None else show
    self._started = time.monotonic()
    self._n = 0
    self._pending_losses: list[Any] = []
    self._loss_sum, self._loss_count = 0.0, 0
    self._bar = None
    self._wrapped: list[tuple[py_logging.Handler, _AboveTheBar]] = []
    if not self._show:
      return
    if bar is None:  # a library call's progress=True: on a terminal or in a notebook, as fit's bar
      bar = (interactive(self._file) if shown
             else getattr(self._file, 'isatty', lambda: False)() and logging.level_info())
    if bar:
      self._bar = _Bar(total=total, desc=desc, file=self._file, leave=False, dynamic_ncols=True,
                       mininterval=BAR_EVERY_SECS if every_secs is None else every_secs,
                       bar_format='{desc}: {percentage:3.0f}%|{bar}| {n}/{total} ' + self.units + ' '
                                  '[{elapsed}<{remaining}{postfix}]',
                       describe=self._describe)
      root = py_logging.getLogger()
      self._wrapped = [(handler, _AboveTheBar(handler, self._file)) for handler in root.handlers]
      root.handlers = [wrapper for _, wrapper in self._wrapped]
    else:
      self._every_secs = LOG_EVERY_SECS if every_secs is None else every_secs
      self._last_log = (self._started, 0)

  def update(self, n: int = 1, metrics: Mapping[str, Any] | None = None):
    """Counts `n` more steps done; `metrics` (device arrays are fine) may carry their 'loss'."""
    self._n += n
    if not self._show:
      return
    if metrics is not None:
      weights = self._loss_key if isinstance(self._loss_key, dict) else {self._loss_key: 1.0}
      if all(key in metrics for key in weights):  # a sum of device arrays stays on the device until shown
        self._pending_losses.append(sum(weight * metrics[key] for key, weight in weights.items()))
    if self._bar is not None:
      self._bar.update(n)
      if self._n >= self.total:
        self._bar.refresh()  # the finished pass stays in view while what follows it (evaluation) runs
      return
    now = time.monotonic()
    then, n_then = self._last_log
    if now - then >= self._every_secs and self._n > n_then:
      self._last_log = (now, self._n)
      rate = (self._n - n_then) / max(now - then, 1e-9)
      eta = (self.total - self._n) / rate
      logging.info('%s: %d/%d %s (%.0f%%), %s, ETA %s', self.desc, self._n, self.total, self.units,
                   100 * self._n / self.total, self._describe(rate), tqdm.format_interval(eta))

  def _running_loss(self) -> float | None:
    for loss in self._pending_losses:
      for values in _local_values(loss):
        self._loss_sum += float(values.sum())
        self._loss_count += values.size
    self._pending_losses = []
    return self._loss_sum / self._loss_count + self._loss_offset if self._loss_count else None

  def _describe(self, rate: float | None) -> str:
    if not rate:
      parts = [f'? {self.units}/s']
    elif rate >= 1:
      parts = [f'{rate:.3g} {self.units}/s']
    else:
      parts = [f'{1 / rate:.3g} s/{self.unit}']
    if self._items_per_step:
      parts.append(f'{tqdm.format_sizeof(rate * self._items_per_step) if rate else "?"} {self._items}/s')
    loss = self._running_loss()
    if loss is not None:
      parts.append(f'loss {_figure(loss)}')
    return ', '.join(parts)

  def close(self) -> float:
    """Removes the bar and returns the seconds since the pass began."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None
      root = py_logging.getLogger()
      root.handlers = [next((inner for inner, wrapper in self._wrapped if wrapper is h), h) for h in root.handlers]
      self._wrapped = []
    return time.monotonic() - self._started

  def __enter__(self) -> 'Progress':
    return self

  def __exit__(self, *exc_info):
    self.close()


def track(iterable: Iterable[Any], desc: str, **kwargs) -> Iterator[Any]:
  """Yields the items of `iterable`, showing a `Progress` over them (keyword arguments as for `Progress`)."""
  items = list(iterable)
  progress = Progress(len(items), desc, **kwargs)
  try:
    for item in items:
      yield item
      progress.update()
  finally:
    progress.close()


def _loss_name(record: Mapping[str, Any]) -> str:
  """What a summary's losses are: a quantile ensemble's a pinball loss (its `test_coverage` says so), else NLLs."""
  return 'pinball loss' if 'test_coverage' in record else 'NLL'


def _member_accuracies(record: Mapping[str, Any]) -> list[float]:
  """Member accuracies from an epoch summary (`member_test_accuracy/i` keys) or a metrics.jsonl line (a list)."""
  if 'member_test_accuracy' in record:
    return list(record['member_test_accuracy'])
  prefix = 'member_test_accuracy/'
  indexed = {int(k[len(prefix):]): v for k, v in record.items() if k.startswith(prefix)}
  return [indexed[i] for i in sorted(indexed)]


def _figures(record: Mapping[str, Any]) -> str:
  if 'test_rmse' in record:  # regression
    return f'ensemble RMSE {_figure(record["test_rmse"])}, NLL {_figure(record["test_loss"])}'
  if 'test_coverage' in record:  # quantile regression: a pinball loss and the outermost pair's interval
    return (f'ensemble pinball loss {_figure(record["test_loss"])}, interval coverage '
            f'{_figure(record["test_coverage"])}')
  members = _member_accuracies(record)
  if len(members) <= 1:
    return f'accuracy {_figure(record["test_accuracy"])}, NLL {_figure(record["test_loss"])}'
  return (f'ensemble accuracy {_figure(record["test_accuracy"])}, NLL {_figure(record["test_loss"])}; '
          f'member accuracy mean {_figure(np.mean(members))}, best {_figure(max(members))}')


# A member is near chance (1 / classes) when it has come less than this share of the way from chance to where the
# median member is, once the median member is at least NEAR_CHANCE_MIN_GAIN above chance (the others learn).
NEAR_CHANCE_SHARE = 0.2
NEAR_CHANCE_MIN_GAIN = 0.1


def members_near_chance(accuracies: list[float], num_classes: int | None) -> list[int]:
  """The members whose test accuracy stays near chance while the others learn.

  Such a member adds noise to the ensemble's average without a NaN to stop the
  run: method hyper draws a learning rate too high (or too low) for it.
  """
  if len(accuracies) < 2 or not num_classes:
    return []
  chance = 1.0 / num_classes
  learned = float(np.median(accuracies)) - chance
  if learned < NEAR_CHANCE_MIN_GAIN:
    return []
  return [i for i, accuracy in enumerate(accuracies) if accuracy - chance < NEAR_CHANCE_SHARE * learned]


def _near_chance_warning(record: Mapping[str, Any], num_classes: int | None, method: str | None) -> str | None:
  accuracies = _member_accuracies(record)
  near = members_near_chance(accuracies, num_classes)
  if not near:
    return None
  fix = (' (method hyper draws each member its own from --config.hyper_learning_rate: narrow it)'
         if method == 'hyper' else '')
  return (f'members {near} are near chance (test accuracy {", ".join(_figure(accuracies[i]) for i in near)}; '
          f'chance {_figure(1 / num_classes)}) while the median member reaches {_figure(np.median(accuracies))}: they '
          f'learn nothing and blur the average; their learning rate is likely too high or too low{fix}')


def log_epoch(summary: Mapping[str, Any], num_epochs: int, seconds: float, echo: bool = False,
              num_classes: int | None = None, method: str | None = None):
  """One line per epoch, the figures a person compares across epochs; the members' own go to metrics.jsonl.

  The line is logged; with `echo` it is also written under the bar, for a
  library caller (`ensemble.fit`) whose program does not show absl's INFO lines.
  With `num_classes`, a warning follows it while members stay near chance
  (naming the setting to change when `method` draws each member its own).
  """
  figures = f'{_figures(summary)}; ' if 'test_loss' in summary else ''  # epochs without a test pass have none
  if 'validation_loss' in summary:  # early stopping's
    figures += (f'validation {_loss_name(summary)} {_figure(summary["validation_loss"])} (best: epoch '
                f'{int(summary["best_epoch"])}); ')
  _say(f'epoch {int(summary["epoch"])}/{num_epochs}: {figures}train loss {_figure(summary["train_loss"])}; '
       f'{_duration(seconds)}', echo)
  warning = _near_chance_warning(summary, num_classes, method)
  if warning and _is_main_process():
    logging.warning('epoch %d/%d: %s.', summary['epoch'], num_epochs, warning)


def _say(line: str, echo: bool):
  """Logs `line`; with `echo`, also writes it to stderr (under any bar) where absl's INFO lines do not show: a
  library caller's program (`ensemble.fit`, `Ensemble.report`), which has not set absl's verbosity."""
  if echo and _is_main_process() and not logging.level_info():
    tqdm.write(line, file=sys.stderr)
  logging.info('%s', line)


@contextlib.contextmanager
def stages_shown(progress: bool):
  """While a library call runs (`Ensemble.report`): its `progress=` says whether its `stage`s write their lines and
  its passes (`Progress`, `track`) their bars, as `ensemble.fit(progress=)` does its epochs. Outside one (the CLIs)
  no stage line is written: their log already says what each stage does."""
  token = _STAGES_SHOWN.set(progress)
  try:
    yield
  finally:
    _STAGES_SHOWN.reset(token)


@contextlib.contextmanager
def stage(name: str):
  """Times one stage of a library call ('report: test pass 1.234 s') and, where `stages_shown(True)`, says it when
  it ends: a long call shows where it is, as fit's epoch lines do."""
  started = time.monotonic()
  yield
  if _STAGES_SHOWN.get():
    _say(f'report: {name} {_duration(time.monotonic() - started)}', echo=True)


def _last_record(path: str) -> dict[str, Any] | None:
  try:
    with open(path, encoding='utf-8') as f:
      lines = [line for line in f if line.strip()]
    return json.loads(lines[-1]) if lines else None
  except (OSError, ValueError):
    return None


def _recorded_classes(workdir: str, epoch: int) -> int | None:
  """The number of classes that checkpoint `epoch` of `workdir` records, if it can be read."""
  from ensemble import checkpoint  # pylint: disable=g-import-not-at-top  # imports jax: see the module docstring
  try:
    return int(checkpoint.read_record(workdir, epoch)['data']['num_classes'])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def log_training_summary(workdir: str, summary: Mapping[str, Any] | None = None, num_classes: int | None = None,
                         method: str | None = None):
  """Where a finished run's results are and what to run next, on process 0; and a warning if members ended near
  chance (`num_classes` defaults to what the checkpoints record; `method` as in `log_epoch`).

  `summary` is the last epoch's (`trainer.train_and_evaluate` returns it);
  when this run trained nothing (resumed at its last epoch), the last line of
  metrics.jsonl speaks for it.
  """
  if not _is_main_process():
    return
  workdir = os.path.abspath(workdir)
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  record = summary or _last_record(metrics_path)
  result = f' (epoch {int(record["epoch"])}): {_figures(record)}' if record else ''
  if record and 'epochs_trained' in record:  # early stopping: the best epoch's members are the result
    result = (f' (early stopping: epoch {int(record["epoch"])} of the {int(record["epochs_trained"])} trained, the '
              f'lowest validation {_loss_name(record)}, {record["validation_loss"]:.4g}): {_figures(record)}')
  quoted = shlex.quote(workdir)
  logging.info('\n'.join([
      f'Done in {_duration(time.monotonic() - _STARTED)}{result}.',
      f'  checkpoints:        {os.path.join(workdir, "checkpoints")}',
      f'  metrics:            {metrics_path}',
      f'  TensorBoard events: {workdir}',
      'Next:',
      f'  tensorboard --logdir {quoted}',
      f'  python -m ensemble.evaluate --workdir {quoted}',
  ]))
  if record and len(_member_accuracies(record)) > 1:
    warning = _near_chance_warning(record, num_classes or _recorded_classes(workdir, int(record['epoch'])), method)
    if warning:
      logging.warning('In the last epoch, %s.', warning)
