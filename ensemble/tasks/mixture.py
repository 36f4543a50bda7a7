"""The uniform mixture of Gaussians that a regression ensemble predicts, on the host in float64: its moments, exact
density, CDF, quantiles and intervals, CRPS, variance scaling, split-conformal intervals and the report's numbers.

`means` and `variances` are (M, N, D): M components, N inputs, D targets; each target's marginal is a
one-dimensional mixture. What `predictive` uses also runs traced (xp=jnp), so that `ensemble.export`'s artifact
returns what `Ensemble.predict` does.
"""

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import jax.scipy.special
import numpy as np
import scipy.special  # ndtr and ndtri are the standard normal's CDF and quantile; scipy.stats takes 0.6 s to import

from ensemble import console
from ensemble.errors import UsageError
from ensemble.uncertainty import conformal

# The central intervals that predict returns and evaluate scores.
LEVELS = (0.5, 0.8, 0.9, 0.95)
# The report's: the expected coverages of the calibration plot, and the shares of inputs kept by std.
PLOT_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
SELECTIVE_COVERAGES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
_LOG_2PI = float(np.log(2 * np.pi))
_SQRT_2PI = float(np.sqrt(2 * np.pi))

def _special(xp):
  """The standard normal's CDF (`ndtr`) and quantile (`ndtri`) for numpy or traced arrays."""
  return jax.scipy.special if xp is jnp else scipy.special


def mixture_moments(means: np.ndarray, variances: np.ndarray) -> dict[str, np.ndarray]:
  """'mean', 'variance' = 'aleatoric' + 'epistemic' and 'std', each (N, D): the law of total variance.

  numpy or jax arrays alike (`ensemble.export` traces it).
  """
  mean = means.mean(0)
  aleatoric = variances.mean(0)
  epistemic = ((means - mean) ** 2).mean(0)
  variance = aleatoric + epistemic
  return {'mean': mean, 'variance': variance, 'std': variance ** 0.5, 'aleatoric': aleatoric,
          'epistemic': epistemic}


def mixture_log_density(means: np.ndarray, variances: np.ndarray, y: np.ndarray) -> np.ndarray:
  """(N,) log p(y) of the D-dimensional mixture of diagonal Gaussians: log mean_m prod_d N(y_d; mu_md, s_md^2)."""
  component = -0.5 * (_LOG_2PI + np.log(variances) + (y - means) ** 2 / variances).sum(-1)
  return scipy.special.logsumexp(component, axis=0) - np.log(len(means))


def mixture_cdf(means: np.ndarray, variances: np.ndarray, x: np.ndarray, xp=np) -> np.ndarray:
  """(N, D) P(Y_d <= x_d) of each target's mixture marginal."""
  return _special(xp).ndtr((x - means) / xp.sqrt(variances)).mean(0)


def _quantile_step(x, low, high, means, scales, q, xp):
  """One safeguarded Newton step towards cdf(x) = q: (low, high, x) narrowed. `means` and `scales` hold the
  components on their first axis and broadcast against `x` on the rest."""
  z = (x - means) / scales
  excess = _special(xp).ndtr(z).mean(0) - q
  density = (xp.exp(-0.5 * z ** 2) / scales).mean(0) / _SQRT_2PI
  low, high = xp.where(excess < 0, x, low), xp.where(excess < 0, high, x)
  newton = x - excess / xp.maximum(density, xp.finfo(x.dtype).tiny)
  return low, high, xp.where((newton > low) & (newton < high), newton, 0.5 * (low + high))


