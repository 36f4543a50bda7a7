"""A regression ensemble's report: report.md, metrics.json and the coverage plot, drawn from the numbers
`tasks.mixture.report` makes (the mixture and the mean member on the test split: RMSE, the exact mixture's NLL,
CRPS, the coverage of central intervals; a variance scale and split-conformal intervals fitted on held-out
examples; selective prediction by predicted std).
"""

from typing import Any

import numpy as np
from absl import logging
from matplotlib.figure import Figure

from ensemble import report
from ensemble.uncertainty import conformal


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
  scaling = results.get('variance_scaling')
  rows = [('ensemble', results['ensemble']), ('mean_member', results['mean_member'])]
  if scaling:
    rows.insert(1, ('ensemble, variance-scaled', scaling['after']))
  for who, scores in rows:
    lines.append(f'| {who} | ' + ' | '.join(f'{scores[n]:.4g}' for n in names) + ' |')
  if scaling:
    calibration_rows = results['conformal']['calibration_examples']
    lines += ['', f'Variance scale fitted on {scaling["heldout_examples"]} held-out examples: {scaling["scale"]:.4g} '
              f'(test NLL {scaling["before"]["nll"]:.4g} -> {scaling["after"]["nll"]:.4g}; the scaled row above).', '',
              f'Split-conformal intervals calibrated on the {calibration_rows} held-out examples (the test set\'s '
              'coverage falls in the bounds with 99% probability where they and the test examples are drawn alike):',
              '', '| alpha | conformal coverage | 99% bounds | mean width |', '|---|---|---|---|']
    for row in results['conformal']['rows']:
      width = (f'{row["mean_width"]:.4g}' if np.isfinite(row['mean_width']) else
               f'inf: {calibration_rows} examples are too few at this alpha (at least '
               f'{conformal.rows_needed(row["alpha"])})')
      coverage = f'{row["coverage"]:.4f}' + ('' if row['within_bounds'] else ' (outside the bounds)')
      lines.append(f'| {row["alpha"]} | {coverage} | {row["bounds"][0]:.4f} to {row["bounds"][1]:.4f} | {width} |')
  else:
    lines += ['', 'No held-out examples: no variance scale or conformal intervals (give calibration examples).']
  lines += ['', *report.posthoc_conformal_markdown(results)]
  lines += ['', 'Selective prediction: the test RMSE when only the share of inputs with the smallest predicted std is '
            'kept.', '', '| kept | RMSE |', '|---|---|']
  lines += [f'| {row["coverage"]:.0%} | {row["rmse"]:.4g} |' for row in results['selective']]
  lines += ['', '![coverage](coverage.png)', '']
  report.save(results, '\n'.join(lines), {'coverage.png': _coverage_figure(results)}, output_dir)
  logging.info('Wrote metrics.json, report.md and coverage.png to %s.', output_dir)

