"""The optimizer recipe from the config: optimizer, learning-rate schedule, decoupled weight decay.

Small optax pieces chained, so every option composes with every other:
`sgd` is SGD with momentum, `adamw` is Adam; either gets weight decay that
is added after the optimizer's own update and scaled by the learning rate
(decoupled, Loshchilov and Hutter 2019), on kernels only: decaying biases
and BatchNorm scales only hurts.
"""

import math

import jax
import optax

from ensemble.errors import UsageError

OPTIMIZERS = {
    'sgd': lambda config: optax.trace(decay=config.momentum),
    'adamw': lambda config: optax.scale_by_adam(),
}


def _warmup_steps(config, steps_per_epoch: int) -> int:
  return int(round(config.warmup_epochs * steps_per_epoch))


SCHEDULES = {
    'constant': lambda config, steps_per_epoch: optax.constant_schedule(config.learning_rate),
    'cosine': lambda config, steps_per_epoch: optax.cosine_decay_schedule(
        config.learning_rate, config.num_epochs * steps_per_epoch),
    'warmup_cosine': lambda config, steps_per_epoch: optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, _warmup_steps(config, steps_per_epoch), config.num_epochs * steps_per_epoch),
}


def check(config):
  """Refuses optimizer fields that cannot work, before anything runs."""
  for field, choices in (('optimizer', OPTIMIZERS), ('schedule', SCHEDULES)):
    if config[field] not in choices:
      raise UsageError(f'unknown {field} {config[field]!r}: set --config.{field} to one of {list(choices)}')
  if not (config.learning_rate > 0 and math.isfinite(config.learning_rate)):
    raise UsageError(f'learning_rate={config.learning_rate} must be positive and finite')
  if not 0 <= config.momentum < 1:
    raise UsageError(f'momentum={config.momentum} must be in [0, 1)')
  if not config.weight_decay >= 0:
    raise UsageError(f'weight_decay={config.weight_decay} must be 0 or positive')
  if not 0 <= config.warmup_epochs < config.num_epochs:
    raise UsageError(f'warmup_epochs={config.warmup_epochs} must be in [0, num_epochs={config.num_epochs})')
  if config.warmup_epochs and config.schedule != 'warmup_cosine':
    raise UsageError(f'warmup_epochs={config.warmup_epochs} needs --config.schedule=warmup_cosine '
                     f'(schedule is {config.schedule!r})')


def _kernels(params):
  """True for weight matrices and convolution kernels, False for biases and normalisation scales."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def create(config, steps_per_epoch: int) -> optax.GradientTransformation:
  """The optimizer `config` describes; schedules span `config.num_epochs` epochs of `steps_per_epoch` steps."""
  check(config)
  schedule = SCHEDULES[config.schedule](config, steps_per_epoch)
  parts = [OPTIMIZERS[config.optimizer](config)]
  if config.weight_decay:
    parts.append(optax.add_decayed_weights(config.weight_decay, mask=_kernels))
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts)
