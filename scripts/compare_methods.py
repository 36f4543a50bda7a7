"""Trains every ensembling method on the same data for the same epochs and prints one Markdown table.

  python scripts/compare_methods.py --cpu_devices=8 --epochs=10 --out=/tmp/compare

Each method is one `python -m ensemble.train` run of configs/default.py with `--config.method=NAME` (the row
`adversarial`: independent members with `--config.adversarial_epsilon=0.01`),
scored by `python -m ensemble.evaluate` (the test set, and the test set rotated by --angle degrees)
exactly as a user would run them. The table gives the ensemble's test accuracy, NLL, Brier score
and ECE, its NLL on the rotated test set, the ensemble's distinct trained parameters, the training
throughput (member-images per second of training, from the epochs' `train_seconds` in
metrics.jsonl, the first epoch and its compiles left out) and the whole run's wall time, next to
the best single member's accuracy and NLL (each the best over the members). Workdirs that already
hold a finished run of the same epochs are scored again, not retrained. --markdown writes the
table to a file too.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# This process only reads shapes and records, on the CPU; an accelerator stays whole for the runs it starts
# (JAX would otherwise take most of a GPU's memory here).
CHILD_ENV = dict(os.environ)
os.environ['JAX_PLATFORMS'] = 'cpu'
# The table's rows: each the config it trains on top of --config (a method, and adversarial training as the
# deep-ensemble paper's recipe adds it to independent members, its eps 0.01).
VARIANTS = {**{name: {'method': name} for name in ('independent', 'bagging', 'hyper', 'snapshot', 'batchensemble',
                                                   'mc_dropout')},
            'adversarial': {'method': 'independent', 'adversarial_epsilon': 0.01}}
METHODS = tuple(VARIANTS)


def _run(args: list[str], log_path: str):
  """Runs `python -m args` from the repository root, its output in `log_path`; exits on failure."""
  with open(log_path, 'w', encoding='utf-8') as log:
    result = subprocess.run([sys.executable, '-m', *args], cwd=ROOT, env=CHILD_ENV, stdout=log,
                            stderr=subprocess.STDOUT, check=False)
  if result.returncode:
    with open(log_path, encoding='utf-8') as log:
      last = log.read().strip().splitlines()[-1:]
    sys.exit(f'error: python -m {" ".join(args)} failed (exit {result.returncode}): {last}; log: {log_path}')


def _lines(workdir: str) -> list[dict]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def snapshot_cycles(epochs: int, preferred: int = 5) -> int:
  """The most cycles up to `preferred` that divide `epochs` (each cycle spans whole epochs)."""
  return max(c for c in range(1, min(preferred, epochs) + 1) if epochs % c == 0)


def train(method: str, args, workdir: str) -> float:
  """Trains `method` in `workdir` unless it holds a finished run; returns the wall time in seconds (0 if reused)."""
  lines = _lines(workdir)
  if lines and lines[-1]['epoch'] == args.epochs:
    return 0.0
  command = ['ensemble.train', f'--workdir={workdir}', f'--config={args.config}',
             *(f'--config.{key}={value}' for key, value in VARIANTS[method].items()),
             f'--config.num_epochs={args.epochs}', f'--config.data_dir={args.data_dir}',
             f'--config.snapshot_cycles={snapshot_cycles(args.epochs)}', *args.override]
  if args.cpu_devices:
    command.append(f'--cpu_devices={args.cpu_devices}')
  started = time.perf_counter()
  _run(command, os.path.join(args.out, f'{method}.train.log'))
  return time.perf_counter() - started


def _recorded(workdir: str):
  """(run config, member) of a finished run, as `ensemble.evaluate` reads them."""
  from ensemble import checkpoint, config as config_lib, evaluation  # pylint: disable=g-import-not-at-top
  config = evaluation.load_run_config(workdir)
  ckpt = checkpoint.Checkpointer(workdir)
  member = config_lib.member(config, ckpt.meta(ckpt.latest_epoch())['data'])
  ckpt.close()
  return config, member


def num_params(workdir: str) -> int:
  """The ensemble's distinct trained parameters, as its method counts them (BatchEnsemble's shared ones once)."""
  import jax  # pylint: disable=g-import-not-at-top
  config, member = _recorded(workdir)
  return member.method.num_params(jax.eval_shape(member.init, jax.random.key(0)).params, config.ensemble_size)


def steps_per_epoch(workdir: str) -> int:
  from ensemble import data  # pylint: disable=g-import-not-at-top
  config, _ = _recorded(workdir)
  train, _ = data.hold_out(data.load(config.dataset, config.data_dir, config.train_split, config.test_split).train,
                           config.heldout_fraction)
  return data.steps_per_epoch(len(train['label']), config.batch_size)


def score(method: str, args, workdir: str, seconds: float) -> dict:
  """The table's row for `method`: `ensemble.evaluate`'s numbers and the run's own records."""
  output_dir = os.path.join(workdir, 'eval')
  _run(['ensemble.evaluate', f'--workdir={workdir}', f'--output_dir={output_dir}', f'--angles=0,{args.angle}'],
       os.path.join(args.out, f'{method}.evaluate.log'))
  with open(os.path.join(output_dir, 'metrics.json'), encoding='utf-8') as f:
    results = json.load(f)
  lines = _lines(workdir)
  config, _ = _recorded(workdir)
  steady = [line['train_seconds'] for line in lines[1:]] or [lines[0]['train_seconds']]
  member_images = config.batch_size * config.ensemble_size * steps_per_epoch(workdir)
  rotated = next(row for row in results['rotation'] if row['angle'] == args.angle)
  return {
      'method': method, 'ensemble': results['ensemble'], 'best_member': results['best_member'],
      'rotated_nll': rotated['ensemble']['nll'], 'params': num_params(workdir),
      'member_images_per_s': member_images * len(steady) / sum(steady),
      'wall_seconds': seconds or sum(line['train_seconds'] for line in lines),
  }


