"""What a person sees: the progress helper, the epoch line, the summary, and the CLIs on a terminal and a pipe."""

import fcntl
import io
import json
import logging as py_logging
import os
import re
import struct
import subprocess
import sys
import termios

import jax
import numpy as np
import pytest
from absl import logging

from conftest import COMPILE_FLAGS, DURATION, write_mnist
from ensemble import console

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the libraries print at start-up unless the CLIs silence it.
LIBRARY_NOTICES = ('oneDNN', 'absl::InitializeLog', 'Unable to initialize backend', 'cpu_feature_guard',
                   'PjRt-IFRT', 'Setting work unit notes', 'logging_writer', 'member_test_accuracy/')
EPOCH_LINE = re.compile(r'epoch (\d+)/2: ensemble accuracy (\S+), NLL (\S+); member accuracy mean (\S+), '
                        rf'best (\S+); train loss (\S+); {DURATION}')


class Terminal(io.StringIO):

  def isatty(self):
    return True


@pytest.fixture
def info_verbosity():
  """absl's verbosity as `app.run` leaves it (INFO); pytest itself leaves it at WARNING."""
  before = logging.get_verbosity()
  logging.set_verbosity(logging.INFO)
  yield
  logging.set_verbosity(before)


SI = {'': 1, 'k': 1e3, 'M': 1e6, 'G': 1e9, 'T': 1e12}
RATES = re.compile(r'([\d.e+]+) steps/s, ([\d.]+)([kMGT]?) member-images/s')


def _check_rates(text, items_per_step):
  rates = RATES.findall(text)
  assert rates, text
  for steps, images, prefix in rates:
    assert float(images) * SI[prefix] == pytest.approx(items_per_step * float(steps), rel=0.02)


def _messages(caplog):
  return [record.getMessage() for record in caplog.records if record.name == 'absl']


def test_bar_on_a_terminal_shows_rate_throughput_eta_and_running_loss(info_verbosity):
  screen = Terminal()
  progress = console.Progress(4, 'epoch 1/2', items_per_step=64, every_secs=0, file=screen, show=True)
  progress.update(1, {'loss': jax.numpy.array([2.0, 4.0])})  # a device array, as the trainer passes
  progress.update(1, {'loss': np.array([0.0, 2.0])})
  first = screen.getvalue()
  progress.update(2)
  assert progress.close() > 0
  drawn = screen.getvalue()

  assert 'epoch 1/2' in drawn and '4/4 steps' in drawn and '\r' in drawn
  assert 'loss 3.000' in first and 'loss 2.000' in first  # the running mean over the epoch so far
  assert re.search(r'\[\d\d:\d\d<\d\d:\d\d', drawn)  # elapsed < ETA
  _check_rates(drawn, 64)
  assert drawn.endswith('\r') and not drawn.rstrip('\r').split('\r')[-1].strip()  # the bar is gone


def test_log_lines_do_not_tear_the_bar(info_verbosity):
  screen = Terminal()
  root = py_logging.getLogger()
  handler = py_logging.StreamHandler(screen)
  root.addHandler(handler)
  try:
    progress = console.Progress(2, 'rotations', unit='angle', every_secs=0, file=screen, show=True)
    progress.update()
    logging.warning('a warning while the bar is up')
    progress.update()
    progress.close()
    assert handler in root.handlers  # the handlers are given back
  finally:
    root.removeHandler(handler)
  before, _, _ = screen.getvalue().partition('a warning while the bar is up')
  assert re.search(r'\r +\r$', before), repr(before[-200:])  # the bar was cleared first
  assert 'rotations:' in before and '1/2 angles' in before


def test_log_lines_when_not_a_terminal(info_verbosity, caplog):
  caplog.set_level(py_logging.INFO)
  piped = io.StringIO()
  progress = console.Progress(4, 'epoch 1/2', items_per_step=64, every_secs=0, file=piped, show=True)
  progress.update(2, {'loss': np.array([[1.0], [3.0]])})
  progress.update(2, {'loss': np.array([[0.0], [0.0]])})
  progress.close()
  assert piped.getvalue() == ''
  lines = _messages(caplog)
  assert len(lines) == 2
  assert lines[0].startswith('epoch 1/2: 2/4 steps (50%), ') and lines[0].endswith('loss 2.000, ETA 00:00')
  assert lines[1].startswith('epoch 1/2: 4/4 steps (100%), ') and 'loss 1.000' in lines[1]
  _check_rates(lines[0], 64)


