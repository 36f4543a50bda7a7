"""The measuring scripts: they run where the GPU machines have neither clu, TFDS nor ml_collections."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import COMPILE_FLAGS

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
                        env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS}, timeout=600)


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
  result = _run('scripts/backbone.py', '--rows=256', '--test_rows=500', '--epochs=1', '--ensemble_size=2',
                '--sections=memory,quality')
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


@pytest.mark.parametrize('script, disagreement', [('scripts/multilabel_mnist.py', 'auroc_mi'),
                                                   ('scripts/segmentation_mnist.py', 'errors_auroc_mi')])
def test_a_task_benchmark_prints_its_table(script, disagreement):
  """The multi-label and the segmentation benchmark on a few examples: the ensemble's row and the single model's,
  every figure a number but the single model's disagreement (it has none: '–'); a single-member ensemble row
  refused in one line."""
  result = _run(script, '--train=64', '--test=32', '--calibration=40', '--epochs=1', '--ensemble_size=2')
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [line for line in result.stdout.splitlines() if line.startswith('| ')]
  header = [cell.strip() for cell in lines[0].strip('|').split('|')]
  rows = {line.split(' | ')[0][2:]: [cell.strip() for cell in line.strip('|').split('|')[1:]] for line in lines[2:]}
  assert list(rows) == ['ensemble (K=2)', 'single model'], lines
  for name, figures in rows.items():
    for key, figure in zip(header[1:], figures, strict=True):
      if name == 'single model' and key.startswith(disagreement):
        assert figure == '–', (key, figure)
      else:
        assert float(figure) == float(figure), (name, key, figure)  # a number, not NaN
  refused = _run(script, '--ensemble_size=1')
  assert refused.returncode == 2 and 'error: --ensemble_size=1' in refused.stderr, refused.stderr[-3000:]


def test_the_quantile_benchmark_prints_both_ensembles_rows(tmp_path):
  """scripts/quantile_uci.py on a small generated table: a row per ensemble, every figure a number; a table it
  cannot read refused in one line."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(120, 3))
  y = x[:, 0] * 3 + rng.normal(size=120) * (1 + np.abs(x[:, 1]))
  (tmp_path / 't.csv').write_text('a,b,c,y\n' + ''.join(f'{a},{b},{c},{t}\n' for (a, b, c), t in zip(x, y)))
  result = _run('scripts/quantile_uci.py', f'--csv={tmp_path / "t.csv"}:y', '--splits=2', '--epochs=2',
                f'--json={tmp_path / "out.json"}')
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [line for line in result.stdout.splitlines() if line.startswith('| ') and '---' not in line][1:]
  assert [row.split(' | ')[0] for row in rows] == ['| Gaussian', '| quantile + CQR'], result.stdout
  for row in rows:
    assert all(float(cell.split()[0]) == float(cell.split()[0]) for cell in row.strip('|').split('|')[1:]), row
  assert set(json.loads((tmp_path / 'out.json').read_text())['t'][0]) == {'regression', 'quantile'}
  refused = _run('scripts/quantile_uci.py', f'--csv={tmp_path / "t.csv"}:z')
  assert refused.returncode == 2 and "error: --csv=" in refused.stderr and "no column 'z'" in refused.stderr


