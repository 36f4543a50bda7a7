"""Trains every ensembling method on the same data for the same epochs and prints one Markdown table.

  python scripts/compare_methods.py --cpu_devices=8 --epochs=10 --out=/tmp/compare

Each method is one `python -m ensemble.train` run of configs/default.py with `--config.method=NAME` (the row
`adversarial`: independent members with `--config.adversarial_epsilon=0.01`),
scored by `python -m ensemble.evaluate` (the test set, and the test set rotated by --angle degrees)
exactly as a user would run them. The table gives the ensemble's test accuracy, NLL, Brier score and ECE, its NLL
on the rotated test set, the AUROC of its predictive entropy against each of the report's default
out-of-distribution sets (uniform noise, permuted pixels), the ensemble's distinct trained parameters, the training
throughput (member-images per second of training, from the epochs' `train_seconds` in metrics.jsonl, the first
epoch and its compiles left out) and the whole run's wall time, next to the best single member's accuracy and NLL
(each the best over the members). The `distilled` row (one network trained for --student_epochs, by default
three times the members') trains in a process of its own too, so that the student runs where the members ran.
Workdirs that already hold a finished run of the same epochs are not retrained, and their rows are kept from the
last scoring (eval/row.json; remove it to score again), so that a table can be made over several sessions.
--markdown writes the table to a file too. On a GPU host, --score_in_background scores each run while the next
one trains (the scoring's compiles and data work run on the host's otherwise idle CPUs).

  python scripts/compare_methods.py --task=regression --epochs=40

--task=regression is the short table: each method fitted in this process (`ensemble.fit`'s regression recipe:
the built-in MLP, K=4 members, Adam at 0.01 on a cosine schedule, batch 64, features and targets standardised) on
two generated sets of one feature, --regression_rows training rows and 4,096 test rows each: the deep-ensemble
paper's cubic toy (y = x^3 + N(0, 3^2), x uniform in [-4, 4]) and a heteroscedastic set (y = x sin x +
N(0, (0.1 + 0.4 |x|)^2), x uniform in [-3, 3]), scored by `Ensemble.evaluate`: the mixture's RMSE, NLL, CRPS
and 90% interval coverage, next to the best member's NLL and the fit's wall time (compiles included).
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The runs it starts see the caller's environment (and its accelerator); main() keeps this process on the CPU.
CHILD_ENV = dict(os.environ)
# The table's rows: each the config it trains on top of --config (a method, and adversarial training as the
# deep-ensemble paper's recipe adds it to independent members, its eps 0.01).
VARIANTS = {**{name: {'method': name} for name in ('independent', 'bagging', 'hyper', 'snapshot', 'batchensemble',
                                                   'mc_dropout', 'mimo', 'packed', 'multiswag')},
            'adversarial': {'method': 'independent', 'adversarial_epsilon': 0.01}}
# The row of one network distilled from the `independent` row's ensemble (which trains first), `ensemble.distill`.
STUDENT = 'distilled'
METHODS = (*VARIANTS, STUDENT)
# --task=regression: what every method fits with on top of fit's regression recipe, and its two generated sets
# (name -> (rows, rng) -> (x, y)).
REGRESSION_RECIPE = {'task': 'regression', 'ensemble_size': 4, 'batch_size': 64}
REGRESSION_TEST_ROWS = 4096


def cubic(rows: int, rng):
  """The deep-ensemble paper's toy: y = x^3 + N(0, 3^2), x uniform in [-4, 4]."""
  x = rng.uniform(-4, 4, (rows, 1)).astype('float32')
  return x, (x[:, 0] ** 3 + rng.normal(0, 3, rows)).astype('float32')


def heteroscedastic(rows: int, rng):
  """Noise that grows with |x|: y = x sin x + N(0, (0.1 + 0.4 |x|)^2), x uniform in [-3, 3]."""
  x = rng.uniform(-3, 3, (rows, 1)).astype('float32')
  return x, (x[:, 0] * np.sin(x[:, 0]) + rng.normal(0, 0.1 + 0.4 * abs(x[:, 0]))).astype('float32')


REGRESSION_SETS = {'cubic': cubic, 'heteroscedastic': heteroscedastic}
# The OOD column: the AUROC of the ensemble's predictive entropy, test set against each of the report's default sets.
OOD_SCORE = 'entropy'


