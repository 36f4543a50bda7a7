"""The acquisition functions: their values where they are known, under jit and grad, and batches that spread."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensemble import acquire, tasks
from ensemble.errors import UsageError
from ensemble.uncertainty import decomposition


def _log(probs):
  return jnp.log(jnp.asarray(probs, jnp.float32))


def test_classification_scores_match_the_decomposition_and_their_definitions():
  rng = np.random.default_rng(0)
  member_probs = rng.dirichlet(np.ones(5) * 0.5, size=(4, 30))
  parts = decomposition.decompose(member_probs)
  log_probs = _log(member_probs)
  np.testing.assert_allclose(acquire.entropy(log_probs), parts['entropy'], atol=1e-5)
  np.testing.assert_allclose(acquire.bald(log_probs), parts['mutual_information'], atol=1e-5)
  mean = member_probs.mean(0)
  np.testing.assert_allclose(acquire.variation_ratios(log_probs), 1 - mean.max(-1), atol=1e-6)
  ordered = np.sort(mean, -1)
  np.testing.assert_allclose(acquire.margin(log_probs), 1 - (ordered[:, -1] - ordered[:, -2]), atol=1e-6)


def test_bald_is_high_only_where_members_disagree():
  agree_ambiguous = np.full((4, 1, 4), 0.25)  # every member unsure: entropy log 4, nothing to learn
  disagree = np.eye(4)[:, None, :] * (1 - 4e-6) + 1e-6  # member k sure of class k
  log_probs = _log(np.concatenate([agree_ambiguous, disagree], 1))
  entropy, bald = acquire.entropy(log_probs), acquire.bald(log_probs)
  np.testing.assert_allclose(entropy, [math.log(4)] * 2, atol=1e-3)
  np.testing.assert_allclose(bald, [0.0, math.log(4)], atol=1e-3)


def test_scores_run_under_jit_and_grad_through_logits():
  logits = jax.random.normal(jax.random.key(0), (3, 6, 4))
  for score in (acquire.bald, acquire.entropy, acquire.variation_ratios, acquire.margin):
    log_probs = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(jax.jit(score)(log_probs), score(log_probs), rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda z, score=score: score(jax.nn.log_softmax(z)).sum())(logits)
    assert np.isfinite(np.asarray(grads)).all() and np.abs(np.asarray(grads)).sum() > 0


def _duplicated_pool():
  """Five copies of the input with the most BALD (members 0, 1 sure of class 0, members 2, 3 of class 1), then
  five inputs with a little less, on which members 0, 2 and 1, 3 side together: once a copy's label is known, a
  second copy's tells nothing more, and one of those still halves what is unknown about the member."""
  sure = lambda cls, noise: np.eye(4)[cls] * (1 - 4 * noise) + noise
  copy = np.stack([sure(c, 1e-4) for c in (0, 0, 1, 1)])  # (K, C)
  others = [np.stack([sure(c, 1e-2) for c in (a, b, a, b)]) for a, b in ((0, 1), (1, 0), (2, 3), (3, 2), (0, 3))]
  return _log(np.stack([copy] * 5 + others, 1))  # (K, 10, C)


def test_batch_bald_spreads_where_top_k_takes_copies():
  log_probs = _duplicated_pool()
  assert set(np.asarray(acquire.top(acquire.bald(log_probs), 2))) <= set(range(5))  # two copies of one input
  batch = np.asarray(acquire.batch_bald(log_probs, 2, jax.random.key(0), samples=2000))
  assert batch[0] == int(np.argmax(acquire.bald(log_probs)))  # the first pick is BALD's
  assert batch[1] >= 5, batch  # then an input that adds, not a copy


def test_batch_bald_and_stochastic_choose_only_valid_distinct_inputs():
  log_probs = _duplicated_pool()
  valid = jnp.asarray([False] * 5 + [True] * 5)
  batch = np.asarray(jax.jit(acquire.batch_bald, static_argnums=1)(log_probs, 4, jax.random.key(1), valid=valid))
  assert len(set(batch)) == 4 and all(i >= 5 for i in batch)
  for seed in range(5):
    drawn = np.asarray(acquire.stochastic(acquire.bald(log_probs), 4, jax.random.key(seed), valid=valid))
    assert len(set(drawn)) == 4 and all(i >= 5 for i in drawn)


def test_stochastic_draws_in_proportion_to_the_scores():
  scores = jnp.asarray([1.0, 3.0])
  firsts = [int(acquire.stochastic(scores, 1, jax.random.key(seed))[0]) for seed in range(400)]
  assert 0.68 < np.mean(firsts) < 0.82  # P(second first) = 3/4


def _mixture(seed=0, k=5, n=7):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(k, n)), rng.uniform(0.05, 1.0, size=(k, n))


