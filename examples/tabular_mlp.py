"""An ensemble of MLPs on feature vectors (tabular data), with the members' disagreement as a warning light.

  python examples/tabular_mlp.py            # 8 members on 20,000 rows
  python examples/tabular_mlp.py --quick    # a smoke run

The features are in very different units (one in thousands, one in
thousandths), as a table's columns often are: `standardize_features=True`
centres and scales each with the training split's statistics, kept with the
checkpoints so that predictions are prepared the same way. Inputs that lie
far from anything seen in training get a high mutual information: the members
disagree there.
"""

import sys

import ensemble

ensemble.cpu_devices(8)

import flax.linen as nn
import numpy as np


class MLP(nn.Module):
  num_classes: int = 3

  @nn.compact
  def __call__(self, x):  # no `train` argument: the model has no dropout or BatchNorm, and needs none
    for width in (64, 64):
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


def make_table(n: int, seed: int = 0):
  """Three classes from a nonlinear rule on 8 columns, two of them noise, in mixed units."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 8))
  radius = np.hypot(x[:, 0], x[:, 1])
  y = np.where(radius < 0.8, 0, np.where(x[:, 2] > 0, 1, 2))
  units = np.array([1.0, 1000.0, 0.001, 1.0, 1.0, 1.0, 5.0, 1.0])
  return (x * units).astype(np.float32), y


def main(quick: bool):
  n = 4000 if quick else 20_000
  x, y = make_table(n)
  split = int(0.8 * n)
  ens = ensemble.fit(MLP(), (x[:split], y[:split]), test=(x[split:], y[split:]), ensemble_size=8,
                     epochs=2 if quick else 10, standardize_features=True, learning_rate=0.05)
  scores = ens.evaluate(x[split:], y[split:])
  print(f'ensemble accuracy {scores["ensemble"]["accuracy"]:.4f}, NLL {scores["ensemble"]["nll"]:.4f}; '
        f'mean member accuracy {scores["mean_member"]["accuracy"]:.4f}')
  far = make_table(500, seed=1)[0] * 6  # rows far outside the training range
  near, away = ens.predict(x[split:])['mutual_information'], ens.predict(far)['mutual_information']
  print(f'mutual information: {near.mean():.4f} on test rows, {away.mean():.4f} on rows far from the training data')


if __name__ == '__main__':
  main(quick='--quick' in sys.argv)
