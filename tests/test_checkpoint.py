"""Faults made on purpose: damaged checkpoints, divergence, a held workdir, a failing save, lost metrics lines.

One workdir trained for two epochs serves every test; each works on its own copy.
"""

import glob
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import serialization

from conftest import (COMPILE_FLAGS, checkpoint_state, linked_workdir, make_member, small_config, synthetic_mnist,
                      timeless, write_mnist)
from ensemble import api, backends, checkpoint, divergence, evaluation, members, recipe as recipe_lib, steps
from ensemble import trainer, writers
from ensemble.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def trained(tmp_path_factory) -> tuple[str, str]:
  """(mnist_dir, workdir): 8 members, 8 steps per epoch, checkpoints of epochs 1 and 2."""
  root = tmp_path_factory.mktemp('checkpoint')
  mnist_dir = write_mnist(str(root / 'mnist'))
  workdir = str(root / 'run')
  trainer.train_and_evaluate(small_config(mnist_dir, num_epochs=2), workdir)
  return mnist_dir, workdir


@pytest.fixture
def run(trained, tmp_path) -> str:
  """A copy of the trained workdir for one test to damage."""
  copy = str(tmp_path / 'run')
  shutil.copytree(trained[1], copy)
  return copy


def _config(trained, **overrides):
  return small_config(overrides.pop('data_dir', trained[0]), **{'num_epochs': 2, **overrides})


_state = checkpoint_state


def _assert_same(a: dict, b: dict):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _largest_array_file(workdir: str, epoch: int) -> str:
  files = glob.glob(os.path.join(workdir, 'checkpoints', str(epoch), 'state', 'ocdbt.process_*', 'd', '*'))
  return max(files, key=os.path.getsize)


def _truncate(path: str):
  os.truncate(path, os.path.getsize(path) // 2)


def _strict_json_lines(path: str) -> list[dict]:
  """metrics.jsonl as a strict reader (jq) sees it: NaN and Infinity are errors."""
  def refuse(constant):
    raise ValueError(f'{path} holds {constant}')
  with open(path, encoding='utf-8') as f:
    return [json.loads(line, parse_constant=refuse) for line in f]


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and 'checkpoint' in r.getMessage()]


def test_a_damaged_checkpoint_is_moved_aside_and_its_epochs_trained_again(trained, run, caplog):
  epoch1, lines = _state(run, 1), writers.read_jsonl(os.path.join(run, 'metrics.jsonl'))
  config_json = open(os.path.join(run, 'config.json'), 'rb').read()
  _truncate(_largest_array_file(run, 2))
  with caplog.at_level(logging.WARNING):
    trainer.train_and_evaluate(_config(trained, num_epochs=3), run)
  warnings = _warnings(caplog)
  assert len(warnings) == 1 and '\n' not in warnings[0], warnings
  assert warnings[0].startswith(f'checkpoint {run}/checkpoints/2 is damaged (ValueError: OUT_OF_RANGE: Error reading ')
  assert warnings[0].endswith(f'); moved it to {run}/checkpoints_damaged/2 and went back to epoch 1')
  assert os.path.isdir(os.path.join(run, 'checkpoints_damaged', '2', 'state'))
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['1', '2', '3']
  _assert_same(_state(run, 1), epoch1)
  # Epoch 2 was trained again, to the same numbers, and its line is not written twice.
  again = writers.read_jsonl(os.path.join(run, 'metrics.jsonl'))
  assert [line['epoch'] for line in again] == [1, 2, 3]
  assert timeless(again[:2]) == timeless(lines)
  # The resume changed num_epochs, which may change; config.json still describes the run as started.
  assert open(os.path.join(run, 'config.json'), 'rb').read() == config_json


def test_evaluate_goes_back_past_a_damaged_checkpoint_and_leaves_it(run, tmp_path, caplog):
  os.remove(_largest_array_file(run, 2))
  with caplog.at_level(logging.WARNING):
    results = evaluation.evaluate(run, angles=[0], output_dir=str(tmp_path / 'eval'))
  assert results['epoch'] == 1
  warnings = _warnings(caplog)
  assert len(warnings) == 1 and '\n' not in warnings[0], warnings
  assert warnings[0].startswith(f'checkpoint {run}/checkpoints/2 is damaged (')
  assert warnings[0].endswith('); left in place, using epoch 1 instead')
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['1', '2']  # the trainer moves it, holding the lock
  with pytest.raises(UsageError, match=r'^--step=2: checkpoint .*/checkpoints/2 is damaged \(.*\); choose another '
                                       r'of \[1, 2\], or leave --step out for the newest intact one$'):
    evaluation.restore(run, evaluation.load_run_config(run), 2, jax.devices())


