"""MC dropout (Gal and Ghahramani 2016): one network trained with dropout, its dropout kept on at prediction.

The K members are K dropout samples of one network. They share every weight
the way BatchEnsemble's members share theirs (methods/batchensemble.py): all
start from the seed's parameters, and inside each step the backends average
every gradient over all the members, so every member applies the same update
and the parameters stay identical. Each step is then one step of one network
on the K members' batches together (K x `batch_size` examples, each under its
own member's dropout mask and augmentation): training costs what K members
cost, where a single network on one batch would cost 1/K of it, and the
checkpoints hold K copies of the weights (`num_params` counts one). That keeps
the method inside the protocol that every backend, checkpoint and program
already serves. BatchNorm's running averages (ResNet) are each member's own,
estimates from its own batches of the same statistics.

At prediction a member is one stochastic forward pass: the test-time network
(BatchNorm's running averages) with every dropout layer dropping, under the
member's own key (`PREDICTION_KEY` folded into it), so the ensemble's mean is
the mean of K dropout samples. The key is fixed, so a member's predictions are
reproducible: the same inputs in the same batch get the same masks; an input
in another batch, or at another place in it, gets other masks, as another MC
sample would.

The built-in models get a dropout layer before their dense layers
(`dropout_rate`); a user's model keeps its own `nn.Dropout` (linen) or
`nnx.Dropout` (NNX) layers and rates, switched on here at prediction whatever
`train` or `.eval()` says (`dropout_kept_on`). A model with none is refused
(`members.check_model`).
"""

import contextlib
import contextvars
import dataclasses
import functools

import flax.linen as nn
import jax

from ensemble.methods.batchensemble import OneNetwork

# fold_in tag of a member's prediction key: its training steps fold the step number into the same key.
PREDICTION_KEY = 0x4d43_4450

# The dropout layers that dropped inside `dropout_kept_on`, as traced; None outside it.
_DROPPED: contextvars.ContextVar[list | None] = contextvars.ContextVar('dropped', default=None)


@dataclasses.dataclass(frozen=True)
class MCDropout(OneNetwork):
  name: str = 'mc_dropout'

  def predict(self, member, state, images):
    """One dropout sample of the network: its test-time pass with dropout on, under the member's own key."""
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), PREDICTION_KEY)
    with dropout_kept_on():
      return member.logits(state, images, key=key)


@contextlib.contextmanager
def dropout_kept_on():
  """Within it, every linen `nn.Dropout` and NNX `nnx.Dropout` layer drops, whatever its `deterministic` (a test
  pass, `train=False`, `.eval()`), with keys from the 'dropout' stream the call is given; nothing else changes
  (BatchNorm keeps its running averages). Yields a list that holds the rate of each layer that dropped as traced."""
  dropped = []
  token = _DROPPED.set(dropped)
  try:
    with nn.intercept_methods(functools.partial(_linen_dropout_on, dropped)):
      yield dropped
  finally:
    _DROPPED.reset(token)


class _Dropping(nn.Dropout):
  """The `nn.Dropout` that `_linen_dropout_on` calls in a layer's place (and lets through)."""


def _linen_dropout_on(dropped, next_fun, args, kwargs, context):
  """A linen method interceptor: an `nn.Dropout` call drops, with the layer's own rate and key stream."""
  layer = context.module
  if not isinstance(layer, nn.Dropout) or isinstance(layer, _Dropping) or context.method_name != '__call__':
    return next_fun(*args, **kwargs)
  rng = kwargs.get('rng', args[2] if len(args) > 2 else None)  # (inputs, deterministic, rng)
  if layer.rate > 0:
    dropped.append(layer.rate)
    rng = layer.make_rng(layer.rng_collection) if rng is None else rng
  return _Dropping(layer.rate, layer.broadcast_dims, deterministic=False).apply({}, args[0], rng=rng)


def nnx_dropout_on(module):
  """Inside `dropout_kept_on`: sets every `nnx.Dropout` layer of `module` (a member's NNX model, as
  `models.user.NNX` builds it for a call) to drop; elsewhere nothing."""
  dropped = _DROPPED.get()
  if dropped is None:
    return
  from flax import nnx  # pylint: disable=g-import-not-at-top
  for _, layer in nnx.iter_modules(module):
    if isinstance(layer, nnx.Dropout):
      layer.deterministic = False
      if layer.rate > 0:
        dropped.append(layer.rate)