def test_regression_acquisitions_on_the_members_mixture_match_monte_carlo():
  means, variances = _mixture()
  outputs = (jnp.asarray(means), jnp.asarray(variances))
  rng = np.random.default_rng(1)
  member = rng.integers(0, means.shape[0], (200000, means.shape[1]))
  draws = np.take_along_axis(means, member, 0) + np.sqrt(np.take_along_axis(variances, member, 0)) * rng.normal(
      size=member.shape)
  best = 0.3
  np.testing.assert_allclose(acquire.expected_improvement(outputs, best), np.maximum(draws - best, 0).mean(0),
                             atol=6e-3)
  np.testing.assert_allclose(acquire.probability_of_improvement(outputs, best), (draws > best).mean(0), atol=6e-3)
  mixture_std = np.sqrt(variances.mean(0) + means.var(0))
  np.testing.assert_allclose(acquire.upper_confidence_bound(outputs, beta=2.0), means.mean(0) + 2 * mixture_std,
                             rtol=1e-5)
  np.testing.assert_allclose(acquire.epistemic_std(outputs), means.std(0), rtol=1e-5)
  sampled = np.asarray(acquire.thompson(outputs, jax.random.key(3)))
  assert any(np.allclose(sampled, row) for row in means)
  # Member outputs of one target, (K, N, 1), are read as (K, N).
  np.testing.assert_allclose(acquire.expected_improvement((outputs[0][..., None], outputs[1][..., None]), best),
                             acquire.expected_improvement(outputs, best), rtol=1e-6)


def test_log_expected_improvement_is_its_log_where_ei_is_representable_and_climbable_where_it_underflows():
  means, variances = _mixture()
  outputs = (jnp.asarray(means), jnp.asarray(variances))
  for best in (-1.0, 0.3, 2.0):
    np.testing.assert_allclose(acquire.log_expected_improvement(outputs, best),
                               np.log(acquire.expected_improvement(outputs, best)), rtol=2e-5, atol=2e-5)
  # Far below the best, EI is a flat 0 in float32; its log is finite, close to float64's, and rises toward it.
  far = (jnp.asarray([[-15.0, -20.0, -40.0]]), jnp.ones((1, 3)))
  assert (np.asarray(acquire.expected_improvement(far, 0.0)) == 0.0).all()
  z = np.array([-15.0, -20.0, -40.0])
  with np.errstate(divide='ignore'):  # float64's EI underflows at z = -40 too: its series is taken there
    exact = np.log(np.exp(-0.5 * z ** 2) / math.sqrt(2 * math.pi) + z * 0.5 * np.asarray(
        [math.erfc(-v / math.sqrt(2)) for v in z]))
  exact = np.where(np.isfinite(exact), exact, -0.5 * z ** 2 - 0.5 * math.log(2 * math.pi) - 2 * np.log(-z))
  np.testing.assert_allclose(acquire.log_expected_improvement(far, 0.0), exact, rtol=1e-3)
  gradient = jax.grad(lambda m: acquire.log_expected_improvement((m, far[1]), 0.0).sum())(far[0])
  assert (np.asarray(gradient) > 0).all()


def test_regression_acquisitions_have_gradients_with_respect_to_inputs():
  def outputs(x):  # two members, means and variances smooth in x
    means = jnp.stack([jnp.sin(x).sum(-1), jnp.cos(x).sum(-1)])
    return means, jnp.stack([0.1 + x.sum(-1) ** 2, 0.2 + jnp.ones(x.shape[0])])
  x = jnp.linspace(0.1, 0.9, 8).reshape(4, 2)
  for name, score in acquire.REGRESSION.items():
    grads = jax.jit(jax.grad(lambda x, score=score: score(outputs(x), jax.random.key(0), 0.5).sum()))(x)
    assert np.isfinite(np.asarray(grads)).all(), name


def test_an_unknown_name_is_one_line_that_lists_the_task_s_acquisitions():
  with pytest.raises(UsageError, match=r"acquisition='ei' is not one for a classification ensemble: give one of "
                                       r'bald, entropy'):
    acquire.named('ei', tasks.named('classification'))
  with pytest.raises(UsageError, match='epistemic_std, ucb, ei, pi, thompson, random'):
    acquire.named('bald', tasks.named('regression'))


def test_every_function_takes_numpy_arrays_as_member_outputs_gives_them():
  """`ens.member_outputs(x)` is numpy: each function answers for it as for the JAX array, batch_bald's scan too."""
  log_probs = np.asarray(_duplicated_pool(), np.float64)
  key = jax.random.key(3)
  for name in ('bald', 'entropy', 'variation_ratios', 'margin'):
    function = getattr(acquire, name)
    np.testing.assert_allclose(function(log_probs), function(jnp.asarray(log_probs)), rtol=1e-6, err_msg=name)
  np.testing.assert_array_equal(acquire.batch_bald(log_probs, 3, key), acquire.batch_bald(jnp.asarray(log_probs), 3,
                                                                                          key))
  scores = np.asarray(acquire.bald(log_probs))
  np.testing.assert_array_equal(acquire.stochastic(scores, 2, key), acquire.stochastic(jnp.asarray(scores), 2, key))
  np.testing.assert_array_equal(acquire.top(scores, 2), acquire.top(jnp.asarray(scores), 2))
  mixture = _mixture()
  traced = tuple(jnp.asarray(a, jnp.float32) for a in mixture)
  for function in (acquire.epistemic_std, acquire.upper_confidence_bound, lambda o: acquire.thompson(o, key),
                   lambda o: acquire.expected_improvement(o, 0.5),
                   lambda o: acquire.probability_of_improvement(o, 0.5)):
    np.testing.assert_allclose(function(mixture), function(traced), rtol=1e-5)
  jax.jit(lambda o: acquire.thompson(o, key))(traced)  # and traced, under jit
