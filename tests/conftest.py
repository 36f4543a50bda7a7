"""Test set-up: 8 simulated CPU devices and quick compiles (set before jax is imported), tiny MNIST-shaped data."""

import os
import subprocess
import sys

# The suite compiles with XLA's optimisations off (ENSEMBLE_TEST_COMPILE=fast, the default): most of its time was
# compiling, and JAX's `jax_disable_most_optimizations` (JAX_DISABLE_MOST_OPTIMIZATIONS=1, which the processes the
# tests start inherit) with XLA:CPU's older emitters compile the tests' programs about 4x faster
# (docs/testing.md#what-it-costs), while what a test checks (shapes, refusals, saved files, numbers against an
# independent computation) is the same arithmetic. What does depend on XLA's optimisations is marked `optimized` and
# runs in a process of its own that compiles as users do (`pytest_pyfunc_call`): two different programs that the
# docs say compute the same numbers exactly, figures a page quotes. A test that runs more than it compiles (hundreds
# of steps, a page's example on real digits) is marked `compute_bound`: it compiles as users do in this process (and
# the processes it starts), which is faster there. ENSEMBLE_TEST_COMPILE=optimized runs the whole suite that way.
COMPILE = os.environ.get('ENSEMBLE_TEST_COMPILE', 'fast')
if COMPILE not in ('fast', 'optimized'):
  raise SystemExit(f"ENSEMBLE_TEST_COMPILE={COMPILE!r}: set it to 'fast' (the default) or 'optimized'")
USER_XLA_FLAGS = os.environ.get('ENSEMBLE_TEST_USER_XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))
os.environ['ENSEMBLE_TEST_USER_XLA_FLAGS'] = USER_XLA_FLAGS  # what the processes the tests start inherit
QUICK = 'JAX_DISABLE_MOST_OPTIMIZATIONS'  # read by JAX when it is imported, and by each compile from its config


def _quick_compile_flags() -> str:
  """XLA:CPU's flag for its older emitters, which compile quickly, where this jaxlib knows it (XLA aborts a process
  on a flag it does not know): tried once in a child process, and kept in the environment for the test processes
  and theirs."""
  if 'ENSEMBLE_TEST_QUICK_FLAGS' not in os.environ:
    flags = '--xla_cpu_use_fusion_emitters=false'
    probe = subprocess.run([sys.executable, '-c', 'import jax; jax.devices()'], capture_output=True, check=False,
                           env={**os.environ, 'XLA_FLAGS': f'{USER_XLA_FLAGS} {flags}', 'JAX_PLATFORMS': 'cpu'})
    os.environ['ENSEMBLE_TEST_QUICK_FLAGS'] = flags if probe.returncode == 0 else ''
  return os.environ['ENSEMBLE_TEST_QUICK_FLAGS']


# XLA_FLAGS for a process a test starts (a CLI, a script) that sets its own devices: it compiles as this one does.
COMPILE_FLAGS = ' '.join([USER_XLA_FLAGS, _quick_compile_flags() if COMPILE == 'fast' else '']).strip()
os.environ['XLA_FLAGS'] = f'{COMPILE_FLAGS} --xla_force_host_platform_device_count=8'.strip()
if COMPILE == 'fast':
  os.environ[QUICK] = '1'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from ensemble import host_memory  # pylint: disable=g-import-not-at-top,g-bad-import-order

host_memory.keep_freed_memory()  # as `ensemble.train` does on CPU: steps stop page-faulting

import collections  # pylint: disable=g-import-not-at-top,g-bad-import-order
import contextlib
import gzip
import inspect
import json
import struct
import tempfile

import jax
import numpy as np
import pytest

from configs import classic
from ensemble import devices, members, recipe as recipe_lib, steps

# Every test process compiles into the persistent cache the command line uses ('auto': ~/.cache/ensemble/jax, or
# ENSEMBLE_TEST_CACHE's folder; '' for none), as `python -m ensemble.train` does: a program that another test, the
# other worker or an earlier run compiled is read instead of compiled again (the contract's fits of different
# recipes compile some of the same programs). What is counted as compiled (`compiles`) counts a program read too.
devices.compilation_cache(os.environ.get('ENSEMBLE_TEST_CACHE', 'auto'))

# The tests' MNIST-shaped members: 28x28x1 pixels scaled to [0, 1] and not standardised (mean 0, std 1),
# so a member's forward pass is its model's own.
MNIST_INFO = members.data_info((28, 28, 1), 10, (0.0,), (1.0,))
# For tests that compare runs across layouts or processes. XLA's own CPU kernels (the training default,
# backends.train_program) sum a convolution's weight gradient in an order that depends on how many members share
# a device (2e-5 apart after two steps), and runs across processes keep YNNPACK's: with YNNPACK's kernels
# everywhere the sums are the same and the comparisons stay exact to 1e-5.
SAME_SUMS = {'xla_cpu_ynnpack': True}

SHARED_MNIST = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'mnist'))


