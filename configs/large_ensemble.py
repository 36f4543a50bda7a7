"""32 members on however many devices divide 32 (4 per device on 8): the jit backend, shuffled data.

  python -m ensemble.train --workdir=/tmp/k32 --config=configs/large_ensemble.py --cpu_devices=8
"""

from configs import default


def get_config():
  config = default.get_config()
  config.backend = 'jit'
  config.ensemble_size = 32
  config.member_data = 'shuffled'
  # Several members per device: the fast path measured 1.3x the plain one on CPU (docs/benchmarks.md).
  config.steps_per_dispatch = 8
  config.num_epochs = 3
  return config