def test_log_lines_wait_for_their_interval(info_verbosity, caplog):
  caplog.set_level(py_logging.INFO)
  progress = console.Progress(3, 'epoch 1/2', every_secs=3600, file=io.StringIO(), show=True)
  for _ in range(3):
    progress.update()
  progress.close()
  assert _messages(caplog) == []


def test_nothing_shows_below_info_or_off_process_zero(info_verbosity, caplog, monkeypatch):
  caplog.set_level(py_logging.INFO)
  screen = Terminal()
  logging.set_verbosity(logging.WARNING)
  with console.Progress(2, 'quiet', every_secs=0, file=screen, show=True) as progress:
    progress.update(2)
  logging.set_verbosity(logging.INFO)
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  for file in (screen, io.StringIO()):
    progress = console.Progress(2, 'process 1', every_secs=0, file=file)
    progress.update(2, {'loss': np.ones(2)})
    progress.close()
  console.log_training_summary('/tmp/run', {'epoch': 1, 'test_accuracy': 1.0, 'test_loss': 0.0})
  assert screen.getvalue() == '' and _messages(caplog) == []


def test_track_yields_every_item(info_verbosity):
  screen = Terminal()
  assert list(console.track([0, 90, 180], 'rotations', unit='angle', every_secs=0, file=screen, show=True)) == [
      0, 90, 180]
  assert '3/3 angles' in screen.getvalue()


def test_a_progress_line_names_its_units_in_the_plural(info_verbosity, caplog):
  """Issue 76: the noise sweep's progress read "2/5 severitys"."""
  caplog.set_level(py_logging.INFO)
  assert [console.plural_of(noun) for noun in ('step', 'severity', 'batch', 'day', 'class')] == [
      'steps', 'severities', 'batches', 'days', 'classes']
  list(console.track([1, 2], 'gaussian noise', unit='severity', every_secs=0, file=io.StringIO(), show=True))
  line, = [message for message in _messages(caplog) if message.startswith('gaussian noise: 2/2')]
  assert line.startswith('gaussian noise: 2/2 severities (100%), ') and ' severities/s' in line, line


def _summary(member_accuracy, epoch=2, test_accuracy=0.991234567, test_loss=0.0310213):
  summary = {'epoch': float(epoch), 'train_loss': 0.123456789, 'train_accuracy': 0.97,
             'test_loss': test_loss, 'test_accuracy': test_accuracy}
  for i, accuracy in enumerate(member_accuracy):
    summary[f'member_test_loss/{i}'] = 0.05
    summary[f'member_test_accuracy/{i}'] = accuracy
  return summary


@pytest.mark.parametrize('seconds', [3e-05, 0.5, 59.99, 61.0, 3599.0, 3700.0])
def test_every_duration_the_console_prints_is_one_the_tests_read(seconds):
  """The tests read a run's durations with `DURATION`: a first epoch over a minute (its compiles, on a machine whose
  compilation cache is empty) printed as '1m 05s', which the tests' old pattern ('12.34 s') did not read."""
  assert re.fullmatch(DURATION, console._duration(seconds)), console._duration(seconds)  # pylint: disable=protected-access


def test_epoch_line_has_the_ensemble_and_member_figures_to_four_digits(info_verbosity, caplog):
  caplog.set_level(py_logging.INFO)
  members = [0.9812345, 0.9765432, 0.9901234]
  console.log_epoch(_summary(members), 10, 52.3456)
  console.log_epoch(_summary([0.5]), 10, 125)  # one model over a mesh: no members to compare
  ensemble, single = _messages(caplog)
  assert ensemble == (f'epoch 2/10: ensemble accuracy 0.9912, NLL 0.03102; member accuracy mean '
                      f'{np.mean(members):.4f}, best 0.9901; train loss 0.1235; 52.35 s')
  assert single == 'epoch 2/10: accuracy 0.9912, NLL 0.03102; train loss 0.1235; 2m 05s'