def mixture_quantile(means: np.ndarray, variances: np.ndarray, q, iterations: int = 100, xp=np) -> np.ndarray:
  """(N, D) the q-quantile of each target's mixture marginal, the root of cdf(x) = q; for a sequence of L levels
  `q`, (L, N, D), all found together.

  The mixture's CDF is continuous and increasing, and its q-quantile lies
  between the smallest and the largest of the components' q-quantiles (at the
  one, every component's CDF is at most q; at the other, at least q). Each
  step narrows that bracket at the current point and takes Newton's step
  (the mixture's density is the CDF's derivative), or halves the bracket where
  Newton's would leave it (in a gap between components): most quantiles reach
  float64's resolution in a few steps, the others at bisection's pace. On the
  host, each quantile stops once it moves by no more than a few units of that
  resolution, and the steps go on for the others only; traced (xp=jnp), the
  steps are one `fori_loop` of `iterations`, so the program stays small.
  """
  levels = xp.asarray(q, dtype=means.dtype).reshape(-1, 1, 1)  # (L, 1, 1) against (N, D)
  scales = xp.sqrt(variances)
  components = means + scales * _special(xp).ndtri(levels[:, None])  # each component's quantiles, (L, M, N, D)
  low, high = components.min(1), components.max(1)
  x = 0.5 * (low + high)
  if xp is jnp:
    step = lambda _, c: _quantile_step(c[2], c[0], c[1], means[:, None], scales[:, None], levels, xp)
    x = jax.lax.fori_loop(0, iterations, step, (low, high, x))[2]
  else:
    shape, columns = x.shape, means[0].size
    low, high, x = low.ravel(), high.ravel(), x.ravel()
    means, scales = means.reshape(len(means), -1), scales.reshape(len(scales), -1)  # (M, N D)
    resolution = np.tile(16 * np.finfo(x.dtype).eps * (np.abs(means).max(0) + scales.max(0)), len(levels))
    column, level = np.tile(np.arange(columns), len(levels)), np.repeat(levels.ravel(), columns)
    active = np.arange(x.size)
    for _ in range(iterations):
      c = column[active]
      low[active], high[active], stepped = _quantile_step(x[active], low[active], high[active], means[:, c],
                                                          scales[:, c], level[active], xp)
      moved = np.abs(stepped - x[active]) > resolution[active]
      x[active] = stepped
      active = active[moved]
      if not active.size:
        break
    x = x.reshape(shape)
  return x if np.ndim(q) else x[0]


def mixture_interval(means: np.ndarray, variances: np.ndarray, level: float,
                     xp=np) -> tuple[np.ndarray, np.ndarray]:
  """The central interval holding `level` of each target's mixture: its (1-level)/2 and (1+level)/2 quantiles."""
  low, high = mixture_quantile(means, variances, [(1 - level) / 2, (1 + level) / 2], xp=xp)
  return low, high


def level_name(level: float) -> str:
  """How an interval's level names it in `predictive`'s keys: its percent, with the decimals it needs (0.9 is
  '90', 0.904 '90.4')."""
  return f'{round(100 * level, 6):g}'


def checked_levels(levels) -> tuple[float, ...]:
  """`levels` as a tuple of interval levels, each a probability in (0, 1), each named apart from the others
  (`level_name`); anything else is one UsageError."""
  if isinstance(levels, (str, bytes)) or not hasattr(levels, '__iter__'):
    raise UsageError(f'levels={levels!r} must be a sequence of probabilities in (0, 1), e.g. (0.5, 0.9), or () for '
                     'none')
  levels = tuple(levels)
  for level in levels:
    if isinstance(level, bool) or not isinstance(level, (int, float, np.floating, np.integer)) or not 0 < level < 1:
      percent = isinstance(level, (int, float)) and 1 < level < 100
      hint = f' (for a {level:g}% interval give {level / 100:g})' if percent else ''
      raise UsageError(f'levels={levels!r}: each level is the probability an interval holds, in (0, 1), not '
                       f'{level!r}{hint}')
  names = [level_name(level) for level in levels]
  if len(set(names)) != len(names):
    raise UsageError(f'levels={levels!r} names an interval twice ({sorted(n for n in names if names.count(n) > 1)[0]}%'
                     '); give each level once')
  return tuple(float(level) for level in levels)


