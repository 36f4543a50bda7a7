"""One GPU run of at most 8 minutes for issue 77: where ResNet-20's step loses to PyTorch, the peer table, README's
command end to end and small data, each figure written to --out the moment it exists.

  bash scripts/gpu_wheels.sh        # here, once: the wheels the GPU image lacks, into .whl/ (git-ignored)
  bash scripts/gpu_check.sh         # on the GPU machine: installs .whl/, then runs this with --out=$OUT
  python scripts/gpu_check.py --out=FOLDER [--sections=profile,peers,end_to_end,small_data]
  python scripts/gpu_check.py --dry --out=FOLDER     # the same on the CPU with tiny sizes, in under a minute

In this order, each section within its time budget (--budget_scale scales them all; a section's unused seconds go
to the next):

1. profile (260 s): ResNet-20's training step, K=8, batch 128 a member, float32 and bfloat16, as
   `scripts/benchmark.py --paths=jit-fast` times it (its `bench_backend`), then traced with `jax.profiler` and the
   trace reduced to the operations that took the device's time, joined to XLA's optimized HLO (dumped by the child
   that profiles) for their shapes, layouts and kinds: convolutions (grouped ones with their group count),
   reductions (BatchNorm's statistics and their gradients), transposes, copies, matmuls, elementwise fusions. The
   same for PyTorch's vmap ensemble, compiled (`scripts/torch_peers.py`'s step, timed by its `bench`), with
   `torch.profiler`'s key_averages table. Then the layouts, each a row of member-images/s: our members mapped
   with vmap (the GPU's default: one grouped convolution per layer) or unrolled (`--member_map=unrolled` of
   benchmark.py: a convolution per member; one step a dispatch, as its steps unroll too), float32 with TF32
   allowed (JAX's default precision) or not ('highest'); PyTorch's vmap peer eager with TF32 on and off in cuDNN
   and matmuls, and its loop peer (where channels-last runs) NHWC against NCHW.
2. peers (80 s): the peer table, CNN and ResNet-20, float32 and bfloat16: ours `jit-fast` against torch vmap
   compiled. ResNet's rows come from section 1 where it measured them (the same settings, the same run).
3. end_to_end (60 s): README's default command, `python -m ensemble.train --workdir=... --config=configs/default.py`
   (10 epochs), with an empty compilation cache, as a first run on a fresh machine: its wall time and each epoch's
   times from metrics.jsonl (written after every epoch, so a run cut short keeps the epochs it finished).
4. small_data (60 s): `scripts/small_data.py --section=fixed,regression,bo`, a section per process (fewer
   repeats than its defaults, to fit).

A row runs in a child process (JAX and PyTorch never share one, nor the GPU's memory), several rows per child; a row
that outlives its budget (compile and timing) or its section's is stopped and reported as skipped, with why, and a
new child takes the rows after it. Written under --out (at most 8 files, none in a subfolder, as the device tool
brings back): summary.md (every table so far), profile.txt (the top operations of each profile), profile.json,
peers.json, end_to_end.json, small_data.json; gpu_check.sh adds log.txt.

--dry runs the same sections on the CPU with tiny sizes: 2 members, batch 8, one step a dispatch, float32 only, the
CNN for the profile and the layouts (ResNet-20's CPU compiles take ~40 s a dtype on 2 cores; its peer row is given
1 s, so that a row stopped past its budget is seen too), the members mapped with vmap for the layout row (a CPU
unrolls them already), 1 epoch of a 512-image MNIST subset end to end, small_data's fixed section only (its
regression and bo sections start 5 JAX processes), PyTorch's steps eager, and its rows skipped with a line where it
is not installed. tests/test_scripts.py runs it.
"""

import argparse
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
sys.path.insert(0, REPO)
sys.path.insert(0, SCRIPTS)

from ensemble import files  # pylint: disable=g-import-not-at-top,wrong-import-position  (no JAX: the parent's GPU stays free)
from ensemble.errors import UsageError, exit_with_error  # pylint: disable=g-import-not-at-top,wrong-import-position

SECTIONS = ('profile', 'peers', 'end_to_end', 'small_data')
# Seconds each group of rows may take, in order; a group's deadline is the run's start plus the budgets of every group
# up to it, so what one leaves goes to the next. Sized to fit 8 minutes on one H100 with the wrapper's install.
BUDGETS = {'jax profile': 75, 'torch profile': 100, 'jax layouts': 55, 'torch layouts': 30,
           'jax peers': 35, 'torch peers': 45, 'end_to_end': 60, 'small_data': 60}
GROUPS = {'profile': ('jax profile', 'torch profile', 'jax layouts', 'torch layouts'),
          'peers': ('jax peers', 'torch peers'), 'end_to_end': ('end_to_end',), 'small_data': ('small_data',)}
FULL = {'K': 8, 'batch': 128, 'steps': 16, 'repeats': 3, 'steps_per_dispatch': 8, 'num_train': 10_000,
        'profile_dispatches': 2, 'torch_steps': 20, 'torch_compile': True}
# dry: PyTorch's steps run eager where it is installed (torch.compile on a CPU takes minutes)
DRY = {'K': 2, 'batch': 8, 'steps': 2, 'repeats': 1, 'steps_per_dispatch': 1, 'num_train': 256,
       'profile_dispatches': 2, 'torch_steps': 2, 'torch_compile': False}
# small_data.py's sections and flags: fewer repeats than its defaults, to fit the budget.
SMALL_DATA = {'full': ('fixed,regression,bo', ['--fixed_repeats=20', '--repeats=5', '--cold_repeats=1',
                                               '--bo_fits=10']),
              'dry': ('fixed', ['--fixed_repeats=2', '--repeats=2', '--cold_repeats=1', '--bo_fits=2', '--bo_start=20',
                                '--bo_batch_size=8'])}
GOALS = {'resnet': 1.2, 'cnn': 1.5}  # ours / torch vmap (compiled), issue 77
TOP_OPS = 30


# --- the rows ----------------------------------------------------------------------------------------------------

def _jax_row(sizes, model, dtype, what='bench', member_map='auto', precision='default', budget_s=60, **changes):
  row = {'stack': 'jax', 'what': what, 'model': model, 'dtype': dtype, 'member_map': member_map,
         'precision': precision, 'budget_s': budget_s, 'data_dir': sizes.get('data_dir', ''),
         **{k: sizes[k] for k in ('K', 'batch', 'steps', 'repeats', 'steps_per_dispatch', 'num_train',
                                  'profile_dispatches')}, **changes}
  row['id'] = (f"jax {model} {dtype} {what} map={member_map} precision={precision} "
               f"spd={row['steps_per_dispatch']}")
  # The peer table's settings: jit-fast as benchmark.py runs it.
  row['peer_like'] = (member_map == 'auto' and precision == 'default'
                      and row['steps_per_dispatch'] == sizes['steps_per_dispatch'])
  return row


