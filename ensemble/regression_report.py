"""`python -m ensemble.evaluate` on a regression workdir: scores, interval calibration, the report and its plot.

The scores and the report that `evaluation.evaluate` makes of a regression workdir. Scores
the mixture and the mean member on the test split (RMSE, the exact mixture's
NLL, CRPS, the coverage of central intervals), fits a variance scale on the
held-out slice (regression's temperature), calibrates split-conformal
intervals normalised by the predicted std on it at each alpha, and ranks the
test inputs by predicted std for selective prediction.
"""

from typing import Any, Sequence

import numpy as np
from absl import logging
from matplotlib.figure import Figure

from ensemble import report
from ensemble.tasks import regression
from ensemble.uncertainty import conformal

# The expected coverages of the calibration plot.
PLOT_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
SELECTIVE_COVERAGES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)


def _members(means: np.ndarray, variances: np.ndarray, size: int):
  per_member = len(means) // size
  return [(means[k * per_member:(k + 1) * per_member], variances[k * per_member:(k + 1) * per_member])
          for k in range(size)]


def _coverages(means, variances, y, levels) -> list[float]:
  covered = []
  for level in levels:
    low, high = regression.mixture_interval(means, variances, level)
    covered.append(float(((low <= y) & (y <= high)).mean()))
  return covered


def score(test: tuple[np.ndarray, np.ndarray, np.ndarray], heldout: tuple[np.ndarray, np.ndarray, np.ndarray],
          size: int, alphas: Sequence[float], seen_in_training: bool) -> dict[str, Any]:
  """The report's numbers from the components (means, variances (K M, N, D)) and targets (N, D) of the test
  split and of the held-out slice."""
  means, variances, y = test
  members = _members(means, variances, size)
  member_scores = [regression.score(m, v, y) for m, v in members]
  results = {'ensemble': regression.score(means, variances, y), 'members': member_scores,
             'mean_member': {key: float(np.mean([s[key] for s in member_scores])) for key in member_scores[0]}}
  results['calibration'] = {
      'expected': list(PLOT_LEVELS), 'ensemble': _coverages(means, variances, y, PLOT_LEVELS),
      'mean_member': list(np.mean([_coverages(m, v, y, PLOT_LEVELS) for m, v in members], axis=0))}
  held_means, held_variances, held_y = heldout
  scale = regression.scale_variances(held_means, held_variances, held_y)
  results['variance_scaling'] = {'scale': scale, 'heldout_examples': len(held_y), 'seen_in_training': seen_in_training,
                                 'before': results['ensemble'],
                                 'after': regression.score(means, variances * scale, y)}
  test_moments = regression.mixture_moments(means, variances)
  held_moments = regression.mixture_moments(held_means, held_variances)
  rows = []
  for alpha in alphas:
    q = regression.conformal_quantile(held_moments['mean'], held_moments['std'], held_y, alpha)
    half = q * test_moments['std']
    covered = np.abs(y - test_moments['mean']) <= half
    rows.append({'alpha': alpha, 'quantile': [float(v) for v in q], 'coverage': float(covered.mean()),
                 'mean_width': float((2 * half).mean())})
  results['conformal'] = {'calibration_examples': len(held_y), 'seen_in_training': seen_in_training, 'rows': rows}
  results['selective'] = regression.selective_rmse(test_moments['mean'], test_moments['std'], y, SELECTIVE_COVERAGES)
  return results


def _coverage_figure(results: dict[str, Any]) -> Figure:
  """Observed against expected coverage of the central intervals: the regression's reliability diagram."""
  calibration = results['calibration']
  figure = Figure(figsize=(4.5, 4.5), layout='constrained')
  ax = figure.subplots()
  ax.plot([0, 1], [0, 1], color='grey', linestyle=':', label='ideal')
  ax.plot(calibration['expected'], calibration['ensemble'], marker='o', label='ensemble')
  ax.plot(calibration['expected'], calibration['mean_member'], marker='s', label='mean member')
  ax.set_xlabel('expected coverage of the central interval')
  ax.set_ylabel('observed coverage')
  ax.legend()
  return figure


def write(results: dict[str, Any], output_dir: str):
  """metrics.json, report.md and coverage.png in `output_dir`, as `report.save` writes a report."""
  names = ('rmse', 'nll', 'crps', 'coverage_50', 'coverage_80', 'coverage_90', 'coverage_95')
  lines = [f'# Regression ensemble: {results["workdir"]}, {results.get("checkpoint_unit", "epoch")} '
           f'{results["epoch"]}', '',
           f'{results["ensemble_size"]} members, {results["test_examples"]} test examples of {results["data"]}.', '',
           '| | ' + ' | '.join(names) + ' |', '|---' * (len(names) + 1) + '|']
  scaling = results['variance_scaling']
  for who, scores in (('ensemble', results['ensemble']), ('ensemble, variance-scaled', scaling['after']),
                      ('mean_member', results['mean_member'])):
    lines.append(f'| {who} | ' + ' | '.join(f'{scores[n]:.4g}' for n in names) + ' |')
  calibration_rows = results['conformal']['calibration_examples']
  lines += ['', f'Variance scale fitted on {scaling["heldout_examples"]} held-out examples: {scaling["scale"]:.4g} '
            f'(test NLL {scaling["before"]["nll"]:.4g} -> {scaling["after"]["nll"]:.4g}; the scaled row above).', '',
            f'Split-conformal intervals calibrated on the {calibration_rows} held-out examples:', '',
            '| alpha | conformal coverage | mean width |', '|---|---|---|']
  for row in results['conformal']['rows']:
    width = (f'{row["mean_width"]:.4g}' if np.isfinite(row['mean_width']) else
             f'inf: {calibration_rows} examples are too few at this alpha (at least '
             f'{conformal.rows_needed(row["alpha"])})')
    lines.append(f'| {row["alpha"]} | {row["coverage"]:.4f} | {width} |')
  lines += ['', 'Selective prediction: the test RMSE when only the share of inputs with the smallest predicted std is '
            'kept.', '', '| kept | RMSE |', '|---|---|']
  lines += [f'| {row["coverage"]:.0%} | {row["rmse"]:.4g} |' for row in results['selective']]
  lines += ['', '![coverage](coverage.png)', '']
  report.save(results, '\n'.join(lines), {'coverage.png': _coverage_figure(results)}, output_dir)
  logging.info('Wrote metrics.json, report.md and coverage.png to %s.', output_dir)

