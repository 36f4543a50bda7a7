"""Asks a trained ensemble about new images: probabilities, the predicted class, and how far to trust it.

  python -m ensemble.predict --workdir=/tmp/mnist --input=PATH [--output=FILE.csv|FILE.jsonl]

PATH is an .npy or .npz array, an IDX images file, a PNG or JPEG image, or a
folder of them (`ensemble.data.inputs`). One row per image: its name, the
predicted class and its probability, the predictive entropy, the mutual
information between the prediction and the members (the part of the
uncertainty the members disagree on), and `flag`: whether the image is more
uncertain than the threshold that keeps the error rate of the unflagged
held-out images at --flag_risk. From Python:

  model = ensemble.load('/tmp/mnist')
  result = model.predict(images)   # uint8, or float in [0, 1]; (N, H, W, C) of any N

Restores through `ensemble.evaluate.restore` onto the devices at hand, and
predicts with its `Predictor` (the members mapped as in training), one compiled
program per bucket of batch sizes.
"""

import csv
import io
import json
import os
import sys
from typing import Any, Iterator, Sequence

from ensemble import console

console.quiet_libraries()  # before TensorFlow (if tensorflow-datasets loads the data) and JAX load

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top,g-multiple-import
import jax  # pylint: disable=g-import-not-at-top
import ml_collections  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from ensemble import calibration, cli, data, evaluate, steps  # pylint: disable=g-import-not-at-top
from ensemble.data import inputs  # pylint: disable=g-import-not-at-top
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top
from ensemble.uncertainty import decomposition, selective  # pylint: disable=g-import-not-at-top

DEFAULT_FLAG_RISK = 0.01
# The score that `flag` thresholds: the total predictive entropy counts both kinds of doubt, a blurred digit
# (aleatoric) and a shape no member has seen (epistemic).
FLAG_SCORE = 'entropy'
OUTPUT_FORMATS = ('.csv', '.jsonl')
COLUMNS = ('name', 'class', 'probability', 'entropy', 'mutual_information', 'flag')

FLAGS = flags.FLAGS


def bucket(n: int, batch_size: int) -> int:
  """The batch size `n` images are padded to: the next power of two, at most `batch_size`.

  Each bucket compiles once, so any number of images costs at most
  log2(batch_size) + 1 programs, and padding at most doubles the work of a small batch.
  """
  return min(batch_size, 1 << max(n - 1, 0).bit_length())


def _fitted_temperature(workdir: str, epoch: int) -> float | None:
  """The temperature `ensemble.evaluate` fitted for this checkpoint (in WORKDIR/eval/metrics.json), if any."""
  path = os.path.join(workdir, 'eval', 'metrics.json')
  try:
    with open(path, encoding='utf-8') as f:
      results = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    logging.warning('%s cannot be read (%s): predicting without temperature scaling.', path, e)
    return None
  temperature = results.get('temperature_scaling', {}).get('temperature')
  if temperature is not None and results.get('epoch') != epoch:
    logging.warning('%s was fitted for epoch %s, not %d: predicting without temperature scaling; run python -m '
                    'ensemble.evaluate --workdir=%s --step=%d to fit one.', path, results.get('epoch'), epoch,
                    workdir, epoch)
    return None
  return temperature


