"""What the command-line programs share."""

import logging
import os
import re
import sys
import traceback
from typing import Callable, Sequence

from absl import app, flags, logging as absl_logging

from ensemble import checkpoint, console, files
from ensemble.errors import UsageError, exit_with_error


# Moved to ensemble.files, which the report and the trainer share; the name stays for callers of this module.
write_atomically = files.write_atomically
# The folder above the package: in a source checkout (`pip install -e .`), the one that holds configs/.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The exit status of a program that Ctrl-C stopped, as shells report it (128 + SIGINT).
INTERRUPTED = 130
TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended


def start(main: Callable[[Sequence[str]], None]):
  """Runs a program's `main` with absl, its flags parsed by `parse_flags`."""
  app.run(main, flags_parser=parse_flags)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's parsing of the command line, where a mistake in it is one `error:` line and exit status 2, as a
  UsageError in `run` is.

  absl's own reports an unknown flag or a bad value with exit status 1; a
  misspelled --config field reached the user as ml_collections' traceback.
  """
  argv = _config_in_checkout(argv)
  try:
    remaining = flags.FLAGS(argv)
    message = _unloadable_config_file(argv)
    if message is None:
      return remaining
  except flags.Error as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    message = f'{first}; see --helpfull for the flags'
  except (AttributeError, KeyError, TypeError) as e:
    if not _from_ml_collections(e):
      raise
    message = _config_field_error(e, argv)
  except OSError as e:  # a --config.FIELD override of a --config file that could not be loaded
    if not _from_ml_collections(e):
      raise
    message = _load_error(e, argv)
  exit_with_error(message)


def _from_ml_collections(error: BaseException) -> bool:
  return any('/ml_collections/' in frame.filename for frame in traceback.extract_tb(error.__traceback__))


def _config_in_checkout(argv: Sequence[str]) -> list[str]:
  """`argv` with a relative --config file that the current folder lacks and the checkout has made absolute, so that
  README's `--config=configs/default.py` runs from any folder; the checkout joins sys.path (at its end) for the
  configs that import each other (`from configs import classic`)."""
  argv = list(argv)
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      index, value, prefix = i, arg[len('--config='):], '--config='
    elif arg == '--config' and i + 1 < len(argv):
      index, value, prefix = i + 1, argv[i + 1], ''
    else:
      continue
    path, colon, rest = value.partition(':')  # config_flags passes what follows a colon to get_config
    in_checkout = os.path.join(CHECKOUT, path)
    if path and not os.path.isabs(path) and not os.path.exists(path) and os.path.isfile(in_checkout):
      argv[index] = prefix + in_checkout + colon + rest
      if CHECKOUT not in sys.path:
        sys.path.append(CHECKOUT)
  return argv


def _config_file(argv: Sequence[str]) -> str:
  """The --config file the command line names, as it names it."""
  return next((arg.split('=', 1)[1] if '=' in arg else next_arg
               for arg, next_arg in zip(argv, [*argv[1:], 'the --config file'])
               if arg.startswith('--config=') or arg == '--config'), 'the --config file')


def _unloadable_config_file(argv: Sequence[str]) -> str | None:
  """Why the --config file cannot be loaded, if it cannot: config_flags keeps that error until the config is first
  read, in `main`, where it would end the program with a traceback."""
  if 'config' not in flags.FLAGS:
    return None
  try:
    hasattr(flags.FLAGS.config, 'keys')  # the unloaded config raises OSError on any attribute
  except OSError as e:
    return _load_error(e, argv)
  return None


def _load_error(error: OSError, argv: Sequence[str]) -> str:
  """config_flags' error for a --config file it could not load, in a line: its cause's last line, and where a
  relative path was looked for."""
  lines = [line.strip() for line in str(error.__cause__ or error).splitlines() if line.strip()]
  path = _config_file(argv).partition(':')[0]
  folders = [os.getcwd(), *([CHECKOUT] if os.path.isdir(os.path.join(CHECKOUT, 'configs')) else [])]
  looked = (f' (a relative path is looked for in {", then in ".join(dict.fromkeys(folders))})'
            if not os.path.isabs(path) else '')
  return (f'--config={_config_file(argv)}: cannot be loaded ({lines[-1] if lines else type(error).__name__}); name a '
          f'Python file with a get_config(), e.g. --config=configs/default.py{looked}')


def _config_field_error(error: BaseException, argv: Sequence[str]) -> str:
  """What ml_collections' config_flags raises for --config.FIELD=VALUE when the --config file has no FIELD, in a
  line: the flag, and the field it probably meant (config_flags words that in the error's second line)."""
  config = _config_file(argv)
  inner = error.__context__ if isinstance(error, AttributeError) and error.__context__ is not None else error
  text = str(inner.args[0]) if isinstance(inner, KeyError) and inner.args else str(inner)
  lines = text.strip().splitlines() or ['']
  field = lines[0].strip('\'"')
  suggestion = re.search(r'Did you mean "([^"]+)"', text)
  flag = next((arg.split('=', 1)[0] for arg in argv
               if re.match(rf'--config(\.\w+)*\.{re.escape(field)}(=|$)', arg)), None) if field else None
  if flag is None:
    return f'a --config override cannot be set ({type(inner).__name__}: {lines[0]}); name fields of {config}'
  hint = f' (did you mean {flag.rsplit(".", 1)[0]}.{suggestion.group(1)}?)' if suggestion else ''
  return f'{flag}: {config} has no such field{hint}; name fields of {config}'


def run(argv: Sequence[str], program: str, body: Callable[[], None], exit_: Callable[[int], None] = sys.exit):
  """The frame of every program's `main`: no stray arguments, quiet libraries, the logging flags applied,
  then `body()`; a UsageError it raises ends the program with one `error:` line and exit status 2, Ctrl-C with one
  `interrupted` line (the KeyboardInterrupt's message) and exit status 130, SIGTERM in a training run alike with
  exit status 143 (ensemble/sigterm.py's `stop_on_sigterm`). The library's hints (`errors.hint`: Python warnings, which
  a script sees) are the program's log lines (`console.hints_logged`), each shown once.

  `exit_` is how to exit (train.py's skips jax.distributed's shutdown barrier).
  """
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  absl_logging.get_absl_logger().addFilter(QuietLibraries())
  ignore_closed_event_loops()
  try:
    console.setup(program)
    with console.hints_logged():
      body()
  except UsageError as e:
    exit_with_error(str(e), exit_)
  except KeyboardInterrupt as e:  # Ctrl-C: what stopped where, in a line, not a traceback
    # On a terminal, over the progress bar that the interrupt left drawn.
    clear = '\r\x1b[K' if console.interactive(sys.stderr) else ''
    print(f'{clear}interrupted: {e}' if str(e) else f'{clear}interrupted', file=sys.stderr)
    exit_(TERMINATED if getattr(e, 'terminated', False) else INTERRUPTED)


class QuietLibraries:
  """A filter for absl's logger that drops library INFO lines and keeps their warnings.

  orbax logs dozens per checkpoint; clu's ReportProgress logs "Setting work unit
  notes" from clu/platform, which `ensemble.console`'s progress replaces.
  Records carry Python's levels (WARNING is 30), not absl's (WARNING is 1).
  orbax also logs the traceback of a write that failed, then raises the same
  error to its caller, which reports it: one line when the file system
  refused the write, a traceback for a bug. The logged copy goes.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    if not any(library in record.pathname for library in ('/orbax/', '/clu/platform/')):
      return True
    return record.levelno >= logging.WARNING and not record.exc_info


def ignore_closed_event_loops():
  """Drops, for the rest of the program, the debris that a failed checkpoint write or read leaves behind.

  When one TensorStore write (or read) fails, orbax closes its event loop; the
  operations still in flight then finish into it, and each reports an error of
  its own, dozens of tracebacks ahead of the one line that says what happened
  (`checkpoint.is_dropped_io`, `checkpoint.DroppedTasks`). Reads drop theirs
  themselves; a failed write ends the program, which this covers. Every other
  unraisable error is printed.
  """
  sys.unraisablehook = checkpoint.drop_io_debris(sys.unraisablehook)
  logging.getLogger('asyncio').addFilter(checkpoint.DroppedTasks())
