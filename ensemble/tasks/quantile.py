"""Quantile regression: each member predicts the quantiles of every target at given levels, and the ensemble's
quantiles are the mean of the members' (Vincentisation: the quantile average of their distributions).

A member's model gives D Q numbers per input for D targets and Q levels (`quantiles=`, increasing in (0, 1)): per
target, its lowest quantile and Q - 1 raw gaps, each gap softplus(raw) added to the quantile below it, so that a
member's quantiles never cross, whatever the model. It is trained in standardised units by the pinball loss

  rho_tau(y - q) = max(tau (y - q), (tau - 1)(y - q)),

whose minimiser over q is the tau-quantile of y, averaged over the levels and the targets. A snapshot member's
snapshots are averaged alike. The mean of non-crossing quantile functions never crosses either.

The interval of the outermost pair of levels holds levels[-1] - levels[0] of the targets if the quantiles are right;
conformalised quantile regression (CQR, Romano et al. 2019) widens (or narrows) it by the ceil((n + 1)(1 - alpha))-th
smallest of max(lower - y, y - upper) over n calibration examples, so that it holds 1 - alpha of them whatever the
members learned: `Ensemble.conformal` with the score 'cqr'.
"""

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ensemble import console, defaults, posthoc, scoring
from ensemble.errors import UsageError
from ensemble.tasks import base, mixture, regression
from ensemble.uncertainty import conformal

AxisName = str | Sequence[str]
Metrics = dict[str, jnp.ndarray]

DEFAULT_LEVELS = defaults.Recipe.quantiles


