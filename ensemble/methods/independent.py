"""The deep ensemble (Lakshminarayanan et al. 2017), and the base that the other methods change in one place each."""

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Independent:
  """Members differ by their initialisation, their data order and their augmentation, nothing else.

  `member_data` overrides `config.member_data` when set: bagging is this
  method on bootstrap resamples ('bootstrap', see `data.batches`).
  """
  name: str = 'independent'
  member_data: str | None = None
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

  def num_params(self, params, ensemble_size: int) -> int:
    """Distinct trained parameters of the whole ensemble, from one member's `params` (arrays or shapes)."""
    return ensemble_size * sum(leaf.size for leaf in jax.tree.leaves(params))
