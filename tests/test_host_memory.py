"""Keeping freed host memory: a freed large buffer comes back without page faults."""

import subprocess
import sys
import textwrap

import pytest

# Run in a fresh process: the setting is process-wide, and transparent huge pages (which would
# hide the faults being counted) are switched off there only.
_SCRIPT = textwrap.dedent('''
    import ctypes, resource
    import numpy as np
    from ensemble import host_memory

    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: count 4 KiB pages

    def faults_to_fill(num_bytes):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      buffer = np.ones(num_bytes, np.uint8)  # malloc, then every page written
      del buffer
      return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    size = 96 << 20  # above glibc's largest mmap threshold
    faults_to_fill(size)
    default = faults_to_fill(size)
    assert host_memory.keep_freed_memory()
    faults_to_fill(size)
    print(size // resource.getpagesize(), default, faults_to_fill(size))
''')


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc only')
def test_a_freed_buffer_is_reused_without_page_faults():
  output = subprocess.run([sys.executable, '-c', _SCRIPT], capture_output=True, text=True, check=True).stdout
  pages, default, kept = map(int, output.split())
  assert default > pages // 2, 'by default glibc maps a large buffer afresh each time'
  assert kept < pages // 100