def test_a_member_that_stays_near_chance_while_the_others_learn_is_warned_of(info_verbosity, caplog, tmp_path):
  """A `hyper` member whose drawn rate is too high predicts one class, without a NaN to stop the run."""
  caplog.set_level(py_logging.INFO)
  members = [0.97, 0.098, 0.96, 0.95, 0.112, 0.97, 0.96, 0.98]
  assert console.members_near_chance(members, 10) == [1, 4]
  assert console.members_near_chance([0.12, 0.1, 0.11], 10) == []  # nobody learns yet: nothing to compare with
  assert console.members_near_chance([0.6, 0.55, 0.58], 2) == []
  console.log_epoch(_summary(members), 10, 5.0, num_classes=10, method='hyper')
  console.log_training_summary(str(tmp_path), {**_summary(members), 'step': 80}, num_classes=10, method='hyper')
  console.log_epoch(_summary(members), 10, 5.0, num_classes=10, method='independent')
  warnings = [r.getMessage() for r in caplog.records if r.levelno == py_logging.WARNING]
  what = ('members [1, 4] are near chance (test accuracy 0.09800, 0.1120; chance 0.1000) while the median member '
          'reaches 0.9600: they learn nothing and blur the average; their learning rate is likely too high or too '
          'low')
  hyper = f'{what} (method hyper draws each member its own from --config.hyper_learning_rate: narrow it)'
  assert warnings == [f'epoch 2/10: {hyper}.', f'In the last epoch, {hyper}.', f'epoch 2/10: {what}.']
  caplog.clear()
  console.log_epoch(_summary([0.97, 0.96]), 10, 5.0, num_classes=10)
  assert not [r for r in caplog.records if r.levelno == py_logging.WARNING]


def test_summary_says_where_the_results_are_and_what_to_run(info_verbosity, caplog, tmp_path):
  caplog.set_level(py_logging.INFO)
  workdir = tmp_path / 'my run'
  workdir.mkdir()
  last = {'step': 14, 'epoch': 3, 'test_accuracy': 0.87654, 'test_loss': 0.4321, 'member_test_accuracy': [0.8, 0.85]}
  (workdir / 'metrics.jsonl').write_text(json.dumps({**last, 'epoch': 2}) + '\n' + json.dumps(last) + '\n')
  console.log_training_summary(str(workdir), {})  # resumed at its last epoch: metrics.jsonl speaks for it
  (message,) = _messages(caplog)
  quoted = "'" + str(workdir) + "'"
  assert re.match(rf'Done in {DURATION} \(epoch 3\): ensemble accuracy 0.8765, NLL 0.4321; '
                  r'member accuracy mean 0.8250, best 0.8500\.', message), message
  for line in (f'checkpoints:        {workdir}/checkpoints', f'metrics:            {workdir}/metrics.jsonl',
               f'tensorboard --logdir {quoted}', f'python -m ensemble.evaluate --workdir {quoted}'):
    assert line in message


def test_quiet_libraries_keeps_what_the_user_set(monkeypatch):
  monkeypatch.delenv('TF_ENABLE_ONEDNN_OPTS', raising=False)
  monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '0')
  console.quiet_libraries()
  assert os.environ['TF_ENABLE_ONEDNN_OPTS'] == '0' and os.environ['TF_CPP_MIN_LOG_LEVEL'] == '0'
  monkeypatch.delenv('TF_CPP_MIN_LOG_LEVEL')
  console.quiet_libraries()
  assert os.environ['TF_CPP_MIN_LOG_LEVEL'] == '1'  # C++ INFO lines go, warnings and errors stay


# The CLIs as a person runs them, in a fresh process whose environment silences nothing.

def _env():
  env = {k: v for k, v in os.environ.items() if k not in ('TF_CPP_MIN_LOG_LEVEL', 'TF_ENABLE_ONEDNN_OPTS')}
  env['XLA_FLAGS'] = COMPILE_FLAGS  # the CLI's own --cpu_devices must do the job
  return env


def _train_args(workdir, data_dir):
  return [sys.executable, '-m', 'ensemble.train', '--workdir', workdir, '--config', 'configs/default.py',
          '--cpu_devices=2', f'--config.data_dir={data_dir}', '--config.ensemble_size=2', '--config.batch_size=32',
          '--config.num_epochs=2']


