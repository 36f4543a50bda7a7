"""A randomised prior (Osband, Aslanides and Cassirer 2018): each member is its trained network plus `scale` times a
network of the same kind that is never trained, its own random draw.

A deep ensemble's members, trained on few points from different starts,
agree far more than a Gaussian process's posterior draws do between and
beyond the points: their spread is what their initialisations left, and
training wipes much of it. Adding a fixed random function to each member
gives every member a prior draw to correct where there is data and to keep
where there is none, so the ensemble's spread grows away from the data as a
posterior's does. Bayesian optimisation's surrogate (ensemble/loops/
bayesian_optimization.py) wraps its model in one; the loop freezes the prior
(`fit(frozen=(PRIOR,))`): no gradient and no optimizer state, each member's
prior as it was drawn.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

PRIOR = 'prior'  # the module path `frozen` names


class RandomPrior(nn.Module):
  """model(x) + scale x prior(x) on the first `targets` outputs (a regression member's means; its variances' raw
  scales are left to the model alone). `model` and `prior` are two modules of the same architecture: `prior` is
  built with `targets` outputs."""
  model: nn.Module
  prior: nn.Module
  scale: float
  targets: int = 1

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> Any:
    outputs = self.model(x, train=train)
    return outputs.at[..., :self.targets].add(self.scale * self.prior(x, train=False))
