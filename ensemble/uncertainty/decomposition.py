"""Per example: how uncertain the ensemble is, and how much of it the members' disagreement accounts for.

For the members' probabilities p_k (K, N, C), the total predictive entropy
H[mean_k p_k] splits exactly into the expected member entropy E_k H[p_k] (the
aleatoric part: what every member finds ambiguous, which more data would not
remove) and the rest, the mutual information between the prediction and the
choice of member (the epistemic part: what the members disagree on, large far
from the training data). Depeweg et al. (2018); all in nats, float64.
"""

import math

import numpy as np


def entropy(probs: np.ndarray, xp=np) -> np.ndarray:
  """-sum_c p_c log p_c over the last axis, with 0 log 0 = 0: one value per row of `probs` (traced with `xp=jnp`
  for `ensemble.export`)."""
  if xp is np:
    probs = np.asarray(probs, np.float64)
  return -xp.sum(probs * xp.log(xp.where(probs > 0, probs, 1.0)), axis=-1)


def disagreement(member_probs: np.ndarray) -> np.ndarray:
  """(N,): the share of the K(K-1)/2 pairs of members whose top classes differ; 0 for a single member. Members'
  probabilities (K, N, ..., C) per position give it per position, (N, ...).

  Counted from the votes: the pairs that agree are those within each class's
  n_c votes, sum_c n_c (n_c - 1) / 2.
  """
  k, shape, num_classes = member_probs.shape[0], member_probs.shape[1:-1], member_probs.shape[-1]
  if k < 2:
    return np.zeros(shape)
  n = math.prod(shape)
  votes = np.zeros((n, num_classes))
  np.add.at(votes, (np.arange(n)[None, :], np.argmax(member_probs.reshape(k, n, num_classes), -1)), 1.0)
  agreeing_pairs = np.sum(votes * (votes - 1) / 2, axis=-1)
  return (1.0 - agreeing_pairs / (k * (k - 1) / 2)).reshape(shape)


def decompose(member_probs: np.ndarray) -> dict[str, np.ndarray]:
  """From (K, N, C) member probabilities: per example 'entropy' (total), 'aleatoric', 'mutual_information'
  (epistemic, total - aleatoric) and 'disagreement'.

  The mutual information is non-negative (entropy is concave); rounding can
  leave a few ulps below zero, which are clipped so that it reads as a quantity.
  """
  member_probs = np.asarray(member_probs, np.float64)
  total = entropy(member_probs.mean(0))
  aleatoric = entropy(member_probs).mean(0)
  return {'entropy': total, 'aleatoric': aleatoric, 'mutual_information': np.maximum(total - aleatoric, 0.0),
          'disagreement': disagreement(member_probs)}
