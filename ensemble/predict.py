"""Asks a trained ensemble about new images: probabilities, the predicted class, and how far to trust it.

  python -m ensemble.predict --workdir=/tmp/mnist --input=PATH [--output=FILE.csv|FILE.jsonl]

PATH is an .npy or .npz array, an IDX images file, a PNG or JPEG image, or a
folder of them (`ensemble.data.inputs`). For a regression workdir, one row
per input: the mixture's mean and std, its aleatoric and epistemic std and
the 90% interval's bounds; for a multi-label one, the labels predicted and
each label's probability and mutual information; for a quantile one, each
level's quantile (each task's `Task.table`); a dense one writes its maps to
--output=FILE.npz (`write_maps`). For a classifier, one row per image: its name, the
predicted class and its probability, the predictive entropy, the mutual
information between the prediction and the members (the part of the
uncertainty the members disagree on), and `flag`: whether the image is more
uncertain than the threshold that keeps the error rate of the unflagged
held-out images at --flag_risk, or the members disagree on it more than on all
but --flag_ood_rate of the held-out images (`posthoc.flagged`). From Python:

  model = ensemble.load('/tmp/mnist')
  result = model.predict(images)   # uint8, or float in [0, 1]; (N, H, W, C) of any N

A shell over `ensemble.api`: `load` restores the members onto the devices at
hand, and `Ensemble.predict` predicts with `predictor.Predictor` (the members
mapped as in training), one compiled program per bucket of batch sizes.
"""

import csv
import io
import json
import os
import sys
from typing import Any, Iterator, Sequence

from ensemble import console

console.quiet_libraries()  # before TensorFlow (if tensorflow-datasets loads the data) and JAX load

from absl import flags, logging  # pylint: disable=g-import-not-at-top,g-multiple-import
import numpy as np  # pylint: disable=g-import-not-at-top

from ensemble import api, cli, data, files, host_memory, posthoc  # pylint: disable=g-import-not-at-top
from ensemble.posthoc import DEFAULT_FLAG_OOD_RATE, DEFAULT_FLAG_RISK  # pylint: disable=g-import-not-at-top
from ensemble.data import inputs  # pylint: disable=g-import-not-at-top
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top

OUTPUT_FORMATS = ('.csv', '.jsonl', '.npz')
COLUMNS = ('name', 'class', 'probability', 'entropy', 'mutual_information', 'flag')
# A cell that starts with one of these is a formula to a spreadsheet: `=1+2.png` would run (OWASP, "CSV injection").
FORMULA_STARTS = ('=', '+', '-', '@', '\t', '\r')

FLAGS = flags.FLAGS


def rows(names: Sequence[str], result: dict[str, np.ndarray],
         flagged: np.ndarray | None) -> Iterator[dict[str, Any]]:
  """The output's rows; without `flagged` (`posthoc.flagged`) there is no flag column; with the chain's conformal
  step, its 'set' (the classes in it, by spaces). Figures keep 6 significant digits."""
  figure = lambda x: float(f'{x:.6g}')
  probability = np.take_along_axis(result['probs'], result['class'][:, None], axis=-1)[:, 0]
  for i, name in enumerate(names):
    row = {'name': name, 'class': int(result['class'][i]), 'probability': figure(probability[i]),
           'entropy': figure(result['entropy'][i]), 'mutual_information': figure(result['mutual_information'][i])}
    if 'set' in result:
      row['set'] = ' '.join(map(str, np.flatnonzero(result['set'][i])))
    if flagged is not None:
      row['flag'] = int(flagged[i])
    yield row


def with_distance(columns: list[str], rows_: Iterator[dict[str, Any]],
                  result: dict[str, np.ndarray]) -> tuple[list[str], Iterator[dict[str, Any]]]:
  """The columns and rows with the chain's distance step's 'distance' (`Ensemble.distance`) last, where it has
  one: every task's table the same."""
  if 'distance' not in result:
    return columns, rows_
  distance = result['distance']
  return [*columns, 'distance'], ({**row, 'distance': float(f'{distance[i]:.6g}')} for i, row in enumerate(rows_))


def write_maps(names: Sequence[str], result: dict[str, np.ndarray], output: str):
  """A dense ensemble's prediction, a map per input, as one .npz file, whole or not at all: 'name' (N,), and per
  position 'class' and its 'probability', 'entropy' and 'mutual_information' (N, *positions); with the chain's
  conformal step, its 'set' (N, *positions, C) booleans."""
  probability = np.take_along_axis(result['probs'], result['class'][..., None], -1)[..., 0]
  maps = {'name': np.asarray(names), 'class': result['class'].astype(np.int32),
          'probability': probability.astype(np.float32), 'entropy': result['entropy'].astype(np.float32),
          'mutual_information': result['mutual_information'].astype(np.float32)}
  if 'set' in result:
    maps['set'] = np.asarray(result['set'], bool)
  if 'distance' in result:
    maps['distance'] = result['distance'].astype(np.float32)
  buffer = io.BytesIO()
  np.savez_compressed(buffer, **maps)
  files.write_atomically(output, buffer.getvalue())


