"""A .csv file with a header row, for regression: the `target` column(s) are the targets, every other column a
feature.

One file holds both splits: a fixed fifth of its rows, drawn by a permutation
seeded with 0 (so a file sorted by some column still gives a test split like
the rest), is the test split. Every feature must be numeric: a text column is
refused by name rather than silently dropped.
"""

import os

import numpy as np

from ensemble.data import arrays, base

TEST_FRACTION = 0.2


def _read(path: str) -> tuple[list[str], list[list[str]]]:
  import csv  # pylint: disable=g-import-not-at-top
  try:
    # utf-8-sig: spreadsheets start a UTF-8 file with a byte-order mark, which would otherwise join the first name.
    with open(path, newline='', encoding='utf-8-sig') as f:
      rows = [row for row in csv.reader(f) if row]
  except (OSError, UnicodeDecodeError, csv.Error) as e:
    raise base.DataError(f'{path}: cannot be read as CSV ({base.first_line(e)}); give a .csv file with a header '
                         'row') from None
  if len(rows) < 3:
    raise base.DataError(f'{path}: {max(len(rows) - 1, 0)} data rows; give a header row and at least 2 rows')
  header = [name.strip() for name in rows[0]]
  # A name twice would make one of its columns a feature while the other is the target: the target among the inputs.
  repeated = next((name for name in header if header.count(name) > 1), None)
  if repeated is not None:
    raise base.DataError(f'{path}: column {repeated!r} appears {header.count(repeated)} times in the header; give '
                         'every column its own name')
  return header, rows[1:]


def load(path: str, target: str, task: str) -> base.Dataset:
  """The file's rows as a Dataset of float features and the `task`'s labels (float targets, 0/1 labels): the
  columns `target` names, comma-separated."""
  if not os.path.isfile(path):
    raise base.DataError(f'{path}: no such file; data_dir must name a .csv file with a header row')
  header, rows = _read(path)
  targets = [name.strip() for name in target.split(',') if name.strip()]
  if not targets:
    raise base.DataError(f'{path}: no target column named; set --config.target to one of {header}')
  missing = [name for name in targets if name not in header]
  if missing:
    raise base.DataError(f'{path}: no column {missing[0]!r}; --config.target must name columns of {header}')
  widths = {len(row) for row in rows}
  if widths != {len(header)}:
    raise base.DataError(f'{path}: rows of {sorted(widths)} fields but a header of {len(header)}; give every row '
                         'one value per column')
  values = np.empty((len(rows), len(header)), np.float64)
  for column, name in enumerate(header):
    try:
      values[:, column] = [float(row[column]) for row in rows]
    except ValueError:
      bad = next(row[column] for row in rows if not _is_number(row[column]))
      role = 'target' if name in targets else 'feature'
      raise base.DataError(f'{path}: {role} column {name!r} holds {bad!r}, not a number; encode or drop it (every '
                           'column but the targets is a feature)') from None
  target_columns = [header.index(name) for name in targets]
  feature_columns = [c for c in range(len(header)) if c not in target_columns]
  if not feature_columns:
    raise base.DataError(f'{path}: no feature columns besides the targets {targets}; give at least one')
  x, y = values[:, feature_columns], values[:, target_columns]  # float64 until standardised (ensemble/loop.py)
  order = np.random.default_rng(0).permutation(len(rows))
  cut = max(1, int(round(TEST_FRACTION * len(rows))))
  test, train = order[:cut], order[cut:]
  return arrays.from_arrays((x[train], y[train]), (x[test], y[test]), 'features', task, source=path)


def _is_number(text: str) -> bool:
  try:
    float(text)
    return True
  except ValueError:
    return False
