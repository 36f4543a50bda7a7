"""The optimizer recipe from the config: optimizer, learning-rate schedule, decoupled weight decay.

Small optax pieces chained, so every option composes with every other:
`sgd` is SGD with momentum, `adamw` is Adam; either gets weight decay that
is added after the optimizer's own update and scaled by the learning rate
(decoupled, Loshchilov and Hutter 2019), on kernels only: decaying biases
and BatchNorm scales only hurts.
"""

import math

import jax
import jax.numpy as jnp
import optax

from ensemble.errors import UsageError

OPTIMIZERS = {
    'sgd': lambda config: optax.trace(decay=config.momentum),
    'adamw': lambda config: optax.scale_by_adam(),
}


def _warmup_steps(config, steps_per_epoch: int) -> int:
  return int(round(config.warmup_epochs * steps_per_epoch))


# Each spans `steps` optimizer steps: the whole run, or one cycle of a snapshot ensemble.
SCHEDULES = {
    'constant': lambda config, steps, warmup: optax.constant_schedule(config.learning_rate),
    'cosine': lambda config, steps, warmup: optax.cosine_decay_schedule(config.learning_rate, steps),
    'warmup_cosine': lambda config, steps, warmup: optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, warmup, steps),
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
  if not (config.weight_decay >= 0 and math.isfinite(config.weight_decay)):
    raise UsageError(f'weight_decay={config.weight_decay} must be 0 or positive, and finite')
  if not 0 <= config.warmup_epochs < config.num_epochs:
    raise UsageError(f'warmup_epochs={config.warmup_epochs} must be in [0, num_epochs={config.num_epochs})')
  if config.warmup_epochs and config.schedule != 'warmup_cosine':
    raise UsageError(f'warmup_epochs={config.warmup_epochs} needs --config.schedule=warmup_cosine '
                     f'(schedule is {config.schedule!r})')


def _kernels(params):
  """True for weight matrices and convolution kernels, False for biases and normalisation scales."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def _total_steps(config, steps_per_epoch: int) -> int:
  return config.get('num_train_steps', 0) or config.num_epochs * steps_per_epoch


def swag_collection_start(config, steps_per_epoch: int) -> tuple[int, int]:
  """(the step after which MultiSWAG's rate is constant and its members collect moments, the run's steps)."""
  total = _total_steps(config, steps_per_epoch)
  return int(round(config.swag_start * total)), total


def schedule(config, steps_per_epoch: int) -> optax.Schedule:
  """The learning rate by step: over the run (`num_train_steps`, else `num_epochs` epochs), or restarted every cycle
  of a snapshot ensemble, or for MultiSWAG over the steps before its collection phase, shifted to end at
  `swag_learning_rate` and constant at it after (SWAG's moments need iterates that keep moving)."""
  if config.get('method') == 'multiswag':
    start, _ = swag_collection_start(config, steps_per_epoch)
    before = SCHEDULES[config.schedule](config, start, _warmup_steps(config, steps_per_epoch))
    swag_rate, shift = config.swag_learning_rate, 1 - config.swag_learning_rate / config.learning_rate
    return lambda count: jnp.where(count < start, swag_rate + before(count) * shift, swag_rate)
  cycles = config.snapshot_cycles if config.get('method') == 'snapshot' else 1
  cycle_steps = _total_steps(config, steps_per_epoch) // cycles
  rate = SCHEDULES[config.schedule](config, cycle_steps, _warmup_steps(config, steps_per_epoch))
  return rate if cycles == 1 else lambda count: rate(count % cycle_steps)


def _recipe(config, learning_rate, weight_decay) -> optax.GradientTransformation:
  parts = [OPTIMIZERS[config.optimizer](config)]
  if weight_decay is not None:
    parts.append(optax.add_decayed_weights(weight_decay, mask=_kernels))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)


def create(config, steps_per_epoch: int) -> optax.GradientTransformation:
  """The optimizer `config` describes; schedules span `config.num_epochs` epochs of `steps_per_epoch` steps.

  For method 'hyper' the peak learning rate and the weight decay are arrays in
  the optimizer state (`optax.inject_hyperparams`) that each member sets to its
  own values (methods/hyper.py); the schedule's shape scales the member's rate.
  """
  check(config)
  rate = schedule(config, steps_per_epoch)
  if config.get('method') != 'hyper':
    return _recipe(config, rate, config.weight_decay or None)
  shape = lambda count: rate(count) / config.learning_rate
  per_member = lambda learning_rate, weight_decay: _recipe(
      config, lambda count: learning_rate * shape(count), weight_decay)
  return optax.inject_hyperparams(per_member)(learning_rate=config.learning_rate, weight_decay=config.weight_decay)