class Ensemble:
  """A trained ensemble, restored onto the devices at hand, that answers about new images.

  `temperature` scales the mean probabilities (1: left as averaged); `load`
  takes it from `ensemble.evaluate`'s report when there is one.
  """

  def __init__(self, workdir: str, config: ml_collections.ConfigDict, member: steps.Member, state: steps.TrainState,
               devices: Sequence[jax.Device], epoch: int, temperature: float = 1.0, batch_size: int = 1000):
    self.workdir, self.config, self.member, self.state = workdir, config, member, state
    self.devices, self.epoch, self.temperature, self.batch_size = list(devices), epoch, temperature, batch_size
    self._predictors: dict[int, evaluate.Predictor] = {}

  @property
  def size(self) -> int:
    return self.config.ensemble_size

  @property
  def image_shape(self) -> tuple[int, ...]:
    return self.member.image_shape

  @property
  def num_classes(self) -> int:
    return self.member.model.num_classes

  def check(self, images: Any) -> np.ndarray:
    """`images` as (N, *image_shape), uint8 or float in [0, 1]; anything else is a one-line UsageError."""
    images = np.asarray(images)
    shape, expected = self.image_shape, 'x'.join(map(str, self.image_shape))
    if shape[-1] == 1 and images.ndim == len(shape) and images.shape[1:] == shape[:-1]:
      images = images[..., None]  # greyscale (N, H, W)
    if images.ndim != len(shape) + 1 or images.shape[1:] != shape:
      raise UsageError(f'images of shape {images.shape}, but {self.workdir} was trained on {expected} images; '
                       f'give a batch of shape (N, {", ".join(map(str, shape))})')
    if images.dtype == np.uint8:
      return images
    if not np.issubdtype(images.dtype, np.floating):
      raise UsageError(f'images of dtype {images.dtype}; give uint8 pixels (0..255) or floats in [0, 1]')
    if images.size:
      low, high = float(images.min()), float(images.max())
      if not (0.0 <= low and high <= 1.0):  # NaN fails both
        raise UsageError(f'float images must lie in [0, 1] but span [{low:g}, {high:g}]; divide 0..255 values '
                         'by 255, or give uint8')
    return images

  def member_probs(self, images: Any, *, progress: bool = False) -> np.ndarray:
    """(K, N, C) float64: every member's probabilities, `batch_size` images at a time, the last batch bucketed."""
    images = self.check(images)
    starts = range(0, len(images), self.batch_size)
    if progress and len(starts) > 1:
      starts = console.track(starts, 'predicting', unit='batch', items_per_step=self.batch_size, items='images')
    batches = [np.zeros((self.size, 0, self.num_classes))]
    for start in starts:
      # One input dtype, so uint8 and float inputs share a program; [0, 1] as the device would make it.
      chunk = images[start:start + self.batch_size]
      chunk = chunk.astype(np.float32) / 255.0 if chunk.dtype == np.uint8 else chunk.astype(np.float32)
      split = {'image': chunk, 'label': np.zeros(len(chunk), np.int32)}
      batches.append(self._predictor(bucket(len(chunk), self.batch_size))(split))
    return np.concatenate(batches, axis=1)

  def _predictor(self, batch_size: int) -> evaluate.Predictor:
    if batch_size not in self._predictors:
      self._predictors[batch_size] = evaluate.Predictor(self.member, self.state, self.devices, batch_size)
    return self._predictors[batch_size]

  def predict(self, images: Any, *, members: bool = False, progress: bool = False) -> dict[str, np.ndarray]:
    """Per image: 'probs' (N, C), the members' mean, temperature-scaled; 'class' (N,); and, in nats, 'entropy'
    (total predictive), 'aleatoric' (expected member entropy), 'mutual_information' (epistemic: their
    difference) and 'disagreement' (share of member pairs voting differently). 'member_probs' (K, N, C) with
    `members`.

    The uncertainty is split on the members' own probabilities, where total =
    aleatoric + epistemic holds; the temperature only rescales 'probs' (and
    leaves 'class' as it is).
    """
    member_probs = self.member_probs(images, progress=progress)
    probs = member_probs.mean(0)
    if self.temperature != 1.0:
      probs = calibration.temperature_scale(probs, self.temperature)
    result = {'probs': probs, 'class': np.argmax(probs, -1), **decomposition.decompose(member_probs)}
    if members:
      result['member_probs'] = member_probs
    return result

  def flag_threshold(self, target_risk: float = DEFAULT_FLAG_RISK, data_dir: str | None = None) -> dict[str, Any]:
    """The predictive entropy above which to flag an image: the largest that keeps the error rate of the held-out
    images at or below it within `target_risk` (`selective.threshold_for_risk`).

    Fitted on the slice of the training split that the trainer held out
    (`ensemble.evaluate.heldout_split`), read from `data_dir` (default: the
    data the run was trained with). Also returns the held-out 'coverage' and
    'risk' at that threshold.
    """
    dataset = data.load(self.config.get('dataset', 'mnist'), self.config.data_dir if data_dir is None else data_dir,
                        self.config.get('train_split', 'train'), self.config.get('test_split', 'test'))
    if tuple(dataset.image_shape) != self.image_shape:
      raise UsageError(f'{dataset.source} holds {"x".join(map(str, dataset.image_shape))} images but '
                       f'{self.workdir} was trained on {"x".join(map(str, self.image_shape))}; give --data_dir the '
                       'data it was trained on')
    heldout, seen_in_training = evaluate.heldout_split(dataset.train, self.config)
    if seen_in_training:
      logging.warning('%s held out no training examples (heldout_fraction=0): the flag threshold is fitted on '
                      'examples the members were trained on and flags too few images.', self.workdir)
    result = self.predict(heldout['image'])
    curve = selective.risk_coverage(result[FLAG_SCORE], result['class'] == heldout['label'])
    return {**selective.threshold_for_risk(curve, target_risk), 'target_risk': target_risk,
            'examples': len(heldout['label']), 'seen_in_training': seen_in_training}


