"""The deep ensemble (Lakshminarayanan et al. 2017), and the base that the other methods change in one place each."""

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Independent:
  """Members differ by their initialisation, their data order and their augmentation, nothing else.

  Bagging is this method on bootstrap resamples (the recipe's member_data 'bootstrap', see `data.batches`).
  """
  name: str = 'independent'
  shares_weights = False  # BatchEnsemble's members do; the backends then average their shared gradients

  def init(self, member, state, key: jax.Array):
    """A member's fresh state from its key, as `steps.Member.init` made it."""
    del member, key
    return state

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
    """Distinct trained parameters of the whole ensemble, from one member's `params` (arrays or shapes)."""
    return ensemble_size * sum(leaf.size for leaf in jax.tree.leaves(params))