def predictive(means: np.ndarray, variances: np.ndarray, levels: Sequence[float] = LEVELS,
               xp=np) -> dict[str, np.ndarray]:
  """What a regression ensemble predicts per input, (N, D) each: `mixture_moments` and the central intervals
  'lower_P', 'upper_P' holding P% of the mixture at each of `levels` (P as `level_name` writes it), bisected
  together. `Ensemble.predict` and `ensemble.export` both return this, so a served artifact's intervals are
  predict's."""
  result = mixture_moments(means, variances)
  if not levels:
    return result
  bounds = [p for level in levels for p in ((1 - level) / 2, (1 + level) / 2)]
  quantiles = mixture_quantile(means, variances, bounds, xp=xp)
  for i, level in enumerate(levels):
    name = level_name(level)
    result[f'lower_{name}'], result[f'upper_{name}'] = quantiles[2 * i], quantiles[2 * i + 1]
  return result


def _crps_term(mu: np.ndarray, variance: np.ndarray) -> np.ndarray:
  """E|X| for X ~ N(mu, variance): 2 s phi(mu/s) + mu (2 Phi(mu/s) - 1), s = sqrt(variance)."""
  s = np.sqrt(variance)
  z = mu / s
  return 2 * s * np.exp(-0.5 * z ** 2 - 0.5 * _LOG_2PI) + mu * (2 * scipy.special.ndtr(z) - 1)


def mixture_crps(means: np.ndarray, variances: np.ndarray, y: np.ndarray) -> np.ndarray:
  """(N, D) CRPS of each target's mixture marginal at y, in closed form (Grimit et al. 2006):

    CRPS = E|X - y| - E|X - X'| / 2
         = 1/M sum_m A(y - mu_m, s_m^2) - 1/(2 M^2) sum_m,n A(mu_m - mu_n, s_m^2 + s_n^2),  A(mu, v) = E|N(mu, v)|.

  Lower is better; for a point forecast it is the absolute error.
  """
  first = _crps_term(y - means, variances).mean(0)
  pairs = _crps_term(means[:, None] - means[None], variances[:, None] + variances[None])
  return first - 0.5 * pairs.mean((0, 1))


def score(means: np.ndarray, variances: np.ndarray, y: np.ndarray, levels: Sequence[float] = LEVELS) -> dict:
  """RMSE, NLL (nats per input, exact mixture density), CRPS (mean over targets) and the coverage of the central
  intervals at `levels`, of the mixture of the (M, N, D) components at targets y (N, D)."""
  mean = means.mean(0)
  result = {'rmse': float(np.sqrt(((mean - y) ** 2).mean())),
            'nll': float(-mixture_log_density(means, variances, y).mean()),
            'crps': float(mixture_crps(means, variances, y).mean())}
  for level in levels:
    low, high = mixture_interval(means, variances, level)
    result[f'coverage_{level_name(level)}'] = float(((low <= y) & (y <= high)).mean())
  return result


def scale_variances(means: np.ndarray, variances: np.ndarray, y: np.ndarray) -> float:
  """The factor s that minimises the mixture's NLL of y when every component's variance becomes s * variance:
  regression's temperature, fitted on a held-out slice. A one-dimensional, smooth problem in log s, bounded to
  [e^-8, e^8]."""
  import scipy.optimize  # pylint: disable=g-import-not-at-top
  nll = lambda log_s: -mixture_log_density(means, variances * np.exp(log_s), y).mean()
  return float(np.exp(scipy.optimize.minimize_scalar(nll, bounds=(-8.0, 8.0), method='bounded').x))


