"""Unlabelled images to predict on, from a file or a folder, in the image shape an ensemble was trained on.

`python -m ensemble.predict --input=PATH` reads PATH here: an .npy or .npz
array, an IDX images file (gzipped or not), a PNG or JPEG image, or a folder of
them. Arrays must already have the right shape; image files are turned as
their EXIF orientation says, 16-bit ones scaled to 8 bits, transparent ones
laid on white (as a viewer shows them), converted to the channels the ensemble
takes, and resized when only their size differs (a different aspect ratio
would distort them, so they are refused, before they are decoded). Pixel values
are left as they are: `ensemble.predict` checks them.
"""

import gzip
import os
import zipfile
from typing import NamedTuple

import numpy as np
from absl import logging

from ensemble import console
from ensemble.data import base, idx
from ensemble.errors import UsageError

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg')
# Image modes for each channel count: Pillow converts colour to greyscale (ITU-R 601 luma) and back.
MODES = {1: 'L', 3: 'RGB', 4: 'RGBA'}
ASPECT_TOLERANCE = 0.02  # a 281x280 scan of a 28x28 digit still resizes; 640x480 to 28x28 does not
SIXTEEN_BIT_MODES = ('I;16', 'I;16L', 'I;16B', 'I;16N', 'I')  # Pillow's greyscale PNGs of 16 bits a pixel
SKIP_FLAG = '--skip_unreadable'
_KINDS = 'an .npy or .npz array, an IDX images file, a PNG or JPEG image, or a folder of PNG or JPEG images'


class Inputs(NamedTuple):
  names: list[str]  # a name per image: its file, or its index in an array
  images: np.ndarray  # (N, *image_shape)
  skipped: list[str]  # the files of a folder that could not be read, with why, when asked to skip them


def read(path: str, image_shape: tuple[int, ...], array: str | None = None, skip_unreadable: bool = False) -> Inputs:
  """The images at `path`. `array` names the array of an .npz that holds several.

  In a folder, hidden files (a macOS `._a.png` beside `a.png`) are not images;
  a file that cannot be read stops the reading, unless `skip_unreadable`.
  """
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    return _folder(path, image_shape, skip_unreadable)
  if not os.path.isfile(path):
    raise UsageError(f'{path}: no such file or folder; --input must name {_KINDS}')
  lower = path.lower()
  if lower.endswith(IMAGE_SUFFIXES):
    return Inputs([os.path.basename(path)], read_images([path], image_shape)[0], [])
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
  return Inputs([str(i) for i in range(len(images))], images, [])


def _idx_magic(path: str) -> int | None:
  try:
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
      head = f.read(4)
  except (OSError, EOFError):
    return None
  return int.from_bytes(head, 'big') if len(head) == 4 else None


def _load_npy(path: str) -> np.ndarray:
  try:
    with open(path, 'rb') as f:
      base.check_npy_size(f, os.path.getsize(path), path)
    return np.load(path, allow_pickle=False)  # no pickles: an input file must not be able to run code
  except base.DataError:  # a ValueError too, and already says what to do
    raise
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
      base.check_npz_sizes(path, [array])
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


def _folder(path: str, image_shape: tuple[int, ...], skip_unreadable: bool) -> Inputs:
  entries = os.listdir(path)
  names = sorted(name for name in entries if name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith('.')
                 and os.path.isfile(os.path.join(path, name)))
  if not names:
    raise UsageError(f'{path}: no PNG or JPEG files in this folder; --input must name {_KINDS}')
  if len(entries) > len(names):
    logging.info('%s: skipping %d entries that are not PNG or JPEG files, or are hidden.', path,
                 len(entries) - len(names))
  images, unreadable = read_images([os.path.join(path, name) for name in names], image_shape, skip_unreadable)
  if unreadable and len(unreadable) == len(names):
    raise UsageError(f'{path}: none of its {len(names)} PNG or JPEG files can be read as an image '
                     f'({unreadable[names[0]]}); replace them')
  kept = [name for name in names if name not in unreadable]
  return Inputs(kept, images, [f'{name} ({why})' for name, why in unreadable.items()])


def unreadable_reason(error: BaseException) -> str:
  return f'cannot be read as an image: {_first_line(error)}'


