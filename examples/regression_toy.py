"""The one-dimensional toy problem of Lakshminarayanan et al. (2017): a regression deep ensemble on 20 points.

  python examples/regression_toy.py            # 5 members on y = x^3 + e, e ~ N(0, 3^2); plot to regression_toy.png
  python examples/regression_toy.py --quick    # a smoke run

Each member predicts a mean and a variance and is trained by the Gaussian
NLL; the ensemble is the mixture of the five Gaussians. Inside [-4, 4], where
the 20 training points lie, the members agree and the band is the noise; outside
they disagree and the ensemble's +/- 3 std band widens (the epistemic part),
while a single member's band need not.
"""

import os
import sys

import ensemble

ensemble.cpu_devices(8)  # on a CPU: simulated devices, one member each; must come before JAX starts

import flax.linen as nn
import numpy as np


class MLP(nn.Module):
  """One hidden layer of 100 ReLUs, as in the paper; two outputs: the mean and a raw scale."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.Dense(2)(nn.relu(nn.Dense(100)(x)))


def toy(n: int, seed: int, low: float = -4.0, high: float = 4.0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(low, high, (n, 1)).astype(np.float32)
  return x, (x[:, 0] ** 3 + rng.normal(0, 3, n)).astype(np.float32)


def main(quick: bool, output: str = 'regression_toy.png'):
  x, y = toy(20, 0)
  x_test, y_test = toy(1000, 1)
  ens = ensemble.fit(MLP(), (x, y), test=(x_test, y_test), task='regression', ensemble_size=5,
                     epochs=5 if quick else 100, batch_size=5, optimizer='adamw', learning_rate=0.01,
                     weight_decay=0.0, schedule='constant', heldout_fraction=0.0, standardize_features=True,
                     progress=False)
  scores = ens.evaluate(x_test, y_test)
  for who in ('ensemble', 'mean_member'):
    print(f'{who}: RMSE {scores[who]["rmse"]:.2f}, NLL {scores[who]["nll"]:.2f}, CRPS {scores[who]["crps"]:.2f}, '
          f'90% interval coverage {scores[who]["coverage_90"]:.3f}')
  grid = np.linspace(-6, 6, 241, dtype=np.float32)[:, None]
  result = ens.predict(grid, members=True)
  member_std = np.sqrt(result['member_variances'][0, :, 0])
  inside, outside = np.abs(grid[:, 0]) <= 4, np.abs(grid[:, 0]) >= 5
  print(f'ensemble std: {result["std"][inside].mean():.1f} inside the data, {result["std"][outside].mean():.1f} '
        f'beyond |x| = 5; member 0: {member_std[inside].mean():.1f} and {member_std[outside].mean():.1f}')
  if quick:
    return
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for ax, (title, mean, std) in zip(axes, [
      ('one member', result['member_means'][0, :, 0], member_std),
      ('ensemble of 5 (mixture)', result['mean'], result['std'])]):
    ax.plot(grid[:, 0], grid[:, 0] ** 3, color='black', linestyle='--', label='y = x^3')
    ax.plot(grid[:, 0], mean, color='tab:blue', label='predicted mean')
    ax.fill_between(grid[:, 0], mean - 3 * std, mean + 3 * std, color='tab:blue', alpha=0.25, label='+/- 3 std')
    ax.scatter(x[:, 0], y, color='tab:red', s=12, zorder=3, label='training points')
    ax.set_title(title)
    ax.set_xlabel('x')
    ax.set_ylim(-250, 250)
  axes[0].legend(loc='upper left')
  fig.tight_layout()
  fig.savefig(output, dpi=120)
  print(f'wrote {os.path.abspath(output)}')


if __name__ == '__main__':
  main(quick='--quick' in sys.argv)