def conformal_quantile(mean: np.ndarray, std: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
  """(D,) q of split-conformal intervals mean +/- q std normalised by the predicted std (Lei et al. 2018),
  calibrated on n held-out examples: q is the ceil((n + 1)(1 - alpha))-th smallest of the scores |y - mean| / std.

  For a test point exchangeable with them, P(y in mean +/- q std) >= 1 - alpha, whatever the model (and at most
  1 - alpha + 1/(n + 1) without ties). Infinite when n < 1/alpha - 1: too few examples to promise it.
  """
  scores = np.sort(np.abs(y - mean) / std, axis=0)
  n = len(scores)
  rank = int(np.ceil((n + 1) * (1 - alpha)))
  return np.full(scores.shape[1:], np.inf) if rank > n else scores[rank - 1]


def conformal_interval(mean: np.ndarray, std: np.ndarray, quantile: Any, xp=np) -> tuple[np.ndarray, np.ndarray]:
  """(lower, upper): the conformal interval mean +/- q std, q per target (`conformal_quantile`'s); traced with
  `xp=jnp` for `ensemble.export`."""
  half = xp.asarray(quantile) * std
  return mean - half, mean + half


def selective_rmse(mean: np.ndarray, std: np.ndarray, y: np.ndarray, coverages: Sequence[float]) -> list[dict]:
  """RMSE of the `coverage` share of inputs with the smallest predicted std (mean over targets), per coverage:
  how much the error drops when the least certain predictions are left to a person."""
  order = np.argsort(std.mean(-1), kind='stable')
  rows = []
  for coverage in coverages:
    kept = order[:max(1, int(round(coverage * len(order))))]
    rows.append({'coverage': float(coverage), 'rmse': float(np.sqrt(((mean[kept] - y[kept]) ** 2).mean()))})
  return rows


def member_components(means: np.ndarray, variances: np.ndarray, size: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Each member's (means, variances) of a mixture's (K M, N, D) components: its M (a snapshot member's M
  snapshots, else one)."""
  per_member = len(means) // size
  return [(means[k * per_member:(k + 1) * per_member], variances[k * per_member:(k + 1) * per_member])
          for k in range(size)]


def _coverages(means, variances, y, levels) -> list[float]:
  covered = []
  for level in levels:
    low, high = mixture_interval(means, variances, level)
    covered.append(float(((low <= y) & (y <= high)).mean()))
  return covered


def report(test: tuple[np.ndarray, np.ndarray, np.ndarray],
                     heldout: tuple[np.ndarray, np.ndarray, np.ndarray] | None, size: int, alphas: Sequence[float],
                     seen_in_training: bool) -> dict[str, Any]:
  """A regression ensemble's report numbers from the components (means, variances (K M, N, D)) and targets (N, D)
  of the test split and (for the variance scale and the conformal intervals) of the held-out examples."""
  means, variances, y = test
  members = member_components(means, variances, size)
  with console.stage('test scores'):
    member_scores = [score(m, v, y) for m, v in members]
    results = {'ensemble': score(means, variances, y), 'members': member_scores,
               'mean_member': {key: float(np.mean([s[key] for s in member_scores])) for key in member_scores[0]}}
    results['calibration'] = {
        'expected': list(PLOT_LEVELS), 'ensemble': _coverages(means, variances, y, PLOT_LEVELS),
        'mean_member': list(np.mean([_coverages(m, v, y, PLOT_LEVELS) for m, v in members], axis=0))}
  test_moments = mixture_moments(means, variances)
  with console.stage('selective'):
    results['selective'] = selective_rmse(test_moments['mean'], test_moments['std'], y, SELECTIVE_COVERAGES)
  if heldout is None:
    return results
  held_means, held_variances, held_y = heldout
  with console.stage('variance scale'):
    scale = scale_variances(held_means, held_variances, held_y)
    results['variance_scaling'] = {'scale': scale, 'heldout_examples': len(held_y),
                                   'seen_in_training': seen_in_training, 'before': results['ensemble'],
                                   'after': score(means, variances * scale, y)}
  held_moments = mixture_moments(held_means, held_variances)
  rows = []
  with console.stage('conformal'):
    for alpha in alphas:
      q = conformal_quantile(held_moments['mean'], held_moments['std'], held_y, alpha)
      half = q * test_moments['std']
      covered = np.abs(y - test_moments['mean']) <= half
      bounds = list(conformal.coverage_bounds(len(held_y), covered.size, alpha))
      rows.append({'alpha': alpha, 'quantile': [float(v) for v in q], 'coverage': float(covered.mean()),
                   'bounds': bounds, 'within_bounds': bounds[0] <= float(covered.mean()) <= bounds[1],
                   'mean_width': float((2 * half).mean())})
  results['conformal'] = {'calibration_examples': len(held_y), 'seen_in_training': seen_in_training, 'rows': rows}
  return results
