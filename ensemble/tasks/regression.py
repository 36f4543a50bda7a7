"""Regression: each member predicts a Gaussian per target; the ensemble is the uniform mixture of the members'.

A member's model gives 2 D numbers per input for D targets: D means mu and D
raw scales r, and its predictive variance is softplus(r) + VARIANCE_FLOOR, so
any model of the Python API can be a regression member. The member works in
standardised units (targets minus the training split's mean, over its
standard deviation: `target_mean`, `target_std`, kept in the checkpoint);
predictions and scores are in the original units.

The ensemble of M Gaussians N(mu_m, s_m^2) (Lakshminarayanan et al. 2017) is
their uniform mixture p(y) = 1/M sum_m N(y; mu_m, s_m^2), with

  mean      mu*  = 1/M sum_m mu_m
  variance  s*^2 = 1/M sum_m s_m^2  +  1/M sum_m (mu_m - mu*)^2
                   aleatoric (mean of the variances) + epistemic (variance of the means)

Its intervals, NLL and CRPS come from the mixture itself, not from a Gaussian
with those two moments. A snapshot member contributes each of its snapshots as
a component.
"""

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import jax.scipy.special
import numpy as np
import scipy.special  # ndtr and ndtri are the standard normal's CDF and quantile; scipy.stats takes 0.6 s to import

from ensemble.errors import UsageError

AxisName = str | Sequence[str]
Metrics = dict[str, jnp.ndarray]

LOSSES = ('nll', 'beta_nll', 'mse')
# The smallest variance a member predicts, in standardised units: keeps the NLL finite when a member is sure.
VARIANCE_FLOOR = 1e-6
# The central intervals that predict returns and evaluate scores.
LEVELS = (0.5, 0.8, 0.9, 0.95)
_LOG_2PI = float(np.log(2 * np.pi))
_SQRT_2PI = float(np.sqrt(2 * np.pi))