def _run_on_a_terminal(args) -> tuple[int, str]:
  """Runs `args` with stdout and stderr on a pseudo-terminal 120 columns wide; returns its code and what it drew."""
  controller, terminal = os.openpty()
  fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack('HHHH', 24, 120, 0, 0))
  process = subprocess.Popen(args, cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
  os.close(terminal)
  chunks = []
  while True:
    try:
      chunk = os.read(controller, 65536)
    except OSError:  # EIO: the process closed the terminal
      break
    if not chunk:
      break
    chunks.append(chunk)
  os.close(controller)
  return process.wait(timeout=300), b''.join(chunks).decode('utf-8', 'replace')


def _check_run(output, workdir):
  """What every training run must print, and what none may."""
  for notice in LIBRARY_NOTICES:
    assert notice not in output, notice
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8')]
  lines = EPOCH_LINE.findall(output)
  assert [int(line[0]) for line in lines] == [1, 2], output[-3000:]
  for line, record in zip(lines, records):
    members = record['member_test_accuracy']
    assert len(members) == 2  # metrics.jsonl keeps every member
    assert line[1:] == tuple(f'{x:#.4g}' for x in (record['test_accuracy'], record['test_loss'], np.mean(members),
                                                    max(members), record['train_loss']))
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(workdir))
  workdir = os.path.abspath(workdir)
  assert re.search(rf'Done in {DURATION} \(epoch 2\): ensemble accuracy', output)
  for line in (os.path.join(workdir, 'checkpoints'), os.path.join(workdir, 'metrics.jsonl'),
               f'tensorboard --logdir {workdir}', f'python -m ensemble.evaluate --workdir {workdir}'):
    assert line in output, line


@pytest.fixture(scope='module')
def piped_run(tmp_path_factory):
  """A 2-epoch run with its output on a pipe, as in a cluster job; the tests below share its workdir."""
  root = tmp_path_factory.mktemp('console')
  workdir = str(root / 'run')
  result = subprocess.run(_train_args(workdir, write_mnist(str(root / 'mnist'))), cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
  return workdir, str(root / 'mnist'), result


def test_piped_run_prints_plain_lines(piped_run):
  workdir, _, result = piped_run
  assert result.returncode == 0, result.stderr[-3000:]
  _check_run(result.stderr, workdir)
  assert '\r' not in result.stderr and '%|' not in result.stderr  # no bar
  assert result.stdout == ''


def test_run_on_a_terminal_draws_a_bar(piped_run, tmp_path):
  workdir = str(tmp_path / 'run')
  code, output = _run_on_a_terminal(_train_args(workdir, piped_run[1]))
  assert code == 0, output[-3000:]
  _check_run(output, workdir)
  for epoch in (1, 2):
    assert re.search(rf'\repoch {epoch}/2: 100%\|[^\r]*\| (\d+)/\1 steps \[\d\d:\d\d<00:00, '
                     r'[\d.]+ (steps/s|s/step), [\d.]+k? member-images/s, loss \d\.\d+\]', output), output[-3000:]


def test_evaluate_on_a_terminal_draws_a_bar_over_the_rotations(piped_run, tmp_path):
  code, output = _run_on_a_terminal([sys.executable, '-m', 'ensemble.evaluate', '--workdir', piped_run[0],
                                     '--angles=0,90,180', '--output_dir', str(tmp_path / 'eval')])
  assert code == 0, output[-3000:]
  for notice in LIBRARY_NOTICES:
    assert notice not in output, notice
  assert re.search(r'\rrotations: 100%\|[^\r]*\| 3/3 angles', output), output[-3000:]
  assert 'rotation 180 deg: ensemble accuracy' in output


def test_the_summary_takes_the_number_of_classes_from_the_checkpoint(piped_run, caplog):
  """Read by process 0 alone, without orbax's manager, which would wait for the other processes."""
  caplog.set_level(py_logging.WARNING)
  console.log_training_summary(piped_run[0], {**_summary([0.97, 0.098, 0.96]), 'step': 16})
  (warning,) = [r.getMessage() for r in caplog.records if r.levelno == py_logging.WARNING]
  assert warning.startswith('In the last epoch, members [1] are near chance (test accuracy 0.09800; chance 0.1000)')


def test_log_dir_takes_the_log_as_in_absl(piped_run, tmp_path):
  """Resumed at its last epoch, the run trains nothing; its log goes to --log_dir, not to stderr."""
  workdir, data_dir, _ = piped_run
  logs = tmp_path / 'logs'
  result = subprocess.run([*_train_args(workdir, data_dir), f'--log_dir={logs}'], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stderr == ''
  log = (logs / 'ensemble.train.INFO').read_text()
  assert 'Resumed from' in log and 'Done in' in log and 'ensemble accuracy' in log
