"""Member i's random key, a function of the seed and i alone: what the backends start members from, and what a
method that needs a member's index (MIMO's head) recognises it by."""

import jax


def member_keys(seed: int, ensemble_size: int) -> jax.Array:
  """Member i's key: `split` is counter-based, so it depends on the seed and i only, not on K or the devices."""
  return jax.random.split(jax.random.key(seed), ensemble_size)
