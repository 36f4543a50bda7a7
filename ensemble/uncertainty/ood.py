"""How well a score tells out-of-distribution inputs from in-distribution ones.

The out-of-distribution inputs are the positives and a higher score means
"more likely out of distribution" (an uncertainty: predictive entropy, mutual
information, or 1 - the top probability). Tied scores are one threshold: the
curves move over all of them at once, so identical scores give an AUROC of 0.5
whatever order the inputs came in. AUROC and AUPR as in Hendrycks and Gimpel
(2017); FPR95 as in Hendrycks et al. (2019): the in-distribution inputs raised
as false alarms when 95% of the out-of-distribution ones are caught.
"""

import numpy as np

TPR = 0.95  # FPR is reported where 95% of the out-of-distribution inputs are caught


def _counts(in_scores: np.ndarray, out_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """True and false positives when flagging every input scoring >= t, for each distinct score t, highest first."""
  scores = np.concatenate([np.asarray(in_scores, np.float64), np.asarray(out_scores, np.float64)])
  if not len(in_scores) or not len(out_scores):
    raise ValueError(f'need in- and out-of-distribution scores, got {len(in_scores)} and {len(out_scores)}')
  is_out = np.concatenate([np.zeros(len(in_scores)), np.ones(len(out_scores))])
  order = np.argsort(-scores, kind='stable')
  scores, is_out = scores[order], is_out[order]
  last_of_each_score = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]
  true_positives = np.cumsum(is_out)[last_of_each_score]
  return true_positives, last_of_each_score + 1 - true_positives


def auroc(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
  """Area under the ROC curve: the chance that an out-of-distribution input outscores an in-distribution one
  (ties count half). 1 separates perfectly, 0.5 is chance."""
  true_positives, false_positives = _counts(in_scores, out_scores)
  tpr = np.r_[0.0, true_positives / len(out_scores)]
  fpr = np.r_[0.0, false_positives / len(in_scores)]
  return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))


def aupr(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
  """Area under the precision-recall curve (average precision), out-of-distribution inputs as positives.

  Chance is the positives' share of all inputs, so it depends on the sets' sizes; AUROC does not.
  """
  true_positives, false_positives = _counts(in_scores, out_scores)
  recall = np.r_[0.0, true_positives / len(out_scores)]
  precision = true_positives / (true_positives + false_positives)
  return float(np.sum(np.diff(recall) * precision))


def fpr_at_tpr(in_scores: np.ndarray, out_scores: np.ndarray, tpr: float = TPR) -> float:
  """The share of in-distribution inputs flagged by the strictest threshold that catches `tpr` of the rest."""
  true_positives, false_positives = _counts(in_scores, out_scores)
  first = np.flatnonzero(true_positives >= tpr * len(out_scores) - 1e-9)[0]
  return float(false_positives[first] / len(in_scores))


def detection(in_scores: np.ndarray, out_scores: np.ndarray) -> dict[str, float]:
  """The three figures a report gives per score: 'auroc', 'aupr' and 'fpr95' (lower is better)."""
  return {'auroc': auroc(in_scores, out_scores), 'aupr': aupr(in_scores, out_scores),
          'fpr95': fpr_at_tpr(in_scores, out_scores)}
