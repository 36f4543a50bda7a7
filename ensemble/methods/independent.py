"""The deep ensemble (Lakshminarayanan et al. 2017), and the base that the other methods change in one place each."""

import dataclasses

import jax
import jax.numpy as jnp

from ensemble import sharing

# fold_in tag for the shared weights' key, so that they differ from every member's own parameters.
_SHARED_INIT = 0x5368_6172


@dataclasses.dataclass(frozen=True)
class Independent:
  """Members differ by their initialisation, their data order and their augmentation, nothing else.

  Bagging is this method on bootstrap resamples (the recipe's member_data 'bootstrap', see `data.batches`).
  With `shared_filters` (`fit(shared=...)`, ensemble/sharing.py) the parameters they name are one copy that all
  members train together, as BatchEnsemble's shared weights are: the members are heads (or whatever the rest is)
  on one backbone.
  """
  name: str = 'independent'
  shared_filters: tuple[str, ...] = ()

  @property
  def shares_weights(self) -> bool:
    """Whether some parameters are one copy for all members: the backends then average their gradients over the
    members (`average_shared`) and hold them once per device (`map_shared`)."""
    return bool(self.shared_filters)

  def shared(self, params):
    """True for the leaves of `params` that all members share (a tree of `params`' structure)."""
    return sharing.mask(self.shared_filters, params)

  def is_shared_path(self, path) -> bool:
    """Whether the leaf at `path` of a member's state (its parameters or their optimizer state) is shared."""
    return sharing.in_state(self.shared_filters, path)

  def map_shared(self, fn, tree, other=lambda x: x):
    """`tree` (a member state's) with `fn` applied to the leaves all members share, `other` to the rest."""
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(x) if self.is_shared_path(path) else other(x), tree)

  def init(self, member, state, key: jax.Array, seed_key: jax.Array):
    """A member's fresh state from its key, as `steps.Member.init` made it; its shared weights from the seed's key
    (`keys.seed_key`, an argument of the programs), the same for every member."""
    del key
    if not self.shares_weights:
      return state
    shared_key = jax.random.fold_in(seed_key, _SHARED_INIT)
    reference, _ = member.initial_params(shared_key)
    params = jax.tree.map(lambda own, common, shared: common if shared else own,
                          state.params, reference, self.shared(state.params))
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

  def after_update(self, state):
    """The state after an optimizer step, as `apply_gradients` left it."""
    return state

  def predict(self, member, state, images):
    """A member's logits (or log-probabilities) at test time."""
    return member.logits(state, images)

  def model_input(self, inputs):
    """The model's input for a batch of inputs outside training (its initialisation, `members.check_model`): as
    they are. MIMO's model takes each input once per head."""
    return inputs

  def training_batch(self, inputs, labels):
    """(inputs, labels) of a member's prepared training batch, as its model trains on them: as they are. MIMO
    groups them into examples of one input per head."""
    return inputs, labels

  def loss(self, task, outputs, labels):
    """(loss, metrics) of the model's outputs for `training_batch`: the task's. MIMO sums its heads' losses."""
    return task.loss(outputs, labels)

  def params_of(self, state):
    """What a member's predictions are a function of, as `Ensemble.params` and `Ensemble.apply` take it: its
    parameters. A method that predicts with what it kept (snapshots, SWAG's moments) adds those."""
    return state.params

  def with_params(self, state, params):
    """`state` predicting with `params` (what `params_of` gave, changed)."""
    return state.replace(params=params)

  def num_params(self, params, ensemble_size: int) -> int:
    """Distinct parameters of the whole ensemble, from one member's `params` (arrays or shapes): the shared ones
    once."""
    sizes = jax.tree.map(lambda leaf, s: leaf.size * (1 if s else ensemble_size), params, self.shared(params))
    return sum(jax.tree.leaves(sizes))
