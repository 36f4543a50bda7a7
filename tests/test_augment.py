"""On-device augmentation: what each transform does, and that every member draws its own views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_member
from ensemble.data import augment


def _images(n=16, size=8, channels=3):
  return jax.random.uniform(jax.random.key(0), (n, size, size, channels)) + 0.1  # no black pixels of their own


def _offsets(original, shifted, pad):
  """The (dy, dx) at which `shifted` is a window of the zero-padded `original`, or None."""
  padded = np.pad(original, ((pad, pad), (pad, pad), (0, 0)))
  size = original.shape[0]
  for dy in range(2 * pad + 1):
    for dx in range(2 * pad + 1):
      if np.array_equal(padded[dy:dy + size, dx:dx + size], shifted):
        return dy, dx
  return None


def test_shift_translates_each_image_by_at_most_two_pixels():
  images = np.asarray(_images())
  shifted = np.asarray(augment.shift(jax.random.key(1), jnp.asarray(images)))
  offsets = [_offsets(x, y, pad=2) for x, y in zip(images, shifted)]
  assert all(o is not None for o in offsets)
  assert len(set(offsets)) > 3, 'each image gets its own offset'


def test_crop_flip_crops_the_padded_image_and_flips_about_half():
  images = np.asarray(_images(n=64))
  out = np.asarray(augment.crop_flip(jax.random.key(2), jnp.asarray(images)))
  flipped = 0
  for x, y in zip(images, out):
    if _offsets(x, y, pad=4) is None:
      assert _offsets(x, y[:, ::-1], pad=4) is not None
      flipped += 1
  assert 16 <= flipped <= 48


def test_pixels_are_scaled_and_standardised_per_channel():
  pixels = jnp.array([[[[0, 255]]]], jnp.uint8).reshape(1, 1, 1, 2)
  unit = augment.to_unit_range(pixels)
  np.testing.assert_allclose(unit, [[[[0.0, 1.0]]]])
  np.testing.assert_allclose(augment.normalize(unit, (0.5, 0.5), (0.25, 0.5)), [[[[-2.0, 1.0]]]])


@pytest.mark.parametrize('name', ['shift', 'crop_flip'])
def test_a_member_s_views_come_from_its_own_key_and_the_step(name):
  """Same member state but another key: other views, so another update. Without augmentation the key is unused."""
  member = make_member(augment=name)
  state = member.init(jax.random.key(0))
  other = state.replace(key=jax.random.key_data(jax.random.key(7)))
  images = (jax.random.uniform(jax.random.key(1), (16, 28, 28, 1)) * 255).astype(jnp.uint8)
  labels = jnp.arange(16) % 10
  step = jax.jit(member.train_step)
  a, b, again = step(state, images, labels)[0], step(other, images, labels)[0], step(state, images, labels)[0]
  assert not np.allclose(a.params['Dense_1']['kernel'], b.params['Dense_1']['kernel'])
  np.testing.assert_array_equal(a.params['Dense_1']['kernel'], again.params['Dense_1']['kernel'])

  plain = make_member(augment='none')
  step = jax.jit(plain.train_step)
  np.testing.assert_array_equal(step(state, images, labels)[0].params['Dense_1']['kernel'],
                                step(other, images, labels)[0].params['Dense_1']['kernel'])