def test_active_mnist_gives_kirschs_table(mnist_dir, tmp_path):
  """scripts/active_mnist.py --protocol=kirsch on a few synthetic digits: BatchBALD's row and random's, the labels to
  each accuracy the seeds' median [25%, 75%] as BatchBALD's results loader takes them (numpy's 'nearest': of two
  seeds, the fewer labels twice, then the more) with how many seeds reached it, from each run's record; the seeds
  given on the command line override the protocol's six, each run in a workdir of its own."""
  result = _run('scripts/active_mnist.py', '--protocol=kirsch', f'--data_dir={mnist_dir}', '--seeds=0,1',
                '--max_labels=30', '--epochs=1', '--ensemble_size=2', '--candidates=50',
                f'--workdir={tmp_path / "runs"}')
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [line for line in result.stdout.splitlines() if line.startswith('| ')]
  assert 'labels to 90%, median [25%, 75%]' in lines[0], lines[0]
  rows = {line.split(' | ')[0][2:]: [cell.strip() for cell in line.strip('|').split('|')[1:]] for line in lines[2:]}
  assert list(rows) == ['batch_bald', 'random'], lines
  assert sorted(os.listdir(tmp_path / 'runs')) == ['batch_bald-0', 'batch_bald-1', 'random-0', 'random-1']
  for acquisition, cells in rows.items():
    curves = [[json.loads(line) for line in (tmp_path / 'runs' / f'{acquisition}-{seed}' / 'curve.jsonl').open()]
              for seed in (0, 1)]
    for target, cell in zip((0.90, 0.95), cells[:2]):
      labels = sorted(next((entry['labels'] for entry in curve if entry['accuracy'] >= target), np.inf)
                      for curve in curves)
      shown = [f'{n}' if n < np.inf else '> 30' for n in labels]
      reached = sum(n < np.inf for n in labels)
      assert cell == f'{shown[0]} [{shown[0]}, {shown[1]}] ({reached}/2)', (acquisition, target, cell, labels)
    assert cells[2] == f"{np.median([curve[-1]['accuracy'] for curve in curves]):.4f}", (acquisition, cells[2])


# What a GPU machine's image lacks once scripts/gpu_check.sh has installed its wheels: TensorFlow and TFDS. PyTorch is
# hidden too, so that the dry run takes the same path (and time) wherever it runs. In every process the run starts.
HIDDEN_ON_GPU = """import sys
for name in ('tensorflow', 'tensorflow_datasets', 'torch'):
  sys.modules[name] = None  # `import` fails and importlib.util.find_spec finds nothing, as where it is not installed
"""


def test_gpu_check_dry_run_writes_every_section_as_it_goes(tmp_path):
  """scripts/gpu_check.py --dry: issue 77's GPU run on the CPU with tiny sizes, so that it is known to work before
  GPU time is spent on it: the profile joined to the HLO, the layouts, the peers (a row past its budget stopped and
  said so), README's command end to end and small data, in at most the 8 files the device tool brings back."""
  hidden = tmp_path / 'hidden'
  hidden.mkdir()
  (hidden / 'sitecustomize.py').write_text(HIDDEN_ON_GPU)
  out = tmp_path / 'out'
  result = subprocess.run([sys.executable, 'scripts/gpu_check.py', '--dry', f'--out={out}'], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS, 'PYTHONPATH': str(hidden)})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert sorted(os.listdir(out)) == ['end_to_end.json', 'peers.json', 'profile.json', 'profile.txt',
                                     'small_data.json', 'summary.md']

  profile = json.loads((out / 'profile.json').read_text())
  ours = [row for row in profile['rows'] if row['stack'] == 'jax']
  assert [(row['what'], row['member_map'], row['status']) for row in ours] == [
      ('profile', 'auto', 'measured'), ('bench', 'vmap', 'measured')]
  assert all(row['member_images_per_s'] > 0 for row in ours)
  table = ours[0]['profile']
  assert table['ms_per_step'] > 0 and table['hlo_modules'] > 0 and table['unattributed_share'] == 0
  assert abs(sum(category['share'] for category in table['categories']) - 1) < 1e-6
  convolutions = [op for op in table['ops'] if op['category'] == 'convolution']
  assert convolutions and all(op['shape'] and op['operands'] and 'dim_labels' in op['detail'] for op in convolutions)
  torch_rows = [row for row in profile['rows'] if row['stack'] == 'torch']
  assert torch_rows and all(row['status'] == 'skipped' and 'PyTorch is not installed' in row['note']
                            for row in torch_rows)
  assert 'convolution' in (out / 'profile.txt').read_text()

  peers = json.loads((out / 'peers.json').read_text())
  [resnet] = [row for row in peers['rows'] if row['stack'] == 'jax']
  assert resnet['model'] == 'resnet' and resnet['status'] == 'skipped' and 'past its budget of 1 s' in resnet['note']
  [cnn] = peers['table']  # ours from section 1's profiled row, PyTorch's missing
  assert cnn['model'] == 'cnn' and cnn['ours_jit_fast'] > 0 and cnn['torch_vmap_compiled'] is None

  end_to_end = json.loads((out / 'end_to_end.json').read_text())
  assert end_to_end['status'] == 'finished' and end_to_end['wall_s'] > 0 and 0 <= end_to_end['test_accuracy'] <= 1
  assert [epoch['epoch'] for epoch in end_to_end['epochs']] == [1] and end_to_end['epochs'][0]['train_seconds'] > 0
  small_data = json.loads((out / 'small_data.json').read_text())['sections']
  assert list(small_data) == ['fixed'] and small_data['fixed']['fixed']['fit_1_epochs']['fit'] > 0

  summary = (out / 'summary.md').read_text()
  for heading in ('## 1. Profile', '### Layouts and precision', '## 2. Peers', "## 3. README's default command",
                  '## 4. scripts/small_data.py', '## fixed cost of a call'):
    assert heading in summary, heading


