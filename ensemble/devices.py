"""JAX's devices and settings for a process: simulated CPU devices (what `--cpu_devices` is to the programs, for a
library caller), the devices an ensemble's members go on to predict, and the persistent compilation cache.

Kept apart from `ensemble.api` so that asking for devices imports nothing heavy.
"""

import os
from typing import Sequence

import jax
from absl import logging

from ensemble.errors import UsageError


def cpu_devices(count: int):
  """Asks JAX for `count` simulated CPU devices, to train `count` members in parallel on a CPU.

  Call it before anything uses JAX (JAX picks its devices once per process);
  called after, it passes when JAX already has at least `count` CPU devices and
  says how to get them otherwise.
  """
  if not isinstance(count, int) or count < 1:
    raise UsageError(f'cpu_devices({count!r}): give a positive number of devices')
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top  # the one way to ask without starting JAX
  if not xla_bridge.backends_are_initialized():
    jax.config.update('jax_num_cpu_devices', count)
    return
  have = len(jax.devices('cpu'))
  if have < count:
    raise UsageError(f'cpu_devices({count}): JAX has already started with {have} CPU device'
                     f'{"s" if have > 1 else ""}; call ensemble.cpu_devices({count}) before anything uses JAX (in '
                     'a notebook, restart the kernel and call it first)')


def compilation_cache(setting: str) -> str | None:
  """Turns on JAX's persistent compilation cache in the folder `setting` names, unless the process has one already;
  returns the folder in use (None: off).

  'auto' is the user's cache folder ($XDG_CACHE_HOME, else ~/.cache, then ensemble/jax), shared by every run, so
  a second run with the same shapes loads its programs instead of compiling them. JAX reads the setting at its
  first compile: a process that compiled before without a cache keeps going without one.

  Every program is kept, however fast it compiled, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says
  otherwise: JAX's own threshold, 1 s, leaves out a CPU run's train step (0.75 s) and the hundred-odd small
  programs of set-up and the first save, and loading them all took 2.4 s off a warm run (docs/benchmarks.md).
  """
  current = jax.config.jax_compilation_cache_dir
  if current or not setting:
    return current or None
  if setting == 'auto':
    setting = os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'ensemble', 'jax')
  try:
    os.makedirs(setting, exist_ok=True)
  except OSError as e:
    logging.warning('Compiling without a persistent cache: %s cannot be made (%s).', setting, e.strerror or e)
    return None
  jax.config.update('jax_compilation_cache_dir', setting)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  return setting


def evaluation_devices(ensemble_size: int, available: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """As many of the `available` devices (default: all) as split the members evenly: each device a member's whole
  state, or several members'."""
  available = list(jax.devices() if available is None else available)
  count = max(n for n in range(1, len(available) + 1) if ensemble_size % n == 0)
  return available[:count]
