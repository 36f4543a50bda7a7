"""Quantile regression with CQR against the Gaussian ensemble, on UCI tables: interval coverage and width, CRPS.

  python scripts/quantile_uci.py --from_wheel=scikit_learn-1.1.3-cp311-...whl   # Boston and diabetes (see below)
  python scripts/quantile_uci.py --csv=boston.csv:MEDV --csv=diabetes.csv:target --splits=20 --json=OUT.json

Each table is split 20 times at random (numpy seed = split): 10% test, and of the rest 20% calibration rows for the
conformal steps, the others to train on (Lakshminarayanan et al.'s UCI protocol, with a calibration slice). Both
ensembles are 5 members of the built-in MLP (50 units, ReLU), 40 epochs of batch 100, Adam at 0.01, standardised
features and targets: `task='regression'` (a Gaussian per member, the mixture's central 90% interval, its exact
CRPS; conformalised by the normalised score |y - mean| / std) and `task='quantile'` (the quantiles at 0.05, 0.1,
0.2, ..., 0.9, 0.95 by the pinball loss, their mean over the members; the 0.05-0.95 pair's interval; CRPS from the
quantiles; conformalised by CQR, Romano et al. 2019). Both conformal steps at alpha = 0.1 on the calibration rows.
It prints a table per table: mean (and standard error over the splits) of the raw and conformal intervals'
coverage of the test targets and their mean width (in the targets' units), and the CRPS.

The Boston housing and diabetes tables come with scikit-learn 1.1.3's wheel (no network needed once it is on disk:
`pip download scikit-learn==1.1.3 --no-deps`); --from_wheel writes them as CSV files beside this run's output and
uses them. Timings mean nothing here; the figures do.
"""

import argparse
import csv
import gzip
import io
import json
import os
import sys
import zipfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import ensemble
from ensemble.errors import UsageError, exit_with_error

LEVELS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
ALPHA = 0.1
RECIPE = {'ensemble_size': 5, 'epochs': 40, 'batch_size': 100, 'optimizer': 'adamw', 'learning_rate': 0.01,
          'weight_decay': 0.0, 'standardize_features': True, 'progress': False}


def tables_from_wheel(wheel: str, folder: str) -> list[str]:
  """Boston (MEDV) and diabetes (target) as CSV files in `folder`, from scikit-learn 1.1.3's wheel."""
  os.makedirs(folder, exist_ok=True)
  with zipfile.ZipFile(wheel) as archive:
    boston = archive.read('sklearn/datasets/data/boston_house_prices.csv').decode().splitlines()[1:]  # a count line
    features = np.loadtxt(io.BytesIO(gzip.decompress(archive.read('sklearn/datasets/data/diabetes_data_raw.csv.gz'))))
    target = np.loadtxt(io.BytesIO(gzip.decompress(archive.read('sklearn/datasets/data/diabetes_target.csv.gz'))))
  with open(os.path.join(folder, 'boston.csv'), 'w', encoding='utf-8') as f:
    f.write('\n'.join(boston) + '\n')
  with open(os.path.join(folder, 'diabetes.csv'), 'w', encoding='utf-8') as f:
    f.write(','.join([f'x{i}' for i in range(features.shape[1])] + ['target']) + '\n')
    f.writelines(','.join(f'{v:.17g}' for v in (*row, y)) + '\n' for row, y in zip(features, target))
  return [f'{os.path.join(folder, "boston.csv")}:MEDV', f'{os.path.join(folder, "diabetes.csv")}:target']


def read_table(spec: str) -> tuple[str, np.ndarray, np.ndarray]:
  """PATH:TARGET -> (name, features (N, F), targets (N,)) of a CSV file with a header, every other column a
  feature."""
  path, _, target = spec.rpartition(':')
  if not path or not os.path.isfile(path):
    raise UsageError(f'--csv={spec}: give PATH:TARGET, a CSV file with a header and the target column\'s name')
  with open(path, encoding='utf-8') as f:
    rows = list(csv.reader(f))
  header, values = rows[0], np.asarray(rows[1:], np.float64)
  if target not in header:
    raise UsageError(f'--csv={spec}: no column {target!r} in {header}')
  column = header.index(target)
  return (os.path.splitext(os.path.basename(path))[0], np.delete(values, column, 1).astype(np.float32),
          values[:, column].astype(np.float32))