def _approx_of_numbers(approx):
  """`pytest.approx`, refusing a JAX array anywhere in what it is given to expect.

  pytest 9.2 reads `expected.flat`, which JAX arrays refuse (NotImplementedError), while 9.0 did not: a JAX value
  passed here passes on one machine and fails on a fresh install. Refused on every version, it fails where it is
  written; `float(x)` or `np.asarray(x)` gives what approx compares."""

  def approx_of_numbers(expected, *args, **kwargs):
    if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(expected)):
      raise TypeError('pytest.approx was given a JAX array to expect; pass float(x) or np.asarray(x): pytest 9.2 '
                      'cannot read a JAX array (no .flat)')
    return approx(expected, *args, **kwargs)
  approx_of_numbers.__wrapped__ = approx
  return approx_of_numbers


pytest.approx = _approx_of_numbers(pytest.approx)


def pytest_configure(config):
  config.addinivalue_line('markers', 'optimized: compiled as users compile (XLA\'s optimisations on), in a process '
                          'of its own unless ENSEMBLE_TEST_COMPILE=optimized: the test compares two programs the '
                          'docs say compute the same numbers exactly, or figures a page quotes')
  config.addinivalue_line('markers', 'compute_bound: compiled as users compile in the test\'s own process and the '
                          'processes it starts: it runs more than it compiles, and optimised programs run it faster')


@pytest.fixture(autouse=True)
def _compiled_as_its_work_needs(request):
  """A test marked `compute_bound` compiles with XLA's optimisations on (JAX's config, read at each compile, and
  the environment its processes inherit); the programs it compiles are cached apart from the quick ones."""
  if COMPILE != 'fast' or request.node.get_closest_marker('compute_bound') is None:
    yield
    return
  jax.config.update('jax_disable_most_optimizations', False)
  os.environ[QUICK] = '0'
  try:
    yield
  finally:
    jax.config.update('jax_disable_most_optimizations', True)
    os.environ[QUICK] = '1'


_OPTIMIZED_REPORTS = {}  # nodeid -> [(when, outcome, text)] from the process that compiled as users do


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  """A test marked `optimized`, in a quickly compiling process: its outcome is that of the same test run in a
  pytest process that compiles as users do, one process for all of its file's marked tests (their fixtures made
  once there)."""
  if COMPILE == 'optimized' or pyfuncitem.get_closest_marker('optimized') is None:
    return None
  if pyfuncitem.nodeid not in _OPTIMIZED_REPORTS:
    _run_compiled_as_users_do([item for item in pyfuncitem.session.items if item.path == pyfuncitem.path
                               and item.get_closest_marker('optimized') is not None], pyfuncitem.config)
  reports = _OPTIMIZED_REPORTS.get(pyfuncitem.nodeid)
  if reports is None:
    pytest.fail(f'{pyfuncitem.nodeid}: its optimised run reported nothing (ENSEMBLE_TEST_COMPILE=optimized)',
                pytrace=False)
  for when, outcome, text in reports:
    if outcome == 'failed':
      pytest.fail(f'compiled as users compile (ENSEMBLE_TEST_COMPILE=optimized), its {when} failed:\n{text}',
                  pytrace=False)
    if outcome == 'skipped':
      pytest.skip(text)
  return True


