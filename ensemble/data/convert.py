"""Converts a dataset to a folder of ArrayRecord files that `--config.data_dir` reads with no further flags.

  python -m ensemble.data.convert --input=SOURCE --output=FOLDER [--target=COL[,COL]]
      [--task=regression|multilabel|dense] [--ignore_label=N] [--examples_per_file=N]

SOURCE is a folder of IDX files, an .npz (x_train, y_train, x_test, y_test;
float y_train means regression), a folder of images in class folders
(SOURCE/train/CLASS/*.png and SOURCE/test/CLASS/*.png, PNG or JPEG), or a .csv
with --target (regression, split as `--config.data_dir` on it splits it). It is
read by the loader training would use, so the folder holds exactly what a
training run on SOURCE would see, checked the same way; dataset.json
(`ensemble.data.array_record`) records the shapes, dtypes, task, classes or
target columns. The folder is written beside FOLDER and renamed into place
when complete: a failed or interrupted conversion leaves nothing at FOLDER.
"""

import json
import os
import shutil
import zipfile
from typing import Any, Sequence

from absl import flags, logging
import numpy as np

from ensemble import cli, console, files, tasks
from ensemble.data import array_record, base, csv, idx, inputs, npz, stream
from ensemble.errors import UsageError

# A file of about this many bytes unless --examples_per_file says otherwise: few files, none too large to copy.
FILE_BYTES = 256 << 20
_GREY_MODES = ('1', 'L', 'LA', 'La', 'F', *inputs.SIXTEEN_BIT_MODES)
_KINDS = ('a folder of IDX files, an .npz file, a folder of images in class folders (SOURCE/train/CLASS/*.png, '
          'SOURCE/test/CLASS/*.png) or a .csv file with --target')

FLAGS = flags.FLAGS


def load_source(path: str, task: str | None = None, target: str = '',
                ignore: int = base.IGNORED) -> tuple[base.Dataset, dict[str, Any]]:
  """The Dataset training on `path` would read, and what dataset.json should say of it beyond its arrays
  (class names, target columns). `task` None: regression for a .csv or an .npz with float y_train. `ignore`: a
  dense task's label of the positions without one."""
  path = os.path.expanduser(path)
  if target and not path.endswith('.csv'):
    raise UsageError(f'--target={target}: names the target columns of a .csv input, not of {path}; drop it')
  if path.endswith('.csv'):
    if task and not tasks.named(task).tables:
      readers = [name for name in tasks.NAMES if tasks.named(name).tables]
      raise UsageError(f'{path}: a .csv input is {", ".join(readers[:-1])} or {readers[-1]} data; drop --task={task}')
    if not target:
      raise UsageError(f'{path}: name its target column(s) with --target=COL[,COL]; every other column is a feature')
    targets = [name.strip() for name in target.split(',') if name.strip()]
    return csv.load(path, target, task or tasks.DEFAULT_FOR_TARGETS), {'targets': targets}
  if path.endswith('.npz'):
    task = task or (tasks.DEFAULT_FOR_TARGETS if _float_targets(path) else tasks.DEFAULT)
    return npz.load(path, task, ignore), {}
  if array_record.is_folder(path):  # converted before: written again, e.g. with other file sizes
    info = array_record.read_info(path)
    extra = {key: info[key] for key in ('class_names', 'targets') if info.get(key)}
    return array_record.load(path, task or info['task'], streaming='always'), extra
  if task and not tasks.named(task).image_datasets:
    raise UsageError(f'{path}: --task={task} reads an .npz{" or a .csv" if tasks.named(task).tables else ""} input; '
                     'a folder holds classes')
  if os.path.isdir(os.path.join(path, 'train')):
    return image_folder(path)
  if os.path.isdir(path):
    return idx.load(path), {}
  problem = 'no such file or folder' if not os.path.exists(path) else 'not a file this reads'
  raise UsageError(f'--input={path}: {problem}; give {_KINDS}')


def _float_targets(path: str) -> bool:
  """Whether the .npz's y_train is float, read from its header; a file that cannot say is left to `npz.load`,
  which refuses it in a line."""
  try:
    with zipfile.ZipFile(path) as archive, archive.open('y_train.npy') as f:
      return np.issubdtype(base.npy_header(f)[1], np.floating)
  except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
    return False


