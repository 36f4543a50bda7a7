"""Acquisition functions: which inputs an ensemble should have labelled (or evaluated) next.

Each is a pure function of the members' outputs, as `Ensemble.apply` returns
them (or `Ensemble.member_outputs`, numpy arrays), so it runs under `jax.jit`
and `jax.grad`: classification takes the (K, N, C) log-probabilities and returns a
score per input, higher for an input more worth labelling; regression takes
the mixture's components (means, variances), each (K, N) or (K, N, 1), and
returns the score of each input as a point to evaluate a function being
maximised at.

  log_probs = ens.apply(ens.params, x_pool)      # or ens.member_outputs(x_pool)
  acquire.bald(log_probs)                        # (N,) nats
  acquire.batch_bald(log_probs, 10, key)         # (10,) indices of a batch chosen jointly

A batch of the top k of a per-input score takes k near-duplicates where the
pool has them (ten copies of one ambiguous digit are as informative as one);
`batch_bald` scores the batch jointly (Kirsch et al. 2019) and `stochastic`
samples it (Kirsch et al. 2023), so that the batch spreads.
"""

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.scipy import special

from ensemble.errors import UsageError

__all__ = ['CLASSIFICATION', 'REGRESSION', 'bald', 'batch_bald', 'entropy', 'epistemic_std', 'expected_improvement',
           'log_expected_improvement', 'margin', 'probability_of_improvement', 'random', 'stochastic', 'thompson',
           'top', 'upper_confidence_bound', 'variation_ratios']


def _entropy(log_probs: jax.Array) -> jax.Array:
  """-sum_c p_c log p_c over the last axis, 0 log 0 = 0."""
  return -jnp.sum(jnp.where(log_probs > -jnp.inf, jnp.exp(log_probs) * log_probs, 0.0), axis=-1)


def _mean_log_probs(log_probs: jax.Array) -> jax.Array:
  """The ensemble's log-probabilities: the log of the members' mean probabilities."""
  log_probs = jnp.asarray(log_probs)
  return special.logsumexp(log_probs, axis=0) - math.log(log_probs.shape[0])


def entropy(log_probs: jax.Array) -> jax.Array:
  """(N,) nats: the entropy of the ensemble's predictive distribution (max entropy, Shannon 1948): high where the
  members agree that an input is ambiguous, too, which a label will not resolve."""
  return _entropy(_mean_log_probs(log_probs))


def bald(log_probs: jax.Array) -> jax.Array:
  """(N,) nats: the mutual information between an input's label and the choice of member (BALD, Houlsby et al.
  2011): the predictive entropy less the members' mean entropy, high only where the members disagree."""
  log_probs = jnp.asarray(log_probs)
  return jnp.maximum(entropy(log_probs) - _entropy(log_probs).mean(0), 0.0)


def variation_ratios(log_probs: jax.Array) -> jax.Array:
  """(N,): 1 - the ensemble's probability of its top class (Freeman 1965)."""
  return 1.0 - jnp.exp(_mean_log_probs(log_probs)).max(-1)


def margin(log_probs: jax.Array) -> jax.Array:
  """(N,): 1 - (the ensemble's first - its second most probable class's probability): high where two classes are
  close (margin sampling, Scheffer et al. 2001)."""
  top2 = jax.lax.top_k(jnp.exp(_mean_log_probs(log_probs)), 2)[0]
  return 1.0 - (top2[..., 0] - top2[..., 1])


def random(outputs: Any, key: jax.Array) -> jax.Array:
  """(N,) uniform scores: the baseline every acquisition function must beat. `outputs` gives only N (log-probs
  (K, N, C), or regression's (means, variances))."""
  n = (outputs[0] if isinstance(outputs, tuple) else outputs).shape[1]
  return jax.random.uniform(key, (n,))


def top(scores: jax.Array, size: int) -> jax.Array:
  """The indices of the `size` highest scores, highest first."""
  return jax.lax.top_k(jnp.asarray(scores), size)[1]


def stochastic(scores: jax.Array, size: int, key: jax.Array, beta: float = 1.0,
               valid: jax.Array | None = None) -> jax.Array:
  """`size` indices drawn without replacement with probability proportional to score**beta (power acquisition,
  Kirsch et al. 2023, "Stochastic Batch Acquisition"), by the Gumbel top-k trick: a batch that takes the best
  inputs most often but spreads where many score alike, at the cost of one score per input. Scores must be >= 0
  (BALD, entropy, ...). `valid` (N,) bool: the inputs that may be chosen (the others pad a batch of inputs to a
  size already compiled for)."""
  scores = jnp.asarray(scores)
  gumbel = jax.random.gumbel(key, scores.shape)
  perturbed = beta * jnp.log(jnp.maximum(scores, 1e-30)) + gumbel
  return top(perturbed if valid is None else jnp.where(valid, perturbed, -jnp.inf), size)


