"""A member's penultimate-layer features: the input of the last layer with a kernel that its forward pass calls.

What a distance step fits its Gaussians on (ensemble/uncertainty/distance.py). Read by intercepting the linen
module calls of the member's own test-time pass (`steps.Member.predict`, its method's), so that the package's
models and a user's linen model need nothing added: no `sow`, no second `__call__`, no knowledge of where the head
is. A layer with a kernel is one whose own parameters hold a leaf named '*kernel' (nn.Dense, nn.Conv,
BatchEnsemble's and Packed-Ensembles' layers); the last one called is the head, and what it reads is the feature
vector. A head that acts at each position (a dense task's 1x1 convolution, a token model's Dense) reads features
per position: they are averaged over the positions, one vector per input.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from ensemble.errors import UsageError

# The methods whose members' features a distance step cannot take, and why.
REFUSED = {
    'snapshot': "averages each member's snapshots, so a member has no one feature space",
    'multiswag': "averages each member's weight samples, so a member has no one feature space",
    'mimo': 'gives its members one feature vector, read by all its heads',
}


def _holds_kernel(module: nn.Module) -> bool:
  params = module.variables.get('params', {}) if module.scope is not None else {}
  return any(name.endswith('kernel') and not isinstance(leaf, dict) for name, leaf in params.items())


def penultimate(member, state, images: jnp.ndarray) -> jnp.ndarray:
  """(N, F) float32: what the last layer with a kernel reads in one member's test-time pass over `images`."""
  read = []

  def record(next_fun, args, kwargs, context):
    if context.method_name == '__call__' and args and _holds_kernel(context.module):
      read.append(args[0])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    member.predict(state, images)
  if not read:
    raise UsageError('distance: the members\' model calls no flax.linen layer with a kernel (an NNX model\'s '
                     'layers cannot be read), so its penultimate features cannot be found; give a flax.linen model '
                     'whose last layer is nn.Dense (or nn.Conv)')
  features = read[-1].astype(jnp.float32)
  return features.reshape(features.shape[0], -1, features.shape[-1]).mean(1)


def check(member):
  """Refuses, in one line, a member whose features a distance step cannot take; else their width."""
  if member.method.name in REFUSED:
    raise UsageError(f'distance: method {member.method.name} {REFUSED[member.method.name]}; use method '
                     'independent (or bagging, hyper, batchensemble, packed, mc_dropout)')
  return width(member)


@functools.lru_cache(maxsize=64)
def width(member) -> int:
  """F, the features' width, traced once per member (without computing)."""
  state = jax.eval_shape(member.init, jax.random.key(0))
  return int(jax.eval_shape(functools.partial(penultimate, member), state, member.example_input()).shape[-1])
