"""How far an input lies from the data in the members' feature space: a Gaussian per class on each member's
penultimate-layer features, as deep deterministic uncertainty (DDU, Mukhoti et al. 2023) fits them.

Why: ReLU members extrapolate alike, so far from the data they agree and are confident, and neither the predictive
entropy nor the mutual information sees it (rows 6 standard deviations out scored as the test rows). The features
the last layer reads still move with the input, so a density over them does.

  fitted = fit(features, labels, classes)       # (K, N, F) features of labelled rows, (N,) classes (or None)
  scores = score(fitted['means'], fitted['whitening'], features)   # (N,): higher is farther, in standard deviations

Each member gets one Gaussian per class with a covariance shared by its classes (the within-class scatter pooled
over all of them, as Lee et al. 2018): a class needs rows only for its mean, so a feature width above a class's
rows is no singular matrix (DDU's per-class covariances would need more rows than features in every class). A task
without classes gets one Gaussian. The covariance gets a jitter floor, a share of its mean variance on its
diagonal, so that a feature no training row moves (a ReLU that never fires) does not make the distance infinite.

An input's distance is the Mahalanobis distance to its nearest class mean in a member's features, averaged over
the members: every member's distance is in its own standard deviations, so they are comparable, and the mean is
steadier than the minimum (which the one member that maps an unfamiliar input near the data decides) or the
maximum (one member's outlier). Numpy on the host, or traced with xp=jnp (ensemble.export).
"""

from typing import Any

import numpy as np

from ensemble.errors import UsageError

# A class's Gaussian needs this many rows of it: its mean from one row is that row.
MIN_ROWS_PER_CLASS = 2
# The covariance's diagonal floor, as a share of the mean variance of the features.
JITTER = 1e-4


def fit(features: np.ndarray, labels: np.ndarray | None, classes: int = 1,
        jitter: float = JITTER) -> dict[str, np.ndarray]:
  """{'means': (K, C, F), 'whitening': (K, F, F)} of `features` (K, N, F) grouped by `labels` (N,) in
  0..classes-1, or as one group (labels None): the class means and the inverse of the shared covariance's
  Cholesky factor, so that |whitening (x - mean)| is the Mahalanobis distance."""
  features = np.asarray(features, np.float64)
  k, n, width = features.shape
  classes = 1 if labels is None else classes
  labels = np.zeros(n, np.int64) if labels is None else np.asarray(labels).astype(np.int64)
  counts = np.bincount(labels, minlength=classes)
  if counts.min() < MIN_ROWS_PER_CLASS:
    c = int(np.argmin(counts))
    group = f'class {c} has' if classes > 1 else 'the data have'
    raise UsageError(f'distance: {group} {counts[c]} of the {n} rows given, and a Gaussian needs at least '
                     f'{MIN_ROWS_PER_CLASS} (the covariance is pooled over the classes, the mean is not); give the '
                     'training rows, with every class')
  onehot = np.eye(classes)[labels]  # (N, C)
  means = np.einsum('nc,knf->kcf', onehot, features) / counts[None, :, None]
  centred = features - means[:, labels]
  covariance = np.einsum('knf,kng->kfg', centred, centred) / max(n - classes, 1)
  mean_variance = np.trace(covariance, axis1=1, axis2=2) / width
  floor = jitter * np.where(mean_variance > 0, mean_variance, 1.0)
  covariance = covariance + floor[:, None, None] * np.eye(width)
  whitening = np.linalg.inv(np.linalg.cholesky(covariance))
  return {'means': means, 'whitening': whitening}


def score(means: Any, whitening: Any, features: Any, xp=np) -> Any:
  """(N,): each input's Mahalanobis distance to its nearest class mean in each member's features (K, N, F), under
  `fit`'s Gaussians, averaged over the members."""
  means, whitening = xp.asarray(means, features.dtype), xp.asarray(whitening, features.dtype)
  white = xp.einsum('kgf,knf->kng', whitening, features)  # (K, N, F) in the member's standard deviations
  centres = xp.einsum('kgf,kcf->kcg', whitening, means)  # (K, C, F)
  squared = ((white ** 2).sum(-1)[:, :, None] - 2 * xp.einsum('kng,kcg->knc', white, centres)
             + (centres ** 2).sum(-1)[:, None, :])
  return xp.sqrt(xp.maximum(squared.min(-1), 0.0)).mean(0)