def _torch_row(sizes, model, dtype, what='bench', peer='torch vmap', compiled=True, layout='auto', tf32='default',
               budget_s=60):
  row = {'stack': 'torch', 'what': what, 'peer': peer, 'model': model, 'dtype': dtype,
         'compiled': compiled and sizes['torch_compile'],
         'layout': layout, 'tf32': tf32, 'budget_s': budget_s, 'K': sizes['K'], 'batch': sizes['batch'],
         'steps': sizes['torch_steps'], 'repeats': sizes['repeats']}
  row['id'] = f"{peer} {model} {dtype} {what} {'compiled' if row['compiled'] else 'eager'} layout={layout} tf32={tf32}"
  row['peer_like'] = peer == 'torch vmap' and compiled and layout == 'auto' and tf32 == 'default'
  return row


def profile_rows(dry: bool, data_dir: str = '') -> dict[str, list[dict]]:
  """Section 1's rows by group, most wanted first within each; `data_dir` the CNN's MNIST (default: the bundled)."""
  sizes = {**(DRY if dry else FULL), 'data_dir': data_dir}
  model = 'cnn' if dry else 'resnet'
  dtypes = ('float32',) if dry else ('float32', 'bfloat16')
  one = dict(steps_per_dispatch=1, steps=max(1, sizes['steps'] // 2))  # unrolled: a step a dispatch (members unroll)
  if dry:  # a CPU unrolls the members already: the other mapping, forced (the precision is a context around it)
    jax_layouts = [_jax_row(sizes, model, 'float32', member_map='vmap', budget_s=50)]
  else:
    jax_layouts = [_jax_row(sizes, model, 'float32', member_map='unrolled', budget_s=50, **one),
                   _jax_row(sizes, model, 'float32', precision='highest', budget_s=35),
                   _jax_row(sizes, model, 'bfloat16', member_map='unrolled', budget_s=45, **one)]
  eager = lambda peer, layout, tf32: _torch_row(sizes, model, 'float32', peer=peer, compiled=False, layout=layout,
                                                tf32=tf32, budget_s=15)
  return {
      'jax profile': [_jax_row(sizes, model, dtype, 'profile', budget_s=60 if dtype == 'float32' else 50)
                      for dtype in dtypes],
      'torch profile': [_torch_row(sizes, model, dtype, 'profile', budget_s=90 if dtype == 'float32' else 80)
                        for dtype in dtypes],
      'jax layouts': jax_layouts,
      'torch layouts': [eager('torch vmap', 'auto', 'on'), eager('torch vmap', 'auto', 'off'),
                        eager('torch loop', 'channels_last', 'default'), eager('torch loop', 'contiguous', 'default'),
                        eager('torch vmap', 'channels_last', 'default')]}


def peer_rows(dry: bool, measured: list[dict], data_dir: str = '') -> dict[str, list[dict]]:
  """Section 2's rows: the CNN's and ResNet-20's, each model and dtype unless section 1 measured it alike."""
  sizes = {**(DRY if dry else FULL), 'data_dir': data_dir}
  dtypes = ('float32',) if dry else ('float32', 'bfloat16')
  have = {(r['stack'], r['model'], r['dtype']) for r in measured if _peer_like(r)}
  # dry: ResNet-20 gets 1 s, so that a row past its budget is seen stopped and reported
  budgets = {('jax', 'cnn'): 25, ('jax', 'resnet'): 1 if dry else 45, ('torch', 'cnn'): 40,
             ('torch', 'resnet'): 1 if dry else 70}
  rows = {'jax peers': [], 'torch peers': []}
  for model in ('cnn', 'resnet'):
    for dtype in dtypes:
      if ('jax', model, dtype) not in have:
        rows['jax peers'].append(_jax_row(sizes, model, dtype, budget_s=budgets['jax', model]))
      if ('torch', model, dtype) not in have:
        rows['torch peers'].append(_torch_row(sizes, model, dtype, budget_s=budgets['torch', model]))
  return rows


def _peer_like(row: dict) -> bool:
  """A measured row with the peer table's settings: ours jit-fast as benchmark.py runs it, or torch vmap compiled."""
  return row.get('status') == 'measured' and row['peer_like']


# --- the children: one process per run of rows, JAX or PyTorch ---------------------------------------------------

class Events:
  """What a child tells its parent: one JSON line each, flushed, so a child killed mid-row leaves the rows before."""

  def __init__(self, path: str):
    self._file = open(path, 'a', encoding='utf-8')  # pylint: disable=consider-using-with

  def __call__(self, event: str, **fields):
    self._file.write(json.dumps({'event': event, **fields}, default=str) + '\n')
    self._file.flush()


@contextlib.contextmanager
def _reported(row: dict, emit: Events):
  """One row's run: 'start', then the body's 'done' or an 'error' naming why; the next row runs either way."""
  emit('start', id=row['id'])
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    emit('error', id=row['id'], error=f'{type(e).__name__}: {e}'[:2000])


def child_jax(rows: list[dict], emit: Events, scratch: str):
  import jax  # pylint: disable=g-import-not-at-top
  import benchmark  # pylint: disable=g-import-not-at-top
  from ensemble import backends  # pylint: disable=g-import-not-at-top
  from ensemble.data import bundled  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  emit('env', jax=jax.__version__, device=f'{devices[0].platform} ({devices[0].device_kind})', devices=len(devices))
  unrolls, create, datasets = backends.unrolls, backends.create, {}
  for row in rows:
    with _reported(row, emit):
      try:
        if row['model'] not in datasets:
          datasets[row['model']] = benchmark.load_data(row['model'], row['data_dir'] or bundled.DATASETS['mnist'],
                                                       row['num_train'])
        dataset = datasets[row['model']]
        member = benchmark.make_member(row['model'], dataset, row['dtype'])
        if row['member_map'] != 'auto':  # as benchmark.py's --member_map does
          forced = row['member_map'] == 'unrolled'
          backends.unrolls = lambda devices, member=None, forced=forced: forced
        made = {}  # the backend bench_backend builds, to trace it once timed (its programs compiled)
        backends.create = _keeping(made, 'backend', create)
        precision = (contextlib.nullcontext() if row['precision'] == 'default'
                     else jax.default_matmul_precision(row['precision']))
        with precision:
          result = benchmark.bench_backend('jit', True, member, dataset.train, dataset.test, devices, row['K'],
                                           row['batch'], row['steps'], row['repeats'], row['steps_per_dispatch'])
          result['members_mapped'] = 'unrolled' if backends.unrolls(devices, member) else 'vmap'
          if row['what'] == 'profile':  # the timing stands even where the profile fails
            result.update(_profiled(profile_jax, made['backend'], dataset.train, row, scratch))
        emit('done', id=row['id'], result=result)
      finally:
        backends.unrolls, backends.create = unrolls, create


def profile_jax(backend, split, row: dict, scratch: str) -> dict:
  """The device's time in a few traced dispatches of the backend's fast path, by operation."""
  import jax  # pylint: disable=g-import-not-at-top
  from ensemble import backends, data  # pylint: disable=g-import-not-at-top
  state, resident = backend.init(0), backend.put_dataset(split)
  indices = data.train_batch_indices(len(split['label']), row['batch'], 0, 1, row['K'], 'shared')
  chunk = row['steps_per_dispatch']

  def dispatch(i):
    nonlocal state
    start = (i * chunk) % max(1, len(indices) - chunk + 1)
    state, metrics = backends.train_chunk(backend, state, split, resident, indices[start:start + chunk])
    jax.block_until_ready(metrics)
  dispatch(0)  # outside the trace: whatever a first call does
  folder = tempfile.mkdtemp(prefix='trace-', dir=scratch)
  reader = _xplane_reader()
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # the device's work, not every Python call around it
  options.raise_error_on_start_failure = True  # (a tracer that cannot start, CUPTI's, raises: no empty table)
  with jax.profiler.trace(folder, create_perfetto_trace=reader is None, profiler_options=options):
    for i in range(row['profile_dispatches']):
      dispatch(i + 1)
  planes = read_trace(folder, reader)
  hlo = read_hlo_dump(os.path.join(scratch, 'hlo'))
  return op_table(planes, hlo, steps=row['profile_dispatches'] * chunk)


def child_torch(rows: list[dict], emit: Events):
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    emit('unavailable', reason=f'PyTorch is not installed here ({e})')
    return
  import torch_peers  # pylint: disable=g-import-not-at-top
  device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
  name = torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'
  emit('env', torch=torch.__version__, device=name)
  tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
  memory_format, peers, compile_ = torch_peers.memory_format, dict(torch_peers.PEERS), torch.compile
  for row in rows:
    steps = {}
    with _reported(row, emit):
      try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = (
            tf32 if row['tf32'] == 'default' else (row['tf32'] == 'on',) * 2)
        if row['layout'] != 'auto':
          layout = torch.channels_last if row['layout'] == 'channels_last' else torch.contiguous_format
          torch_peers.memory_format = lambda peer, model, layout=layout: layout
        # bench builds the step and compiles it: both kept here, to profile the very step it timed.
        torch_peers.PEERS[row['peer']] = _keeping(steps, 'eager', peers[row['peer']])
        torch.compile = _keeping(steps, 'compiled', compile_)
        result = torch_peers.bench(row['peer'], row['model'], row['K'], row['batch'], row['dtype'], row['steps'],
                                   row['repeats'], row['compiled'], device)
        result['tf32_cudnn'], result['tf32_matmul'] = (torch.backends.cudnn.allow_tf32,
                                                       torch.backends.cuda.matmul.allow_tf32)
        if row['what'] == 'profile':  # the timing stands even where the profile fails
          result.update(_profiled(profile_torch, torch, steps.get('compiled', steps.get('eager')), row, device))
        emit('done', id=row['id'], result=result)
      finally:
        torch_peers.memory_format, torch.compile = memory_format, compile_
        torch_peers.PEERS.update(peers)
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _profiled(profile, *args) -> dict:
  """{'profile': profile(*args)}, or {'profile_error': why} where it raised."""
  try:
    return {'profile': profile(*args)}
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    return {'profile_error': f'{type(e).__name__}: {e}'[:2000]}


def _keeping(kept: dict, key: str, make):
  """`make`, its first result also kept as kept[key] (a backend, a training step)."""
  def made(*args, **kwargs):
    result = make(*args, **kwargs)
    kept.setdefault(key, result)
    return result
  return made


def profile_torch(torch, step, row: dict, device) -> dict:
  """torch.profiler over a few steps of the timed step: key_averages by input shape, by self device time."""
  import torch_peers  # pylint: disable=g-import-not-at-top
  from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top
  x = torch.randn(row['K'], row['batch'], *torch_peers.SHAPES[row['model']], device=device)
  y = torch.randint(0, 10, (row['K'], row['batch']), device=device)
  cuda = device.type == 'cuda'
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  steps = max(2, row['steps'] // 4)
  step(x, y)
  sync()
  with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
               record_shapes=True) as prof:
    for _ in range(steps):
      step(x, y)
    sync()
  averages = prof.key_averages(group_by_input_shape=True)
  for sort in ('self_device_time_total', 'self_cuda_time_total') if cuda else ('self_cpu_time_total',):
    try:  # PyTorch's name for it, before and after 'cuda' became 'device'
      table = averages.table(sort_by=sort, row_limit=TOP_OPS, max_name_column_width=70, max_shapes_column_width=90)
      break
    except Exception as e:  # pylint: disable=broad-except
      table = f'(key_averages().table(sort_by={sort!r}) failed: {e})'
  field = lambda evt, *names: next((getattr(evt, n) for n in names if hasattr(evt, n)), 0.0)
  ops = []
  for evt in averages:
    self_us = (field(evt, 'self_device_time_total', 'self_cuda_time_total') if cuda
               else field(evt, 'self_cpu_time_total'))
    if self_us > 0:
      ops.append({'op': evt.key, 'count': evt.count, 'self_us': self_us, 'shapes': str(evt.input_shapes)[:300],
                  'category': _category_from_name(evt.key)})
  ops.sort(key=lambda op: -op['self_us'])
  total = sum(op['self_us'] for op in ops)
  categories = {}
  for op in ops:
    categories[op['category']] = categories.get(op['category'], 0.0) + op['self_us']
  return {'steps': steps, 'clock': 'device' if cuda else 'cpu', 'ms_per_step': total / steps / 1e3,
          'categories': [{'category': c, 'share': us / total if total else 0.0, 'ms_per_step': us / steps / 1e3}
                         for c, us in sorted(categories.items(), key=lambda kv: -kv[1])],
          'ops': [{**op, 'share': op['self_us'] / total if total else 0.0, 'ms_per_step': op['self_us'] / steps / 1e3}
                  for op in ops[:TOP_OPS]],
          'table': table}


# --- the trace, reduced ----------------------------------------------------------------------------------------

def _xplane_reader():
  try:
    from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
    return ProfileData
  except ImportError:
    return None


def read_trace(folder: str, reader) -> list[dict]:
  """The trace's planes as [{'name', 'lines': [{'name', 'events': [(name, start_ns, duration_ns, stats)]}]}]: from
  the .xplane.pb through jax.profiler.ProfileData, or from the perfetto JSON where this JAX lacks it."""
  found = lambda pattern: sorted(
      os.path.join(root, f) for root, _, names in os.walk(folder) for f in names if re.fullmatch(pattern, f))
  if reader is not None:
    data = reader.from_file(found(r'.*\.xplane\.pb')[-1])
    return [{'name': plane.name,
             'lines': [{'name': line.name,
                        'events': [(e.name, e.start_ns, e.duration_ns, dict(e.stats)) for e in line.events]}
                       for line in plane.lines]}
            for plane in data.planes]
  with gzip.open(found(r'perfetto_trace\.json\.gz')[-1], 'rt', encoding='utf-8') as f:
    trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  processes = {e['pid']: e['args']['name'] for e in events if e.get('ph') == 'M' and e['name'] == 'process_name'}
  threads = {(e['pid'], e.get('tid')): e['args']['name'] for e in events
             if e.get('ph') == 'M' and e['name'] == 'thread_name'}
  planes = {}
  for e in events:
    if e.get('ph') == 'X':
      plane = planes.setdefault(e['pid'], {'name': processes.get(e['pid'], str(e['pid'])), 'lines': {}})
      line = plane['lines'].setdefault(e.get('tid'), {'name': threads.get((e['pid'], e.get('tid')), ''), 'events': []})
      line['events'].append((e['name'], e['ts'] * 1e3, e.get('dur', 0) * 1e3, e.get('args', {})))
  return [{'name': p['name'], 'lines': list(p['lines'].values())} for p in planes.values()]


# Lines that XLA's profiler derives from the streams' kernels: counting them too would count each kernel twice.
DERIVED_LINES = ('XLA Modules', 'XLA Ops', 'XLA TraceMe', 'Steps', 'Framework Ops', 'Framework Name Scope',
                 'Launch Stats', 'Source code')


def device_events(planes: list[dict]) -> tuple[str, list[dict]]:
  """The events that took the device's time, each with its self time: an accelerator's kernels and copies (its
  streams), else XLA:CPU's thunks (the events that name an hlo_op), their nested thunks' time taken out."""
  accelerators = ([p for p in planes if p['name'].startswith('/device:GPU') and p['lines']]
                  or [p for p in planes if p['name'].startswith('/device:') and 'CUSTOM' not in p['name']
                      and p['lines']])
  if accelerators:
    lines = [line for p in accelerators for line in p['lines'] if line['name'].startswith('Stream')]
    lines = lines or [line for p in accelerators for line in p['lines'] if line['name'] not in DERIVED_LINES]
    clock = accelerators[0]['name']
  else:
    lines = [{'name': line['name'], 'events': [e for e in line['events'] if 'hlo_op' in e[3]]}
             for p in planes if p['name'] == '/host:CPU' for line in p['lines']]
    clock = '/host:CPU (XLA:CPU thunks)'
  result = []
  for line in lines:
    stack = []  # (end_ns, index in result) of the events enclosing the next one
    for name, start, duration, stats in sorted(line['events'], key=lambda e: (e[1], -e[2])):
      while stack and stack[-1][0] <= start:
        stack.pop()
      if stack:
        result[stack[-1][1]]['self_ns'] -= duration
      annotation = ' '.join(str(v) for v in stats.values() if isinstance(v, str) and 'hlo_op=' in v)
      parsed = dict(re.findall(r'(hlo_op|hlo_module|program_id)=([^,#\s]+)', annotation))
      result.append({'kernel': name, 'self_ns': duration,
                     'op': str(stats.get('hlo_op') or parsed.get('hlo_op') or ''),
                     'module': str(stats.get('hlo_module') or parsed.get('hlo_module') or ''),
                     'program_id': str(stats.get('program_id') or parsed.get('program_id') or '')})
      stack.append((start + duration, len(result) - 1))
  return clock, result


_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$')
_SHAPE = re.compile(r'\b[a-z]\w*\[[\d,]*\](?:\{[^}]*\})?')


def parse_hlo(text: str) -> tuple[dict, dict]:
  """An optimized HLO module's instructions by name ({'shape', 'opcode', 'operands', 'attributes', 'calls',
  'op_name'}) and its computations' instruction names."""
  instructions, computations, current = {}, {}, None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith('{') and not line.startswith('HloModule'):
      current = line.removeprefix('ENTRY ').split()[0].lstrip('%')
      computations[current] = []
      continue
    match = _INSTRUCTION.match(line)
    if not match or current is None:
      continue
    name, shape, opcode, rest = match.groups()
    depth, end = 1, len(rest)
    for i, char in enumerate(rest):  # the operand list ends at its closing parenthesis
      depth += {'(': 1, ')': -1}.get(char, 0)
      if depth == 0:
        end = i
        break
    attributes = rest[end + 1:]
    op_name = re.search(r'op_name="([^"]*)"', attributes)
    instructions[name] = {
        'shape': shape, 'opcode': opcode, 'operands': re.findall(r'%([\w.\-]+)', rest[:end]),
        'calls': re.findall(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)', attributes),
        'attributes': {key: value for key, value in re.findall(
            r'(custom_call_target|feature_group_count|batch_group_count|dim_labels|window|kind)='
            r'("[^"]*"|\{[^}]*\}|[^,\s]+)', attributes)},
        'op_name': op_name.group(1) if op_name else ''}
    computations[current].append(name)
  return instructions, computations


def read_hlo_dump(folder: str) -> dict:
  """The dumped modules after XLA's optimizations, by module id and by name."""
  modules = {}
  if not os.path.isdir(folder):
    return modules
  for name in sorted(os.listdir(folder)):
    match = re.fullmatch(r'module_(\d+)\.(.+?)\.(?:[\w.]+_)?after_optimizations\.txt', name)
    if match:
      with open(os.path.join(folder, name), encoding='utf-8') as f:
        instructions, computations = parse_hlo(f.read())
      modules[match.group(1).lstrip('0') or '0'] = {
          'name': match.group(2), 'instructions': instructions, 'computations': computations,
          'underscored': {k.replace('.', '_'): k for k in instructions}}
  return modules


def _find(modules: dict, event: dict):
  """The HLO instruction an event ran, with its module: by program id, else by module name, else by name alone (a
  GPU kernel is named after its fusion, '.' written '_'); (None, None) where none matches."""
  if event['program_id'] in modules:
    candidates = [modules[event['program_id']]]
  else:  # the latest module of that name first
    latest = list(reversed(modules.values()))
    candidates = [m for m in latest if m['name'] == event['module']] or latest
  for name in (event['op'], event['kernel']):
    for module in candidates:
      if name in module['instructions']:
        return module, module['instructions'][name]
      if name in module['underscored']:
        return module, module['instructions'][module['underscored'][name]]
  return None, None


def _category_from_name(name: str) -> str:
  n = name.lower()
  for words, category in ((('memcpy', 'memset'), 'memcpy/memset'),
                          (('batch_norm', 'batchnorm', 'bn_fw', 'bn_bw', '::bn_'), 'batchnorm'),
                          (('conv', 'xmma_fprop', 'dgrad', 'wgrad', 'implicit_gemm', 'cudnn'), 'convolution'),
                          (('gemm', 'cublas', 'matmul', 'addmm', 'aten::mm', 'aten::bmm', 'dot'), 'matmul'),
                          (('triton_red', 'triton_per', 'reduce', 'reduction', 'sum'), 'reduction'),
                          (('transpose', 'permute', 'nchw', 'nhwc'), 'transpose'),
                          (('copy', 'contiguous', 'clone'), 'copy'),
                          (('gather', 'scatter', 'index'), 'gather/scatter'),
                          (('fusion', 'triton_poi', 'elementwise', 'vectorized'), 'elementwise')):
    if any(word in n for word in words):
      return category
  return 'other'


def _category(module: dict, instruction: dict) -> tuple[str, str]:
  """(category, detail) of an HLO instruction: what kind of work, and for a convolution its groups and layout."""
  inner = [module['instructions'][n] for c in instruction['calls'] for n in module['computations'].get(c, ())]
  everything = [instruction, *inner]
  opcodes = {i['opcode'] for i in everything}
  target = instruction['attributes'].get('custom_call_target', '').strip('"')
  convolutions = [i for i in everything if i['opcode'] == 'convolution'
                  or 'conv' in i['attributes'].get('custom_call_target', '').lower()]
  if convolutions:
    attributes = convolutions[0]['attributes']
    groups = max(int(attributes.get('feature_group_count', 1)), int(attributes.get('batch_group_count', 1)))
    direction = attributes.get('custom_call_target', '').strip('"').split('$')[-1]
    detail = ', '.join(f'{k}={attributes[k]}' for k in ('dim_labels', 'window', 'feature_group_count',
                                                         'batch_group_count') if k in attributes)
    return (f'convolution, grouped ({groups})' if groups > 1 else 'convolution'), f'{direction} {detail}'.strip()
  if 'gemm' in target.lower() or 'matmul' in target.lower() or 'dot' in opcodes:
    return 'matmul', target
  for ops, category in (({'reduce', 'reduce-window', 'select-and-scatter'}, 'reduction'), ({'transpose'}, 'transpose'),
                        ({'copy', 'copy-start', 'copy-done'}, 'copy'),
                        ({'gather', 'scatter', 'dynamic-slice', 'dynamic-update-slice'}, 'gather/scatter')):
    if opcodes & ops:
      return category, ''
  if instruction['opcode'] == 'fusion':
    return 'elementwise', instruction['attributes'].get('kind', '')
  return instruction['opcode'], target


def op_table(planes: list[dict], modules: dict, steps: int) -> dict:
  """The device's time by operation and by category (ms a step, share), the operations with their shapes."""
  clock, events = device_events(planes)
  if not events:
    raise ValueError('the trace holds no device events: its planes and lines were '
                     + '; '.join(f"{p['name']}: {[line['name'] for line in p['lines']][:8]}" for p in planes))
  groups = {}
  for event in events:
    key = event['op'] or event['kernel']
    group = groups.setdefault(key, {'op': key, 'ns': 0.0, 'count': 0, 'kernels': {}, 'event': event})
    group['ns'] += event['self_ns']
    group['count'] += 1
    group['kernels'][event['kernel']] = group['kernels'].get(event['kernel'], 0.0) + event['self_ns']
  total = sum(g['ns'] for g in groups.values()) or 1.0
  ops, categories = [], {}
  for group in sorted(groups.values(), key=lambda g: -g['ns']):
    module, instruction = _find(modules, group['event'])
    if instruction is None:
      category, detail, shape, operands, op_name = _category_from_name(group['op']), '', '', [], ''
    else:
      category, detail = _category(module, instruction)
      inner = [module['instructions'][n] for c in instruction['calls'] for n in module['computations'].get(c, ())]
      shape = instruction['shape']
      op_name = next((i['op_name'] for i in [instruction, *inner] if i['op_name']), '')
      operands = [module['instructions'][o]['shape'] for o in instruction['operands'][:3]
                  if o in module['instructions']]
    if category in ('reduction', 'elementwise') and 'BatchNorm' in op_name:
      category += ' (BatchNorm)'
    categories[category] = categories.get(category, 0.0) + group['ns']
    ops.append({'op': group['op'], 'category': category, 'share': group['ns'] / total,
                'ms_per_step': group['ns'] / steps / 1e6, 'calls_per_step': group['count'] / steps,
                'shape': shape[:160], 'operands': [s[:120] for s in operands], 'detail': detail[:200],
                'op_name': re.sub(r'^jit\([^)]*\)/', '', op_name)[:120],
                'kernel': max(group['kernels'], key=group['kernels'].get)[:100]})
  unattributed = sum(e['self_ns'] for e in events if not e['op'])
  return {'clock': clock, 'steps': steps, 'events': len(events), 'ms_per_step': total / steps / 1e6,
          'planes': [f"{p['name']} ({len(p['lines'])} lines, {sum(len(line['events']) for line in p['lines'])} events)"
                     for p in planes],
          'unattributed_share': unattributed / total, 'hlo_modules': len(modules),
          'categories': [{'category': c, 'share': ns / total, 'ms_per_step': ns / steps / 1e6}
                         for c, ns in sorted(categories.items(), key=lambda kv: -kv[1])],
          'ops': ops[:TOP_OPS]}


# --- the parent: runs the children within their budgets and writes what they measured ---------------------------

class Report:
  """Everything measured so far; `save` rewrites the files under --out (whole, never half written)."""

  def __init__(self, out: str, args, command: str):
    self.out, self.args, self.command = out, args, command
    self.started = time.time()
    self.env = {}
    self.unavailable = {}  # stack -> why its children cannot run here (PyTorch not installed)
    self.rows = []  # every row of sections 1 and 2, as measured, failed or skipped
    self.lines = {}  # section -> lines said about it (skips of whole groups, notes)
    self.end_to_end = None
    self.small_data = {}
    self.small_data_text = ''

  def note(self, section: str, line: str):
    print(f'# {section}: {line}', flush=True)
    self.lines.setdefault(section, []).append(line)

  def save(self):
    header = {'started': time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started)), 'command': self.command,
              'dry': self.args.dry, 'env': self.env, 'budgets_s': self.budgets()}
    rows = lambda section: [r for r in self.rows if r['section'] == section]
    if rows('profile') or self.lines.get('profile'):
      self._write('profile.json', {**header, 'rows': rows('profile'), 'notes': self.lines.get('profile', [])})
      self._write('profile.txt', self.profile_text())
    if rows('peers') or self.lines.get('peers'):
      self._write('peers.json', {**header, 'table': self.peer_table(), 'rows': rows('peers'),
                                 'notes': self.lines.get('peers', [])})
    if self.end_to_end is not None:
      self._write('end_to_end.json', {**header, **self.end_to_end})
    if self.small_data:
      self._write('small_data.json', {**header, 'sections': self.small_data})
    files.write_atomically(os.path.join(self.out, 'summary.md'), self.summary())

  def budgets(self) -> dict:
    return {g: round(BUDGETS[g] * self.args.budget_scale, 1) for s in self.args.sections for g in GROUPS[s]}

  def _write(self, name: str, value):
    text = value if isinstance(value, str) else json.dumps(value, indent=1, default=str)
    files.write_atomically(os.path.join(self.out, name), text)

  def measured(self, **where) -> list[dict]:
    return [r for r in self.rows if r['status'] == 'measured' and all(r.get(k) == v for k, v in where.items())]

  def peer_table(self) -> list[dict]:
    table = []
    for model in ('cnn', 'resnet'):
      for dtype in ('float32', 'bfloat16'):
        ours = [r for r in self.measured(stack='jax', model=model, dtype=dtype) if _peer_like(r)]
        theirs = [r for r in self.measured(stack='torch', model=model, dtype=dtype) if _peer_like(r)]
        if ours or theirs:
          rate = lambda rows: rows[0]['member_images_per_s'] if rows else None
          ratio = rate(ours) / rate(theirs) if ours and theirs else None
          table.append({'model': model, 'dtype': dtype, 'ours_jit_fast': rate(ours), 'torch_vmap_compiled':
                        rate(theirs), 'ratio': ratio, 'goal': GOALS[model],
                        'from_section': sorted({r['section'] for r in ours + theirs})})
    return table

  def summary(self) -> str:
    env = self.env
    out = [f"# GPU check (issue 77){' — dry run on the CPU, tiny sizes' if self.args.dry else ''}", '',
           f"Started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}, "
           f"{time.time() - self.started:.0f} s so far: `{self.command}`.",
           f"JAX: {env.get('jax', {}).get('jax', '–')} on {env.get('jax', {}).get('device', '–')}; "
           f"PyTorch: {env.get('torch', {}).get('torch', '–')} on {env.get('torch', {}).get('device', '–')}.",
           'Budgets (s): ' + ', '.join(f'{g} {b:g}' for g, b in self.budgets().items()) + '.', '']
    sizes = DRY if self.args.dry else FULL
    if 'profile' in self.args.sections:
      out += [f"## 1. Profile: {'the CNN' if self.args.dry else 'ResNet-20'}'s training step, K={sizes['K']}, "
              f"batch {sizes['batch']} a member", '',
              'Device time by category (top operations with their shapes in profile.txt).', '']
      for row in self.rows:
        if row['section'] == 'profile' and 'profile_error' in row:
          out += [f"### {_label(row)}: {row['member_images_per_s']:,.0f} member-images/s timed; the profile failed: "
                  f"{row['profile_error']}", '']
        if row['section'] == 'profile' and 'profile' in row:
          p = row['profile']
          out += [f"### {_label(row)}: {p['ms_per_step']:.2f} ms a step on {p.get('clock', '?')}, "
                  f"{row['member_images_per_s']:,.0f} member-images/s timed", '',
                  '| category | share | ms a step |', '| --- | --- | --- |']
          out += [f"| {c['category']} | {100 * c['share']:.1f}% | {c['ms_per_step']:.3f} |" for c in p['categories']]
          out.append('')
      out += ['### Layouts and precision: member-images/s of the training step', '',
              '| stack | path | members / layout | dtype | TF32 | steps a dispatch | member-images/s | compile s | '
              'status |', '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
      out += [_layout_line(r) for r in self.rows if r['section'] == 'profile']
      out += [''] + [f'- {line}' for line in self.lines.get('profile', [])] + ['']
    if 'peers' in self.args.sections:
      out += ['## 2. Peers: ours (jit-fast) against torch vmap (compiled), member-images/s', '',
              '| model | dtype | ours | torch vmap | ours / torch | goal |', '| --- | --- | --- | --- | --- | --- |']
      for t in self.peer_table():
        fmt = lambda v: f'{v:,.0f}' if v else '–'
        ratio = '–' if t['ratio'] is None else f"{t['ratio']:.2f}x"
        verdict = '' if t['ratio'] is None else ('met' if t['ratio'] >= t['goal'] else 'MISSED')
        out.append(f"| {t['model']} | {t['dtype']} | {fmt(t['ours_jit_fast'])} | {fmt(t['torch_vmap_compiled'])} | "
                   f"{ratio} | >= {t['goal']}x {verdict} |")
      out += ['', '| row | status | member-images/s | compile s |', '| --- | --- | --- | --- |']
      measured = lambda r, key, fmt: format(r[key], fmt) if r['status'] == 'measured' else '–'
      out += [f"| {_label(r)} | {r['status']}{': ' + r['note'] if r.get('note') else ''} | "
              f"{measured(r, 'member_images_per_s', ',.0f')} | {measured(r, 'compile_s', '.1f')} |"
              for r in self.rows if r['section'] == 'peers']
      out += [''] + [f'- {line}' for line in self.lines.get('peers', [])] + ['']
    if 'end_to_end' in self.args.sections:
      out += ["## 3. README's default command end to end", '']
      e = self.end_to_end
      if e:
        accuracy = '' if e.get('test_accuracy') is None else f", test accuracy {e['test_accuracy']:.4f}"
        out += [f"`{e['command']}`: {e['status']}, wall {e['wall_s']:.1f} s, {len(e['epochs'])} epoch(s) done"
                f"{accuracy}.",
                '', '| epoch | train s | test s | save s |', '| --- | --- | --- | --- |']
        out += [f"| {x.get('epoch')} | {x.get('train_seconds', 0):.2f} | {x.get('test_seconds', 0):.2f} | "
                f"{x.get('save_seconds', 0):.2f} |" for x in e['epochs']]
      out += [''] + [f'- {line}' for line in self.lines.get('end_to_end', [])] + ['']
    if 'small_data' in self.args.sections:
      out += ['## 4. scripts/small_data.py', '', self.small_data_text.strip(), '']
      out += [f'- {line}' for line in self.lines.get('small_data', [])] + ['']
    return '\n'.join(out) + '\n'

  def profile_text(self) -> str:
    out = []
    for row in self.rows:
      if row['section'] != 'profile' or 'profile' not in row:
        continue
      p = row['profile']
      out += ['=' * 100, f"{_label(row)}: {p['ms_per_step']:.3f} ms a step ({p.get('clock')}), "
              f"{row['member_images_per_s']:,.0f} member-images/s", '']
      if row['stack'] == 'jax':
        out += [f"{p['events']} events over {p['steps']} steps; {100 * p['unattributed_share']:.1f}% of the time in "
                f"events naming no HLO op; {p['hlo_modules']} HLO modules dumped", '']
        for op in p['ops']:
          out += [f"{100 * op['share']:5.1f}% {op['ms_per_step']:8.3f} ms x{op['calls_per_step']:g}  "
                  f"{op['category']:<26} {op['op']}", f"        shape {op['shape']}"]
          out += [f'        {label} {value}' for label, value in (
              ('operands', ', '.join(op['operands'])), ('detail', op['detail']), ('from', op['op_name']),
              ('kernel', op['kernel'] if op['kernel'] != op['op'] else '')) if value]
      else:
        out.append(p['table'])
      out.append('')
    return '\n'.join(out) + '\n'


def _label(row: dict) -> str:
  if row['stack'] == 'jax':
    mapped = row.get('members_mapped', row['member_map'])
    return (f"ours jit-fast {row['model']} {row['dtype']}, members {mapped}"
            f"{', precision ' + row['precision'] if row['precision'] != 'default' else ''}"
            f", {row['steps_per_dispatch']} step{'s' if row['steps_per_dispatch'] != 1 else ''} a dispatch")
  return (f"{row['peer']} {'compiled' if row['compiled'] else 'eager'} {row['model']} {row['dtype']}, "
          f"{row.get('memory_format', row['layout'])}, TF32 {row['tf32']}")


def _layout_line(row: dict) -> str:
  if row['stack'] == 'jax':
    path, layout = 'jit-fast', f"members {row.get('members_mapped', row['member_map'])}"
    tf32 = 'off (highest)' if row['precision'] == 'highest' else 'default'
    dispatch = row['steps_per_dispatch']
  else:
    path = f"{row['peer']} {'compiled' if row['compiled'] else 'eager'}"
    layout, dispatch = row.get('memory_format', row['layout']), 1
    tf32 = (f"cudnn {row['tf32_cudnn']}, matmul {row['tf32_matmul']}" if 'tf32_cudnn' in row else row['tf32'])
  rate = f"{row['member_images_per_s']:,.0f}" if row['status'] == 'measured' else '–'
  compile_s = f"{row['compile_s']:.1f}" if row['status'] == 'measured' else '–'
  status = row['status'] + (f": {row['note']}" if row.get('note') else '')
  return (f"| {row['stack']} | {path} | {layout} | {row['dtype']} | {tf32} | {dispatch} | {rate} | {compile_s} | "
          f"{status} |")


def run_rows(report: Report, section: str, group: str, rows: list[dict], deadline: float, scratch: str,
             env: dict) -> None:
  """Runs `rows` in children of their stack, as many rows per child as finish: a row past its budget (or the
  group's deadline) is stopped there and reported skipped, and a new child takes the rows after it."""
  pending = list(rows)
  kind = rows[0]['stack'] if rows else 'jax'

  def skip(rows, note):
    report.rows.extend({**row, 'section': section, 'status': 'skipped', 'note': note} for row in rows)
    report.save()
  while pending:
    if kind in report.unavailable:
      skip(pending, report.unavailable[kind])
      report.note(section, f'{group}: skipped, {report.unavailable[kind]}')
      return
    if deadline - time.monotonic() < 2:
      skip(pending, f"{group}'s time ran out first")
      return
    spec, events = (os.path.join(scratch, f'{group.replace(" ", "_")}-{time.monotonic_ns()}.{s}')
                    for s in ('rows.json', 'events.jsonl'))
    with open(spec, 'w', encoding='utf-8') as f:
      json.dump(pending, f)
    open(events, 'w', encoding='utf-8').close()  # pylint: disable=consider-using-with
    command = [sys.executable, os.path.abspath(__file__), f'--_child={kind}', f'--_rows={spec}',
               f'--_events={events}', f'--_scratch={scratch}']
    child = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)  # pylint: disable=consider-using-with
    by_id, done, current, started, offset = {r['id']: r for r in pending}, set(), None, None, 0
    stopped = None
    while True:
      exited = child.poll() is not None
      with open(events, encoding='utf-8') as f:
        f.seek(offset)
        text = f.read()
      complete = text[:text.rfind('\n') + 1]
      offset += len(complete.encode('utf-8'))
      for line in complete.splitlines():
        event = json.loads(line)
        if event['event'] == 'env':
          report.env[kind] = {k: v for k, v in event.items() if k != 'event'}
        elif event['event'] == 'unavailable':
          report.unavailable[kind] = event['reason']
        elif event['event'] == 'start':
          current, started = event['id'], time.monotonic()
        elif event['event'] in ('done', 'error'):
          row = by_id[event['id']]
          if event['event'] == 'done':
            report.rows.append({**row, **event['result'], 'section': section, 'status': 'measured'})
          else:
            report.rows.append({**row, 'section': section, 'status': 'failed', 'note': event['error']})
          print(f"# {group}: {event['id']}: {report.rows[-1]['status']} in {time.monotonic() - started:.1f} s",
                flush=True)
          done.add(event['id'])
          current = None
          report.save()
      if exited:
        break
      now = time.monotonic()
      if current is not None and now > min(started + by_id[current]['budget_s'], deadline):
        past = now - started
        stopped = (current, f"stopped after {past:.0f} s: past its budget of {by_id[current]['budget_s']} s (compile "
                            'and timing)' if now < deadline else f"stopped after {past:.0f} s: {group}'s time ran out")
      elif current is None and now > deadline:
        stopped = (None, '')
      if stopped:
        _kill(child)
        break
      time.sleep(0.2)
    if child.returncode and not stopped and current is not None:
      stopped = (current, f'the child process died (exit status {child.returncode})')
    if stopped and stopped[0] is not None:
      report.rows.append({**by_id[stopped[0]], 'section': section, 'status': 'skipped', 'note': stopped[1]})
      done.add(stopped[0])
      print(f'# {group}: {stopped[0]}: {stopped[1]}', flush=True)
      report.save()
    left = [r for r in pending if r['id'] not in done]
    if stopped == (None, ''):
      skip(left, f"{group}'s time ran out first")
      return
    if left and left == pending and kind not in report.unavailable:  # the child ran none of them: say so, not loop
      for row in left:
        report.rows.append({**row, 'section': section, 'status': 'failed',
                            'note': f'the child process exited with status {child.returncode} before this row'})
      report.save()
      return
    pending = left