def _run(args: list[str], log_path: str):
  """Runs `python -m args` (or `python -c CODE ...`) from the repository root, its output in `log_path`; exits
  on failure."""
  argv = args if args[0] == '-c' else ['-m', *args]
  with open(log_path, 'w', encoding='utf-8') as log:
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=CHILD_ENV, stdout=log,
                            stderr=subprocess.STDOUT, check=False)
  if result.returncode:
    with open(log_path, encoding='utf-8') as log:
      last = log.read().strip().splitlines()[-1:]
    sys.exit(f'error: python {" ".join(argv[:2])} failed (exit {result.returncode}): {last}; log: {log_path}')


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
  from ensemble import checkpoint, evaluation, members  # pylint: disable=g-import-not-at-top
  config = evaluation.load_run_config(workdir)
  ckpt = checkpoint.Checkpointer(workdir)
  member = members.member(config, ckpt.meta(ckpt.latest_epoch())['data'])
  ckpt.close()
  return config, member


def num_params(workdir: str) -> int:
  """The ensemble's distinct trained parameters, as its method counts them (BatchEnsemble's shared ones once)."""
  import jax  # pylint: disable=g-import-not-at-top
  config, member = _recorded(workdir)
  return member.method.num_params(jax.eval_shape(member.init, jax.random.key(0)).params, config.ensemble_size)


def score(method: str, args, workdir: str, seconds: float, data_dir: str | None = None) -> dict:
  """The table's row for `method`: `ensemble.evaluate`'s numbers (on `data_dir`, default the run's data) and the
  run's own records; a reused run's row as it was scored, if it was (`seconds` 0)."""
  output_dir = os.path.join(workdir, 'eval')
  kept = os.path.join(output_dir, 'row.json')
  if not seconds and os.path.exists(kept):
    with open(kept, encoding='utf-8') as f:
      return json.load(f)
  _run(['ensemble.evaluate', f'--workdir={workdir}', f'--output_dir={output_dir}', f'--angles=0,{args.angle}',
        *([f'--data_dir={data_dir}'] if data_dir else [])], os.path.join(args.out, f'{method}.evaluate.log'))
  with open(os.path.join(output_dir, 'metrics.json'), encoding='utf-8') as f:
    results = json.load(f)
  lines = _lines(workdir)
  config, _ = _recorded(workdir)
  steady = lines[1:] or lines  # the first epoch holds the compiles
  steps = steady[-1]['step'] - (lines[0]['step'] if len(lines) > 1 else 0)
  rotated = next(row for row in results['rotation'] if row['angle'] == args.angle)
  row = {
      'method': method, 'ensemble': results['ensemble'], 'best_member': results['best_member'],
      'mean_member': results['mean_member'], 'rotated_nll': rotated['ensemble']['nll'], 'params': num_params(workdir),
      'ood_auroc': {name: result['ensemble'][OOD_SCORE]['auroc'] for name, result in results['ood'].items()},
      'member_images_per_s': config.batch_size * config.ensemble_size * steps / sum(
          line['train_seconds'] for line in steady),
      'wall_seconds': seconds or sum(line['train_seconds'] for line in lines),
  }
  with open(kept, 'w', encoding='utf-8') as f:  # kept if a later row fails, and for the next run of the script
    json.dump(row, f, indent=2)
  return row


# The student trains in a process of its own, as the members do, so that it runs where they run (this one is on
# the CPU): sys.argv[1:] = teacher workdir, student workdir, epochs.
DISTIL = '''
import sys
import ensemble
from ensemble import data
teacher, workdir, epochs = sys.argv[1:]
ens = ensemble.load(teacher)
config = ens.config
train, _ = data.hold_out(data.load(config.dataset, config.data_dir).train, config.heldout_fraction)
ensemble.distill(ens, config.model, train['image'], epochs=int(epochs), workdir=workdir, progress=False)
'''


def student_epochs(args) -> int:
  """--student_epochs, else three times the members' epochs: a student learns from a patient teacher (Beyer et al.
  2022); at the members' 10 epochs on MNIST it kept none of the ensemble's gain (docs/benchmarks.md)."""
  return args.student_epochs or 3 * args.epochs