def batch_bald(log_probs: jax.Array, size: int, key: jax.Array, samples: int = 1000,
               valid: jax.Array | None = None) -> jax.Array:
  """(size,) indices chosen greedily to maximise the batch's joint mutual information with the choice of member
  (BatchBALD, Kirsch et al. 2019): each next input is the one whose label the members disagree on most *given*
  the labels of those chosen before, so that a batch is not `size` copies of one confusing input.

  The joint entropy of the chosen labels is estimated on `samples` label configurations drawn from the ensemble
  (a member, then a label per chosen input from it), in log space, so that it costs O(samples x N x C) a step
  whatever the batch. `valid` (N,) bool: the inputs that may be chosen.
  """
  log_probs = jnp.asarray(log_probs, jnp.float32)
  k, n, _ = log_probs.shape
  conditional = _entropy(log_probs).mean(0)  # E_k H[y_x | member]
  member_of_sample = jax.random.randint(key, (samples,), 0, k)

  def step(carry, step_key):
    log_joint, chosen = carry  # (samples, K): log prod_i p_k(y_i^s) over the chosen inputs; (N,) bool
    # p(config_s, y_x = c) = 1/K sum_k prod_i p_k(y_i^s) p_k(y_x = c), with the configurations' scale taken out.
    shift = log_joint.max(1, keepdims=True)
    weights = jnp.exp(log_joint - shift)  # (samples, K)
    probs = jnp.exp(log_probs)  # (K, N, C)
    joint = jnp.einsum('sk,knc->snc', weights, probs) / k  # (samples, N, C), times e^-shift
    config = weights.mean(1)  # (samples,): p(config_s), times e^-shift
    log_joint_c = jnp.log(jnp.maximum(joint, 1e-30)) + shift[:, :, None]
    # H(y_1..y_n, y_x) = E_{config ~ p} [-sum_c p(y_x = c | config) log p(config, y_x = c)]
    joint_entropy = -jnp.mean(jnp.sum(joint / config[:, None, None] * log_joint_c, -1), 0)
    score = jnp.where(chosen, -jnp.inf, joint_entropy - conditional)
    pick = jnp.argmax(score)
    # Each configuration's label for the chosen input, from the configuration's own member.
    labels = jax.random.categorical(step_key, log_probs[member_of_sample, pick])
    log_joint = log_joint + log_probs[:, pick, labels].T
    return (log_joint, chosen.at[pick].set(True)), pick

  start = (jnp.zeros((samples, k)), jnp.zeros(n, bool) if valid is None else ~valid)
  _, picks = jax.lax.scan(step, start, jax.random.split(jax.random.fold_in(key, 1), size))
  return picks


# --- regression: scores of points at which to evaluate a function being maximised -------------------------------


