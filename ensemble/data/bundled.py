"""Datasets the package carries: the first run (README's train command) needs no network and no TensorFlow.

MNIST's four official IDX files (11 MB, gzipped) live in `ensemble/data/mnist/` as package data and are
read by the IDX reader. TFDS's `mnist` holds the same 60,000 / 10,000 images and labels, in the order its
preparation shuffled them into; this copy keeps the files' order, as `--config.data_dir` on a folder of
them does.
"""

import dataclasses
import os

from ensemble.data import base, idx

DATASETS = {'mnist': os.path.join(os.path.dirname(os.path.abspath(__file__)), 'mnist')}


def accepts(dataset: str, data_dir: str, train_split: str, test_split: str) -> bool:
  # Other split names (slices such as 'train[:50%]') are tensorflow-datasets' to interpret.
  return not data_dir and dataset in DATASETS and (train_split, test_split) == ('train', 'test')


def load(name: str) -> base.Dataset:
  directory = DATASETS[name]
  missing = [file for file in sum(idx.FILES.values(), ()) if not os.path.exists(os.path.join(directory, file + '.gz'))]
  if missing:
    # An install without package data (a partial copy of the source tree, a hand-made wheel).
    raise base.DataError(f'the bundled {name} copy lacks {", ".join(m + ".gz" for m in missing)} in {directory}; '
                         'reinstall the package (pip install -e .), or set --config.data_dir to a folder of the files')
  dataset = idx.load(directory)
  return dataclasses.replace(dataset, source=f'{name} (bundled copy, {directory})')