def _output_format(output: str | None, dense: bool | None = None) -> str:
  """`output`'s format, checked; with `dense` (once the ensemble is read), that it holds what the ensemble gives:
  a dense one's maps an .npz, the others' rows a .csv or .jsonl."""
  suffix = ('.npz' if dense else '.csv') if output is None else os.path.splitext(output)[1].lower()
  if suffix not in OUTPUT_FORMATS:
    raise UsageError(f'--output={output}: unknown format {suffix or "(no suffix)"}; end it in .csv, or .jsonl for '
                     "JSON lines (.npz: a dense ensemble's maps)")
  if dense and (suffix != '.npz' or output is None):
    raise UsageError(f'--output={output}: a dense ensemble predicts a map per input, which rows cannot hold; give '
                     '--output=FILE.npz')
  if dense is False and suffix == '.npz':
    raise UsageError(f"--output={output}: an .npz holds a dense ensemble's maps, and this ensemble predicts a row "
                     'per input; end it in .csv, or .jsonl for JSON lines')
  if output:
    files.check_output('--output', output)
  return suffix


def _spreadsheet_safe(value: Any) -> Any:
  """A text cell that a spreadsheet would run as a formula, quoted with a leading ' as spreadsheets quote text."""
  return f"'{value}" if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def write(rows_: Iterator[dict[str, Any]], output: str | None, columns: Sequence[str]):
  """CSV or JSON lines by `output`'s suffix, on stdout without one; a file appears whole or not at all.

  JSON lines keep every name as it is; CSV, which people open in spreadsheets, quotes names that would run as
  formulas there.
  """
  text = io.StringIO()
  if _output_format(output) == '.csv':
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator='\n')
    writer.writeheader()
    writer.writerows({key: _spreadsheet_safe(value) for key, value in row.items()} for row in rows_)
  else:
    text.writelines(json.dumps(row) + '\n' for row in rows_)
  if output is None:
    sys.stdout.write(text.getvalue())
    return
  files.write_atomically(output, text.getvalue())


def predict_files(workdir: str, input_path: str, output: str | None = None, *, step: int | None = None,
                  array: str | None = None, flag: bool = True, flag_risk: float = DEFAULT_FLAG_RISK,
                  flag_ood_rate: float = DEFAULT_FLAG_OOD_RATE, data_dir: str | None = None,
                  batch_size: int | None = None,
                  skip_unreadable: bool = False) -> dict[str, Any]:
  """The CLI's work: every check first, then the prediction, then the file (a dense ensemble's maps: an .npz).
  Returns a summary.

  `batch_size` None is the run's eval_batch_size.
  """
  _output_format(output)
  if not 0 <= flag_risk < 1:
    raise UsageError(f'--flag_risk={flag_risk} must be an error rate in [0, 1)')
  if not 0 <= flag_ood_rate < 1:
    raise UsageError(f'--flag_ood_rate={flag_ood_rate} must be a share of the held-out images in [0, 1)')
  if batch_size is not None and batch_size < 1:
    raise UsageError(f'--batch_size={batch_size}: give a positive number of images per device program, or leave '
                     "it out for the run's eval_batch_size")
  if not input_path:
    raise UsageError('--input is required: an image, a folder of images, an .npy/.npz array or an IDX file')
  model = api.read(workdir, step, batch_size=batch_size)
  _output_format(output, dense=model.task.per_position)
  names, images, skipped = inputs.read(input_path, model.image_shape, array, skip_unreadable)
  model.check(images, role=input_path)  # its errors name the file
  if model.task.per_position:
    logging.info('Predicting %d inputs.', len(images))
    write_maps(names, model.predict(images, progress=True), output)
    logging.info('Wrote the maps of %d inputs to %s.', len(names), output)
    return {'images': len(names), 'flagged': None, 'threshold': None, 'skipped': skipped}
  if not model.task.flags:  # a row per input of the task's own columns (`Task.table`)
    logging.info('Predicting %d inputs.', len(images))
    result = model.predict(images, progress=True)
    columns, rows_ = with_distance(*model.task.table(names, result), result)
    write(rows_, output, columns)
    logging.info('Wrote %d rows to %s.', len(names), output or 'stdout')
    return {'images': len(names), 'flagged': None, 'threshold': None, 'skipped': skipped}
  fitted = None
  if flag and posthoc.last(model.posthoc, 'flags') is not None:  # a saved ensemble's own flags step
    fitted = posthoc.last(model.posthoc, 'flags')
    logging.info('Flag: by the flags step of %s (%s).', workdir, fitted.describe())
  elif flag:
    try:
      fitted = model.flag_threshold(flag_risk, data_dir, flag_ood_rate)
    except data.DataError as e:
      raise UsageError(f'the flag column is fitted on the held-out slice of the training data, which cannot be '
                       f'read ({e}); give --data_dir where that data is now, or --noflag to predict without the '
                       'column') from None
    logging.info('Flag: entropy > %.4g, which on the %d held-out images keeps %.1f%% of them with an error rate '
                 'of %.4f (target %.4f), or mutual information > %.4g, which %.1f%% of them exceed.',
                 fitted['threshold'], fitted['examples'], 100 * fitted['coverage'], fitted['risk'], flag_risk,
                 fitted['ood_threshold'], 100 * flag_ood_rate)
  logging.info('Predicting %d images.', len(images))
  result = model.predict(images, progress=True)
  columns = [*COLUMNS[:-1], *(['set'] if 'set' in result else []), *(COLUMNS[-1:] if flag else [])]
  referred = posthoc.flagged(result, fitted) if flag else None
  columns, rows_ = with_distance(columns, rows(names, result, referred), result)
  write(rows_, output, columns)
  flagged = int(np.sum(referred)) if flag else None
  logging.info('Wrote %d rows to %s%s.', len(names), output or 'stdout',
               f'; {flagged} flagged' if flag else '')
  if skipped:
    logging.warning('Skipped %d files of %s that cannot be read (%s): %s', len(skipped), input_path,
                    inputs.SKIP_FLAG, '; '.join(skipped))
  return {'images': len(names), 'flagged': flagged, 'threshold': fitted and fitted['threshold'],
          'ood_threshold': fitted and fitted['ood_threshold'], 'skipped': skipped}


