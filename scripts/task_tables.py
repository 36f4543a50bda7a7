"""What the task benchmarks (multilabel_mnist.py, segmentation_mnist.py) share: their flags, the check of
--ensemble_size, and the table of their rows, each figure the mean over the seeds ('–' where a row has none)."""

from absl import flags
import numpy as np

from ensemble.errors import UsageError

FLAGS = flags.FLAGS


def define_flags(what: str, epochs: int):
  """The flags of a benchmark of `what` examples (mosaics, digits), training for `epochs` by default."""
  flags.DEFINE_integer('train', 12000, f'Training {what}.')
  flags.DEFINE_integer('test', 4000, f'Test {what}.')
  flags.DEFINE_integer('calibration', 2000, f'Held-out {what} the temperature and the conformal sets are fitted on.')
  flags.DEFINE_integer('epochs', epochs, 'Epochs of every fit.')
  flags.DEFINE_integer('ensemble_size', 4, 'Members K of the ensemble row.')
  flags.DEFINE_list('seeds', ['0'], 'Seeds; each row is the mean over them.')
  flags.DEFINE_float('alpha', 0.1, 'Miscoverage of the conformal sets.')


def rows() -> dict[str, int]:
  """{row name: members}: the ensemble's and the single model's."""
  if FLAGS.ensemble_size < 2:
    raise UsageError(f'--ensemble_size={FLAGS.ensemble_size}: the ensemble row needs at least 2 members')
  return {f'ensemble (K={FLAGS.ensemble_size})': FLAGS.ensemble_size, 'single model': 1}


def print_table(results: dict[str, list[dict[str, float]]]):
  """A markdown table: a row per name, a column per figure, each the mean of the row's runs (one per seed)."""
  keys = list(next(iter(results.values()))[0])
  print(f'| row | {" | ".join(keys)} |')
  print(f'| --- |{" ---: |" * len(keys)}')
  for name, runs in results.items():
    means = [np.mean([run[key] for run in runs]) for key in keys]
    print(f'| {name} | {" | ".join("–" if np.isnan(v) else f"{v:.4g}" for v in means)} |', flush=True)
