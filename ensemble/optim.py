"""The optimizer recipe from the config: optimizer, learning-rate schedule, decoupled weight decay.

Small optax pieces chained, so every option composes with every other:
`sgd` is SGD with momentum, `adamw` is Adam; either gets weight decay that
is added after the optimizer's own update and scaled by the learning rate
(decoupled, Loshchilov and Hutter 2019), on kernels only: decaying biases
and BatchNorm scales only hurts.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ensemble import sharing


OPTIMIZERS = {
    'sgd': lambda config: optax.trace(decay=config.momentum),
    'adamw': lambda config: optax.scale_by_adam(),
}


def _warmup_steps(config, steps_per_epoch: int) -> int:
  return int(round(config.warmup_epochs * steps_per_epoch))


# A run's horizon: what its schedule's shape depends on besides the recipe, as int32 data of the programs (each
# member's `TrainState.horizon`), so that fits of other lengths (a growing active-learning set) share programs.
HORIZON = ('total', 'warmup', 'swag_start')


def horizon(config, steps_per_epoch: int) -> np.ndarray:
  """(total steps, warmup steps, MultiSWAG's first constant-rate step) of a run of `steps_per_epoch`-step epochs."""
  start, total = swag_collection_start(config, steps_per_epoch)
  return np.array([total, _warmup_steps(config, steps_per_epoch), start], np.int32)


def _cosine(peak, count, steps):
  """optax.cosine_decay_schedule(peak, steps)(count), with `steps` traced or not."""
  steps = jnp.asarray(steps, jnp.float32)
  return peak * (0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(count, steps) / steps)))


def _warmup_cosine(peak, count, steps, warmup):
  """optax.warmup_cosine_decay_schedule(0, peak, warmup, steps)(count), with `steps` and `warmup` traced or not."""
  warmup = jnp.asarray(warmup, jnp.int32)
  rising = -peak * (1 - jnp.clip(count, 0, warmup) / jnp.maximum(warmup, 1)) + peak  # optax's linear_schedule
  return jnp.where(count < warmup, rising, _cosine(peak, count - warmup, steps - warmup))


# Each spans `steps` optimizer steps (the whole run, or one cycle of a snapshot ensemble): the rate at `count`.
SCHEDULES = {
    'constant': lambda config, count, steps, warmup: config.learning_rate,
    'cosine': lambda config, count, steps, warmup: _cosine(config.learning_rate, count, steps),
    'warmup_cosine': lambda config, count, steps, warmup: _warmup_cosine(config.learning_rate, count, steps, warmup),
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


def rate(config) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The learning rate by (step, `horizon`): over the run, or restarted every cycle of a snapshot ensemble, or for
  MultiSWAG over the steps before its collection phase, shifted to end at `swag_learning_rate` and constant at it
  after (SWAG's moments need iterates that keep moving)."""
  by_name = SCHEDULES[config.schedule]
  if config.method == 'multiswag':
    swag_rate = config.swag_learning_rate or config.learning_rate / 10  # 0: a tenth (ensemble/defaults.py)
    shift = 1 - swag_rate / config.learning_rate

    def swag(count, horizon):
      start = horizon[2]
      return jnp.where(count < start, swag_rate + by_name(config, count, start, horizon[1]) * shift, swag_rate)
    return swag
  cycles = config.snapshot_cycles if config.method == 'snapshot' else 1
  if cycles == 1:
    return lambda count, horizon: by_name(config, count, horizon[0], horizon[1])

  def cycle(count, horizon):
    steps = horizon[0] // cycles
    return by_name(config, count % steps, steps, horizon[1])
  return cycle


def schedule(config, steps_per_epoch: int) -> optax.Schedule:
  """`rate` for a run of `steps_per_epoch`-step epochs: the learning rate by step."""
  fixed = horizon(config, steps_per_epoch)
  by_step = rate(config)
  return lambda count: by_step(jnp.asarray(count), fixed)


def scale_by_rate(by_step, fixed: np.ndarray | None = None) -> optax.GradientTransformationExtraArgs:
  """optax.scale_by_learning_rate of a schedule that also reads the run's horizon: the `horizon` extra argument of
  `update` (`TrainState.apply_gradients` gives each member's), else `fixed`. Its state is optax's for a schedule
  (a count), so checkpoints are as they were."""
  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, horizon=None, **extra_args):
    del params, extra_args
    if horizon is None:
      if fixed is None:
        raise ValueError('this optimizer reads the run\'s horizon (optim.horizon): pass update(..., horizon=...)')
      horizon = fixed
    elif fixed is not None:  # a state whose horizon no run set (all zeros) follows the optimizer's own
      horizon = jnp.where(jnp.asarray(horizon)[0] > 0, jnp.asarray(horizon), jnp.asarray(fixed))
    step_size = -by_step(state.count, jnp.asarray(horizon))
    updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))
  return optax.GradientTransformationExtraArgs(init, update)


def _recipe(config, scale, weight_decay) -> optax.GradientTransformation:
  parts = [OPTIMIZERS[config.optimizer](config)]
  if weight_decay is not None:
    parts.append(optax.add_decayed_weights(weight_decay, mask=_kernels))
  parts.append(scale)
  return optax.chain(*parts)


def create(config, steps_per_epoch: int | None = None) -> optax.GradientTransformation:
  """The optimizer a recipe describes; its schedule spans the run's horizon, which `update` takes as its extra
  argument `horizon` (`optim.horizon`: data, so that one program serves runs of any length), or, with
  `steps_per_epoch`, that of `config.num_epochs` epochs of so many steps.

  For method 'hyper' the peak learning rate and the weight decay are arrays in
  the optimizer state (`optax.inject_hyperparams`) that each member sets to its
  own values (methods/hyper.py); the schedule's shape scales the member's rate.
  """
  by_step = rate(config)
  fixed = None if steps_per_epoch is None else horizon(config, steps_per_epoch)
  if config.frozen:  # frozen parameters get neither an update nor any optimizer state (ensemble/sharing.py)
    return optax.multi_transform({'trained': _recipe(config, scale_by_rate(by_step, fixed),
                                                     config.weight_decay or None),
                                  'frozen': optax.set_to_zero()}, sharing.labels(tuple(config.frozen)))
  if config.method != 'hyper':
    return _recipe(config, scale_by_rate(by_step, fixed), config.weight_decay or None)
  shape = lambda count, horizon: by_step(count, horizon) / config.learning_rate
  per_member = lambda learning_rate, weight_decay: _recipe(
      config, scale_by_rate(lambda count, horizon: learning_rate * shape(count, horizon), fixed), weight_decay)
  return optax.inject_hyperparams(per_member)(learning_rate=config.learning_rate, weight_decay=config.weight_decay)


def restart_schedule(opt_state):
  """`opt_state` with its learning-rate schedule back at its start (each `ScaleByScheduleState`'s count 0), the
  rest kept (momentum, Adam's moments and their count): a warm start that keeps its optimizer trains for the new
  fit's own schedule, instead of carrying the old one's end (a cosine's zero rate) into it."""
  is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)
  restart = lambda node: node._replace(count=jnp.zeros_like(node.count)) if is_schedule(node) else node
  return jax.tree.map(restart, opt_state, is_leaf=is_schedule)

