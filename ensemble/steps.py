"""What one ensemble member computes: init, train step, eval step.

Written once for every backend. Each function sees a single member; a backend
maps it over members (vmap, and pmap over devices) and passes the names of the
mapped axes as `axis_name`, so `lax.pmean` over them averages the members'
probabilities into the ensemble prediction wherever the members live.
"""

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

AxisName = str | Sequence[str]
TrainState = train_state.TrainState
Metrics = dict[str, jnp.ndarray]


def create_optimizer(config) -> optax.GradientTransformation:
  return optax.sgd(config.learning_rate, config.momentum)


def create_member_state(key: jax.Array, model: nn.Module, tx: optax.GradientTransformation,
                        input_shape: Sequence[int]) -> TrainState:
  params = model.init(key, jnp.ones((1, *input_shape), jnp.float32))['params']
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def predict(state: TrainState, images: jnp.ndarray) -> jnp.ndarray:
  """One member's logits: the forward pass that evaluation and the eval step share."""
  return state.apply_fn({'params': state.params}, images)


def train_step(state: TrainState, images: jnp.ndarray, labels: jnp.ndarray) -> tuple[TrainState, Metrics]:
  """One SGD step of one member on its batch.

  Members train independently (that is what makes a deep ensemble), so there is
  no collective here: the ensemble only meets at prediction time.
  """
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, images)
    return cross_entropy(logits, labels).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  return state.apply_gradients(grads=grads), {'loss': loss, 'accuracy': accuracy}


def train_steps(state: TrainState, images: jnp.ndarray, labels: jnp.ndarray,
                indices: jnp.ndarray, step_fn=train_step, unroll: bool = False) -> tuple[TrainState, Metrics]:
  """`len(indices)` train steps in one program, on batches gathered from a resident training set.

  The fast path: the training set stays on the device, so the chunk's batches
  cost one on-device gather instead of host-to-device copies, and one dispatch
  and one host sync serve many steps. Each step is `step_fn` (`train_step`, or
  the data-parallel step of `parallel.fsdp`), so results match the plain path.
  The gather happens before the loop: a dataset referenced inside the scan body
  rides in the loop state, and XLA on CPU copied it every iteration (14x slower).

  `unroll` traces the steps one after another instead of as a `lax.scan`
  loop; backends set it on CPU (see `backends.unrolls`).
  """
  batches = (images[indices], labels[indices])
  step = lambda state, batch: step_fn(state, *batch)
  if not unroll:
    return jax.lax.scan(step, state, batches)
  outputs = []
  for i in range(len(indices)):
    state, output = step(state, (batches[0][i], batches[1][i]))
    outputs.append(output)
  return state, stack(outputs)


def stack(trees: Sequence[Any]) -> Any:
  """Equally shaped pytrees -> one pytree with a new leading axis: what a traced loop would return."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def ensemble_probs(probs: jnp.ndarray, axis_name: AxisName) -> jnp.ndarray:
  """The ensemble prediction: the mean of the members' probabilities over the mapped axes."""
  return jax.lax.pmean(probs, axis_name)


def log_mean_exp(log_values: jnp.ndarray, axis_name: AxisName) -> jnp.ndarray:
  """log(mean(exp(log_values))) over the mapped axes, without leaving log space.

  The ensemble's log-probability of a label from its members': shifted by the
  members' maximum, the largest term is exp(0) = 1, so a confident mistake
  (every member's probability below float32's smallest) keeps its cost
  instead of being clipped at float32 tiny (87 nats).
  """
  peak = jax.lax.pmax(log_values, axis_name)
  return peak + jnp.log(jax.lax.pmean(jnp.exp(log_values - peak), axis_name))


def eval_step(state: TrainState, images: jnp.ndarray, labels: jnp.ndarray, *,
              axis_name: AxisName) -> Metrics:
  """Per-example losses and hits of this member and of the whole ensemble."""
  return eval_outputs(predict(state, images), labels, axis_name=axis_name)


def eval_outputs(logits: jnp.ndarray, labels: jnp.ndarray, *, axis_name: AxisName) -> Metrics:
  """`eval_step` from this member's logits: backends that compute the logits their own way use it."""
  log_probs = jax.nn.log_softmax(logits)
  ensemble = ensemble_probs(jnp.exp(log_probs), axis_name)
  label_log_prob = jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
  return {
      'member_loss': cross_entropy(logits, labels),
      'member_correct': (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
      'ensemble_loss': -log_mean_exp(label_log_prob, axis_name),
      'ensemble_correct': (jnp.argmax(ensemble, -1) == labels).astype(jnp.float32),
  }


def member_keys(seed: int, ensemble_size: int) -> jax.Array:
  """Member i's init key depends on the seed and the ensemble size only, not on the devices."""
  return jax.random.split(jax.random.key(seed), ensemble_size)


def abstract_ensemble_state(model: nn.Module, tx: optax.GradientTransformation,
                            ensemble_size: int, input_shape: Sequence[int]) -> Any:
  """Shapes and dtypes of the stacked (K, ...) ensemble state, computed without allocating it."""
  init = jax.vmap(lambda key: create_member_state(key, model, tx, input_shape))
  return jax.eval_shape(init, jax.eval_shape(lambda: member_keys(0, ensemble_size)))
