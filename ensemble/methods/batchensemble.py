"""BatchEnsemble (Wen et al. 2020): K members that share their weights and differ in rank-1 fast factors.

The members are the model built with rank-1 layers (models/rank1.py). Their
shared weights (the parameters under a 'shared' layer) start equal, from the
seed alone, and stay equal: inside each step the backends average the
members' gradients of those weights over the device's members and, with
`lax.pmean`, over the devices, so every member applies the same update. The
fast factors, biases and BatchNorm statistics are the member's own and live
with it on the 'ensemble' axis like any member state.

Each device keeps one copy of the shared weights (and of their optimizer
state), however many members it holds: in the backends' layout a shared leaf
has one entry per device where the others have one per member, and each step
broadcasts it to the device's members and keeps one copy of the result
(`map_shared`). Checkpoints and the evaluation see K ordinary members, each
with its copy: the backends' `to_canonical` repeats the device's copy for its
members. `num_params` counts the shared weights once.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import traverse_util

from ensemble.methods.independent import Independent

# fold_in tag for the shared weights' key, so that they differ from every member's own parameters.
_SHARED_INIT = 0x5368_6172


def is_shared_path(path) -> bool:
  """Whether a leaf at `path` (a key path into a member's state: params, optimizer state) is shared."""
  return any(getattr(key, 'key', None) == 'shared' for key in path)


def map_shared(fn, tree, other=lambda x: x):
  """`tree` with `fn` applied to the leaves all members share, `other` to the rest."""
  return jax.tree_util.tree_map_with_path(lambda path, x: fn(x) if is_shared_path(path) else other(x), tree)


def is_shared(params):
  """True for the leaves of `params` that all members share: those under a rank-1 layer's 'shared' layer."""
  return traverse_util.path_aware_map(lambda path, _: 'shared' in path, params)


@dataclasses.dataclass(frozen=True)
class BatchEnsemble(Independent):
  name: str = 'batchensemble'
  seed: int = 0
  shares_weights = True

  def shared(self, params):
    """True for the leaves of `params` that all members share (a tree of `params`' structure)."""
    return is_shared(params)

  def init(self, member, state, key: jax.Array):
    """The member's own factors from its key; the shared weights from the seed, the same for every member."""
    del key
    shared_key = jax.random.fold_in(jax.random.key(self.seed), _SHARED_INIT)
    reference = member.init_variables(shared_key)
    params = jax.tree.map(lambda own, common, shared: common if shared else own,
                          state.params, reference['params'], self.shared(state.params))
    return state.replace(params=params, opt_state=state.tx.init(params))

  def average_shared(self, grads, axis_name: str | None):
    """Gradients of a device's members, (M, ...) per leaf: the shared ones replaced by their mean over all members
    (over `axis_name` too, unless None: these are all the members)."""
    def average(grad, shared):
      if not shared:
        return grad
      mean = jnp.mean(grad, axis=0)
      mean = mean if axis_name is None else jax.lax.pmean(mean, axis_name)
      return jnp.broadcast_to(mean, grad.shape)
    return jax.tree.map(average, grads, self.shared(grads))

  def num_params(self, params, ensemble_size: int) -> int:
    sizes = jax.tree.map(lambda leaf, s: leaf.size * (1 if s else ensemble_size), params, self.shared(params))
    return sum(jax.tree.leaves(sizes))


@dataclasses.dataclass(frozen=True)
class OneNetwork(BatchEnsemble):
  """Members that share every weight: one network, of which each member is one way to predict (MC dropout's dropout
  pass, MIMO's head). Its parameters stay identical across members by BatchEnsemble's mechanism."""

  def shared(self, params):
    """Every leaf."""
    return jax.tree.map(lambda _: True, params)
