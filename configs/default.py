"""The default deep ensemble: one CNN per device (8 on a single device), trained with pmap on MNIST.

The fields, their values and what each means live in ensemble/defaults.py, so
that `ensemble.fit` starts from the same recipe when the package is installed
without this folder. The other configs start from this one.
"""

import ml_collections

from ensemble import defaults


def get_config() -> ml_collections.ConfigDict:
  return defaults.get_config()