def main(argv):
  def body():
    if not FLAGS.workdir:
      raise UsageError('--workdir is required: a folder trained by python -m ensemble.train')
    host_memory.keep_freed_memory_on_cpu()
    predict_files(FLAGS.workdir, FLAGS.input, FLAGS.output, step=FLAGS.step, array=FLAGS.array, flag=FLAGS.flag,
                  flag_risk=FLAGS.flag_risk, flag_ood_rate=FLAGS.flag_ood_rate, data_dir=FLAGS.data_dir,
                  batch_size=None if FLAGS.batch_size == 0 else FLAGS.batch_size,
                  skip_unreadable=FLAGS.skip_unreadable)
  cli.run(argv, 'ensemble.predict', body)


def define_flags():
  """The program's flags, defined when it runs (not on import: `ensemble.load` adds no flags to a caller's).

  allow_override lets a test process define them beside `ensemble.evaluate`'s.
  """
  if 'flag_risk' in FLAGS:
    return
  flags.DEFINE_string('workdir', None, 'A folder trained by `python -m ensemble.train`.', allow_override=True)
  flags.DEFINE_integer('step', None, 'The checkpoint (epoch) to predict with; default: the latest.',
                       allow_override=True)
  flags.DEFINE_string('data_dir', None, 'Where the training data is, for the held-out slice that the flag threshold '
                      'is fitted on; default: the data the workdir was trained with.', allow_override=True)
  flags.DEFINE_string('input', None, 'An .npy/.npz array, an IDX images file, a PNG/JPEG image or a folder of them.',
                      allow_override=True)
  flags.DEFINE_string('array', None, 'The array of an --input .npz that holds the images; default: its only array.')
  flags.DEFINE_string('output', None, 'A .csv or .jsonl file (JSON lines); default: CSV on stdout. A dense '
                      "ensemble's maps: an .npz file.", allow_override=True)
  flags.DEFINE_bool('flag', True, 'Add the flag column (needs the training data, for its held-out slice).')
  flags.DEFINE_float('flag_risk', DEFAULT_FLAG_RISK, 'The error rate that unflagged held-out images may have: '
                     'images more uncertain than the threshold that achieves it are flagged.')
  flags.DEFINE_float('flag_ood_rate', DEFAULT_FLAG_OOD_RATE, 'The share of held-out images whose mutual '
                     'information (the members\' disagreement) the flag allows: inputs the members disagree on more '
                     'are flagged as unlike the training data.')
  flags.DEFINE_integer('batch_size', 0, 'Images per device program; 0: the run\'s eval_batch_size.')
  flags.DEFINE_bool('skip_unreadable', False, 'In a folder, skip the files that cannot be read as images (listed '
                    'at the end) instead of stopping at the first.')


if __name__ == '__main__':
  define_flags()
  cli.start(main)
