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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ensemble import acquire, posthoc, scoring
from ensemble.tasks import base, classification, mixture

AxisName = str | Sequence[str]
Metrics = dict[str, jnp.ndarray]

LOSSES = ('nll', 'beta_nll', 'mse')
# The smallest variance a member predicts, in standardised units: keeps the NLL finite when a member is sure.
VARIANCE_FLOOR = 1e-6
LEVELS = mixture.LEVELS
_LOG_2PI = float(np.log(2 * np.pi))


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
class Regression(base.Targets):
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
  name = 'regression'
  label_kind = 'targets'
  fields = ('loss', 'beta')
  calibration = 'variance_scale'
  conformal_scores = ('normalised',)
  acquisitions = acquire.REGRESSION

  @classmethod
  def field_error(cls, name, value):
    if name == 'loss':
      return None if value in LOSSES else f'unknown loss {value!r}: set --config.loss to one of {list(LOSSES)}'
    if base.is_number(value) and 0 <= value <= 1:  # beta
      return None
    return f'{name}={value!r} must be in [0, 1] (0: the Gaussian NLL, 1: gradients of the mean as MSE)'

  @classmethod
  def of(cls, config, data_info=None):
    """For data described by `data_info`: its targets in their units (its `target_mean` and `target_std`); where
    `data_info` leaves them out (what the programs are built for, so that they do not change when the data does),
    in standardised units, D = num_classes / 2 of them."""
    info = data_info or {}
    targets = len(info['target_std']) if 'target_std' in info else max(info.get('num_classes', 2) // 2, 1)
    return cls(loss_name=config.loss, beta=config.beta,
               target_mean=tuple(info.get('target_mean', (0.0,) * targets)),
               target_std=tuple(info.get('target_std', (1.0,) * targets)))

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
    return base.with_test_scores(summary, test, {'loss': ('loss', lambda value: value),
                                                 'rmse': ('squared_error', np.sqrt)})

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

  # --- the model's outputs -----------------------------------------------------------------------------------------

  def model_outputs(self, width):
    return 2 * width

  def output_error(self, shape, width, positions):
    outputs = self.model_outputs(width)
    if shape is None or len(shape) != 2 or shape[1] != outputs:
      return (f'not to (batch, {outputs}): for {width} target(s) give its last layer {outputs} outputs, a mean and a '
              'raw scale per target')
    return None

  # --- what an ensemble answers ------------------------------------------------------------------------------------

  def apply_outputs(self, outputs, xp=np):
    return self.components(outputs, xp=xp)

  def view(self, outputs, xp=np):
    means, variances = self.components(outputs, xp=xp)
    return {'means': means, 'variances': variances}

  def check_predict_options(self, levels, threshold):
    super().check_predict_options(levels, threshold)
    mixture.checked_levels(levels)

  def predict(self, outputs, *, members, levels, threshold):
    """The mixture's 'mean', 'std', 'variance' = 'aleatoric' + 'epistemic', and the central intervals 'lower_P',
    'upper_P' holding P% of it (exact mixture quantiles), of the components as the chain leaves them (times its
    variance scale); the conformal step's 'conformal_lower' and 'conformal_upper'; each (N, D), or (N,) for one
    target. 'member_means' and 'member_variances' (K M, N, D) with `members`."""
    result = mixture.predictive(outputs['means'], outputs['variances'], mixture.checked_levels(levels))
    result.update({key: outputs[key] for key in ('conformal_lower', 'conformal_upper') if key in outputs})
    if self.targets == 1:
      result = {k: v[:, 0] for k, v in result.items()}
    if members:
      result['member_means'], result['member_variances'] = outputs['means'], outputs['variances']
    return result

  def evaluate(self, outputs, labels, chain, size):
    view = self.view(outputs)
    members = [mixture.score(m, v, labels) for m, v in mixture.member_components(view['means'], view['variances'],
                                                                                size)]
    scores = {'ensemble': mixture.score(view['means'], view['variances'], labels), 'members': members,
              'mean_member': {key: float(np.mean([m[key] for m in members])) for key in members[0]}}
    if any(step.kind == self.calibration for step in chain):
      scaled = posthoc.apply(posthoc.of_outputs(chain), view)
      scores['variance_scaled'] = mixture.score(scaled['means'], scaled['variances'], labels)
    return scores

  def report(self, forward, test, heldout, seen_in_training, *, size, angles, noise, ood_sets, alphas):
    components = lambda split, name: (*self.components(scoring.outputs(forward, split, name)),
                                      self.host_labels(forward.labels(split)))
    return {'test_examples': len(test['label']),
            **mixture.report(components(test, 'test'), None if heldout is None else components(heldout, 'calibration'),
                             size, alphas, seen_in_training)}

  def exported(self, outputs, chain, xp):
    """What `Ensemble.predict` returns, each (N, D) and in float32 (`mixture.predictive`, the same code traced), and
    the components 'member_means' and 'member_variances' (K M, N, D) in the targets' units, as the chain leaves them
    (times its variance scale)."""
    chained = posthoc.apply(chain, self.view(outputs, xp), xp=xp)
    return {'member_means': chained['means'], 'member_variances': chained['variances'],
            **mixture.predictive(chained['means'], chained['variances'], xp=xp),
            **{key: chained[key] for key in ('conformal_lower', 'conformal_upper') if key in chained}}

  def fitted_scale(self, view, labels, **settings):
    return {'value': mixture.scale_variances(view['means'], view['variances'], labels)}

  def fit_conformal(self, view, labels, alpha, score):
    """|y - mean| / std of the mixture as the steps before left it."""
    moments = mixture.mixture_moments(view['means'], view['variances'])
    q = mixture.conformal_quantile(moments['mean'], moments['std'], labels, alpha)
    return {'alpha': float(alpha), 'score': score, 'quantile': [float(v) for v in q]}

  def apply_conformal(self, step, view, xp):
    moments = mixture.mixture_moments(view['means'], view['variances'])
    lower, upper = mixture.conformal_interval(moments['mean'], moments['std'], step['quantile'], xp=xp)
    return {**view, 'conformal_lower': lower, 'conformal_upper': upper}

  def covered(self, result, labels):
    lower, upper = (result[key].reshape(labels.shape) for key in ('conformal_lower', 'conformal_upper'))
    return (lower <= labels) & (labels <= upper)

  def table(self, names, result):
    """Per target the mixture's mean and std, its aleatoric and epistemic std, and the bounds of the 90% central
    interval (and the conformal step's, where the chain has one); a suffix _d per target when there are several."""
    return base.target_table(names, {
        'mean': result['mean'], 'std': result['std'], 'aleatoric_std': np.sqrt(result['aleatoric']),
        'epistemic_std': np.sqrt(result['epistemic']), 'lower_90': result['lower_90'],
        'upper_90': result['upper_90']}, result)

  # --- distillation and the loops ----------------------------------------------------------------------------------

  def student_labels(self, ens, inputs):
    """(inputs twice, targets (2N, D)): every input with the targets m + sqrt(v) and m - sqrt(v), m and v the
    mixture's mean and variance per target (the members as trained): the average of the Gaussian NLL at the two
    is the expected NLL under N(m, v)."""
    moments = mixture.mixture_moments(*ens.components(inputs))
    spread = np.sqrt(moments['variance'])
    return (np.concatenate([inputs, inputs]),
            np.concatenate([moments['mean'] + spread, moments['mean'] - spread]))

  def acquisition_outputs(self, ens, outputs):
    return self.components(outputs)

  def curve_scores(self, ens, inputs, labels):
    labels = self.labels(labels, 'test', len(inputs), self.targets)
    means, variances = ens.components(inputs)
    return mixture.score(means, variances, labels, levels=())
