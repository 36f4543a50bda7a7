"""On-device input preparation: uint8 pixels -> normalised floats, and random augmentation.

Runs inside the jitted train step, so the host ships uint8 batches (a quarter
of float32's bytes) and the fast path keeps one uint8 copy of the training set
per device. Each member draws its own augmentation from its own key, which
`steps` folds from the member's key and the step: member i sees the same views
on either backend and any device count, and different views from member j.
"""

from typing import Callable

import jax
import jax.numpy as jnp


def to_unit_range(images: jnp.ndarray) -> jnp.ndarray:
  """Integer pixels -> float32 in [0, 1]; float images are taken to be in [0, 1] already."""
  if jnp.issubdtype(images.dtype, jnp.integer):
    return images.astype(jnp.float32) / 255.0
  return images.astype(jnp.float32)


def normalize(images: jnp.ndarray, mean, std) -> jnp.ndarray:
  """Per-channel standardisation with the training split's statistics."""
  return (images - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def _random_crops(key: jax.Array, images: jnp.ndarray, pad: int) -> jnp.ndarray:
  """Each image padded with `pad` black pixels per side, then cut back to its size at a random offset."""
  n, height, width, channels = images.shape
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  offsets = jax.random.randint(key, (n, 2), 0, 2 * pad + 1)
  crop = lambda image, offset: jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, channels))
  return jax.vmap(crop)(padded, offsets)


def shift(key: jax.Array, images: jnp.ndarray) -> jnp.ndarray:
  """Random translations of up to 2 pixels each way: for digits, which must not be mirrored."""
  return _random_crops(key, images, pad=2)


def crop_flip(key: jax.Array, images: jnp.ndarray) -> jnp.ndarray:
  """A random crop of the 4-pixel-padded image and a horizontal flip half the time: the CIFAR recipe."""
  crop_key, flip_key = jax.random.split(key)
  images = _random_crops(crop_key, images, pad=4)
  flip = jax.random.bernoulli(flip_key, 0.5, (images.shape[0], 1, 1, 1))
  return jnp.where(flip, images[:, :, ::-1], images)


AUGMENTATIONS: dict[str, Callable[[jax.Array, jnp.ndarray], jnp.ndarray] | None] = {
    'none': None,
    'shift': shift,
    'crop_flip': crop_flip,
}