def member_quantiles(outputs, targets: int, levels: int, xp=jnp):
  """Raw outputs (..., N, M D Q) -> quantiles (..., M, N, D, Q) in standardised units, each row increasing: the
  lowest, then softplus of each raw gap added in turn."""
  shape = outputs.shape
  parts = xp.reshape(outputs, (*shape[:-1], shape[-1] // (targets * levels), targets, levels))
  parts = xp.moveaxis(parts, -3, -4)  # (..., M, N, D, Q), M known for N = 0 too
  softplus = jax.nn.softplus if xp is jnp else lambda x: np.logaddexp(0.0, x)
  gaps = softplus(parts[..., 1:])
  return xp.concatenate([parts[..., :1], parts[..., :1] + xp.cumsum(gaps, axis=-1)], axis=-1)


def pinball(quantiles, y, levels, xp=jnp):
  """(..., D, Q) the pinball loss of each quantile of `quantiles` (..., D, Q) at targets y (..., D)."""
  error = y[..., None] - quantiles
  tau = xp.asarray(levels, quantiles.dtype)
  return xp.maximum(tau * error, (tau - 1) * error)


def crps_weights(levels: Sequence[float]) -> np.ndarray:
  """(Q,) each level's share of [0, 1]: from the midpoint with the level below (0 for the lowest) to the midpoint
  with the level above (1 for the highest). CRPS = 2 int_0^1 rho_tau(y - q_tau) dtau (Gneiting and Raftery 2007),
  the integral taken with the quantile function held at each level over its share."""
  levels = np.asarray(levels, np.float64)
  edges = np.concatenate([[0.0], (levels[1:] + levels[:-1]) / 2, [1.0]])
  return np.diff(edges)


def scores(quantiles: np.ndarray, y: np.ndarray, levels: Sequence[float]) -> dict[str, Any]:
  """The scores of quantiles (N, D, Q) at targets y (N, D), in the targets' units: 'pinball' (mean over levels,
  targets and inputs), 'crps' (`crps_weights`), the outermost pair's interval 'coverage' and mean 'width', and
  'calibration': per level, the share of targets at or below its quantile (ideally the level)."""
  y = np.asarray(y, np.float64)
  losses = pinball(quantiles, y, levels, xp=np)
  lower, upper = quantiles[..., 0], quantiles[..., -1]
  return {'pinball': float(losses.mean()), 'crps': float(2 * (losses * crps_weights(levels)).sum(-1).mean()),
          'coverage': float(((lower <= y) & (y <= upper)).mean()), 'width': float((upper - lower).mean()),
          'calibration': [float(v) for v in (y[..., None] <= quantiles).reshape(-1, len(levels)).mean(0)]}


def cqr_quantile(quantiles: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
  """(D,) CQR's widening of the outermost pair's interval at miscoverage `alpha`: the ceil((n + 1)(1 - alpha))-th
  smallest of max(lower - y, y - upper) over the n calibration examples; inf where n is too small for `alpha`."""
  errors = np.maximum(quantiles[..., 0] - y, y - quantiles[..., -1])  # (N, D)
  return np.array([conformal.quantile(errors[:, d], alpha) for d in range(errors.shape[1])])


@dataclasses.dataclass(frozen=True)
class Quantile(base.Targets):
  """The `levels`' quantiles of each target; trained by the pinball loss. `target_mean` and `target_std` as a
  regression's: the programs work in standardised units, and the host converts."""
  levels: tuple[float, ...] = DEFAULT_LEVELS
  target_mean: tuple[float, ...] = (0.0,)
  target_std: tuple[float, ...] = (1.0,)
  name = 'quantile'
  label_kind = 'targets'
  fields = ('quantiles',)
  conformal_scores = ('cqr',)
  loss_score = 'pinball'
  eval_scores = {'loss': 'loss', 'coverage': 'covered'}

  @classmethod
  def field_error(cls, name, value):
    if (len(value) >= 2 and all(base.is_number(v) and 0 < v < 1 for v in value)
        and all(a < b for a, b in zip(value, value[1:]))):
      return None
    return (f'{name}={value!r} must be at least two levels in (0, 1), increasing, e.g. '
            f'--config.{name}="{DEFAULT_LEVELS}" (the outermost pair bounds the interval)')

  @classmethod
  def of(cls, config, data_info=None):
    info = data_info or {}
    levels = tuple(float(level) for level in config.quantiles)
    targets = len(info['target_std']) if 'target_std' in info else max(info.get('num_classes', 1) // len(levels), 1)
    return cls(levels=levels, target_mean=tuple(info.get('target_mean', (0.0,) * targets)),
               target_std=tuple(info.get('target_std', (1.0,) * targets)))

  @property
  def interval(self) -> float:
    """The share of targets the outermost pair's interval should hold."""
    return self.levels[-1] - self.levels[0]

  def layout_error(self, labels, images, num_classes):
    """Targets (N, D), or a distilled student's (N, Q, D): the teacher's quantiles (`student_labels`)."""
    return super().layout_error(labels[:, 0] if labels.ndim == 3 else labels, images, num_classes)

  # --- in the programs ---------------------------------------------------------------------------------------------

  def member_output(self, outputs: jnp.ndarray) -> jnp.ndarray:
    """What prediction takes from a member: its raw outputs (`quantiles` reads them on the host)."""
    return outputs

  def _member(self, outputs):
    """(N, D, Q) a member's quantiles in standardised units: its components' mean."""
    return member_quantiles(outputs, self.targets, len(self.levels)).mean(0)

  def loss(self, outputs: jnp.ndarray, labels: jnp.ndarray) -> tuple[jnp.ndarray, Metrics]:
    """(the mean pinball loss over the batch, the levels and the targets, the step's metrics: it, and each target's
    mean pinball loss ('pinball/d'), which the summary reports in the targets' units).

    A distilled student's labels (B, Q, D) are already quantiles, the teacher's (`student_labels`): each level's
    head is held to its own by the pinball loss at 1/2 (half the absolute error), least where they are equal.
    Symmetric, so that where the student cannot follow the teacher it errs to both sides alike, where the pinball
    loss at a 0.025 head's own level would weigh an overshoot 39 times an undershoot and push it below."""
    quantiles = self._member(outputs)
    if labels.ndim == 3:
      losses = jnp.abs(jnp.swapaxes(labels, 1, 2) - quantiles) / 2
    else:
      losses = pinball(quantiles, labels, self.levels)
    per_target = losses.mean((0, 2))  # (D,)
    return per_target.mean(), {'loss': per_target.mean(),
                               **{f'pinball/{d}': per_target[d] for d in range(self.targets)}}

  def eval_outputs(self, outputs: jnp.ndarray, labels: jnp.ndarray, *, axis_name: AxisName) -> Metrics:
    """Per input and target, standardised: the member's and the ensemble's mean pinball loss, and whether the
    outermost pair's interval holds the target."""
    member = self._member(outputs)
    ensemble = jax.lax.pmean(member, axis_name)
    covered = lambda q: ((q[..., 0] <= labels) & (labels <= q[..., -1])).astype(jnp.float32)
    return {'member_loss': pinball(member, labels, self.levels).mean(-1), 'member_covered': covered(member),
            'ensemble_loss': pinball(ensemble, labels, self.levels).mean(-1), 'ensemble_covered': covered(ensemble)}

  combine_snapshots = regression.Regression.combine_snapshots  # each snapshot a component, their quantiles averaged

  @property
  def reported_loss(self) -> tuple[dict[str, float], float]:
    """The progress bar's running loss: each target's pinball loss in its units, averaged, as the summary's."""
    return {f'pinball/{d}': float(s) / self.targets for d, s in enumerate(self.target_std)}, 0.0

  def in_data_units(self, outputs: dict) -> dict:
    """Pinball losses (N, D) scaled by each target's std, coverage as it is, each averaged over the targets."""
    std = np.asarray(self.target_std, np.float64)
    return {name: (np.asarray(values, np.float64) * (std if name.endswith('loss') else 1.0)).mean(-1)
            for name, values in outputs.items()}

  def summary(self, train, test=None) -> dict[str, float]:
    """Every loss a pinball loss in the targets' units; the test set's interval coverage beside it."""
    std = self.target_std
    # Each target's training pinball loss in its units, averaged (per epoch, for a run trained at once).
    summary = {} if train is None else {
        'train_loss': sum(s * np.asarray(train[f'pinball/{d}'], np.float64) for d, s in enumerate(std)) / len(std)}
    same = lambda value: value
    return base.with_test_scores(summary, test, {'loss': ('loss', same), 'coverage': ('coverage', same)})

  # --- the model's outputs -----------------------------------------------------------------------------------------

  def model_outputs(self, width):
    return width * len(self.levels)

  def output_error(self, shape, width, positions):
    outputs = self.model_outputs(width)
    if shape is None or len(shape) != 2 or shape[1] != outputs:
      return (f'not to (batch, {outputs}): for {width} target(s) and {len(self.levels)} quantile levels give its last '
              f'layer {outputs} outputs, a lowest quantile and {len(self.levels) - 1} gaps per target')
    return None

  # --- what an ensemble answers ------------------------------------------------------------------------------------

  def quantiles(self, outputs, xp=np):
    """(K, N, M D Q) member outputs -> (K, N, D, Q) each member's quantiles in the targets' units (float64 on the
    host; traced by `ensemble.export` with xp=jnp)."""
    outputs = np.asarray(outputs, np.float64) if xp is np else outputs
    q = member_quantiles(outputs, self.targets, len(self.levels), xp=xp).mean(1)
    return q * xp.asarray(self.target_std)[:, None] + xp.asarray(self.target_mean)[:, None]

  apply_outputs = quantiles

  def view(self, outputs, xp=np):
    member = self.quantiles(outputs, xp)
    return {'member_quantiles': member, 'quantiles': member.mean(0)}

  def check_predict_options(self, levels, threshold):
    super().check_predict_options(levels, threshold)
    if tuple(levels) != regression.LEVELS:
      raise UsageError(f'levels={levels!r}: a quantile ensemble predicts the quantiles it was trained for '
                       f'({", ".join(f"{level:g}" for level in self.levels)}); leave levels out')

  def _answer(self, view: dict[str, Any], xp) -> dict[str, Any]:
    quantiles = view['quantiles']
    result = {'quantiles': quantiles, 'lower': quantiles[..., 0], 'upper': quantiles[..., -1],
              'epistemic_std': view['member_quantiles'].std(0).mean(-1)}
    result.update({key: view[key] for key in ('conformal_lower', 'conformal_upper') if key in view})
    return result

  def predict(self, outputs, *, members, levels, threshold):
    """'quantiles' (N, D, Q), the outermost pair's 'lower' and 'upper' (N, D), 'epistemic_std' (N, D: the members'
    disagreement, the std of their quantiles averaged over the levels), the conformal step's 'conformal_lower' and
    'conformal_upper'; one target's without its axis, (N, Q) and (N,). 'member_quantiles' (K, N, D, Q) with
    `members`."""
    result = self._answer(outputs, np)
    if self.targets == 1:
      result = {k: v[:, 0] for k, v in result.items()}
    if members:
      result['member_quantiles'] = outputs['member_quantiles']
    return result

  def evaluate(self, outputs, labels, chain, size):
    """`scores` of the ensemble's quantiles and of each member's; the conformal interval's coverage and width
    where the chain has one."""
    view = self.view(outputs)
    members = [scores(q, labels, self.levels) for q in view['member_quantiles']]
    flat = [key for key, value in members[0].items() if not isinstance(value, list)]
    result = {'ensemble': scores(view['quantiles'], labels, self.levels), 'members': members,
              'mean_member': {key: float(np.mean([m[key] for m in members])) for key in flat},
              'levels': list(self.levels)}
    chained = posthoc.apply(posthoc.of_outputs(chain), view)
    if 'conformal_lower' in chained:
      lower, upper = chained['conformal_lower'], chained['conformal_upper']
      result['conformal'] = {'coverage': float(((lower <= labels) & (labels <= upper)).mean()),
                             'width': float((upper - lower).mean())}
    return result

  def report(self, forward, test, heldout, seen_in_training, *, size, angles, noise, ood_sets, alphas):
    """The test split's scores (`evaluate`'s), and with held-out examples CQR's intervals at each alpha: their
    coverage of the test targets, its 99% bounds where calibration and test examples are exchangeable, and their
    width."""
    labels = self.host_labels(test['label']).reshape(len(test['label']), -1)
    outputs = scoring.outputs(forward, test, 'test')
    with console.stage('test scores'):
      results = {'test_examples': len(labels), **self.evaluate(outputs, labels, (), size)}
    if heldout is None:
      return results
    held = self.view(scoring.outputs(forward, heldout, 'calibration'))['quantiles']
    held_y = self.host_labels(forward.labels(heldout)).reshape(len(held), -1)
    quantiles, rows = self.view(outputs)['quantiles'], []
    with console.stage('conformal'):
      for alpha in alphas:
        q = cqr_quantile(held, held_y, alpha)
        lower, upper = quantiles[..., 0] - q, quantiles[..., -1] + q
        covered = (lower <= labels) & (labels <= upper)
        bounds = list(conformal.coverage_bounds(len(held_y), covered.size, alpha))
        rows.append({'alpha': alpha, 'quantile': [float(v) for v in q], 'coverage': float(covered.mean()),
                     'bounds': bounds, 'within_bounds': bounds[0] <= float(covered.mean()) <= bounds[1],
                     'mean_width': float((upper - lower).mean())})
    results['conformal'] = {'calibration_examples': len(held_y), 'seen_in_training': seen_in_training,
                            'rows': rows}
    return results

  def write_report(self, results: dict[str, Any], output_dir: str):
    from ensemble import report  # pylint: disable=g-import-not-at-top  # matplotlib
    names = ('pinball', 'crps', 'coverage', 'width')
    lines = [f'# Quantile ensemble: {results["workdir"]}, {results.get("checkpoint_unit", "epoch")} {results["epoch"]}',
             '', f'{results["ensemble_size"]} members, {results["test_examples"]} test examples of {results["data"]}; '
             f'quantiles at {", ".join(f"{level:g}" for level in results["levels"])}, the interval of the outermost '
             f'pair nominally holding {results["levels"][-1] - results["levels"][0]:.0%}.', '',
             '| | ' + ' | '.join(names) + ' |', '|---' * (len(names) + 1) + '|']
    for who in ('ensemble', 'mean_member'):
      lines.append(f'| {who} | ' + ' | '.join(f'{results[who][n]:.4g}' for n in names) + ' |')
    lines += ['', '| level | share of targets at or below the quantile |', '|---|---|']
    lines += [f'| {level:g} | {share:.4f} |' for level, share in zip(results['levels'],
                                                                       results['ensemble']['calibration'])]
    if 'rows' in (results.get('conformal') or {}):
      lines += ['', f'CQR intervals calibrated on {results["conformal"]["calibration_examples"]} examples (the '
                'coverage falls in the bounds with 99% probability where they and the test examples are drawn alike):',
                '', '| alpha | coverage | 99% bounds | mean width |', '|---|---|---|---|']
      lines += [f'| {row["alpha"]} | {row["coverage"]:.4f} | {row["bounds"][0]:.4f} to {row["bounds"][1]:.4f} | '
                f'{row["mean_width"]:.4g} |' for row in results['conformal']['rows']]
    lines += ['', *report.posthoc_conformal_markdown(results)]
    report.save(results, '\n'.join(lines) + '\n', {}, output_dir)

  def exported(self, outputs, chain, xp):
    chained = posthoc.apply(chain, self.view(outputs, xp), xp=xp)
    return {'member_quantiles': chained['member_quantiles'], **self._answer(chained, xp)}

  def fit_conformal(self, view, labels, alpha, score):
    return {'alpha': float(alpha), 'score': score,
            'quantile': [float(v) for v in cqr_quantile(view['quantiles'], labels, alpha)]}

  def apply_conformal(self, step, view, xp):
    q = xp.asarray(step['quantile'])
    return {**view, 'conformal_lower': view['quantiles'][..., 0] - q, 'conformal_upper': view['quantiles'][..., -1] + q}

  covered = regression.Regression.covered

  def table(self, names, result):
    """Per target each level's quantile ('q5', 'q50', 'q95'), the members' disagreement ('epistemic_std'), and the
    conformal (CQR) interval where the chain has one."""
    quantiles = result['quantiles']
    parts = {f'q{mixture.level_name(level)}': quantiles[..., i] for i, level in enumerate(self.levels)}
    return base.target_table(names, {**parts, 'epistemic_std': result['epistemic_std']}, result)

  # --- distillation and the loops ----------------------------------------------------------------------------------

  def student_settings(self, teacher, temperature):
    """The student's heads are the teacher's levels, each fitted to the teacher's quantile at its own level."""
    return {'quantiles': teacher.quantiles}

  def student_labels(self, ens, inputs):
    """(inputs, the teacher's quantiles (N, Q, D)), one target per head, which `loss` fits each head to. Not each
    input once per level with all heads fitted to every target: the head at tau would learn the tau-quantile of
    the teacher's Q quantiles, which is its own tau-quantile only at evenly spread levels (at 0.025, 0.05, ...,
    the 0.05 head learned the 0.025 one). The targets last, as every task's labels: standardised per target."""
    return inputs, np.swapaxes(self.view(ens.member_outputs(inputs))['quantiles'], 1, 2)

  def curve_scores(self, ens, inputs, labels):
    labels = self.labels(labels, 'test', len(inputs), self.targets)
    return {key: value for key, value in scores(self.view(ens.member_outputs(inputs))['quantiles'], labels,
                                                           self.levels).items()
            if not isinstance(value, list)}