def _class_files(folder: str, classes: Sequence[str]) -> tuple[list[str], list[int]]:
  """The image files of each class folder (sorted by name; hidden ones are not images) and their class indices."""
  paths, labels = [], []
  for label, name in enumerate(classes):
    class_folder = os.path.join(folder, name)
    if not os.path.isdir(class_folder):
      continue
    found = sorted(entry for entry in os.listdir(class_folder)
                   if entry.lower().endswith(inputs.IMAGE_SUFFIXES) and not entry.startswith('.'))
    paths += [os.path.join(class_folder, entry) for entry in found]
    labels += [label] * len(found)
  return paths, labels


def _subfolders(folder: str) -> list[str]:
  return sorted(entry for entry in os.listdir(folder)
                if not entry.startswith('.') and os.path.isdir(os.path.join(folder, entry)))


def _image_shape(paths: Sequence[str]) -> tuple[int, int, int]:
  """(H, W, C) of the first image (turned upright), C = 3 if any image is in colour, else 1: a colour image is
  never made grey because the first one was. The others are resized to it (`inputs.read`'s rules)."""
  from PIL import Image, ImageOps  # pylint: disable=g-import-not-at-top

  colour = False
  for i, path in enumerate(paths):
    try:
      with Image.open(path) as image:
        colour = colour or image.mode not in _GREY_MODES
        if not i:
          width, height = ImageOps.exif_transpose(image).size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
      raise UsageError(f'{path}: {inputs.unreadable_reason(e)}; replace or remove it') from None
  return height, width, 3 if colour else 1


def image_folder(path: str) -> tuple[base.Dataset, dict[str, Any]]:
  """SOURCE/train/CLASS/* and SOURCE/test/CLASS/*: the classes are train's folder names in sorted order."""
  folders = {split: os.path.join(path, split) for split in array_record.SPLITS}
  if not os.path.isdir(folders['test']):
    raise base.DataError(f'{folders["test"]}: no such folder; an image folder needs train/CLASS/ and test/CLASS/ '
                         'folders of PNG or JPEG images')
  classes = _subfolders(folders['train'])
  if not classes:
    raise base.DataError(f'{folders["train"]}: no class folders; put each class\'s images in train/CLASS/')
  unknown = sorted(set(_subfolders(folders['test'])) - set(classes))
  if unknown:
    raise base.DataError(f'{folders["test"]}/{unknown[0]}: a class with no folder in {folders["train"]}; give '
                         'train and test the same class folders')
  listed = {split: _class_files(folder, classes) for split, folder in folders.items()}
  for split, (paths, _) in listed.items():
    base.check_examples(len(paths), f'{folders[split]} (PNG or JPEG files in its class folders)')
  shape = _image_shape(listed['train'][0] + listed['test'][0])
  splits, names = {}, {}
  for split, (paths, labels) in listed.items():
    images = inputs.read_images(paths, shape)[0]
    names[split] = (folders[split], folders[split])
    splits[split] = base.make_split(images, np.asarray(labels, np.int32), *names[split])
  dataset = base.make_dataset(splits['train'], splits['test'], f'{path} (images)', names, num_classes=len(classes))
  return dataset, {'class_names': classes}


def check_output(output: str):
  """Refuses, before any work, a FOLDER that exists (it is never overwritten) or that could not be created."""
  if os.path.lexists(output):
    raise UsageError(f'--output={output}: already exists; name a new folder (it is never overwritten)')
  files.check_output('--output', output)