def _kill(child: subprocess.Popen):
  """Ends a child this script started and the processes it started (its own process group: PyTorch's compile
  workers, small_data's children)."""
  try:
    os.killpg(child.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  child.wait()


def run_process(command: list[str], deadline: float, env: dict, on_poll, stdout=None) -> tuple[int | None, float]:
  """Runs `command` until it ends or `deadline`, calling `on_poll()` every half second; (exit status or None if
  stopped, seconds)."""
  start = time.monotonic()
  child = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout,  # pylint: disable=consider-using-with
                           stderr=subprocess.STDOUT if stdout else None, start_new_session=True)
  while child.poll() is None:
    if time.monotonic() > deadline:
      _kill(child)
      on_poll()
      return None, time.monotonic() - start
    time.sleep(0.5)
    on_poll()
  on_poll()
  return child.returncode, time.monotonic() - start


def tiny_mnist(folder: str, rows: int = 512) -> str:
  """The first `rows` images of the bundled MNIST's training and test splits as IDX files: the dry run's data."""
  from ensemble.data import bundled  # pylint: disable=g-import-not-at-top
  source = bundled.DATASETS['mnist']
  os.makedirs(folder, exist_ok=True)
  for name in os.listdir(source):
    if name.endswith('-ubyte.gz'):
      with gzip.open(os.path.join(source, name), 'rb') as f:
        raw = f.read()
      dims = raw[3]
      shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], 'big') for i in range(dims)]
      item = 1
      for size in shape[1:]:
        item *= size
      shape[0] = min(shape[0], rows)
      header = raw[:4] + b''.join(s.to_bytes(4, 'big') for s in shape)
      body = raw[4 + 4 * dims:4 + 4 * dims + shape[0] * item]
      with gzip.open(os.path.join(folder, name), 'wb') as f:
        f.write(header + body)
  return folder


