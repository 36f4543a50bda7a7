"""Scores for a multi-label ensemble: L labels of 0/1 per example, one sigmoid probability per label and member.

`probs` is (N, L), the probability that each label is 1 (the ensemble's is the
mean of its members'), and `labels` is (N, L) of 0/1 (or booleans). Each label
is a two-class problem with probabilities [1 - p, p], so where the multi-class
code (`ensemble.calibration`, `decomposition`, `conformal`, `ood`) already says
what a score is, it is applied to that pair rather than written again; the
per-label results are (L,) arrays, and `scores` averages them over the labels.
Plain numpy on the host, in float64, unless a function takes `xp` (traced with
`xp=jnp` for `ensemble.export`).
"""

import numpy as np

from ensemble import calibration
from ensemble.errors import UsageError
from ensemble.uncertainty import conformal, decomposition, ood

_TINY = np.finfo(np.float64).tiny  # as calibration.nll: a zero-probability label costs ~708 nats, not inf


def _two_class(p, xp=np):
  """(..., 2): [p(0), p(1)] = [1 - p, p], the label as the multi-class code sees it."""
  return xp.stack([1.0 - p, p], axis=-1)


def _host(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """float64 probabilities and boolean labels (True where the label is 1), whatever the labels' dtype."""
  return np.asarray(probs, np.float64), np.asarray(labels) == 1


def sigmoid(logits: np.ndarray) -> np.ndarray:
  """float64 probabilities from logits, without overflow at either end."""
  logits = np.asarray(logits, np.float64)
  return np.exp(-np.logaddexp(0.0, -logits))


def binary_entropy(p: np.ndarray, xp=np) -> np.ndarray:
  """Elementwise entropy in nats of Bernoulli(p), 0 at p = 0 and p = 1 (decomposition's 0 log 0 = 0)."""
  if xp is np:
    p = np.asarray(p, np.float64)
  return decomposition.entropy(_two_class(p, xp), xp=xp)


def decompose(member_probs: np.ndarray) -> dict[str, np.ndarray]:
  """From (K, N, L) member probabilities, per example and label: 'entropy' (total: of the mean), 'aleatoric' (the
  members' mean entropy) and 'mutual_information' (epistemic: their difference, between the label and the choice
  of member); the names `Ensemble.predict` gives a classifier's.

  The split is decomposition.decompose's, label by label: a label the members
  all find ambiguous is aleatoric, one they contradict each other on is
  epistemic. Rounding can leave the difference a few ulps below zero; it is clipped.
  """
  member_probs = np.asarray(member_probs, np.float64)
  total = binary_entropy(member_probs.mean(0))
  aleatoric = binary_entropy(member_probs).mean(0)
  return {'entropy': total, 'aleatoric': aleatoric, 'mutual_information': np.maximum(total - aleatoric, 0.0)}


def nll(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """(L,): the mean binary negative log-likelihood of each label, probabilities clipped at float tiny as
  calibration.nll does, so one confident mistake costs ~708 nats and not inf."""
  probs, positive = _host(probs, labels)
  label_probs = np.where(positive, probs, 1.0 - probs)
  return -np.mean(np.log(np.maximum(label_probs, _TINY)), axis=0)


def ensemble_nll(member_logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """(L,): the NLL of the mean of the members' probabilities, from their sigmoid logits, (K, N, L).

  Taken from logits, not probabilities: sigmoid(z) is 0 in float64 below
  z = -745 and 1 above z = 37, where `nll` can only clip, while log p(y) =
  -softplus(-z) for y = 1 and -softplus(z) for y = 0 is exact; averaged over
  members in log space (calibration.log_mean_exp) a confident mistake costs
  what it costs, as in calibration.ensemble_nll. K = 1 gives one member's NLL.
  """
  member_logits = np.asarray(member_logits, np.float64)
  sign = np.where(np.asarray(labels) == 1, 1.0, -1.0)
  label_log_probs = -np.logaddexp(0.0, -sign * member_logits)
  return -np.mean(calibration.log_mean_exp(label_log_probs, axis=0), axis=0)


def brier(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """(L,): the mean of (p - y)^2, a bounded proper score in [0, 1]; calibration.brier on the pair [1 - p, p]
  counts the same error twice, so it is half that."""
  probs, positive = _host(probs, labels)
  return np.mean((probs - positive) ** 2, axis=0)


def ece(probs: np.ndarray, labels: np.ndarray, num_bins: int = calibration.ECE_BINS) -> np.ndarray:
  """(L,): per label, the binary reliability gap: bins of p (the probability of a 1) against the share of 1s in
  each, weighted by the bin's share of examples.

  Not the top-label variant (max(p, 1 - p) against the share predicted right):
  that folds p and 1 - p together into [1/2, 1], where a label that is rarely 1
  (most p near 0) keeps its probabilities apart on [0, 1] here, and a bin's gap
  says which way it errs. Binned as calibration.reliability bins: it is run on
  the single column p, whose top probability is then p and whose "right" (the
  top class, 0, is the label) is y = 1 when the label passed is 1 - y.
  """
  probs, positive = _host(probs, labels)
  return np.array([calibration.ece(probs[:, [label]], (~positive[:, label]).astype(np.int64), num_bins)
                   for label in range(probs.shape[-1])])


def average_precision(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """(L,): per label, the area under the step-wise precision-recall curve, sum_n (R_n - R_{n-1}) P_n over the
  distinct probabilities as thresholds (tied ones move together), as scikit-learn's average_precision_score.

  A label that is 1 everywhere has precision 1 at every threshold: 1.0. One
  that is never 1 has no recall to speak of and gets 0.0 (scikit-learn's value
  too); any label with a positive scores above 0, so 0.0 marks such a label,
  and `mean_average_precision` leaves it out.
  """
  probs, positive = _host(probs, labels)

  def one_label(p, y):
    if not y.any():
      return 0.0
    if y.all():
      return 1.0
    return ood.aupr(p[~y], p[y])  # ood's positives are the out-of-distribution inputs: here, the 1s

  return np.array([one_label(probs[:, label], positive[:, label]) for label in range(probs.shape[-1])])


def mean_average_precision(probs: np.ndarray, labels: np.ndarray) -> float:
  """The mean of `average_precision` over the labels that are 1 on some example: a label with no positive has no
  precision-recall curve, and counting it as 0 would score the data, not the model."""
  positive = np.asarray(labels) == 1
  has_positive = positive.any(0)
  if not has_positive.any():
    raise UsageError(f'mean average precision needs a label that is 1 on some example; all {positive.shape[-1]} '
                     f'labels are 0 on all {positive.shape[0]} examples: score on data with positive labels')
  return float(np.mean(average_precision(probs, labels)[has_positive]))


def _predicted(probs: np.ndarray, threshold: float) -> np.ndarray:
  """1 where p > threshold: at exactly 0.5 the label reads 0, as argmax over [1 - p, p] breaks the tie."""
  return np.asarray(probs, np.float64) > threshold


def subset_accuracy(probs: np.ndarray, labels: np.ndarray, threshold: float = 0.5) -> float:
  """The share of examples with every label right: exact match, strict in the number of labels."""
  return float(np.mean(np.all(_predicted(probs, threshold) == (np.asarray(labels) == 1), axis=-1)))


def hamming_loss(probs: np.ndarray, labels: np.ndarray, threshold: float = 0.5) -> float:
  """The share of (example, label) pairs predicted wrong: partial credit where subset accuracy gives none."""
  return float(np.mean(_predicted(probs, threshold) != (np.asarray(labels) == 1)))


def scores(probs: np.ndarray, labels: np.ndarray, threshold: float = 0.5) -> dict[str, float | list[float]]:
  """Every score of the ensemble's (N, L) probabilities as JSON-ready floats and per-label lists, with no NaN:
  'nll', 'brier' and 'ece' are means over the labels, 'map' over the labels with a positive (UsageError if none)."""
  per_label = {'nll': nll(probs, labels), 'brier': brier(probs, labels), 'ece': ece(probs, labels)}
  result = {}
  for name, values in per_label.items():
    result[name] = float(np.mean(values))
    result[f'{name}_per_label'] = values.tolist()
  result['average_precision_per_label'] = average_precision(probs, labels).tolist()
  result['map'] = mean_average_precision(probs, labels)
  result['subset_accuracy'] = subset_accuracy(probs, labels, threshold)
  result['hamming_loss'] = hamming_loss(probs, labels, threshold)
  return result


def temperature_scale(probs: np.ndarray, temperature, xp=np) -> np.ndarray:
  """sigmoid(logit(p) / T), T a scalar or one per label, (L,): T > 1 softens towards 1/2, T < 1 sharpens.

  That is calibration.temperature_scale on [1 - p, p] (the softmax of their
  logs over T), which clips both at float tiny, so p = 0 and p = 1 stay finite;
  traced with `xp=jnp`, in the probabilities' own precision.
  """
  if xp is np:
    probs = np.asarray(probs, np.float64)
  per_label = xp.asarray(temperature)[..., None]  # against the pair axis: () -> (1,), (L,) -> (L, 1)
  return calibration.temperature_scale(_two_class(probs, xp), per_label, xp=xp)[..., 1]


def fit_temperature(probs: np.ndarray, labels: np.ndarray, per_label: bool = False):
  """The temperature in [1/20, 20] minimising the mean binary NLL of `temperature_scale(probs, T)`: one float,
  or an (L,) array fitted label by label when `per_label`.

  The binary NLL is the two-class NLL of [1 - p, p], so this is
  calibration.fit_temperature (a bounded search over log T) on those pairs:
  over all N * L of them for one T (each label weighs N examples either way),
  or on each label's N for one T per label.
  """
  probs, positive = _host(probs, labels)
  pairs, classes = _two_class(probs), positive.astype(np.int64)
  if not per_label:
    return calibration.fit_temperature(pairs.reshape(-1, 2), classes.reshape(-1))
  return np.array([calibration.fit_temperature(pairs[:, label], classes[:, label])
                   for label in range(probs.shape[-1])])


def label_scores(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """(N, L): the nonconformity of each label's true value, 1 - p(y), conformal's 'thr' score on [1 - p, p]."""
  probs, positive = _host(probs, labels)
  return np.where(positive, 1.0 - probs, probs)


def calibrated_quantiles(probs: np.ndarray, labels: np.ndarray, alpha: float) -> np.ndarray:
  """(L,): each label's split-conformal threshold at miscoverage `alpha` (conformal.quantile over its N
  calibration scores), so each label's sets hold its true value with probability at least 1 - alpha, label by
  label; not all L at once, which would need alpha / L per label. inf where N is too small for `alpha`."""
  calibration_scores = label_scores(probs, labels)
  return np.array([conformal.quantile(calibration_scores[:, label], alpha)
                   for label in range(calibration_scores.shape[-1])])


def class_conditional_quantiles(probs: np.ndarray, labels: np.ndarray, alpha: float
                                ) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
  """(quantiles (L, 2), examples (L, 2), pooled [[label, value], ...]): a threshold per label and value, of the
  examples whose label has that value (`conformal.group_quantiles`), so that a label's rare value is covered at
  1 - alpha too; a value with too few examples gets its label's quantile over all of them."""
  calibration_scores, positive = label_scores(probs, labels), _host(probs, labels)[1]
  per_label = [conformal.group_quantiles(calibration_scores[:, label], positive[:, label].astype(int), 2, alpha)
               for label in range(calibration_scores.shape[-1])]
  return (np.array([q for q, _, _ in per_label]), np.array([n for _, n, _ in per_label]),
          [[label, value] for label, (_, _, pooled) in enumerate(per_label) for value in pooled])


def prediction_sets(probs: np.ndarray, quantiles: np.ndarray, xp=np) -> np.ndarray:
  """(N, L, 2) boolean: value v (0 or 1) is in label l's set when 1 - p(v) <= quantiles[l] (quantiles (L,)), or
  quantiles[l, v] (class-conditional quantiles (L, 2)).

  The two scores sum to 1, so a threshold of 1/2 or more never leaves a set
  empty; below 1/2 (alpha large, the model sure) an example with p near 1/2
  gets an empty set, as conformal's 'thr' sets can. Traced with `xp=jnp`.
  """
  if xp is np:
    probs = np.asarray(probs, np.float64)
  quantiles = xp.asarray(quantiles)
  return conformal.prediction_sets(_two_class(probs, xp), quantiles if quantiles.ndim == 2 else quantiles[..., None],
                                   'thr', xp=xp)
