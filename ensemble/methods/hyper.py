"""Hyper-deep ensembles without their search stage (Wenzel et al. 2020): each member its own rate and decay.

The two hyperparameters are arrays in each member's optimizer state
(`optim.create` wraps the recipe in `optax.inject_hyperparams` for this
method), drawn at initialisation from the member's own key. The members stay
one stacked state, so one compiled step trains them all, on either backend.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from ensemble.methods.independent import Independent

# fold_in tag for the draw: the member's key is also split for its parameters and folded with step numbers.
_HYPER_DRAW = 0x4879_7065


def log_uniform(key: jax.Array, low: float, high: float) -> jax.Array:
  return jnp.exp(jax.random.uniform(key, (), jnp.float32, math.log(low), math.log(high)))


@dataclasses.dataclass(frozen=True)
class Hyper(Independent):
  """Independent members whose peak learning rate and weight decay are drawn log-uniformly from the ranges."""
  name: str = 'hyper'
  learning_rate: tuple[float, float] = (0.04, 0.12)
  weight_decay: tuple[float, float] = (1e-4, 1e-3)

  @classmethod
  def from_config(cls, config):
    return cls(learning_rate=tuple(config.hyper_learning_rate), weight_decay=tuple(config.hyper_weight_decay))

  def draw(self, key: jax.Array) -> dict[str, jax.Array]:
    """This member's hyperparameters: a function of the seed and the member index alone, like its key."""
    lr_key, wd_key = jax.random.split(jax.random.fold_in(key, _HYPER_DRAW))
    return {'learning_rate': log_uniform(lr_key, *self.learning_rate),
            'weight_decay': log_uniform(wd_key, *self.weight_decay)}

  def init(self, member, state, key: jax.Array, seed_key: jax.Array | None = None):
    opt_state = state.opt_state
    return state.replace(opt_state=opt_state._replace(hyperparams={**opt_state.hyperparams, **self.draw(key)}))