def distil(args, teacher: str, workdir: str) -> float:
  """Distils the `teacher` workdir into one network of its model (`ensemble.distill`, its recipe, `student_epochs`)
  on its training examples, in `workdir` unless it holds one; returns the wall time (labelling included), 0 if
  reused."""
  if _lines(workdir):
    return 0.0
  started = time.perf_counter()
  _run(['-c', DISTIL, teacher, workdir, str(student_epochs(args))], os.path.join(args.out, f'{STUDENT}.train.log'))
  return time.perf_counter() - started


def data_folder(args) -> str:
  """The data every run trained on, as a path: what `ensemble.evaluate` needs for a run of arrays (the student)."""
  from ensemble.data import bundled  # pylint: disable=g-import-not-at-top
  return args.data_dir or bundled.DATASETS['mnist']


def regression_rows(methods: list[str], args) -> list[dict]:
  """The short table's rows: every method fitted on each of `REGRESSION_SETS`, scored on its test rows."""
  import ensemble  # pylint: disable=g-import-not-at-top
  rows = []
  for set_name, make in REGRESSION_SETS.items():
    train, test = make(args.regression_rows, np.random.default_rng(0)), make(REGRESSION_TEST_ROWS,
                                                                              np.random.default_rng(1))
    fitted = {}
    for method in methods:
      started = time.perf_counter()
      if method == STUDENT:
        recipe = {key: value for key, value in REGRESSION_RECIPE.items() if key not in ('ensemble_size', 'task')}
        fitted[method] = ensemble.distill(fitted['independent'], 'mlp', train[0], epochs=student_epochs(args),
                                          progress=False, **recipe)
      else:
        fitted[method] = ensemble.fit('mlp', train, epochs=args.epochs, progress=False,
                                      snapshot_cycles=snapshot_cycles(args.epochs), **REGRESSION_RECIPE,
                                      **VARIANTS[method])
      seconds = time.perf_counter() - started
      scores = fitted[method].evaluate(*test)
      rows.append({'set': set_name, 'method': method, 'ensemble': scores['ensemble'],
                   'best_member_nll': min(member['nll'] for member in scores['members']), 'wall_seconds': seconds})
      print(f'{set_name} {method}: done ({seconds:.0f} s)', file=sys.stderr, flush=True)
  return rows


def regression_table(rows: list[dict]) -> str:
  header = ['set', 'method', 'RMSE', 'NLL', 'CRPS', '90% coverage', 'best member NLL', 'wall time']
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for row in rows:
    e = row['ensemble']
    lines.append('| ' + ' | '.join([
        row['set'], row['method'], f"{e['rmse']:.3f}", f"{e['nll']:.3f}", f"{e['crps']:.3f}",
        f"{e['coverage_90']:.3f}", f"{row['best_member_nll']:.3f}", f"{row['wall_seconds']:.1f} s"]) + ' |')
  return '\n'.join(lines)