def section_end_to_end(report: Report, deadline: float, scratch: str, env: dict, data_dir: str):
  workdir = os.path.join(scratch, 'end_to_end')
  command = [sys.executable, '-m', 'ensemble.train', f'--workdir={workdir}', '--config=configs/default.py']
  if report.args.dry:
    command += ['--cpu_devices=2', '--config.ensemble_size=2', '--config.num_epochs=1', '--config.batch_size=32',
                f'--config.data_dir={data_dir}', '--config.heldout_fraction=0']
  shown = ' '.join(['python', *command[1:]]).replace(workdir, '/tmp/gpu_check_run')
  cache = os.path.join(scratch, 'xdg_cache')  # empty: the compiles of a first run on a fresh machine
  metrics = os.path.join(workdir, 'metrics.jsonl')
  state = {'epochs': 0}

  def poll(status='running', wall=None):
    lines = []
    if os.path.exists(metrics):
      with open(metrics, encoding='utf-8') as f:
        lines = [json.loads(line) for line in f if line.strip().endswith('}')]
    if len(lines) != state['epochs'] or wall is not None:
      state['epochs'] = len(lines)
      report.end_to_end = {'command': shown, 'status': status,
                           'wall_s': wall if wall is not None else time.monotonic() - state['start'],
                           'epochs': [{k: v for k, v in line.items() if not k.startswith('member_')}
                                      for line in lines],
                           'test_accuracy': lines[-1].get('test_accuracy') if lines else None,
                           'compilation_cache': 'empty at the start (XDG_CACHE_HOME in a fresh folder)'}
      report.save()
  state['start'] = time.monotonic()
  code, wall = run_process(command, deadline, {**env, 'XDG_CACHE_HOME': cache}, poll)
  poll('finished' if code == 0 else ('stopped: its time ran out' if code is None else f'failed (exit status {code})'),
       wall)
  if code != 0:
    report.note('end_to_end', f'{shown}: ' + report.end_to_end['status'])