def _run_compiled_as_users_do(items, config):
  with tempfile.TemporaryDirectory() as folder:
    outcomes = os.path.join(folder, 'outcomes.jsonl')
    env = {**{k: v for k, v in os.environ.items() if k != QUICK}, 'ENSEMBLE_TEST_COMPILE': 'optimized',
           'XLA_FLAGS': USER_XLA_FLAGS, 'ENSEMBLE_TEST_OUTCOMES': outcomes}
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-n', '0',
                          *[item.nodeid for item in items]], cwd=str(config.rootpath), env=env,
                         capture_output=True, text=True, check=False)
    if not os.path.exists(outcomes):
      pytest.fail(f'the optimised run of {items[0].path.name} failed (exit {run.returncode}):\n'
                  f'{(run.stdout + run.stderr)[-3000:]}', pytrace=False)
    with open(outcomes) as f:
      for line in f:
        report = json.loads(line)
        _OPTIMIZED_REPORTS.setdefault(report['nodeid'], []).append(
            (report['when'], report['outcome'], report['text']))


def pytest_runtest_logreport(report):
  """In the process that compiles as users do: each report, for the process that asked for it."""
  outcomes = os.environ.get('ENSEMBLE_TEST_OUTCOMES')
  if outcomes and COMPILE == 'optimized':
    text = report.longreprtext if report.outcome == 'failed' else (
        report.longrepr[2] if report.outcome == 'skipped' and isinstance(report.longrepr, tuple) else '')
    with open(outcomes, 'a') as f:
      f.write(json.dumps({'nodeid': report.nodeid, 'when': report.when, 'outcome': report.outcome,
                          'text': text}) + '\n')


def write_idx(path: str, array: np.ndarray, magic: int | None = None):
  """Writes `array` as an IDX file (gzipped when `path` ends in .gz)."""
  array = np.asarray(array, dtype=np.uint8)
  magic = 0x0800 + array.ndim if magic is None else magic
  raw = struct.pack('>I', magic) + struct.pack(f'>{array.ndim}I', *array.shape) + array.tobytes()
  with (gzip.open if path.endswith('.gz') else open)(path, 'wb') as f:
    f.write(raw)


def synthetic_mnist(num_train: int = 256, num_test: int = 100, seed: int = 0):
  """Learnable fake digits: each class lights its own rows of the image, plus noise."""
  rng = np.random.default_rng(seed)
  def split(n):
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 60, (n, 28, 28))
    for i, label in enumerate(labels):
      images[i, 2 * label + 4:2 * label + 6, 4:24] = 255
    return images.astype(np.uint8), labels.astype(np.uint8)
  return split(num_train), split(num_test)


def write_mnist(directory: str, num_train: int = 256, num_test: int = 100, gz: bool = True) -> str:
  os.makedirs(directory, exist_ok=True)
  suffix = '.gz' if gz else ''
  (train_x, train_y), (test_x, test_y) = synthetic_mnist(num_train, num_test)
  write_idx(os.path.join(directory, 'train-images-idx3-ubyte' + suffix), train_x)
  write_idx(os.path.join(directory, 'train-labels-idx1-ubyte' + suffix), train_y)
  write_idx(os.path.join(directory, 't10k-images-idx3-ubyte' + suffix), test_x)
  write_idx(os.path.join(directory, 't10k-labels-idx1-ubyte' + suffix), test_y)
  return directory


# XLA:CPU maps several memory regions for each executable, and a session that kept all of them (thousands) ran past
# the kernel's limit of 65,530 maps and crashed in a later module. Past this many, the compiled programs are let go.


@pytest.fixture(autouse=True, scope='module')
def _compiled_programs_released():
  """After each test module, the compiled programs are let go if the process maps many regions."""
  yield
  host_memory.release_compiled_programs_if_many()


@pytest.fixture
def mnist_dir(tmp_path) -> str:
  return write_mnist(str(tmp_path / 'mnist'))


def python_module(module: str, *args: str, first: str = '') -> list[str]:
  """`python -m module args` as a command line whose process runs the statements `first` before the module (hiding
  a package, restoring Ctrl-C), the module seeing the same sys.argv."""
  code = (f'{first}; import runpy, sys; sys.argv = sys.argv[1:]; '
          'runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)')
  return [sys.executable, '-c', code, module, *args]


