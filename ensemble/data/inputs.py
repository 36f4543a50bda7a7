"""Unlabelled images to predict on, from a file or a folder, in the image shape an ensemble was trained on.

`python -m ensemble.predict --input=PATH` reads PATH here: an .npy or .npz
array, an IDX images file (gzipped or not), a PNG or JPEG image, or a folder of
them. Arrays must already have the right shape; image files are converted to
the channels the ensemble takes and resized when only their size differs (a
different aspect ratio would distort them, so they are refused). Pixel values
are left as they are: `ensemble.predict` checks them.
"""

import gzip
import os
import zipfile

import numpy as np
from absl import logging

from ensemble import console
from ensemble.data import idx
from ensemble.errors import UsageError

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg')
# Image modes for each channel count: Pillow converts colour to greyscale (ITU-R 601 luma) and back.
MODES = {1: 'L', 3: 'RGB', 4: 'RGBA'}
ASPECT_TOLERANCE = 0.02  # a 281x280 scan of a 28x28 digit still resizes; 640x480 to 28x28 does not
_KINDS = 'an .npy or .npz array, an IDX images file, a PNG or JPEG image, or a folder of PNG or JPEG images'


def read(path: str, image_shape: tuple[int, ...], array: str | None = None) -> tuple[list[str], np.ndarray]:
  """(names, images (N, *image_shape)): a name per image (its file, or its index in an array) and the images.

  `array` names the array of an .npz that holds several.
  """
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    return _folder(path, image_shape)
  if not os.path.isfile(path):
    raise UsageError(f'{path}: no such file or folder; --input must name {_KINDS}')
  lower = path.lower()
  if lower.endswith(IMAGE_SUFFIXES):
    return [os.path.basename(path)], _images([path], image_shape)
  if lower.endswith('.npy'):
    images = _load_npy(path)
  elif lower.endswith('.npz'):
    images = _load_npz(path, array)
  elif _idx_magic(path) == idx.IMAGES_MAGIC:
    images = idx.read_idx(path, idx.IMAGES_MAGIC)
  elif _idx_magic(path) == idx.LABELS_MAGIC:
    raise UsageError(f'{path}: an IDX labels file; give the images file beside it (...-images-idx3-ubyte)')
  else:
    raise UsageError(f'{path}: not a file this reads; --input must name {_KINDS} (.npy, .npz, .png, .jpg, '
                     '.jpeg, or IDX by its header)')
  images = _as_batch(images, image_shape, path)
  return [str(i) for i in range(len(images))], images


def _idx_magic(path: str) -> int | None:
  try:
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
      head = f.read(4)
  except (OSError, EOFError):
    return None
  return int.from_bytes(head, 'big') if len(head) == 4 else None


def _load_npy(path: str) -> np.ndarray:
  try:
    return np.load(path, allow_pickle=False)  # no pickles: an input file must not be able to run code
  except (OSError, ValueError, EOFError) as e:
    raise UsageError(f'{path}: cannot be read as .npy ({_first_line(e)}); save images with np.save') from None


def _load_npz(path: str, array: str | None) -> np.ndarray:
  try:
    with np.load(path, allow_pickle=False) as npz:
      names = list(npz.files)
      if array is None and len(names) == 1:
        array = names[0]
      if array is None or array not in names:
        held = ', '.join(names) or 'no arrays'
        problem = f'no array {array}' if array is not None else 'several arrays'
        raise UsageError(f'{path}: {problem} (it holds {held}); name the images with --array=NAME')
      return npz[array]
  except UsageError:  # a ValueError too, and already says what to do
    raise
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    raise UsageError(f'{path}: cannot be read as .npz ({_first_line(e)}); save images with np.savez') from None


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return lines[0] if lines else type(error).__name__


def _as_batch(images: np.ndarray, image_shape: tuple[int, ...], name: str) -> np.ndarray:
  """A single image (H, W, C), or (H, W) when C is 1, gains a batch axis; a batch keeps its shape."""
  if images.shape == tuple(image_shape) or (image_shape[-1] == 1 and images.shape == tuple(image_shape[:-1])):
    return images[None]
  expected = 'x'.join(map(str, image_shape))
  if images.ndim not in (len(image_shape), len(image_shape) + 1) or not images.size:
    raise UsageError(f'{name}: array of shape {images.shape}; the ensemble takes {expected} images: save a batch '
                     f'(N, {", ".join(map(str, image_shape))}) or one image')
  return images


def _folder(path: str, image_shape: tuple[int, ...]) -> tuple[list[str], np.ndarray]:
  names = sorted(name for name in os.listdir(path) if name.lower().endswith(IMAGE_SUFFIXES)
                 and os.path.isfile(os.path.join(path, name)))
  if not names:
    raise UsageError(f'{path}: no PNG or JPEG files in this folder; --input must name {_KINDS}')
  skipped = len(os.listdir(path)) - len(names)
  if skipped:
    logging.info('%s: skipping %d entries that are not PNG or JPEG files.', path, skipped)
  return names, _images([os.path.join(path, name) for name in names], image_shape)


def _images(paths: list[str], image_shape: tuple[int, ...]) -> np.ndarray:
  """uint8 (N, *image_shape), each file converted to the ensemble's channels and resized if need be."""
  from PIL import Image  # pylint: disable=g-import-not-at-top  # only image inputs need Pillow

  height, width, channels = image_shape
  if channels not in MODES:
    raise UsageError(f'{paths[0]}: the ensemble takes {channels}-channel images, which PNG and JPEG do not hold; '
                     'give an .npy array instead')
  images = np.empty((len(paths), height, width, channels), np.uint8)
  converted, resized = set(), 0
  for i, path in enumerate(console.track(paths, 'reading images', unit='image')):
    try:
      with Image.open(path) as image:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
      raise UsageError(f'{path}: cannot be read as an image ({_first_line(e)}); replace or remove it') from None
    if image.mode != MODES[channels]:
      converted.add(image.mode)
      image = image.convert(MODES[channels])
    if image.size != (width, height):
      if abs(image.width / image.height - width / height) > ASPECT_TOLERANCE * width / height:
        raise UsageError(f'{path}: {image.width}x{image.height} pixels, but the ensemble takes {width}x{height}; '
                         f'resizing would distort it, crop it to a {width}:{height} aspect ratio first')
      image = image.resize((width, height), Image.Resampling.LANCZOS)
      resized += 1
    images[i] = np.asarray(image).reshape(height, width, channels)
  if converted:
    logging.info('Converted %s images to %s: the ensemble takes %d channel(s).', '/'.join(sorted(converted)),
                 MODES[channels], channels)
  if resized:
    logging.info('Resized %d of %d images to %dx%d (Lanczos).', resized, len(paths), width, height)
  return images