def load(workdir: str, step: int | None = None, *, batch_size: int | None = None,
         temperature: float | None = None) -> Ensemble:
  """The ensemble saved in `workdir` at epoch `step` (default: the latest), on as many of the available devices
  as divide its members.

  `temperature` defaults to the one `ensemble.evaluate` fitted for that
  checkpoint (1 when there is none); `batch_size` to the run's eval_batch_size.
  """
  config = evaluate.load_run_config(workdir)
  devices = evaluate.evaluation_devices(config.ensemble_size)
  member, state, epoch = evaluate.restore(workdir, config, step, devices)
  if temperature is None:
    temperature = _fitted_temperature(workdir, epoch) or 1.0
  if not temperature > 0:
    raise UsageError(f'temperature={temperature} must be positive')
  batch_size = batch_size or config.eval_batch_size
  logging.info('Restored epoch %d of %s: %d members on %d devices; temperature %.4g.', epoch, workdir,
               config.ensemble_size, len(devices), temperature)
  return Ensemble(workdir, config, member, state, devices, epoch, temperature, batch_size)


def rows(names: Sequence[str], result: dict[str, np.ndarray],
         threshold: float | None) -> Iterator[dict[str, Any]]:
  """The output's rows; without a `threshold` there is no flag column. Figures keep 6 significant digits."""
  figure = lambda x: float(f'{x:.6g}')
  probability = np.take_along_axis(result['probs'], result['class'][:, None], axis=-1)[:, 0]
  for i, name in enumerate(names):
    row = {'name': name, 'class': int(result['class'][i]), 'probability': figure(probability[i]),
           'entropy': figure(result['entropy'][i]), 'mutual_information': figure(result['mutual_information'][i])}
    if threshold is not None:
      row['flag'] = int(result[FLAG_SCORE][i] > threshold)
    yield row


def _output_format(output: str | None) -> str:
  suffix = '.csv' if output is None else os.path.splitext(output)[1].lower()
  if suffix not in OUTPUT_FORMATS:
    raise UsageError(f'--output={output}: unknown format {suffix or "(no suffix)"}; end it in .csv, or .jsonl for '
                     'JSON lines')
  folder = os.path.dirname(os.path.abspath(output)) if output else None
  if folder and not os.path.isdir(folder):
    raise UsageError(f'--output={output}: no folder {folder}; create it first')
  return suffix


def write(rows_: Iterator[dict[str, Any]], output: str | None, columns: Sequence[str]):
  """CSV or JSON lines by `output`'s suffix, on stdout without one; a file appears whole or not at all."""
  text = io.StringIO()
  if _output_format(output) == '.csv':
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator='\n')
    writer.writeheader()
    writer.writerows(rows_)
  else:
    text.writelines(json.dumps(row) + '\n' for row in rows_)
  if output is None:
    sys.stdout.write(text.getvalue())
    return
  cli.write_atomically(output, text.getvalue())