def run_main(main, program: str, *args: str) -> int:
  """Runs a program's absl `main` in this process with the command-line `args`; returns its exit status."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.FLAGS([program, *args])
  try:
    main([program])
  except SystemExit as e:
    return e.code
  finally:
    flags.FLAGS.unparse_flags()
  return 0


# A duration as ensemble.console prints it (`console._duration`): '12.34 s' under a minute, '1m 05s', '2h 03m'. A
# test that read the first form alone failed on a machine whose compilation cache was empty, where a run's first
# epoch (its compiles) took over a minute.
DURATION = r'(?:\d[\d.e+-]* s|\d+m \d\ds|\d+h \d\dm)'


def timeless(lines: list[dict]) -> list[dict]:
  """metrics.jsonl lines without their timings (`*_seconds`): what two runs of the same steps must agree on."""
  return [{k: v for k, v in line.items() if not k.endswith('_seconds')} for line in lines]


def small_config(data_dir: str, **overrides):
  """A small, fast config on the synthetic data in `data_dir`; keyword arguments override fields."""
  config = classic.get_config()
  config.data_dir = data_dir
  config.num_epochs = 1
  config.batch_size = 32
  config.eval_batch_size = 64
  config.ensemble_size = 8
  config.heldout_fraction = 0.0
  # Half the default rate: on 8 steps an epoch of this tiny set, standardised inputs make 0.1 overshoot.
  config.learning_rate = 0.05
  config.update(overrides)
  return config


def make_member(config=None, data_info=MNIST_INFO, **overrides) -> steps.Member:
  """The member that `config` (default: configs/classic.py, unaugmented and cheap) with `overrides` describes."""
  config = (config or classic.get_config()).copy_and_resolve_references()
  config.update(overrides)
  return members.member(recipe_lib.of(config), data_info)


@pytest.fixture
def make_config(mnist_dir):
  return lambda **overrides: small_config(mnist_dir, **overrides)


def linked_workdir(source: str, path: str, **config_changes) -> str:
  """A workdir at `path` that shares `source`'s checkpoints (a link, not a copy) and has its own config.json, with
  `config_changes`: what a test of how a workdir's record is read needs, without copying an ensemble's state."""
  os.makedirs(path)
  os.symlink(os.path.join(source, 'checkpoints'), os.path.join(path, 'checkpoints'))
  with open(os.path.join(source, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  with open(os.path.join(path, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump({**config, **config_changes}, f)
  return path


def checkpoint_state(workdir: str, epoch: int, **overrides) -> dict:
  """Every leaf of the checkpoint of `epoch` (params, optimizer state, steps, keys) as numpy, for bitwise checks.

  Restored for `small_config`'s ensemble (with `overrides`), with the member the checkpoint's recorded data describes.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from flax import serialization  # pylint: disable=g-import-not-at-top
  from ensemble import backends, checkpoint  # pylint: disable=g-import-not-at-top
  config = small_config('', **overrides)
  ckpt = checkpoint.Checkpointer(workdir)
  member = members.member(recipe_lib.of(config), ckpt.meta(epoch)['data'])
  abstract = backends.abstract_member_state(member, config.ensemble_size, jax.devices())
  state = ckpt.restore(epoch, abstract, {'model': config.model, 'ensemble_size': config.ensemble_size})
  ckpt.close()
  return jax.tree.map(np.asarray, serialization.to_state_dict(state))


# --- the methods' tests: one small problem, ensembles fitted once per module, the checks they share ---------------

def toy_features(n: int = 64, seed: int = 0, dims: int = 5):
  """`n` rows of `dims` standard-normal features, labelled by whether the first two sum above 0."""
  x = np.random.default_rng(seed).normal(size=(n, dims)).astype(np.float32)
  return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32)


# Every program this process obtains, compiled by XLA or read from JAX's persistent cache (which earlier tests turn
# on), reports this event once (jax/_src/dispatch.py's BACKEND_COMPILE_EVENT); a cache hit reports a cache_hits event
# besides, so counting both would count it twice.
COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


@contextlib.contextmanager
def compiles():
  """Counts the programs compiled (or read from the persistent cache) in the block, by event name."""
  counts = collections.Counter()

  def duration(event, _seconds, **_):
    if event == COMPILE_EVENT:
      counts[event] += 1

  jax.monitoring.register_event_duration_secs_listener(duration)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(duration)


