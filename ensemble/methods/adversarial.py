"""Adversarial training (`adversarial_epsilon` > 0), with any method: the deep-ensemble paper's Algorithm 1.

Lakshminarayanan et al. (2017) train each member on the fast gradient sign
method's adversarial examples as well as on the clean ones (Goodfellow et al.
2015): x' = x + eps * range * sign(grad_x loss(x)), the member's own loss and
its own gradient, so that each member smooths its predictive around the
training points where it is steepest. `steps.Member.gradients` computes the
clean loss's gradients for the parameters and the inputs in one backward pass,
then the perturbed loss's for the parameters in a second: a step costs about
twice a plain one. The perturbation is a constant of the second pass (no
gradient flows through it into the parameters); the update is the mean of the
two gradients (Goodfellow et al.'s alpha = 0.5: the paper's sum of the two
losses at half the learning rate).

`range` is each input dimension's range (`steps.Member.input_range`): for
images the pixel range, after augmentation, before standardisation (eps = 0.01
is 2.55 in uint8 units); for features `FEATURE_RANGE_IN_STDS` standard
deviations of the training split.
"""

import jax
import jax.numpy as jnp


# A feature's range, in standard deviations of the training split: the range rule of thumb (std ~ range / 4). The
# data's description (`config.data_info`) keeps each feature's mean and standard deviation, not its minimum and
# maximum, so that is the scale there is; 4 puts eps on the paper's footing, a fraction of the range (a uniform
# feature's range is 3.5 stds, a normal one's over 1,000 examples about 6.5).
FEATURE_RANGE_IN_STDS = 4.0


def fgsm(inputs: jnp.ndarray, input_grads: jnp.ndarray, step) -> jnp.ndarray:
  """`inputs` moved by `step` (eps times each dimension's range) along the sign of the loss's gradient: FGSM's
  adversarial example, a constant for the gradients that follow."""
  return jax.lax.stop_gradient(inputs + step * jnp.sign(input_grads))


def mean_of(grads, perturbed_grads):
  """The update of Algorithm 1: the mean of the clean and the adversarial loss's gradients."""
  return jax.tree.map(lambda clean, perturbed: (clean + perturbed) / 2, grads, perturbed_grads)