def predict_files(workdir: str, input_path: str, output: str | None = None, *, step: int | None = None,
                  array: str | None = None, flag: bool = True, flag_risk: float = DEFAULT_FLAG_RISK,
                  data_dir: str | None = None, batch_size: int | None = None) -> dict[str, Any]:
  """The CLI's work: every check first, then the prediction, then the file. Returns a summary."""
  _output_format(output)
  if not 0 <= flag_risk < 1:
    raise UsageError(f'--flag_risk={flag_risk} must be an error rate in [0, 1)')
  if not input_path:
    raise UsageError('--input is required: an image, a folder of images, an .npy/.npz array or an IDX file')
  model = load(workdir, step, batch_size=batch_size)
  names, images = inputs.read(input_path, model.image_shape, array)
  try:
    model.check(images)
  except UsageError as e:
    raise UsageError(f'{input_path}: {e}') from None
  threshold = None
  if flag:
    fitted = model.flag_threshold(flag_risk, data_dir)
    threshold = fitted['threshold']
    logging.info('Flag threshold: entropy > %.4g, which on the %d held-out images keeps %.1f%% of them with an '
                 'error rate of %.4f (target %.4f).', threshold, fitted['examples'], 100 * fitted['coverage'],
                 fitted['risk'], flag_risk)
  logging.info('Predicting %d images.', len(images))
  result = model.predict(images, progress=True)
  columns = COLUMNS if flag else COLUMNS[:-1]
  write(rows(names, result, threshold), output, columns)
  flagged = int(np.sum(result[FLAG_SCORE] > threshold)) if flag else None
  logging.info('Wrote %d rows to %s%s.', len(names), output or 'stdout',
               f'; {flagged} flagged' if flag else '')
  return {'images': len(names), 'flagged': flagged, 'threshold': threshold}


def main(argv):
  def body():
    if not FLAGS.workdir:
      raise UsageError('--workdir is required: a folder trained by python -m ensemble.train')
    cli.keep_freed_memory_on_cpu()
    predict_files(FLAGS.workdir, FLAGS.input, FLAGS.output, step=FLAGS.step, array=FLAGS.array, flag=FLAGS.flag,
                  flag_risk=FLAGS.flag_risk, data_dir=FLAGS.data_dir, batch_size=FLAGS.batch_size or None)
  cli.run(argv, 'ensemble.predict', body)


def define_flags():
  """The program's flags, defined when it runs (not on import: `ensemble.load` adds no flags to a caller's).

  `ensemble.evaluate`, imported above, defines --workdir, --step and --data_dir
  on import; allow_override lets these replace them with this program's help.
  """
  if 'input' in FLAGS:
    return
  flags.DEFINE_string('workdir', None, 'A folder trained by `python -m ensemble.train`.', allow_override=True)
  flags.DEFINE_integer('step', None, 'The checkpoint (epoch) to predict with; default: the latest.',
                       allow_override=True)
  flags.DEFINE_string('data_dir', None, 'Where the training data is, for the held-out slice that the flag threshold '
                      'is fitted on; default: the data the workdir was trained with.', allow_override=True)
  flags.DEFINE_string('input', None, 'An .npy/.npz array, an IDX images file, a PNG/JPEG image or a folder of them.')
  flags.DEFINE_string('array', None, 'The array of an --input .npz that holds the images; default: its only array.')
  flags.DEFINE_string('output', None, 'A .csv or .jsonl file (JSON lines); default: CSV on stdout.',
                      allow_override=True)
  flags.DEFINE_bool('flag', True, 'Add the flag column (needs the training data, for its held-out slice).')
  flags.DEFINE_float('flag_risk', DEFAULT_FLAG_RISK, 'The error rate that unflagged held-out images may have: '
                     'images more uncertain than the threshold that achieves it are flagged.')
  flags.DEFINE_integer('batch_size', 0, 'Images per device program; default: the run\'s eval_batch_size.')


if __name__ == '__main__':
  define_flags()
  app.run(main)
