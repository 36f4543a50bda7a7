"""Keeps freed host memory mapped, so that XLA:CPU stops page-faulting its buffers in every step.

XLA:CPU takes each run's buffers from malloc and frees them afterwards. glibc
serves every request above its mmap threshold (at most 32 MiB) with fresh pages
from the kernel and unmaps them on free, so each training step faults all of its
buffers in again. At batch 128 on 2 cores with 8 simulated devices, 16 steps
took 5.3 s, with 2.3 s of CPU time spent in the kernel; served from a heap that
is never given back, they took 3.8 s (1.4x the throughput). Device
buffers on accelerators do not come from malloc, which is why the programs do
this on CPU only. `ensemble.fit` does not: it is a setting of the caller's whole
process, which a library must leave alone (a caller who wants it calls
`keep_freed_memory()` once at start-up). The price is that the process keeps its peak heap.
"""

import ctypes

# The memory regions a process may map before its compiled programs are let go (`release_compiled_programs_if_many`):
# Linux's default limit is 65,530 (vm.max_map_count), and each XLA:CPU program maps several.
MAPS_KEPT = 30_000

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # glibc's mallopt parameters
_NEVER = 2**31 - 1  # mallopt takes an int


def keep_freed_memory(top_pad_bytes: int = 256 << 20) -> bool:
  """Makes glibc's malloc keep freed memory for reuse; returns False where libc is not glibc.

  No mmap for large requests (they come from the heap), no trimming of the
  heap, and `top_pad_bytes` of extra room each time the heap grows (without
  that, the steps measured above still faulted in a sixth as many pages).
  Process-wide and not undone: call it once, at start-up.
  """
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER), (_M_TOP_PAD, top_pad_bytes))
  return all(mallopt(param, value) == 1 for param, value in settings)


def keep_freed_memory_on_cpu():
  """On CPU, glibc keeps the memory XLA frees; accelerators need nothing. `python -m ensemble.train` calls it at
  start-up, and so do the programs that only predict."""
  import jax  # pylint: disable=g-import-not-at-top  # here: importing this module must not start JAX
  from absl import logging  # pylint: disable=g-import-not-at-top
  if jax.default_backend() == 'cpu' and keep_freed_memory():
    logging.info('Keeping freed host memory for XLA:CPU to reuse (ensemble/host_memory.py).')


def release_compiled_programs_if_many(limit: int = MAPS_KEPT) -> bool:
  """Lets every compiled program go (`jax.clear_caches`) once the process maps more than `limit` regions (always,
  where the count cannot be read); returns whether it did. A process that compiles for hours (a test session, an
  active-learning loop of hundreds of fits) otherwise reaches the kernel's limit on mapped regions, and XLA's next
  compile fails with "LLVM compilation error: Cannot allocate memory", then the process crashes: the loops' MNIST
  benchmark did, at its 12th run of 29 fits. Programs needed again are compiled again."""
  try:
    with open('/proc/self/maps', 'rb') as f:
      maps = sum(1 for _ in f)
  except OSError:
    maps = limit + 1
  if maps <= limit:
    return False
  import jax  # pylint: disable=g-import-not-at-top  # here: importing this module must not start JAX
  jax.clear_caches()
  return True
