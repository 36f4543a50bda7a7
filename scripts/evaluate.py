"""Evaluates a trained ensemble; the same as `python -m ensemble.evaluate`.

  python scripts/evaluate.py --workdir=/tmp/mnist [--data_dir=DIR] [--step=N] [--output_dir=DIR]
"""

import os
import sys

# Run from a checkout: import the `ensemble` package that sits next to this script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ensemble import cli, evaluate  # pylint: disable=g-import-not-at-top

if __name__ == '__main__':
  evaluate.define_flags()
  cli.start(evaluate.main)