def split_outputs(outputs, targets: int, xp=jnp):
  """Raw outputs (..., N, M 2 D) -> (means, variances), each (..., M, N, D), standardised units.

  Per component, D means then D raw scales; the variance is softplus(raw) + VARIANCE_FLOOR.
  """
  shape = outputs.shape
  parts = xp.reshape(outputs, (*shape[:-1], shape[-1] // (2 * targets), 2, targets))  # M known for N = 0 too
  parts = xp.moveaxis(parts, -3, -4)  # (..., M, N, 2, D)
  softplus = jax.nn.softplus if xp is jnp else lambda x: np.logaddexp(0.0, x)
  return parts[..., 0, :], softplus(parts[..., 1, :]) + VARIANCE_FLOOR


def gaussian_nll(mean, variance, y):
  """Per-target NLL of y under N(mean, variance): (log(2 pi variance) + (y - mean)^2 / variance) / 2."""
  return 0.5 * (_LOG_2PI + jnp.log(variance) + (y - mean) ** 2 / variance)


@dataclasses.dataclass(frozen=True)
class Regression:
  """A mean and a variance per target, trained by `loss`:

    nll       the Gaussian NLL, sum_d (log s_d^2 + (y_d - mu_d)^2 / s_d^2) / 2 (+ const)
    beta_nll  the NLL of each target weighted by stop_gradient(s_d^2)^beta (Seitzer et al. 2022): beta = 0 is
              the NLL, beta = 1 gives the mean the gradient of the squared error; 0.5 is the paper's choice
    mse       sum_d (y_d - mu_d)^2 / 2 for the mean; the variance head is not trained and a member's variance
              stays at its initial value, so the ensemble's spread is mostly its members' disagreement
  """
  loss_name: str = 'nll'
  beta: float = 0.5
  target_mean: tuple[float, ...] = (0.0,)
  target_std: tuple[float, ...] = (1.0,)
  name: str = 'regression'

  @property
  def targets(self) -> int:
    return len(self.target_std)

  def standardise(self, y: np.ndarray) -> np.ndarray:
    return ((y - np.asarray(self.target_mean)) / np.asarray(self.target_std)).astype(np.float32)

  def member_output(self, outputs: jnp.ndarray) -> jnp.ndarray:
    """What prediction takes from a member: its raw outputs (`components` reads them on the host)."""
    return outputs

  def loss(self, outputs: jnp.ndarray, labels: jnp.ndarray) -> tuple[jnp.ndarray, Metrics]:
    """(the batch's mean loss, the step's metrics); `labels` are standardised targets (N, D). The metrics hold the
    loss trained and, whichever it is, the Gaussian NLL ('nll', standardised units), which the summary reports in
    the targets' units beside the test set's."""
    mean, variance = split_outputs(outputs, self.targets)
    mean, variance = mean[0], variance[0]
    nll = gaussian_nll(mean, variance, labels)
    if self.loss_name == 'mse':
      per_target = 0.5 * (labels - mean) ** 2
    elif self.loss_name == 'beta_nll':
      per_target = nll * jax.lax.stop_gradient(variance) ** self.beta
    else:
      per_target = nll
    loss = per_target.sum(-1).mean()
    return loss, {'loss': loss, 'nll': nll.sum(-1).mean()}

  def eval_outputs(self, outputs: jnp.ndarray, labels: jnp.ndarray, *, axis_name: AxisName) -> Metrics:
    """Per input: the member's and the mixture's NLL (exact mixture density) and squared error per target, all in
    standardised units (`labels` standardised): the programs do not change with the data's statistics, and
    `in_data_units` converts on the host.

    A member with several components (snapshots) is their mixture; the
    ensemble's log-density is log mean_k p_k(y), computed in log space over the
    members (`classification.log_mean_exp`).
    """
    from ensemble.tasks import classification  # pylint: disable=g-import-not-at-top
    means, variances = split_outputs(outputs, self.targets)  # (M, N, D)
    component = -gaussian_nll(means, variances, labels).sum(-1)  # (M, N)
    member_log_density = jax.nn.logsumexp(component, axis=0) - jnp.log(component.shape[0])
    member_mean = means.mean(0)
    ensemble_mean = jax.lax.pmean(member_mean, axis_name)
    return {
        'member_loss': -member_log_density,
        'member_squared_error': (member_mean - labels) ** 2,
        'ensemble_loss': -classification.log_mean_exp(member_log_density, axis_name),
        'ensemble_squared_error': (ensemble_mean - labels) ** 2,
    }

  @property
  def log_jacobian(self) -> float:
    """log prod_d std_d: a density in the targets' units is the standardised one divided by prod_d std_d, so an NLL
    in their units is the standardised NLL plus this."""
    return float(np.log(np.asarray(self.target_std, np.float64)).sum())

  @property
  def reported_loss(self) -> tuple[str, float]:
    """What the progress bar shows as the running loss: the NLL in the targets' units, as the summary reports it."""
    return 'nll', self.log_jacobian

  def in_data_units(self, outputs: dict) -> dict:
    """The test pass's outputs (standardised, `eval_outputs`) in the targets' units: NLLs shifted by the log-Jacobian,
    squared errors per target scaled by the target's variance and averaged over the targets."""
    variance = np.asarray(self.target_std, np.float64) ** 2
    converted = {}
    for name, values in outputs.items():
      values = np.asarray(values, np.float64)
      converted[name] = (values * variance).mean(-1) if name.endswith('squared_error') else values + self.log_jacobian
    return converted

  def combine_snapshots(self, outputs: jnp.ndarray, count: jnp.ndarray, current: jnp.ndarray) -> jnp.ndarray:
    """The C snapshots' outputs (C, N, 2D) side by side, (N, C 2D): each a mixture component.

    Slots not yet filled (before the last cycle ends) hold the current
    parameters' outputs, so an epoch's test score during training is that of
    the kept snapshots and the current network; after training all C are kept.
    """
    cycles = outputs.shape[0]
    kept = (jnp.arange(cycles) < count)[:, None, None]
    outputs = jnp.where(kept, outputs, current[None])
    return jnp.moveaxis(outputs, 0, 1).reshape(outputs.shape[1], -1)

  def summary(self, train, test=None) -> dict[str, float]:
    """The task's part of metrics.jsonl's line for an epoch, every loss an NLL in the targets' units (nats per input):
    the training steps' NLL (whatever loss trains) beside the test set's, and the test set's RMSE (`train` None:
    the test set's alone)."""
    summary = {} if train is None else {'train_loss': train['nll'] + self.log_jacobian}
    if test is None:
      return summary
    summary.update(test_loss=test['loss'], test_rmse=np.sqrt(test['squared_error']))
    for i, (loss, squared_error) in enumerate(zip(test['member_loss'], test['member_squared_error'])):
      summary[f'member_test_loss/{i}'] = loss
      summary[f'member_test_rmse/{i}'] = np.sqrt(squared_error)
    return summary

  def components(self, member_outputs: np.ndarray, xp=np) -> tuple[np.ndarray, np.ndarray]:
    """(K, N, M 2D) member outputs -> the K M mixture components' (means, variances), each (K M, N, D) in the
    original units: float64 on the host, or traced by `ensemble.export` with xp=jnp."""
    outputs = np.asarray(member_outputs, np.float64) if xp is np else member_outputs
    means, variances = split_outputs(outputs, self.targets, xp=xp)  # (K, M, N, D)
    components = means.shape[0] * means.shape[1]  # K M, known for zero inputs too
    means = means.reshape(components, *means.shape[2:])
    variances = variances.reshape(components, *variances.shape[2:])
    mean, std = xp.asarray(self.target_mean), xp.asarray(self.target_std)
    return means * std + mean, variances * std ** 2


# The uniform mixture of Gaussians, on the host in float64. `means` and `variances` are (M, N, D): M components,
# N inputs, D targets; each target's marginal is a one-dimensional mixture. What `predictive` uses also runs traced
# (xp=jnp), so that `ensemble.export`'s artifact returns what `Ensemble.predict` does.

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
