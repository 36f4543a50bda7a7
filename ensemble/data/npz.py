"""One .npz file with x_train, y_train, x_test, y_test: what `np.savez` of Keras's `load_data()` arrays gives."""

import os
import zipfile

import numpy as np

from ensemble import tasks
from ensemble.data import arrays, base

KEYS = ('x_train', 'y_train', 'x_test', 'y_test')
_FIX = 'save one with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)'


def load(path: str, task: str = tasks.DEFAULT, ignore: int = base.IGNORED) -> base.Dataset:
  """Reads the four arrays; images HxW or HxWxC, uint8 or float in [0, 1]; labels integer class indices.

  For another task (ensemble/tasks/), x may also be features or token ids and y holds its labels: float targets
  (N,) or (N, D), 0s and 1s (N, L), classes per position (N, *positions), `ignore` where a position has none.
  """
  if not os.path.isfile(path):
    raise base.DataError(f'{path}: no such file; data_dir must name a .npz file with {", ".join(KEYS)}')
  try:
    # No pickles: a data file should not be able to run code.
    with np.load(path, allow_pickle=False) as npz:
      missing = [key for key in KEYS if key not in npz.files]
      if missing:
        held = ', '.join(npz.files) or 'no arrays'
        raise base.DataError(f'{path}: no array {missing[0]} (it holds {held}); {_FIX}')
      base.check_npz_sizes(path, list(KEYS))
      loaded = {key: npz[key] for key in KEYS}
  except base.DataError:  # a ValueError too, and already says what to do
    raise
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    raise base.DataError(f'{path}: cannot be read as .npz ({base.first_line(e)}); {_FIX}') from e
  if not tasks.named(task).image_datasets:
    return arrays.from_arrays((loaded['x_train'], loaded['y_train']), (loaded['x_test'], loaded['y_test']),
                              task=task, source=path, ignore=ignore)
  names = {split: (f'{path}: x_{split}', f'{path}: y_{split}') for split in ('train', 'test')}
  splits = {split: base.make_split(loaded[f'x_{split}'], loaded[f'y_{split}'], *names[split])
            for split in ('train', 'test')}
  return base.make_dataset(splits['train'], splits['test'], path, names)