def table(rows: list[dict], angle: int) -> str:
  header = ['method', 'accuracy', 'NLL', 'Brier', 'ECE', f'NLL at {angle} deg', 'best member acc / NLL',
            'parameters', 'member-images/s', 'wall time']
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for row in rows:
    e, b = row['ensemble'], row['best_member']
    minutes, seconds = divmod(round(row['wall_seconds']), 60)
    lines.append('| ' + ' | '.join([
        row['method'], f"{e['accuracy']:.4f}", f"{e['nll']:.4f}", f"{e['brier']:.4f}", f"{e['ece']:.4f}",
        f"{row['rotated_nll']:.3f}", f"{b['accuracy']:.4f} / {b['nll']:.4f}", f"{row['params']:,}",
        f"{row['member_images_per_s']:,.0f}", f'{minutes}m {seconds:02d}s']) + ' |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--data_dir', default='', help="IDX folder or .npz; empty for the config's dataset (MNIST)")
  parser.add_argument('--config', default='configs/default.py')
  parser.add_argument('--epochs', type=int, default=10)
  parser.add_argument('--methods', default=','.join(METHODS), help='comma-separated, from ' + ', '.join(METHODS))
  parser.add_argument('--cpu_devices', type=int, default=0, help='simulate N CPU devices (0: the real devices)')
  parser.add_argument('--angle', type=int, default=60, help='rotation of the shifted test set, in degrees')
  parser.add_argument('--out', default='/tmp/compare_methods', help='one workdir per method, and the logs')
  parser.add_argument('--markdown', default='', help='also write the table to this file')
  parser.add_argument('--override', action='append', default=[],
                      help='extra --config.KEY=VALUE for every method (repeat the flag)')
  args = parser.parse_args()
  methods = args.methods.split(',')
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    from ensemble.errors import exit_with_error  # pylint: disable=g-import-not-at-top
    exit_with_error(f'--methods: unknown {unknown}; choose from {", ".join(METHODS)}')
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for method in methods:
    workdir = os.path.join(args.out, method)
    seconds = train(method, args, workdir)
    rows.append(score(method, args, workdir, seconds))
    print(f'{method}: done ({rows[-1]["wall_seconds"]:.0f} s)', file=sys.stderr, flush=True)
  with open(os.path.join(args.out, 'rows.json'), 'w', encoding='utf-8') as f:
    json.dump(rows, f, indent=2)
  text = table(rows, args.angle)
  print(text)
  for row in rows:
    if row['ensemble']['nll'] >= row['best_member']['nll']:
      print(f"warning: {row['method']}'s ensemble NLL {row['ensemble']['nll']:.4f} does not beat its best member's "
            f"{row['best_member']['nll']:.4f}", file=sys.stderr)
  if args.markdown:
    with open(args.markdown, 'w', encoding='utf-8') as f:
      f.write(text + '\n')


if __name__ == '__main__':
  main()