def read_images(paths: list[str], image_shape: tuple[int, ...],
                skip_unreadable: bool = False) -> tuple[np.ndarray, dict[str, str]]:
  """uint8 (N, *image_shape) of the files that can be read, each as `_image` makes it; and the base name of each
  file that cannot, with why (only with `skip_unreadable`: else the first such file is a UsageError)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top  # only image inputs need Pillow

  height, width, channels = image_shape
  if channels not in MODES:
    raise UsageError(f'{paths[0]}: the ensemble takes {channels}-channel images, which PNG and JPEG do not hold; '
                     'give an .npy array instead')
  images, unreadable, notes = [], {}, {'converted': set(), 'resized': 0}
  for path in console.track(paths, 'reading images', unit='image'):
    try:
      images.append(_image(path, (height, width), MODES[channels], notes))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:  # Pillow's ways to fail a file
      if isinstance(e, UsageError):
        raise
      if not skip_unreadable:
        skip = f', or pass {SKIP_FLAG} to predict the others' if len(paths) > 1 else ''
        raise UsageError(f'{path}: {unreadable_reason(e)}; replace or remove it{skip}') from None
      unreadable[os.path.basename(path)] = unreadable_reason(e)
  if notes['converted']:
    logging.info('Converted %s images to %s: the ensemble takes %d channel(s).',
                 '/'.join(sorted(notes['converted'])), MODES[channels], channels)
  if notes['resized']:
    logging.info('Resized %d of %d images to %dx%d (Lanczos).', notes['resized'], len(paths), width, height)
  stacked = np.stack(images) if images else np.empty((0, height, width, channels), np.uint8)
  return stacked.reshape(len(images), height, width, channels), unreadable


def _image(path: str, size: tuple[int, int], mode: str, notes: dict) -> np.ndarray:
  """One file as the ensemble takes it: (H, W, C) uint8.

  The aspect ratio is checked from the header, before the pixels are decoded
  (either way round: the EXIF orientation, which may swap them, can lie after
  the pixels in a PNG), and again once the image is turned upright.
  """
  from PIL import Image, ImageOps  # pylint: disable=g-import-not-at-top

  height, width = size
  with Image.open(path) as image:
    if not any(_same_aspect(path, stored, (width, height)) for stored in (image.size, image.size[::-1])):
      _same_aspect(path, image.size, (width, height), refuse=True)
    image.load()
    image = ImageOps.exif_transpose(image)
  _same_aspect(path, image.size, (width, height), refuse=True)
  if image.mode in SIXTEEN_BIT_MODES:
    # convert('L') clips at 255, which turns nearly every 16-bit pixel white: scale 0..65535 to 0..255 instead.
    wide = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
    notes['converted'].add(image.mode)
    image = Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), 'L')
  if mode != 'RGBA' and (image.mode in ('RGBA', 'LA', 'PA', 'RGBa', 'La') or 'transparency' in image.info):
    # Dropping the alpha channel keeps the colour under transparent pixels, which is often black everywhere:
    # a black digit on a transparent background would become all black. Laid on white, it shows as drawn.
    notes['converted'].add(image.mode)
    image = Image.alpha_composite(Image.new('RGBA', image.size, (255, 255, 255, 255)), image.convert('RGBA'))
  if image.mode != mode:
    notes['converted'].add(image.mode)
    image = image.convert(mode)
  if image.size != (width, height):
    image = image.resize((width, height), Image.Resampling.LANCZOS)
    notes['resized'] += 1
  return np.asarray(image).reshape(height, width, len(mode))


def _same_aspect(path: str, image_size: tuple[int, int], size: tuple[int, int], refuse: bool = False) -> bool:
  """Whether an image of `image_size` (width, height) resizes to `size` without distortion; with `refuse`, a
  UsageError if it does not."""
  (image_width, image_height), (width, height) = image_size, size
  same = abs(image_width / max(image_height, 1) - width / height) <= ASPECT_TOLERANCE * width / height
  if refuse and not same:
    raise UsageError(f'{path}: {image_width}x{image_height} pixels, but the ensemble takes {width}x{height}; '
                     f'resizing would distort it, crop it to a {width}:{height} aspect ratio first')
  return same