def _write_split(folder: str, split: str, part: base.Split, info: dict[str, Any], per_file: int) -> dict[str, Any]:
  """Writes one split's records, `per_file` to a file, read a file's worth at a time (a streamed split is never
  read whole); returns dataset.json's entry for it."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  dtypes = [np.dtype(info[key]['dtype']) for key in ('image', 'label')]  # little-endian, as dataset.json says
  count = len(part['label'])
  starts = range(0, count, per_file)
  written = []
  with console.Progress(count, f'writing {split}', unit='example') as progress:
    for index, start in enumerate(starts):
      name = array_record.file_name(split, index, len(starts))
      path = os.path.join(folder, name)
      stop = min(start + per_file, count)
      images, labels = (np.ascontiguousarray(values, dtype)
                        for values, dtype in zip(stream.take(part, np.arange(start, stop)), dtypes))
      try:
        writer = array_record_module.ArrayRecordWriter(path, array_record.WRITER_OPTIONS)
        try:
          for image, label in zip(images, labels):
            writer.write(image.tobytes() + label.tobytes())
            progress.update()
        finally:
          writer.close()
      except (OSError, RuntimeError) as e:  # a full or read-only disk, as Riegeli reports it
        raise UsageError(f'{path}: cannot be written ({base.first_line(e)}); free some space or choose another '
                         '--output') from None
      written.append({'name': name, 'examples': stop - start})
  return {'examples': count, 'files': written}


def write(dataset: base.Dataset, output: str, examples_per_file: int = 0, **extra) -> dict[str, Any]:
  """Writes `dataset` as an ArrayRecord folder at `output` (refused if it exists); returns its dataset.json.

  `examples_per_file` 0: files of about FILE_BYTES. `extra` joins dataset.json (class_names, targets).
  """
  check_output(output)
  if examples_per_file < 0:
    raise UsageError(f'--examples_per_file={examples_per_file}: give a positive count, or 0 for files of about '
                     f'{FILE_BYTES >> 20} MB')
  if dataset.test is None:
    raise UsageError(f'{dataset.source}: no test split; a converted folder holds a train and a test split')
  info = {'format': array_record.FORMAT, 'version': array_record.VERSION, 'task': dataset.task,
          'inputs': dataset.inputs, 'image': array_record.describe(dataset.train['image']),
          'label': array_record.describe(dataset.train['label'])}
  if dataset.kind.has_classes:
    info.update(num_classes=dataset.num_classes, class_names=extra.get('class_names'))
  else:
    info.update(num_targets=dataset.num_classes, targets=extra.get('targets'))
  info['source'] = dataset.source
  size = array_record.record_bytes(info, 'image') + array_record.record_bytes(info, 'label')
  per_file = examples_per_file or max(1, FILE_BYTES // size)
  partial = files.partial_folder(output)
  try:
    splits = {split: _write_split(partial, split, getattr(dataset, split), info, per_file)
              for split in array_record.SPLITS}
    info['splits'] = splits
    files.write_atomically(os.path.join(partial, array_record.INFO), json.dumps(info, indent=2) + '\n')
    if os.path.lexists(output):  # made while this ran: os.rename would replace an empty folder
      raise UsageError(f'--output={output}: appeared while converting; name a new folder')
    os.rename(partial, output)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  return info


def convert(source: str, output: str, task: str | None = None, target: str = '', ignore: int = base.IGNORED,
            examples_per_file: int = 0) -> dict[str, Any]:
  """Reads `source` as training would and writes it to `output`; logs one line of what was written."""
  check_output(output)
  dataset, extra = load_source(source, task, target, ignore)
  info = write(dataset, output, examples_per_file, **extra)
  total = sum(os.path.getsize(os.path.join(output, f['name'])) for s in info['splits'].values() for f in s['files'])
  counts = ', '.join(f'{split} {info["splits"][split]["examples"]:,}' for split in array_record.SPLITS)
  logging.info('Wrote %s: %s examples (%s), %.1f MB in %d files; train on it with --config.data_dir=%s%s.',
               output, counts, dataset.describe(), total / 1e6,
               sum(len(s['files']) for s in info['splits'].values()), output,
               '' if dataset.task == tasks.DEFAULT else f' --config.task={dataset.task}')
  return info


def main(argv):
  def body():
    if not FLAGS.input:
      raise UsageError(f'--input is required: {_KINDS}')
    if not FLAGS.output:
      raise UsageError('--output is required: the folder to write, which must not exist yet')
    convert(FLAGS.input, FLAGS.output, FLAGS.task, FLAGS.target, FLAGS.ignore_label, FLAGS.examples_per_file)
  cli.run(argv, 'ensemble.data.convert', body)


def define_flags():
  """The program's flags, defined when it runs; allow_override lets a test process define them beside the other
  programs'."""
  if 'examples_per_file' in FLAGS:
    return
  flags.DEFINE_string('input', None, f'What to convert: {_KINDS}.', allow_override=True)
  flags.DEFINE_string('output', None, 'The folder to write; it must not exist yet.', allow_override=True)
  flags.DEFINE_string('target', '', 'A .csv input\'s target column(s), comma-separated.', allow_override=True)
  flags.DEFINE_enum('task', None, list(tasks.NAMES),
                    'Default: regression for a .csv or an .npz with float y_train, else classification.',
                    allow_override=True)
  flags.DEFINE_integer('ignore_label', base.IGNORED, 'Task dense: the label of the positions without one.',
                       allow_override=True)
  flags.DEFINE_integer('examples_per_file', 0, f'Examples per file; 0: files of about {FILE_BYTES >> 20} MB.')


if __name__ == '__main__':
  define_flags()
  cli.start(main)
