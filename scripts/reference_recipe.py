"""The classic recipe, kept as the benchmark's reference: the Flax ensembling guide, faithfully.

One member per device; a Python loop over batches that replicates each host batch with
`jax_utils.replicate`; one pmapped step returns gradients (and the ensemble accuracy, through
`lax.pmean`) and a second pmapped step applies them. The one change from the guide: the loop
waits for each step's accuracy before dispatching the next, because on a small CPU with many
simulated devices an unbounded queue of steps holding a collective aborts XLA's rendezvous.

Only jax, flax, optax and numpy are imported, so it runs where clu and TFDS are not installed.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import train_state


class CNN(nn.Module):
  """The guide's CNN (conv 32, conv 64, dense 256, dense 10)."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(features=32, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.Conv(features=64, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.Dense(features=256)(x)
    x = nn.relu(x)
    return nn.Dense(features=10)(x)


@functools.partial(jax.pmap, static_broadcasted_argnums=(1, 2))
def create_train_state(rng, learning_rate, momentum):
  cnn = CNN()
  params = cnn.init(rng, jnp.ones([1, 28, 28, 1]))['params']
  tx = optax.sgd(learning_rate, momentum)
  return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


@functools.partial(jax.pmap, axis_name='ensemble')
def apply_model(state, images, labels):
  def loss_fn(params):
    logits = CNN().apply({'params': params}, images)
    one_hot = jax.nn.one_hot(labels, 10)
    loss = optax.softmax_cross_entropy(logits=logits, labels=one_hot).mean()
    return loss, logits

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(state.params)
  probs = jax.lax.pmean(jax.nn.softmax(logits), axis_name='ensemble')
  accuracy = jnp.mean(jnp.argmax(probs, -1) == labels)
  return grads, loss, accuracy


@jax.pmap
def update_model(state, grads):
  return state.apply_gradients(grads=grads)


def train_epoch(state, train_ds, batch_size, rng, max_steps=None):
  """The guide's train_epoch, plus `max_steps` for benchmarking and a wait per step."""
  train_ds_size = len(train_ds['image'])
  steps_per_epoch = train_ds_size // batch_size
  perms = jax.random.permutation(rng, len(train_ds['image']))
  perms = perms[:steps_per_epoch * batch_size]
  perms = np.asarray(perms.reshape((steps_per_epoch, batch_size)))[:max_steps]
  epoch_loss = []
  epoch_accuracy = []
  for perm in perms:
    batch_images = jax_utils.replicate(train_ds['image'][perm, ...])
    batch_labels = jax_utils.replicate(train_ds['label'][perm, ...])
    grads, loss, accuracy = apply_model(state, batch_images, batch_labels)
    state = update_model(state, grads)
    epoch_loss.append(jax_utils.unreplicate(loss))
    epoch_accuracy.append(jax.block_until_ready(jax_utils.unreplicate(accuracy)))
  train_loss = np.mean(epoch_loss)
  train_accuracy = np.mean(epoch_accuracy)
  return state, train_loss, train_accuracy


@functools.partial(jax.pmap, axis_name='ensemble')
def _test_step(state, images, labels):
  """The guide's test pass: the ensemble's accuracy and loss on one batch, the members' probabilities averaged."""
  probs = jax.lax.pmean(jax.nn.softmax(CNN().apply({'params': state.params}, images)), axis_name='ensemble')
  loss = -jnp.mean(jnp.log(jnp.take_along_axis(probs, labels[:, None], axis=-1)))
  return jnp.mean(jnp.argmax(probs, -1) == labels), loss


def train_and_evaluate(train_ds, test_ds, num_epochs: int, batch_size: int = 128, learning_rate: float = 0.1,
                       momentum: float = 0.9, eval_batch_size: int = 1000):
  """The guide's whole run, for end-to-end timing: one member per device, a test pass after every epoch."""
  devices = jax.local_device_count()
  state = create_train_state(jax.random.split(jax.random.key(0), devices), learning_rate, momentum)
  for epoch in range(1, num_epochs + 1):
    state, train_loss, _ = train_epoch(state, train_ds, batch_size, jax.random.key(epoch))
    results = [jax.device_get(jax_utils.unreplicate(_test_step(
        state, jax_utils.replicate(test_ds['image'][i:i + eval_batch_size] / np.float32(255)),
        jax_utils.replicate(test_ds['label'][i:i + eval_batch_size]))))
        for i in range(0, len(test_ds['label']), eval_batch_size)]
    accuracy, loss = np.mean(results, axis=0)
    print(f'epoch {epoch}: train loss {train_loss:.4f}, test loss {loss:.4f}, test accuracy {accuracy:.4f}')
  return state


if __name__ == '__main__':
  import argparse  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description='The classic recipe end to end, for timing against ensemble.train.')
  parser.add_argument('--epochs', type=int, default=2)
  parser.add_argument('--cpu_devices', type=int, default=0, help='simulated CPU devices (one member each)')
  args = parser.parse_args()
  if args.cpu_devices:
    jax.config.update('jax_num_cpu_devices', args.cpu_devices)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from ensemble.data import bundled  # pylint: disable=g-import-not-at-top  # the same MNIST, read without TensorFlow
  mnist = bundled.load('mnist')
  scale = lambda split: {'image': split['image'].astype(np.float32) / 255, 'label': split['label']}
  train_and_evaluate(scale(mnist.train), mnist.test, args.epochs)
