"""Member i's random key, a function of the seed and i alone: what the backends start members from, and what a
method that needs a member's index (MIMO's head) recognises it by. The seed reaches the programs as its key
(`seed_key`), an argument: one compiled program serves every seed."""

import jax
import numpy as np


def seed_key(seed: int) -> jax.Array:
  """The seed's key, which every member's key is split from and the weights the members share are drawn from
  (methods/independent.py): drawn on the host and passed to the programs, so that they do not depend on the seed."""
  return jax.random.key(seed)


def member_keys(seed: int | jax.Array, ensemble_size: int) -> jax.Array:
  """Member i's key: `split` is counter-based, so it depends on the seed and i only, not on K or the devices.
  `seed`: the seed, or its key (`seed_key`: inside a program, where it is an argument)."""
  key = seed_key(seed) if isinstance(seed, (int, np.integer)) else seed
  return jax.random.split(key, ensemble_size)
