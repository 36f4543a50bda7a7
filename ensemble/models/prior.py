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

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

PRIOR = 'prior'  # the module path `frozen` names
INPUT_SCALES = 'input_scales'  # and the parameter of each member's input scales, where it has them


def _log_uniform(low: float, high: float):
  def init(key, shape, dtype=jnp.float32):
    return jnp.exp(jax.random.uniform(key, shape, dtype, math.log(low), math.log(high)))
  return init


class RandomPrior(nn.Module):
  """model(x) + scale x prior(x) on the first `targets` outputs (a regression member's means; its variances' raw
  scales are left to the model alone). `model` and `prior` are two modules of the same architecture: `prior` is
  built with `targets` outputs. With `input_scales` (low, high), both see the inputs times each member's own
  scales, one a dimension drawn log-uniformly in [low, high] and frozen with the prior: the members' priors vary
  at their own lengthscales, as a GP's draws would over its lengthscales' posterior."""
  model: nn.Module
  prior: nn.Module
  scale: float
  targets: int = 1
  input_scales: tuple[float, float] | None = None

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> Any:
    if self.input_scales is not None:
      x = x.reshape((x.shape[0], -1))
      x = x * self.param(INPUT_SCALES, _log_uniform(*self.input_scales), x.shape[-1:])
    outputs = self.model(x, train=train)
    return outputs.at[..., :self.targets].add(self.scale * self.prior(x, train=False))