# Loads `run` once per file of its newest checkpoint's OCDBT store, that file cut in half each time (and put back
# after); prints the file's size, the epoch loaded and whether the hook is the caller's after each load, and marks
# the end of each load's stderr. Orbax packs the arrays into one large data file or several (it varies from run to
# run), next to small tree nodes that a load may find in its cache.
_LOAD_EACH_FILE_DAMAGED = """
import glob, os, sys
import ensemble
run, hook = sys.argv[1], sys.unraisablehook
for path in sorted(glob.glob(os.path.join(run, 'checkpoints', '2', 'state', 'ocdbt.process_0', 'd', '*'))):
  intact = open(path, 'rb').read()
  open(path, 'wb').write(intact[:len(intact) // 2])
  epoch = ensemble.load(run).epoch
  open(path, 'wb').write(intact)
  print(len(intact), epoch, sys.unraisablehook is hook, flush=True)
  print('<end of load>', file=sys.stderr, flush=True)
"""


def test_a_damaged_array_costs_one_warning_line_and_leaves_the_callers_hook(run):
  """Read in 8 shards, each damaged array file left dozens of orbax tracebacks (hundreds of lines) around the
  warning: the dropped reads' coroutines, each quoting the TensorStore spec, and 'Event loop is closed'. The
  library drops them while it reads, and gives the caller's unraisablehook back after."""
  env = {**os.environ, 'XLA_FLAGS': f'{COMPILE_FLAGS} --xla_force_host_platform_device_count=8'}
  result = subprocess.run([sys.executable, '-c', _LOAD_EACH_FILE_DAMAGED, run], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  loads = [line.split() for line in result.stdout.splitlines()]
  outputs = result.stderr.split('<end of load>\n')
  assert len(loads) > 1 and len(outputs) == len(loads) + 1 and not outputs[-1].strip(), result.stderr[-3000:]
  assert all(hook == 'True' for _, _, hook in loads), loads
  warning = re.compile(rf'WARNING:absl:checkpoint {run}/checkpoints/2 is damaged \([^\n]*\); left in place, using '
                       r'epoch 1 instead$')
  for (_, epoch, _), output in zip(loads, outputs):
    lines = output.strip().splitlines()
    if epoch == '1':  # the damage was found: one line says so
      assert len(lines) == 1 and warning.match(lines[0]), output[-3000:]
    else:
      assert epoch == '2' and not lines, output[-3000:]
  largest = max(loads, key=lambda load: int(load[0]))
  assert largest[1] == '1', loads  # an array's bytes were cut: it cannot have loaded


def _asyncio_report(message: str, filename: str) -> logging.LogRecord:
  """asyncio's report of a failure nobody retrieved, as its default exception handler logs it, raised in `filename`."""
  try:
    exec(compile('raise ValueError("OUT_OF_RANGE")', filename, 'exec'))  # pylint: disable=exec-used
  except ValueError:
    exc_info = sys.exc_info()
  return logging.LogRecord('asyncio', logging.ERROR, filename, 1, f'{message}\nfuture: <...>', None, exc_info)


@pytest.mark.parametrize('kind', ['Task', '_GatheringFuture'])
def test_asyncios_reports_of_orbax_reads_nobody_retrieved_are_dropped_and_no_others(kind):
  """A failed read leaves one report per shard's task and one for the future that gathers them."""
  dropped = checkpoint.DroppedTasks()
  assert not dropped.filter(_asyncio_report(f'{kind} exception was never retrieved', '/site/orbax/read.py'))
  assert dropped.filter(_asyncio_report(f'{kind} exception was never retrieved', '/home/me/mine.py'))
  assert dropped.filter(_asyncio_report('Unclosed client session', '/site/orbax/read.py'))


def test_a_tensorstore_reads_own_future_nobody_retrieved_is_dropped_and_no_other_future_without_traceback():
  """TensorStore sets a read's error on its asyncio future from C++: the report has no Python traceback."""
  def report(error: Exception) -> logging.LogRecord:
    message = f'Future exception was never retrieved\nfuture: <Future finished exception={error!r}>'
    return logging.LogRecord('asyncio', logging.ERROR, __file__, 1, message, None, (type(error), error, None))
  dropped = checkpoint.DroppedTasks()
  assert not dropped.filter(report(ValueError('OUT_OF_RANGE: Error reading "params.Dense_0.kernel/0.0.0"')))
  assert dropped.filter(report(ValueError('my own failure: out of range')))
  assert dropped.filter(report(ValueError('OUT_OF_RANGE')))


def test_with_no_intact_checkpoint_left_it_is_one_line_and_nothing_moves(trained, run):
  for epoch in (1, 2):
    _truncate(_largest_array_file(run, epoch))
  with pytest.raises(UsageError, match=rf'^no intact checkpoint in {run}/checkpoints: epochs 2, 1 are damaged \(epoch '
                                       r'2: ValueError: OUT_OF_RANGE: .*\); copy intact ones back from a backup, or '
                                       r'train afresh in a new --workdir$') as error:
    trainer.train_and_evaluate(_config(trained, num_epochs=3), run)
  assert '\n' not in str(error.value)
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['1', '2']
  assert not os.path.exists(os.path.join(run, 'checkpoints_damaged'))


def test_divergence_stops_the_run_and_keeps_the_good_checkpoints(trained, run):
  before = {epoch: _state(run, epoch) for epoch in (1, 2)}
  with pytest.raises(UsageError, match=r'^training diverged in epoch 3 at step (1[7-9]|2[0-4]): members \[[0-9, ]+\] '
                                       r'have a non-finite training loss; lower --config.learning_rate \(now 50.0\) '
                                       r'or --config.momentum \(now 0.9\) and re-run to resume from epoch 2 \(the '
                                       r'checkpoints saved so far are kept\)$'):
    trainer.train_and_evaluate(_config(trained, num_epochs=4, learning_rate=50.0), run)
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['1', '2']
  for epoch, state in before.items():
    _assert_same(_state(run, epoch), state)
  assert [line['epoch'] for line in _strict_json_lines(os.path.join(run, 'metrics.jsonl'))] == [1, 2]


def test_metrics_jsonl_writes_non_finite_values_as_null(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  writer = writers.JsonlWriter(path)
  writer.write_scalars(3, {'epoch': 1, 'train_loss': math.nan, 'test_loss': np.float32(np.inf),
                           'member_test_loss/0': 0.5, 'member_test_loss/1': -math.inf})
  writer.close()
  assert _strict_json_lines(path) == [{'step': 3, 'epoch': 1, 'train_loss': None, 'test_loss': None,
                                       'member_test_loss': [0.5, None]}]


def test_a_state_with_a_nan_is_found_member_by_member():
  state = {'w': np.ones((8, 3, 2), np.float32), 'b': np.zeros((8, 2), np.float32), 'step': np.zeros(8, np.int32)}
  assert divergence.nonfinite_members(state, 8) == []
  state['w'][5, 1, 0], state['b'][2, 1] = np.nan, -np.inf
  assert divergence.nonfinite_members(state, 8) == [2, 5]


def test_a_line_lost_after_its_checkpoint_is_written_on_resume(trained, run):
  """A crash between the checkpoint of epoch 2 and its metrics.jsonl line: the resume writes the line."""
  path = os.path.join(run, 'metrics.jsonl')
  lines = open(path, encoding='utf-8').readlines()
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(lines[:1])
  trainer.train_and_evaluate(_config(trained), run)  # nothing left to train
  rewritten = open(path, encoding='utf-8').readlines()
  assert rewritten[0] == lines[0]
  # The checkpoint holds the line as it was before the save, whose time it cannot know.
  assert json.loads(rewritten[1]) == {k: v for k, v in json.loads(lines[1]).items() if k != 'save_seconds'}


_DATA_CHANGES = {
    'dataset': lambda _: 'fashion_mnist',
    'train_split': lambda _: 'train[:50%]',
    'test_split': lambda _: 'test[:50%]',
    'data_dir': lambda mnist_dir: shutil.copytree(mnist_dir, mnist_dir + '_copy'),
    'heldout_fraction': lambda _: 0.2,
    'seed': lambda _: 1,
    'batch_size': lambda _: 16,
    'member_data': lambda _: 'shuffled',
    'method': lambda _: 'hyper',
    'inputs': lambda _: 'features',
    'standardize_features': lambda _: True,
    'task': lambda _: 'regression',
    'target': lambda _: 'price',
    'checkpoint_every_steps': lambda _: 5,
}


def test_every_data_setting_has_a_resume_test():
  assert set(_DATA_CHANGES) == set(recipe_lib.RESUME_SETTINGS)


@pytest.mark.parametrize('name', sorted(_DATA_CHANGES))
def test_a_resume_with_other_data_settings_is_refused_and_writes_nothing(trained, run, name):
  value = _DATA_CHANGES[name](trained[0])
  saved = json.load(open(os.path.join(run, 'config.json')))
  before = {path: open(path, 'rb').read() for path in glob.glob(os.path.join(run, '**'), recursive=True)
            if os.path.isfile(path)}
  with pytest.raises(UsageError) as error:
    trainer.train_and_evaluate(_config(trained, num_epochs=3, **{name: value}), run)
  assert str(error.value) == (f'{run}/config.json records {name}={saved[name]!r} (now {value!r}): a resume must keep '
                              f'the data settings and the method ({", ".join(recipe_lib.RESUME_SETTINGS)}); set them '
                              'as recorded there, or train in a new --workdir')
  after = {path: open(path, 'rb').read() for path in glob.glob(os.path.join(run, '**'), recursive=True)
           if os.path.isfile(path)}
  assert after == before


@pytest.mark.parametrize('config_json, message', [
    (None, 'missing'),
    ('{"ensemble_size": 8, "data_dir": ', 'cannot be read (Expecting value: line 1 column 34 (char 33))'),
])
def test_a_resume_without_a_readable_config_json_is_refused_and_writes_nothing(trained, tmp_path, config_json,
                                                                              message):
  """config.json records how the checkpoints were trained: without it the resume would check nothing and write
  the current config in its place."""
  workdir = linked_workdir(trained[1], str(tmp_path / 'run'))
  if config_json is None:
    os.remove(os.path.join(workdir, 'config.json'))
  else:
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      f.write(config_json)
  with pytest.raises(UsageError) as error:
    trainer.train_and_evaluate(_config(trained, num_epochs=3), workdir)
  assert str(error.value) == (
      f'{workdir}/config.json: {message}; it records how the checkpoints of epochs [1, 2] in {workdir}/checkpoints '
      'were trained, and a resume must keep their settings: put it back from a backup (or from the workdir this one '
      'was copied from), or train in a new --workdir')
  assert sorted(os.listdir(workdir)) == ['checkpoints'] + (['config.json'] if config_json else [])


def test_data_dir_is_recorded_resolved_and_compared_resolved(trained, tmp_path, monkeypatch):
  """A relative --config.data_dir names the same folder from wherever a later command runs, and the same folder
  named another way resumes."""
  mnist_dir = trained[0]
  monkeypatch.chdir(os.path.dirname(mnist_dir))
  relative = os.path.basename(mnist_dir)
  config, _ = recipe_lib.resolve(_config(trained, data_dir=relative), jax.devices())
  assert config.data_dir == mnist_dir
  os.symlink(mnist_dir, tmp_path / 'link')
  saved = {**config.to_dict(), 'data_dir': relative}  # as versions before this one recorded it
  for data_dir in (relative, mnist_dir, str(tmp_path / 'link'), mnist_dir + '/'):
    recipe_lib.check_resume(_config(trained, data_dir=data_dir), saved, 'config.json')
  with pytest.raises(UsageError, match=r"^config.json records data_dir='mnist' \(now '/elsewhere'\)"):
    recipe_lib.check_resume(_config(trained, data_dir='/elsewhere'), saved, 'config.json')


def test_a_snapshot_ensemble_resumes_only_with_its_cycles(trained):
  """Another num_epochs would change the cycles' length mid-run, and later snapshots would overwrite the last slot."""
  config = _config(trained, method='snapshot', snapshot_cycles=2, num_epochs=4)
  saved = config.to_dict()
  recipe_lib.check_resume(config, saved, 'config.json')
  config.num_epochs = 6
  with pytest.raises(UsageError) as error:
    recipe_lib.check_resume(config, saved, 'config.json')
  assert str(error.value) == ('config.json records num_epochs=4 (now 6): a snapshot ensemble keeps the length of its '
                              'cycles (num_epochs / snapshot_cycles epochs) for the whole run; resume with '
                              'num_epochs, snapshot_cycles as recorded there, or train in a new --workdir')
  independent = _config(trained, num_epochs=6)  # other methods may train on for more epochs
  recipe_lib.check_resume(independent, {**independent.to_dict(), 'num_epochs': 4}, 'config.json')


def test_a_multiswag_ensemble_resumes_only_with_its_collection_phase(trained):
  """Another swag_start (or length) would move the constant-rate phase mid-run; another swag_rank the moments' shape."""
  config = _config(trained, method='multiswag', num_epochs=4)
  saved = config.to_dict()
  recipe_lib.check_resume(config, saved, 'config.json')
  for field, value in (('swag_start', 0.5), ('swag_rank', 4), ('num_epochs', 6)):
    with pytest.raises(UsageError) as error:
      recipe_lib.check_resume(_config(trained, **{'method': 'multiswag', 'num_epochs': 4, field: value}), saved,
                              'config.json')
    assert str(error.value).startswith(f'config.json records {field}={saved[field]!r} (now {value!r}): MultiSWAG keeps '
                                       'the steps of its collection phase')
    assert '\n' not in str(error.value)
  recipe_lib.check_resume(_config(trained, method='multiswag', num_epochs=4, swag_samples=3), saved, 'config.json')


def _hold(workdir: str) -> subprocess.Popen:
  """Another process that takes the workdir's lock and keeps it."""
  code = ('import sys, time; from ensemble import checkpoint; lock = checkpoint.WorkdirLock(sys.argv[1]); '
          'assert lock.acquire() is None; print("held", flush=True); time.sleep(600)')
  holder = subprocess.Popen([sys.executable, '-c', code, workdir], cwd=REPO, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline() == 'held\n'
  return holder


def test_a_second_trainer_refuses_a_held_workdir_at_once(trained, run):
  before = {epoch: _state(run, epoch) for epoch in (1, 2)}
  holder = _hold(run)
  try:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, '-m', 'ensemble.train', '--config=configs/classic.py', f'--workdir={run}', '--cpu_devices=8',
         f'--config.data_dir={trained[0]}', '--config.num_epochs=3', '--config.batch_size=32',
         '--config.eval_batch_size=64', '--config.ensemble_size=8', '--config.heldout_fraction=0.0'],
        cwd=REPO, env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert time.monotonic() - started < 60
    errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
    assert errors == [f'error: {run} is in use by process {holder.pid} on {os.uname().nodename} (it holds '
                      f'{run}/lock); wait for that run to end or stop it, or train in another --workdir']
    assert 'Traceback' not in result.stderr
    assert holder.poll() is None  # the first run goes on
    assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['1', '2']
    for epoch, state in before.items():
      _assert_same(_state(run, epoch), state)
  finally:
    holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops its lock
    holder.wait()
  trainer.train_and_evaluate(_config(trained), run)  # the workdir is free again


def test_a_trainer_in_this_process_holds_the_workdir_too(trained, run):
  lock = checkpoint.WorkdirLock(run)
  assert lock.acquire() is None
  try:
    with pytest.raises(UsageError, match=rf'^{run} is in use by process {os.getpid()} on '):
      trainer.train_and_evaluate(_config(trained), run)
  finally:
    lock.release()
  trainer.train_and_evaluate(_config(trained), run)


def _train_with_file_size_limit(limit: int) -> list[str]:
  """`python -m ensemble.train` in a process whose files cannot grow past `limit` bytes (RLIMIT_FSIZE)."""
  code = ('import resource, runpy, sys; '
          f'resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); '
          'runpy.run_module("ensemble.train", run_name="__main__", alter_sys=True)')
  return [sys.executable, '-c', code]


def test_a_save_that_fails_ends_the_run_in_one_line_and_keeps_the_checkpoints(trained, run):
  """A file-size limit makes every checkpoint write fail with EFBIG, as a full disk fails with ENOSPC."""
  before = {epoch: _state(run, epoch) for epoch in (1, 2)}
  result = subprocess.run(
      [*_train_with_file_size_limit(1 << 20), '--config=configs/classic.py', f'--workdir={run}', '--cpu_devices=8',
       f'--config.data_dir={trained[0]}', '--config.num_epochs=3', '--config.batch_size=32',
       '--config.eval_batch_size=64', '--config.ensemble_size=8', '--config.heldout_fraction=0.0',
       '--config.checkpoints_to_keep=2'],
      cwd=REPO, env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS}, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert errors == [f'error: cannot save checkpoint {run}/checkpoints/3: File too large (EFBIG); free space or '
                    f'restore write access in {run}/checkpoints, then re-run the same command to resume from the '
                    'last checkpoint (2)'], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  # checkpoints_to_keep=2 did not push epoch 1 out for the failed save, and no half-written folder is left.
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['1', '2']
  for epoch, state in before.items():
    _assert_same(_state(run, epoch), state)
  assert [line['epoch'] for line in _strict_json_lines(os.path.join(run, 'metrics.jsonl'))] == [1, 2]


def test_a_checkpoint_from_before_a_new_empty_field_restores(tmp_path):
  """Checkpoints written before `TrainState.snapshots` existed lack it; for an ensemble that keeps no
  snapshots it is empty, so they restore as they are instead of being set aside as damaged."""
  member = make_member()
  state = jax.vmap(member.init)(steps.member_keys(0, 8))
  older = serialization.to_state_dict(state)
  del older['snapshots']
  meta = {'model': 'cnn', 'ensemble_size': 8}
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'run'))
  ckpt.save(1, older, meta)
  epoch, restored = ckpt.restore_newest_intact(backends.abstract_member_state(member, 8, jax.devices()), meta,
                                               move_aside=True)
  ckpt.close()
  assert epoch == 1 and restored.snapshots == {}
  _assert_same(jax.tree.map(np.asarray, serialization.to_state_dict(restored)), serialization.to_state_dict(state))


