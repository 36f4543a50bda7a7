"""Gaussian members on feature vectors (a .csv naming its target columns, or an .npz of float targets): the recipe
`ensemble.fit(task='regression')` starts from, Adam at 0.01 on standardised features.

  python -m ensemble.train --workdir=/tmp/houses --config=configs/regression.py --cpu_devices=8 \
      --config.data_dir=houses.csv --config.target=price
"""

from ensemble import defaults


def get_config():
  config = defaults.get_config()
  config.task = 'regression'
  config.model = 'mlp'  # the built-in model of feature vectors
  config.augment = 'none'
  config.update(defaults.REGRESSION)
  return config