def _gpu_check():
  spec = importlib.util.spec_from_file_location('gpu_check', os.path.join(REPO, 'scripts', 'gpu_check.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# An XLA:GPU module as --xla_dump_hlo_as_text writes it after optimizations: a grouped cuDNN convolution of 8
# members and a fusion of BatchNorm's reduction (each line ending in a backslash goes on in the next, as one line).
GPU_HLO = """HloModule jit_mapped, is_scheduled=true, \
entry_computation_layout={(f32[1024,32,32,16]{3,2,1,0})->f32[8,16]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_reduce (param_0: f32[8,128,32,32,16]) -> f32[8,16] {
  %param_0 = f32[8,128,32,32,16]{4,3,2,1,0} parameter(0)
  %constant = f32[] constant(0)
  ROOT %reduce.1 = f32[8,16]{1,0} reduce(%param_0, %constant), dimensions={1,2,3}, to_apply=%add, \
metadata={op_name="jit(mapped)/jvp(ResNet)/BatchNorm_0/reduce_sum"}
}

ENTRY %main.9 (p0: f32[1024,32,32,16], p1: f32[3,3,2,128]) -> f32[8,16] {
  %p0 = f32[1024,32,32,16]{3,2,1,0} parameter(0)
  %p1 = f32[3,3,2,128]{3,2,1,0} parameter(1)
  %cudnn-conv.3 = (f32[1024,32,32,128]{3,2,1,0}, u8[0]{0}) custom-call(%p0, %p1), window={size=3x3 pad=1_1x1_1}, \
dim_labels=b01f_01io->b01f, feature_group_count=8, custom_call_target="__cudnn$convForward", \
metadata={op_name="jit(mapped)/jvp(ResNet)/Conv_0/conv_general_dilated"}
  %bitcast.2 = f32[8,128,32,32,16]{4,3,2,1,0} bitcast(%p0)
  %transpose.7 = f32[16,1024,32,32]{3,2,1,0} transpose(%p0), dimensions={3,0,1,2}
  ROOT %input_reduce_fusion.2 = f32[8,16]{1,0} fusion(%bitcast.2), kind=kInput, calls=%fused_reduce
}
"""


def test_gpu_check_reduces_a_gpu_trace_to_operations_with_their_shapes(tmp_path):
  """The GPU side of gpu_check's profile, which no CPU run reaches: a device plane's stream kernels (not its derived
  lines, nor the host's events) named by their hlo_op stat, by an annotation, or by the kernel's own name (a fusion's,
  '.' written '_'), joined to the dumped HLO for their kind, shape, groups and layout."""
  gpu_check = _gpu_check()
  (tmp_path / 'module_0012.jit_mapped.sm_9.0_gpu_after_optimizations.txt').write_text(GPU_HLO)
  modules = gpu_check.read_hlo_dump(str(tmp_path))
  assert list(modules) == ['12'] and modules['12']['name'] == 'jit_mapped'
  kernels = [('sm90_xmma_fprop_implicit_gemm_f32f32', 0, 6000, {'hlo_op': 'cudnn-conv.3', 'program_id': 12}),
             ('input_reduce_fusion_2', 6000, 2000, {}),
             ('transpose_kernel', 8000, 1000, {'annotation': 'x:#hlo_op=transpose.7,hlo_module=jit_mapped#'}),
             ('MemcpyD2D', 9000, 1000, {})]
  planes = [{'name': '/host:CPU', 'lines': [{'name': 'python', 'events': [('cudnn-conv.3', 0, 10 ** 6,
                                                                            {'hlo_op': 'cudnn-conv.3'})]}]},
            {'name': '/device:GPU:0', 'lines': [{'name': 'XLA Ops', 'events': kernels},
                                                {'name': 'Stream #14(Compute)', 'events': kernels}]}]
  table = gpu_check.op_table(planes, modules, steps=2)
  assert table['clock'] == '/device:GPU:0' and table['events'] == 4
  assert table['ms_per_step'] == pytest.approx(0.005) and table['unattributed_share'] == pytest.approx(0.3)
  assert {c['category']: c['share'] for c in table['categories']} == pytest.approx({
      'convolution, grouped (8)': 0.6, 'reduction (BatchNorm)': 0.2, 'transpose': 0.1, 'memcpy/memset': 0.1})
  convolution, reduction, transpose, copy = table['ops']
  assert convolution['op'] == 'cudnn-conv.3' and convolution['ms_per_step'] == pytest.approx(0.003)
  assert convolution['shape'] == '(f32[1024,32,32,128]{3,2,1,0}, u8[0]{0})'
  assert convolution['operands'] == ['f32[1024,32,32,16]{3,2,1,0}', 'f32[3,3,2,128]{3,2,1,0}']
  assert convolution['detail'].startswith('convForward dim_labels=b01f_01io->b01f')
  assert 'feature_group_count=8' in convolution['detail'] and convolution['op_name'].startswith('jvp(ResNet)/Conv_0')
  assert (reduction['op'], reduction['shape']) == ('input_reduce_fusion_2', 'f32[8,16]{1,0}')
  assert reduction['operands'] == ['f32[8,128,32,32,16]{4,3,2,1,0}']
  assert (transpose['op'], transpose['shape'], copy['op']) == ('transpose.7', 'f32[16,1024,32,32]{3,2,1,0}',
                                                                'MemcpyD2D')


def test_the_per_class_conformal_benchmark_prints_its_tables():
  """scripts/conformal_per_class.py on a few digits: the classifier's and the segmenter's rows, marginal and per
  class, every figure a number; the segmenter's with its boundary and interior coverage."""
  result = _run('scripts/conformal_per_class.py', '--train=64', '--test=40', '--calibration=60', '--epochs=1',
                '--ensemble_size=2')
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [line for line in result.stdout.splitlines() if line.startswith('| ')]
  rows = {line.split(' | ')[0][2:]: [float(cell) for cell in line.strip('|').split('|')[1:]]
          for line in lines if not line.startswith(('| row', '| ---'))}
  assert list(rows) == ['digits, marginal', 'digits, per class', 'pixels, marginal', 'pixels, per class'], lines
  assert all(figure == figure for figures in rows.values() for figure in figures), rows  # numbers, not NaN
  assert len(rows['pixels, marginal']) == len(rows['digits, marginal']) + 2  # boundary and interior