@contextlib.contextmanager
def sigterm_at_step(stop_step: int):
  """SIGTERM sent to this process once a workdir's training passes `stop_step` (after the trainer's own hook at
  that step): what a preemptible VM's notice does to a run."""
  import signal  # pylint: disable=g-import-not-at-top
  from ensemble import trainer  # pylint: disable=g-import-not-at-top
  after_steps = trainer._SavesInBackground.after_steps  # pylint: disable=protected-access

  def terminated(hook, step):
    after_steps(hook, step)
    if step == stop_step:
      os.kill(os.getpid(), signal.SIGTERM)
  trainer._SavesInBackground.after_steps = terminated  # pylint: disable=protected-access
  try:
    yield
  finally:
    trainer._SavesInBackground.after_steps = after_steps  # pylint: disable=protected-access


def fitted_once(fit):
  """`fit`, called once per distinct arguments (defaults filled in): what a module fixture hands its tests, so that
  they share each ensemble they ask for."""
  done, signature = {}, inspect.signature(fit)

  def fitted(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    key = tuple(bound.arguments.items())
    if key not in done:
      done[key] = fit(*args, **kwargs)
    return done[key]
  return fitted


def member_params(ens):
  """An ensemble's stacked (K, ...) parameters as numpy arrays."""
  return jax.tree.map(np.asarray, ens.state.params)


def assert_one_network(ens):
  """Every member's parameters are member 0's, bit for bit: members that share every weight."""
  jax.tree.map(lambda leaf: np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape)),
               member_params(ens))


def assert_same_training(a, b, *trees: str):
  """Two ensembles trained alike (pmap against jit): parameters, the `trees` named of their states and the test loss
  equal to float32 reductions' order."""
  close = lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
  for tree in ('params', *trees):
    jax.tree.map(close, getattr(a.state, tree), getattr(b.state, tree))
  np.testing.assert_allclose(a.summary['test_loss'], b.summary['test_loss'], rtol=1e-4)


def assert_same_updates(params, reference, initial):
  """Each leaf's update (params - initial) within 1% of the reference's, in norm: two programs that sum a gradient
  in another order (over 4 devices against one, DP's all-reduce against FSDP's reduce-scatter). Not element by
  element: where an element's terms cancel (a ResNet's BatchNorm biases, its 1x1 shortcut; an MLP kernel's rows of
  nearly constant pixels) that rounding is a few percent of its update after a few steps, and Adam, dividing by the
  root of a tiny second moment, makes it a step's; 3x to 5x beyond rtol=1e-4 on some CPUs. A leaf's update norm
  agrees to 0.9% at worst, and a member whose gradient came from a quarter of its batch misses it by 570-870%."""
  for (path, ours), theirs, start in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(reference),
                                          jax.tree.leaves(initial)):
    ours, theirs = np.asarray(ours, np.float64) - start, np.asarray(theirs, np.float64) - start
    error, size = np.linalg.norm(ours - theirs), np.linalg.norm(theirs)
    where = jax.tree_util.keystr(path)
    assert error <= 1e-2 * size + 1e-5 * np.sqrt(theirs.size), f'{where}: {error:.3g} of {size:.3g}'


GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs', 'python-api.md')


def run_guide_example(heading: str, capsys, guide: str = GUIDE) -> tuple[str, str | None]:
  """Runs the first Python block of the section `heading` of `guide` (docs/python-api.md, or another page of docs/
  by its name) as written: (what it printed, what the page says it prints after 'It prints', or None where it says
  nothing)."""
  import re  # pylint: disable=g-import-not-at-top
  guide = os.path.join(os.path.dirname(GUIDE), guide) if not os.path.isabs(guide) else guide
  with open(guide, encoding='utf-8') as f:
    section = f.read().split(heading, 1)[1]
  code = re.search(r'```python\n(.*?)```', section, re.S).group(1)
  expected = re.search(r'It prints[^\n]*\n\n```\n(.*?)```', section, re.S)
  exec(compile(code, guide, 'exec'), {'__name__': 'guide'})  # pylint: disable=exec-used
  return capsys.readouterr().out, expected and expected.group(1)


def assert_printed_as_the_page_says(printed: str, expected: str, atol: float = 0.01) -> list[float]:
  """The page's lines word for word, and its figures to `atol` (the page's are one device's, the tests' eight
  simulated devices'); the printed figures."""
  import re  # pylint: disable=g-import-not-at-top
  number = re.compile(r'\d+\.\d+')
  assert number.sub('#', printed) == number.sub('#', expected), printed
  figures = [float(x) for x in number.findall(printed)]
  np.testing.assert_allclose(figures, [float(x) for x in number.findall(expected)], atol=atol, err_msg=printed)
  return figures