def _restored(workdir: str, devices, ensemble_size: int = 2, layout: str = 'replicated', **fields) -> dict:
  """The epoch-1 checkpoint of `workdir` restored onto `devices` in `layout` (the canonical one), as numpy."""
  config = small_config('', ensemble_size=ensemble_size, **fields)
  ckpt = checkpoint.Checkpointer(workdir)
  member = members.member(config, ckpt.meta(1)['data'])
  abstract = backends.abstract_member_state(member, ensemble_size, devices, layout)
  state = ckpt.restore(1, abstract, {'model': config.model, 'ensemble_size': ensemble_size})
  ckpt.close()
  leaf = jax.tree.leaves(state.params)[0]
  if layout == 'replicated':
    assert leaf.sharding.is_equivalent_to(backends.member_sharding(devices, ensemble_size), leaf.ndim)
  return jax.tree.map(np.asarray, serialization.to_state_dict(state))


def test_checkpoints_move_between_fewer_members_than_devices_and_a_device_each(trained, tmp_path):
  """K=2 members spread over 8 devices (jit) and K=2 on 2 devices (pmap) write the same canonical checkpoints."""
  spread, own = str(tmp_path / 'spread'), str(tmp_path / 'own')
  trainer.train_and_evaluate(small_config(trained[0], backend='jit', ensemble_size=2), spread)
  trainer.train_and_evaluate(small_config(trained[0], backend='pmap', ensemble_size=2, num_devices=2), own)
  two, eight = jax.devices()[:2], jax.devices()
  on_two, on_eight = _restored(spread, two), _restored(own, eight)
  jax.tree.map(np.testing.assert_array_equal, on_two, _restored(spread, eight))
  # Eight steps of sums in another order (a member's batch over 4 devices) drift by float rounding only.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4), on_two, on_eight)
  images = synthetic_mnist(8, 8)[1][0]
  predictions = [api.load(workdir).predict(images)['probs'] for workdir in (spread, own)]
  np.testing.assert_allclose(*predictions, rtol=1e-4, atol=1e-6)


MLP = dict(model='mlp', num_layers=1, depth=64, use_scan=False, logical=True)


def test_checkpoints_of_model_parallel_members_restore_in_every_layout(trained, tmp_path):
  """K=2 members split over 'model' (member_sharding=model) write the canonical checkpoint: it restores on 2
  devices, split over 'model' or 'data' on 8, and in `ensemble.load`."""
  workdir = str(tmp_path / 'model')
  trainer.train_and_evaluate(small_config(trained[0], backend='jit', ensemble_size=2, member_sharding='model', **MLP),
                             workdir)
  two, eight = jax.devices()[:2], jax.devices()
  on_two = _restored(workdir, two, **MLP)
  for layout in ('model', 'fsdp'):
    jax.tree.map(np.testing.assert_array_equal, on_two, _restored(workdir, eight, layout=layout, **MLP))
  ens = api.load(workdir)
  assert ens.predict(synthetic_mnist(8, 8)[1][0])['probs'].shape == (8, 10)
