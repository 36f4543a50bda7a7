"""How good a classifier's probabilities are: accuracy, NLL, Brier, ECE, entropy, disagreement.

Plain numpy on the host, in float64, on predicted probabilities: `probs` is
(N, C) with rows summing to one and `labels` is (N,) integers. Every function
returns a Python float averaged over the N examples, so members, the ensemble
and a temperature-scaled ensemble are all scored by the same code. The
ensemble's NLL comes from the members' log-probabilities (`ensemble_nll`), as
the trainer computes it (`steps.log_mean_exp`).
"""

import numpy as np

from ensemble.uncertainty import decomposition

ECE_BINS = 15  # Guo et al. (2017) and Ovadia et al. (2019) use 15 equal-width bins.
_TINY = np.finfo(np.float64).tiny  # keeps log(0) finite: a zero-probability label costs ~708 nats


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
  return float(np.mean(np.argmax(probs, -1) == labels))


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
  """Negative log-likelihood of the labels: a proper scoring rule that punishes confident mistakes without bound."""
  label_probs = np.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]
  return float(-np.mean(np.log(np.maximum(label_probs, _TINY))))


def log_mean_exp(log_values: np.ndarray, axis: int = 0) -> np.ndarray:
  """log(mean(exp(log_values))) along `axis`, shifted by the maximum so that nothing underflows to log(0)."""
  peak = np.max(log_values, axis=axis, keepdims=True)
  return np.squeeze(peak + np.log(np.mean(np.exp(log_values - peak), axis=axis, keepdims=True)), axis=axis)


def ensemble_nll(member_log_probs: np.ndarray, labels: np.ndarray) -> float:
  """NLL of the mean of the members' probabilities, from their log-probabilities, (K, N, C).

  exp of a log-probability below -745 is 0 even in float64, and `nll` would
  clip it at 708 nats; in log space a confident mistake costs what it costs,
  as in the trainer's test loss. K = 1 gives one member's NLL.
  """
  label_log_probs = np.take_along_axis(member_log_probs, labels[None, :, None], axis=-1)[..., 0]
  return float(-np.mean(log_mean_exp(label_log_probs.astype(np.float64), axis=0)))


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
  """Squared distance to the one-hot label, summed over classes: a bounded proper score in [0, 2]."""
  one_hot = np.eye(probs.shape[-1])[labels]
  return float(np.mean(np.sum((probs - one_hot) ** 2, axis=-1)))


def reliability(probs: np.ndarray, labels: np.ndarray, num_bins: int = ECE_BINS):
  """Per confidence bin: (count, mean confidence, accuracy); the data of a reliability diagram.

  Confidence is the top probability; bin b holds confidences in (b/num_bins, (b+1)/num_bins].
  Empty bins have NaN confidence and accuracy.
  """
  confidence = probs.max(-1)
  correct = np.argmax(probs, -1) == labels
  bins = np.clip(np.ceil(confidence * num_bins).astype(int) - 1, 0, num_bins - 1)
  counts = np.bincount(bins, minlength=num_bins)
  with np.errstate(invalid='ignore', divide='ignore'):
    mean_confidence = np.bincount(bins, confidence, minlength=num_bins) / counts
    bin_accuracy = np.bincount(bins, correct, minlength=num_bins) / counts
  return counts, mean_confidence, bin_accuracy


def ece(probs: np.ndarray, labels: np.ndarray, num_bins: int = ECE_BINS) -> float:
  """Expected calibration error: the gap |accuracy - confidence| per bin, weighted by the bin's share of examples."""
  counts, mean_confidence, bin_accuracy = reliability(probs, labels, num_bins)
  filled = counts > 0
  return float(np.sum(counts[filled] * np.abs(bin_accuracy[filled] - mean_confidence[filled])) / counts.sum())


def entropy(probs: np.ndarray) -> float:
  """Mean predictive entropy in nats (0 log 0 = 0): how uncertain the predictions are, right or wrong."""
  return float(np.mean(decomposition.entropy(probs)))


def disagreement(member_probs: np.ndarray) -> float:
  """Mean over pairs of members of the share of examples whose top class differs; `member_probs` is (K, N, C)."""
  return float(np.mean(decomposition.disagreement(member_probs)))


def scores(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """The four scores every member and the ensemble get."""
  return {'accuracy': accuracy(probs, labels), 'nll': nll(probs, labels),
          'brier': brier(probs, labels), 'ece': ece(probs, labels)}


def temperature_scale(probs: np.ndarray, temperature: float, xp=np) -> np.ndarray:
  """softmax(log(probs) / T): T > 1 softens, T < 1 sharpens, T = 1 leaves `probs` as they are.

  Applied to the ensemble's mean probabilities, this is temperature scaling
  after averaging (Ashukha et al. 2020), which needs no member logits. Traced
  with `xp=jnp` (`ensemble.export`), in the probabilities' own precision.
  """
  tiny = _TINY if xp is np else np.finfo(probs.dtype).tiny
  logits = xp.log(xp.maximum(probs, tiny)) / temperature
  logits = logits - logits.max(-1, keepdims=True)
  scaled = xp.exp(logits)
  return scaled / scaled.sum(-1, keepdims=True)


def fit_temperature(probs: np.ndarray, labels: np.ndarray) -> float:
  """The temperature in [1/20, 20] that minimises the NLL of `temperature_scale(probs, T)`.

  The NLL is convex in 1/T, so a bounded one-dimensional search (Brent's
  method, over log T) finds the optimum; it is deterministic.
  """
  import scipy.optimize  # pylint: disable=g-import-not-at-top  # 0.5 s to import; only here
  result = scipy.optimize.minimize_scalar(
      lambda log_t: nll(temperature_scale(probs, np.exp(log_t)), labels),
      bounds=(-np.log(20.0), np.log(20.0)), method='bounded', options={'xatol': 1e-6})
  return float(np.exp(result.x))
