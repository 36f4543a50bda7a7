"""The measuring scripts: they run where the GPU machines have neither clu, TFDS nor ml_collections."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs a script (argv[1:]) with these packages unimportable, as on a GPU host that has only JAX, Flax and optax.
WITHOUT_EXTRAS = '''
import runpy, sys
MISSING = ('clu', 'ml_collections', 'tensorflow', 'tensorflow_datasets', 'tensorboard')

class Missing:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in MISSING:
      raise ModuleNotFoundError(f'No module named {name!r} (hidden by the test)')

sys.meta_path.insert(0, Missing())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def _run(*args: str, without_extras: bool = False) -> subprocess.CompletedProcess:
  command = ['-c', WITHOUT_EXTRAS] if without_extras else []
  return subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, 'XLA_FLAGS': ''}, timeout=600)


def test_benchmark_runs_without_clu_tfds_or_ml_collections(mnist_dir, tmp_path):
  out = tmp_path / 'bench.json'
  result = _run('scripts/benchmark.py', '--cpu_devices=2', '--ensemble_sizes=2', '--batch_sizes=16',
                '--paths=pmap,jit-fast', '--dtypes=float32,bfloat16', '--steps=1', '--repeats=1',
                '--steps_per_dispatch=2', f'--data_dir={mnist_dir}', f'--json={out}', without_extras=True)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(out.read_text())['results']
  assert {(row['path'], row.get('dtype')) for row in rows} >= {
      ('pmap', 'float32'), ('pmap', 'bfloat16'), ('jit-fast', 'float32'), ('jit-fast', 'bfloat16')}
  assert all(row['member_images_per_s'] > 0 for row in rows)
  assert [row['path'] for row in rows[:2]] == ['reference', 'reference, freed memory kept']


@pytest.mark.parametrize('variants, message', [
    (['', 'batch_sise=64'], "error: 'batch_sise' in --variants is not a config field"),
    (['', 'augment=none'], 'error: (default) has 2 steps an epoch, fewer than the 62 that --rounds and --steps'),
])
def test_compare_steps_refuses_what_it_cannot_run(mnist_dir, variants, message):
  result = _run('scripts/compare_steps.py', '--cpu_devices=2', f'--data_dir={mnist_dir}', '--variants', *variants)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith(message)


def test_benchmark_refuses_an_output_it_could_not_write_before_timing(tmp_path):
  result = _run('scripts/benchmark.py', f'--json={tmp_path / "missing" / "bench.json"}', without_extras=True)
  assert result.returncode == 2 and not (tmp_path / 'missing').exists()
  assert result.stderr.strip().splitlines()[-1] == (
      f'error: --json={tmp_path / "missing" / "bench.json"}: no folder {tmp_path / "missing"}; create it first')


def test_compare_methods_refuses_an_unknown_method_before_training(tmp_path):
  result = _run('scripts/compare_methods.py', '--methods=independent,bagings', f'--out={tmp_path / "runs"}')
  assert result.returncode == 2 and not (tmp_path / 'runs').exists()
  assert result.stderr.strip().splitlines() == [
      "error: --methods: unknown ['bagings']; choose from independent, bagging, hyper, snapshot, batchensemble, "
      'mc_dropout, mimo, packed, multiswag, adversarial, distilled']


def test_compare_methods_distils_only_after_the_independent_ensemble(tmp_path):
  result = _run('scripts/compare_methods.py', '--methods=distilled,independent', f'--out={tmp_path / "runs"}')
  assert result.returncode == 2 and result.stderr.strip().splitlines() == [
      'error: --methods: distilled is distilled from the independent ensemble; list independent before it']


def test_compare_methods_scores_runs_in_the_background_and_distils_in_a_process_of_its_own(mnist_dir, tmp_path):
  out = tmp_path / 'runs'
  result = _run('scripts/compare_methods.py', f'--data_dir={mnist_dir}', '--epochs=1', '--cpu_devices=2',
                f'--out={out}', '--methods=independent,distilled', '--score_in_background',
                '--override=--config.ensemble_size=2', '--override=--config.batch_size=32')
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads((out / 'classification_rows.json').read_text())
  assert [row['method'] for row in rows] == ['independent', 'distilled']
  for row in rows:  # each row also kept beside its run, as scored
    assert json.loads((out / row['method'] / 'eval' / 'row.json').read_text()) == row
  independent, student = rows
  assert independent['params'] == 2 * student['params']  # two CNN members, one student CNN
  assert 0 < student['ensemble']['nll'] and student['member_images_per_s'] > 0
  assert json.loads((out / 'distilled' / 'config.json').read_text())['ensemble_size'] == 1
  assert [line.split(' | ')[0] for line in result.stdout.splitlines()[2:]] == ['| independent', '| distilled']
  scored = (out / 'independent' / 'eval' / 'metrics.json').stat().st_mtime_ns
  again = _run('scripts/compare_methods.py', f'--data_dir={mnist_dir}', '--epochs=1', '--cpu_devices=2',
               f'--out={out}', '--methods=independent,distilled')
  assert again.returncode == 0 and again.stdout == result.stdout  # finished runs kept, and their rows
  assert (out / 'independent' / 'eval' / 'metrics.json').stat().st_mtime_ns == scored


def test_backbone_prints_its_table(tmp_path):
  """scripts/backbone.py on a few rows: a row per ensemble, every figure a number."""
  result = _run('scripts/backbone.py', '--rows=256', '--epochs=1', '--ensemble_size=2', '--sections=memory,quality')
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [line for line in result.stdout.splitlines() if line.startswith('| ') and not line.startswith('| ensemble')]
  assert [row.split(' | ')[0] for row in rows] == ['| deep ensemble', '| heads (frozen)', '| heads (tuned)',
                                                   '| adapters (r=4)', '| heads (tuned, split)']
  for row in rows:
    figures = [cell.strip() for cell in row.strip('|').split('|')[1:]]
    assert figures[1:3] == ['–', '–'] and figures[5] == '–', row  # speed and peak memory: not asked for
    measured = figures[:1] + figures[3:5] + figures[6:]  # first fit, memory and quality
    assert all(float(figure) == float(figure) for figure in measured), row  # numbers, no NaN
  refused = _run('scripts/backbone.py', '--rows=256', '--peak')
  assert refused.returncode == 2 and 'error: --peak' in refused.stderr, refused.stderr[-3000:]
