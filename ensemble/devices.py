"""Simulated CPU devices for a library caller: what `--cpu_devices` is to the programs.

Kept apart from `ensemble.api` so that asking for devices imports nothing heavy.
"""

import jax

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
