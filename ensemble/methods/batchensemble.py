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
from flax import traverse_util

from ensemble.methods.independent import Independent


def is_shared_path(path) -> bool:
  """Whether a leaf at `path` (a key path into a member's state: params, optimizer state) is shared."""
  return any(getattr(key, 'key', None) == 'shared' for key in path)


def is_shared(params):
  """True for the leaves of `params` that all members share: those under a rank-1 layer's 'shared' layer."""
  return traverse_util.path_aware_map(lambda path, _: 'shared' in path, params)


@dataclasses.dataclass(frozen=True)
class BatchEnsemble(Independent):
  """The members' own factors come from their keys; the shared weights from the seed, the same for every member
  (`Independent.init`), their gradients averaged over the members (`Independent.average_shared`)."""
  name: str = 'batchensemble'
  shares_weights = True

  def shared(self, params):
    return is_shared(params)

  def is_shared_path(self, path) -> bool:
    return is_shared_path(path)


@dataclasses.dataclass(frozen=True)
class OneNetwork(BatchEnsemble):
  """Members that share every weight: one network, of which each member is one way to predict (MC dropout's dropout
  pass, MIMO's head). Its parameters stay identical across members by BatchEnsemble's mechanism."""

  def shared(self, params):
    """Every leaf."""
    return jax.tree.map(lambda _: True, params)
