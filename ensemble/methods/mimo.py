"""MIMO (Havasi et al. 2021, "Training independent subnetworks for robust prediction"): one network of M inputs and
M heads, trained on M independent examples at once, predicting with one input repeated in all M slots.

M is the ensemble size. The network (models/mimo.py) concatenates its M inputs
along their last axis and splits its last layer's outputs into M heads; with
independent examples in the slots, each head learns to predict its own slot's
label and to ignore the others, so the M heads become M subnetworks inside one
network, which disagree as independently trained members do.

The K = M members are that one network: they share every weight as MC
dropout's members do (methods/mc_dropout.py; inside each step the backends
average every gradient over the members), and BatchNorm's statistics are each
member's own. Member i trains on its own batch of B = `batch_size` rows,
grouped into B/M composite examples: example r's slot j holds row j B/M + r,
and its label for head j is that row's label (`training_batch`). Its loss is
the mean over the heads of each head's mean loss: the paper's code sums them,
which is the same at M times the learning rate, and with the default recipe
(SGD at 0.1) the sum's M-fold steps left the CNN at chance (M = 8, MNIST).
Its metrics are the heads' mean too. The members' data orders are independent
(member_data shuffled), so the M slots of a composite example are independent
examples. A step of the ensemble is thus one step of one network on K B/M
composite examples, about the cost of one member's step of B examples (the
first layer is M times wider, the last has M heads); each head sees every
training example once per epoch.

Member i predicts with head i: its input repeated in all M slots, the
network's forward pass, head i's outputs. The ensemble's mean over the
members is then the paper's prediction, the mean of the M heads, at the cost
of one forward pass of the network: every member computes all M heads and
keeps one, so that evaluation, checkpoints and export see K members like any
others, and `backends.predict_members` leaves the weights they share unmapped,
so vmap computes that pass once (per member only where BatchNorm's statistics,
each member's own, enter). A member finds its head in `init` from its key (the i-th of
`steps.member_keys`) and keeps it in `TrainState.snapshots`, so checkpoints,
a restored workdir and an exported artifact know it.

Not implemented: the paper's input repetition (a fraction rho of composite
examples whose slots share an input) and batch repetition (each example in
several composite examples per step).
"""

import dataclasses

import jax
import jax.numpy as jnp

from ensemble.keys import member_keys
from ensemble.methods.batchensemble import OneNetwork


@dataclasses.dataclass(frozen=True)
class MIMO(OneNetwork):
  name: str = 'mimo'
  heads: int = 2  # M: the ensemble size

  @classmethod
  def from_config(cls, config):
    return cls(heads=config.ensemble_size)

  def init(self, member, state, key: jax.Array, seed_key: jax.Array):
    """The seed's network, and the member's head: i for the i-th of the members' keys (split from `seed_key`)."""
    state = super().init(member, state, key, seed_key)
    keys = jax.random.key_data(member_keys(seed_key, self.heads))
    head = jnp.argmax(jnp.all(keys == jax.random.key_data(key), axis=-1)).astype(jnp.int32)
    return state.replace(snapshots={'head': head})

  def model_input(self, inputs):
    """(batch, *shape) -> (batch, M, *shape): each input in every slot."""
    return jnp.broadcast_to(inputs[:, None], (inputs.shape[0], self.heads, *inputs.shape[1:]))

  def training_batch(self, inputs, labels):
    """B rows -> B/M composite examples (B/M, M, ...): example r's slot j is row j B/M + r, with its label."""
    groups = inputs.shape[0] // self.heads
    slots = lambda x: jnp.swapaxes(x.reshape(self.heads, groups, *x.shape[1:]), 0, 1)
    return slots(inputs), slots(labels)

  def loss(self, task, outputs, labels):
    """The mean over heads of the task's loss of head j's outputs (B/M, M, ...)[:, j] on slot j's labels, and of their
    metrics."""
    losses, metrics = jax.vmap(task.loss, in_axes=1)(outputs, labels)
    return jnp.mean(losses), jax.tree.map(jnp.mean, metrics)

  def predict(self, member, state, images):
    """Head i's outputs for the member's inputs repeated in every slot."""
    inputs = self.model_input(member.prepare(images, stats=state.inputs))
    outputs, _ = member.apply(state, state.params, inputs, train=False)
    return jnp.take(outputs, state.snapshots['head'], axis=1)
