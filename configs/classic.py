"""The Flax ensembling guide's recipe: SGD 0.1 with momentum at a constant rate, shared batches, no augmentation.

Kept for comparison with configs/default.py (README, "Results").
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.member_data = 'shared'
  config.augment = 'none'
  config.schedule = 'constant'
  config.weight_decay = 0.0
  return config
