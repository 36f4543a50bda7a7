"""Fully sharded data parallelism: each device keeps 1/N of every large weight and its optimizer state.

The classifier of configs/dp.py; only the placement differs.

  python -m ensemble.train --workdir=/tmp/fsdp --config=configs/fsdp.py --cpu_devices=8
"""

from configs import dp


def get_config():
  config = dp.get_config()
  config.backend = 'fsdp'
  # Weights with fewer values stay replicated (biases, the 10-way head's kernel is 10240 values).
  config.min_weight_size = 2**14
  return config