def section_small_data(report: Report, deadline: float, scratch: str, env: dict):
  sections, flags = SMALL_DATA['dry' if report.args.dry else 'full']
  if report.args.dry:
    report.note('small_data', "dry run: the fixed section only (regression and bo each start JAX processes of their "
                'own, 35 s on 2 CPU cores); the real run runs fixed,regression,bo')
  for name in sections.split(','):
    out = os.path.join(scratch, f'small_data_{name}.json')
    log = os.path.join(scratch, f'small_data_{name}.txt')
    command = [sys.executable, os.path.join(SCRIPTS, 'small_data.py'), f'--section={name}', f'--json={out}', *flags]
    with open(log, 'w', encoding='utf-8') as stdout:
      code, seconds = run_process(command, deadline, env, lambda: None, stdout=stdout)
    with open(log, encoding='utf-8') as f:
      text = f.read()
    print(text, flush=True)
    if code == 0 and os.path.exists(out):
      with open(out, encoding='utf-8') as f:
        report.small_data[name] = {'seconds': seconds, 'flags': flags, **json.load(f)}
      report.small_data_text += '\n'.join(line for line in text.splitlines()
                                          if line.startswith(('|', '##')) or not line.strip()) + '\n'
    else:
      why = 'its time ran out' if code is None else f'exit status {code}: {text.strip().splitlines()[-1:]}'
      report.note('small_data', f'--section={name}: not measured, {why}')
    report.save()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default='', help='folder for the results (the device tool: $OUT); made if missing')
  parser.add_argument('--dry', action='store_true', help='on the CPU, tiny sizes, under a minute')
  parser.add_argument('--sections', default=','.join(SECTIONS), help=f"a list of {', '.join(SECTIONS)}")
  parser.add_argument('--budget_scale', type=float, default=1.0, help="multiplies every section's time budget")
  parser.add_argument('--keep_scratch', action='store_true', help='keep the traces, HLO dumps and workdir')
  parser.add_argument('--_child', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_rows', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_events', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_scratch', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._child:  # pylint: disable=protected-access
    with open(args._rows, encoding='utf-8') as f:  # pylint: disable=protected-access
      rows = json.load(f)
    emit = Events(args._events)  # pylint: disable=protected-access
    if args._child == 'jax':  # pylint: disable=protected-access
      child_jax(rows, emit, args._scratch)  # pylint: disable=protected-access
    else:
      child_torch(rows, emit)
    return
  try:
    args.sections = [s.strip() for s in args.sections.split(',') if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
      raise UsageError(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if not args.out:
      raise UsageError('--out: give a folder for the results (on the GPU machine, $OUT)')
    os.makedirs(args.out, exist_ok=True)
  except UsageError as e:
    exit_with_error(str(e))
  scratch = tempfile.mkdtemp(prefix='gpu_check-')
  command = 'python scripts/gpu_check.py ' + ' '.join(a for a in sys.argv[1:] if not a.startswith('--out'))
  report = Report(args.out, args, command.strip())
  env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'PYTHONPATH': os.pathsep.join(
      p for p in (REPO, os.environ.get('PYTHONPATH', '')) if p)}
  if args.dry:
    env['CUDA_VISIBLE_DEVICES'] = ''  # the CPU, even where a GPU is
    env['JAX_PLATFORMS'] = 'cpu'
  data_dir = tiny_mnist(os.path.join(scratch, 'mnist')) if args.dry else ''  # dry: 512 images of MNIST
  start = time.monotonic()
  spent = 0.0  # the budgets of the groups so far: each group's deadline is the start plus these and its own
  report.save()
  try:
    for section in args.sections:
      print(f'\n# ---- {section} ({time.monotonic() - start:.0f} s in) ----', flush=True)
      if section in ('profile', 'peers'):
        groups = (profile_rows(args.dry, data_dir) if section == 'profile'
                  else peer_rows(args.dry, [r for r in report.rows if r['section'] == 'profile'], data_dir))
        if section == 'peers':
          reused = [r for r in report.rows if r['section'] == 'profile' and _peer_like(r)]
          if reused:
            report.note('peers', 'from section 1 (the same settings, this run): '
                        + '; '.join(_label(r) for r in reused))
        for group in GROUPS[section]:
          spent += BUDGETS[group] * args.budget_scale
          rows = groups[group]
          if not rows:
            continue
          child_env = dict(env)
          if group == 'jax profile':  # XLA's optimized HLO, for the profiled operations' shapes
            # (the backends' training programs are jitted functions named 'mapped': the others are not dumped)
            dump = os.path.join(scratch, 'hlo')
            child_env['XLA_FLAGS'] = (f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                                      '--xla_dump_hlo_module_re=.*mapped.*').strip()
          run_rows(report, section, group, rows, start + spent, scratch, child_env)
      elif section == 'end_to_end':
        spent += BUDGETS[section] * args.budget_scale
        section_end_to_end(report, start + spent, scratch, env, data_dir)
      else:
        spent += BUDGETS[section] * args.budget_scale
        section_small_data(report, start + spent, scratch, env)
  finally:
    report.save()
    if not args.keep_scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  print(f'\n# done in {time.monotonic() - start:.0f} s; wrote {", ".join(sorted(os.listdir(args.out)))} '
        f'in {args.out}', flush=True)


if __name__ == '__main__':
  main()
