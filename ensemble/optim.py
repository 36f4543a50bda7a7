"""The optimizer recipe from the config: optimizer, learning-rate schedule, decoupled weight decay.

Small optax pieces chained, so every option composes with every other:
`sgd` is SGD with momentum, `adamw` is Adam; either gets weight decay that
is added after the optimizer's own update and scaled by the learning rate
(decoupled, Loshchilov and Hutter 2019), on kernels only: decaying biases
and BatchNorm scales only hurts.
"""

import jax
import jax.numpy as jnp
import optax

from ensemble import sharing


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


def _kernels(params):
  """True for weight matrices and convolution kernels, False for biases and normalisation scales."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def _total_steps(config, steps_per_epoch: int) -> int:
  return config.num_train_steps or config.num_epochs * steps_per_epoch


def swag_collection_start(config, steps_per_epoch: int) -> tuple[int, int]:
  """(the step after which MultiSWAG's rate is constant and its members collect moments, the run's steps)."""
  total = _total_steps(config, steps_per_epoch)
  return int(round(config.swag_start * total)), total


def schedule(config, steps_per_epoch: int) -> optax.Schedule:
  """The learning rate by step: over the run (`num_train_steps`, else `num_epochs` epochs), or restarted every cycle
  of a snapshot ensemble, or for MultiSWAG over the steps before its collection phase, shifted to end at
  `swag_learning_rate` and constant at it after (SWAG's moments need iterates that keep moving)."""
  if config.method == 'multiswag':
    start, _ = swag_collection_start(config, steps_per_epoch)
    before = SCHEDULES[config.schedule](config, start, _warmup_steps(config, steps_per_epoch))
    swag_rate = config.swag_learning_rate or config.learning_rate / 10  # 0: a tenth (ensemble/defaults.py)
    shift = 1 - swag_rate / config.learning_rate
    return lambda count: jnp.where(count < start, swag_rate + before(count) * shift, swag_rate)
  cycles = config.snapshot_cycles if config.method == 'snapshot' else 1
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
  """The optimizer a recipe describes; schedules span `config.num_epochs` epochs of `steps_per_epoch` steps.

  For method 'hyper' the peak learning rate and the weight decay are arrays in
  the optimizer state (`optax.inject_hyperparams`) that each member sets to its
  own values (methods/hyper.py); the schedule's shape scales the member's rate.
  """
  rate = schedule(config, steps_per_epoch)
  if config.frozen:  # frozen parameters get neither an update nor any optimizer state (ensemble/sharing.py)
    return optax.multi_transform({'trained': _recipe(config, rate, config.weight_decay or None),
                                  'frozen': optax.set_to_zero()}, sharing.labels(tuple(config.frozen)))
  if config.method != 'hyper':
    return _recipe(config, rate, config.weight_decay or None)
  shape = lambda count: rate(count) / config.learning_rate
  per_member = lambda learning_rate, weight_decay: _recipe(
      config, lambda count: learning_rate * shape(count), weight_decay)
  return optax.inject_hyperparams(per_member)(learning_rate=config.learning_rate, weight_decay=config.weight_decay)


def restart_schedule(opt_state):
  """`opt_state` with its learning-rate schedule back at its start (each `ScaleByScheduleState`'s count 0), the
  rest kept (momentum, Adam's moments and their count): a warm start that keeps its optimizer trains for the new
  fit's own schedule, instead of carrying the old one's end (a cosine's zero rate) into it."""
  is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)
  restart = lambda node: node._replace(count=jnp.zeros_like(node.count)) if is_schedule(node) else node
  return jax.tree.map(restart, opt_state, is_leaf=is_schedule)