def _components(outputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Regression's (means, variances) as (K, N): one target's, its last axis of 1 dropped."""
  means, variances = jnp.asarray(outputs[0]), jnp.asarray(outputs[1])
  if means.ndim == 3:
    if means.shape[-1] != 1:
      raise UsageError(f'a regression acquisition scores one target, and these outputs have {means.shape[-1]}: '
                       'give the one target to optimise, (means[..., d], variances[..., d])')
    means, variances = means[..., 0], variances[..., 0]
  return means, variances


def epistemic_std(outputs: tuple[jax.Array, jax.Array]) -> jax.Array:
  """(N,): the members' means' standard deviation: what the members disagree on (the pool loop's default for
  regression: it asks where more data would change the model, not where the noise is)."""
  means, _ = _components(outputs)
  return jnp.std(means, axis=0)


def upper_confidence_bound(outputs: tuple[jax.Array, jax.Array], beta: float = 2.0) -> jax.Array:
  """(N,): the mixture's mean + beta x its standard deviation (Srinivas et al. 2010)."""
  means, variances = _components(outputs)
  mean = means.mean(0)
  variance = variances.mean(0) + jnp.mean((means - mean) ** 2, 0)
  return mean + beta * jnp.sqrt(variance)


def expected_improvement(outputs: tuple[jax.Array, jax.Array], best: float, xi: float = 0.0) -> jax.Array:
  """(N,): E[max(f - best - xi, 0)] under the members' mixture, exact: the mean of each Gaussian's closed form
  (Jones et al. 1998), not a Gaussian fitted to the mixture."""
  means, variances = _components(outputs)
  std = jnp.sqrt(variances)
  z = (means - best - xi) / std
  return jnp.mean((means - best - xi) * special.ndtr(z) + std * jnp.exp(-0.5 * z ** 2) / math.sqrt(2 * math.pi), 0)


def _log_h(z: jax.Array) -> jax.Array:
  """log(phi(z) + z Phi(z)), the standard Gaussian's expected improvement over its mean + z std, finite for every z:
  directly down to z = -6, where float32 still holds it; below, by its asymptotic series phi(z) / z^2 (1 - 3 / z^2 +
  15 / z^4), within 0.3% (Ament et al. 2023's LogEI, whose point is that EI itself underflows to a flat zero far
  from the best, with no gradient to climb)."""
  direct = jnp.maximum(z, -6.0)
  near = jnp.log(jnp.exp(-0.5 * direct ** 2) / math.sqrt(2 * math.pi) + direct * special.ndtr(direct))
  far = jnp.minimum(z, -6.0)
  inverse = 1.0 / far ** 2
  tail = -0.5 * far ** 2 - 0.5 * math.log(2 * math.pi) + jnp.log(inverse) + jnp.log1p(-3 * inverse + 15 * inverse ** 2)
  return jnp.where(z >= -6.0, near, tail)


def log_expected_improvement(outputs: tuple[jax.Array, jax.Array], best: float, xi: float = 0.0) -> jax.Array:
  """(N,): log `expected_improvement`, computed in logs (the mixture's mean as a log-mean-exp of its components'):
  the same maximiser, and a gradient everywhere, where EI is 0 in float32 over most of a box once the best is
  good."""
  means, variances = _components(outputs)
  std = jnp.sqrt(variances)
  return special.logsumexp(jnp.log(std) + _log_h((means - best - xi) / std), axis=0) - math.log(means.shape[0])


def probability_of_improvement(outputs: tuple[jax.Array, jax.Array], best: float, xi: float = 0.0) -> jax.Array:
  """(N,): P(f > best + xi) under the members' mixture, exact (Kushner 1964)."""
  means, variances = _components(outputs)
  return jnp.mean(special.ndtr((means - best - xi) / jnp.sqrt(variances)), 0)


def thompson(outputs: tuple[jax.Array, jax.Array], key: jax.Array) -> jax.Array:
  """(N,): one member's mean, the member drawn at random: Thompson sampling with the members as posterior draws
  (Lu and Van Roy 2017, ensemble sampling)."""
  means, _ = _components(outputs)
  return means[jax.random.randint(key, (), 0, means.shape[0])]


# The pool loop's acquisitions by name: how each scores member outputs with a key and the best value seen (what
# regression's improve on), and whether it chooses a batch itself. A task says which it takes (`Task.acquisitions`).
CLASSIFICATION: dict[str, Callable[..., jax.Array]] = {
    'bald': lambda outputs, key, best: bald(outputs), 'entropy': lambda outputs, key, best: entropy(outputs),
    'variation_ratios': lambda outputs, key, best: variation_ratios(outputs),
    'margin': lambda outputs, key, best: margin(outputs), 'random': lambda outputs, key, best: random(outputs, key)}
REGRESSION: dict[str, Callable[..., jax.Array]] = {
    'epistemic_std': lambda outputs, key, best: epistemic_std(outputs),
    'ucb': lambda outputs, key, best: upper_confidence_bound(outputs),
    'ei': lambda outputs, key, best: expected_improvement(outputs, best),
    'pi': lambda outputs, key, best: probability_of_improvement(outputs, best),
    'thompson': lambda outputs, key, best: thompson(outputs, key),
    'random': lambda outputs, key, best: random(outputs, key)}
# Batches chosen otherwise than the top of a per-input score.
BATCHES = {'batch_bald': batch_bald,
           'power_bald': lambda log_probs, size, key, valid=None: stochastic(bald(log_probs), size, key, valid=valid)}


def named(name: Any, task: Any) -> str:
  """`name` checked against the acquisitions `task` takes (`Task.acquisitions`, `Task.batch_acquisitions`), in one
  line that lists them."""
  names = list(task.acquisitions) + list(task.batch_acquisitions)
  if not isinstance(name, str) or name not in names:
    raise UsageError(f'acquisition={name!r} is not one for a {task.name} ensemble: give one of {", ".join(names)}')
  return name