def table(rows: list[dict], angle: int) -> str:
  header = ['method', 'accuracy', 'NLL', 'Brier', 'ECE', f'NLL at {angle} deg',
            'OOD AUROC ' + ' / '.join(name.replace('_', ' ') for name in rows[0]['ood_auroc']), 'best member acc / NLL',
            'parameters', 'member-images/s', 'wall time']
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for row in rows:
    e, b = row['ensemble'], row['best_member']
    minutes, seconds = divmod(round(row['wall_seconds']), 60)
    lines.append('| ' + ' | '.join([
        row['method'], f"{e['accuracy']:.4f}", f"{e['nll']:.4f}", f"{e['brier']:.4f}", f"{e['ece']:.4f}",
        f"{row['rotated_nll']:.3f}", ' / '.join(f'{auroc:.3f}' for auroc in row['ood_auroc'].values()),
        f"{b['accuracy']:.4f} / {b['nll']:.4f}", f"{row['params']:,}",
        f"{row['member_images_per_s']:,.0f}", f'{minutes}m {seconds:02d}s']) + ' |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--data_dir', default='', help="IDX folder or .npz; empty for the config's dataset (MNIST)")
  parser.add_argument('--config', default='configs/default.py')
  parser.add_argument('--task', default='classification', choices=('classification', 'regression'),
                      help='the MNIST table, or the short regression table')
  parser.add_argument('--epochs', type=int, default=10)
  parser.add_argument('--student_epochs', type=int, default=0,
                      help='the distilled row: epochs of its one network (0: three times --epochs)')
  parser.add_argument('--regression_rows', type=int, default=1024, help='--task=regression: training rows per set')
  parser.add_argument('--methods', default=','.join(METHODS), help='comma-separated, from ' + ', '.join(METHODS))
  parser.add_argument('--cpu_devices', type=int, default=0, help='simulate N CPU devices (0: the real devices)')
  parser.add_argument('--angle', type=int, default=60, help='rotation of the shifted test set, in degrees')
  parser.add_argument('--out', default='/tmp/compare_methods', help='one workdir per method, and the logs')
  parser.add_argument('--markdown', default='', help='also write the table to this file')
  parser.add_argument('--override', action='append', default=[],
                      help='extra --config.KEY=VALUE for every method (repeat the flag)')
  parser.add_argument('--score_in_background', action='store_true',
                      help="score each finished run while the next one trains (on an accelerator host, whose CPUs "
                           "are otherwise idle; each run then takes at most 45%% of the GPU's memory)")
  args = parser.parse_args()
  # This process only reads shapes and records: on the CPU, so that an accelerator stays whole for its runs.
  os.environ['JAX_PLATFORMS'] = 'cpu'
  if args.score_in_background:
    CHILD_ENV.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.45')
  methods = args.methods.split(',')
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    from ensemble.errors import exit_with_error  # pylint: disable=g-import-not-at-top
    exit_with_error(f'--methods: unknown {unknown}; choose from {", ".join(METHODS)}')
  if STUDENT in methods and 'independent' not in methods[:methods.index(STUDENT)] and (
      args.task == 'regression' or not _lines(os.path.join(args.out, 'independent'))):
    from ensemble.errors import exit_with_error  # pylint: disable=g-import-not-at-top
    exit_with_error(f'--methods: {STUDENT} is distilled from the independent ensemble; list independent before it')
  os.makedirs(args.out, exist_ok=True)
  if args.task == 'regression':
    if args.cpu_devices:
      import ensemble  # pylint: disable=g-import-not-at-top
      ensemble.cpu_devices(args.cpu_devices)
    rows = regression_rows(methods, args)
    _warn_unless_better_than_best_member((row['method'], row['ensemble']['nll'], row['best_member_nll'])
                                         for row in rows)
    return _write(regression_table(rows), rows, args)
  rows = []
  with concurrent.futures.ThreadPoolExecutor(1) as scorer:
    for method in methods:
      workdir = os.path.join(args.out, method)
      if method == STUDENT:
        seconds = distil(args, os.path.join(args.out, 'independent'), workdir)
        rows.append(scorer.submit(score, method, args, workdir, seconds, data_folder(args)))
      else:
        seconds = train(method, args, workdir)
        rows.append(scorer.submit(score, method, args, workdir, seconds))
      print(f'{method}: trained ({seconds:.0f} s)', file=sys.stderr, flush=True)
      if not args.score_in_background:
        rows[-1].result()
  rows = [row.result() for row in rows]
  _warn_unless_better_than_best_member((row['method'], row['ensemble']['nll'], row['best_member']['nll'])
                                       for row in rows)
  _write(table(rows, args.angle), rows, args)


def _warn_unless_better_than_best_member(nlls):
  """The table's goal: every ensemble-like method beats its best member on NLL; (method, ensemble, best member)."""
  for method, ensemble_nll, best_nll in nlls:
    if ensemble_nll >= best_nll:
      print(f"warning: {method}'s ensemble NLL {ensemble_nll:.4f} does not beat its best member's {best_nll:.4f}",
            file=sys.stderr)


def _write(text: str, rows: list[dict], args):
  """Prints the table; keeps the rows in --out and the table in --markdown."""
  with open(os.path.join(args.out, f'{args.task}_rows.json'), 'w', encoding='utf-8') as f:
    json.dump(rows, f, indent=2)
  print(text)
  if args.markdown:
    with open(args.markdown, 'w', encoding='utf-8') as f:
      f.write(text + '\n')


if __name__ == '__main__':
  main()