def one_split(x: np.ndarray, y: np.ndarray, seed: int, epochs: int) -> dict[str, dict[str, float]]:
  """Both ensembles on split `seed`: each one's raw and conformal intervals and CRPS on the test rows."""
  order = np.random.default_rng(seed).permutation(len(y))
  test, rest = order[:len(y) // 10], order[len(y) // 10:]
  calibration, train = rest[:len(rest) // 5], rest[len(rest) // 5:]
  recipe = {**RECIPE, 'epochs': epochs, 'seed': seed}
  figures = {}
  for task, extra in (('regression', {}), ('quantile', {'quantiles': LEVELS})):
    ens = ensemble.fit('mlp', (x[train], y[train]), task=task, **recipe, **extra)
    scores = ens.evaluate(x[test], y[test])['ensemble']
    out = ens.conformal(x[calibration], y[calibration], alpha=ALPHA).predict(x[test])
    lower, upper = (out['lower_90'], out['upper_90']) if task == 'regression' else (out['lower'], out['upper'])
    inside = lambda low, high: float(np.mean((low <= y[test]) & (y[test] <= high)))
    figures[task] = {'coverage': inside(lower, upper), 'width': float(np.mean(upper - lower)),
                     'conformal_coverage': inside(out['conformal_lower'], out['conformal_upper']),
                     'conformal_width': float(np.mean(out['conformal_upper'] - out['conformal_lower'])),
                     'crps': scores['crps']}
  return figures


def table(name: str, splits: list[dict[str, dict[str, float]]]) -> str:
  keys = ('coverage', 'width', 'conformal_coverage', 'conformal_width', 'crps')
  lines = [f'{name}: {len(splits)} splits, mean (standard error)', '', '| | ' + ' | '.join(keys) + ' |',
           '|---' * (len(keys) + 1) + '|']
  for task in ('regression', 'quantile'):
    cells = []
    for key in keys:
      values = np.asarray([split[task][key] for split in splits])
      cells.append(f'{values.mean():.4g} ({values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0:.2g})')
    lines.append(f'| {"Gaussian" if task == "regression" else "quantile + CQR"} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--csv', action='append', default=[], help='PATH:TARGET of a table (repeatable)')
  parser.add_argument('--from_wheel', default='', help="scikit-learn 1.1.3's wheel: its Boston and diabetes tables")
  parser.add_argument('--splits', type=int, default=20)
  parser.add_argument('--epochs', type=int, default=RECIPE['epochs'])
  parser.add_argument('--out', default='/tmp/quantile_uci', help='where --from_wheel writes its CSV files')
  parser.add_argument('--json', default='', help='also write every split\'s figures here')
  parser.add_argument('--cpu_devices', type=int, default=0, help='simulate this many CPU devices (0: as they are)')
  args = parser.parse_args(argv)
  try:
    if args.cpu_devices:
      ensemble.cpu_devices(args.cpu_devices)
    specs = args.csv + (tables_from_wheel(args.from_wheel, args.out) if args.from_wheel else [])
    if not specs:
      raise UsageError('give --csv=PATH:TARGET or --from_wheel=WHEEL')
    if args.splits < 1 or args.epochs < 1:
      raise UsageError('--splits and --epochs must be positive')
    everything = {}
    for spec in specs:
      name, x, y = read_table(spec)
      everything[name] = [one_split(x, y, seed, args.epochs) for seed in range(args.splits)]
      print(table(name, everything[name]) + '\n', flush=True)
    if args.json:
      with open(args.json, 'w', encoding='utf-8') as f:
        json.dump(everything, f, indent=2)
  except UsageError as e:
    exit_with_error(str(e))


if __name__ == '__main__':
  main()
