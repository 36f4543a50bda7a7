"""`python -m ensemble.evaluate` on a regression workdir: scores, interval calibration, the report and its plot.

What `evaluation.evaluate` runs when the workdir's task is regression. Scores
the mixture and the mean member on the test split (RMSE, the exact mixture's
NLL, CRPS, the coverage of central intervals), fits a variance scale on the
held-out slice (regression's temperature), calibrates split-conformal
intervals normalised by the predicted std on it at each alpha, and ranks the
test inputs by predicted std for selective prediction.
"""

import os
from typing import Any, Sequence

import numpy as np
from absl import logging
from matplotlib.figure import Figure

from ensemble import report
from ensemble.errors import UsageError
from ensemble.tasks import regression

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
  lines = [f'# Regression ensemble: {results["workdir"]}, epoch {results["epoch"]}', '',
           f'{results["ensemble_size"]} members, {results["test_examples"]} test examples of {results["data"]}.', '',
           '| | ' + ' | '.join(names) + ' |', '|---' * (len(names) + 1) + '|']
  for who in ('ensemble', 'mean_member'):
    lines.append(f'| {who} | ' + ' | '.join(f'{results[who][n]:.4g}' for n in names) + ' |')
  scaling = results['variance_scaling']
  lines += ['', f'Variance scale fitted on {scaling["heldout_examples"]} held-out examples: {scaling["scale"]:.4g} '
            f'(test NLL {scaling["before"]["nll"]:.4g} -> {scaling["after"]["nll"]:.4g}).', '',
            '| alpha | conformal coverage | mean width |', '|---|---|---|']
  lines += [f'| {row["alpha"]} | {row["coverage"]:.4f} | {row["mean_width"]:.4g} |'
            for row in results['conformal']['rows']]
  lines += ['', '![coverage](coverage.png)', '']
  report.save(results, '\n'.join(lines), {'coverage.png': _coverage_figure(results)}, output_dir)
  logging.info('Wrote metrics.json, report.md and coverage.png to %s.', output_dir)


def evaluate(workdir: str, config, member, state, devices, epoch: int, *, data_dir: str | None, output_dir: str | None,
             alphas: Sequence[float]) -> dict[str, Any]:
  """`evaluation.evaluate` for a regression workdir: restores nothing itself (the caller did), reads the data,
  scores, writes the report into `output_dir` (default WORKDIR/eval) and returns its numbers."""
  from ensemble import config as config_lib, data, evaluation  # pylint: disable=g-import-not-at-top
  data_dir = config.data_dir if data_dir is None else data_dir
  dataset = data.load(config.get('dataset', 'mnist'), data_dir, task='regression', target=config.get('target', ''))
  if tuple(dataset.image_shape) != member.image_shape or dataset.num_classes != member.task.targets:
    raise UsageError(f'{dataset.source} holds inputs {dataset.image_shape} with {dataset.num_classes} '
                                f'targets but {workdir} was trained on {member.image_shape} with '
                                f'{member.task.targets}; give --data_dir the data it was trained on')
  heldout, seen_in_training = evaluation.heldout_split(dataset.train, config)
  predict = evaluation.Predictor(member, state, devices, config.eval_batch_size)
  components = lambda split: (*member.task.components(predict.log_probs(split)),
                              split['label'].astype(np.float64))
  logging.info('Predicting the %d test examples and the %d held-out ones.', len(dataset.test['label']),
               len(heldout['label']))
  results = {'workdir': os.path.abspath(workdir), 'epoch': epoch,
             'checkpoint': evaluation.checkpoint_id(workdir, epoch), 'ensemble_size': config.ensemble_size,
             'task': 'regression', 'data': dataset.source,
             'data_dir': config_lib.data_location(data_dir), 'test_examples': len(dataset.test['label']),
             **score(components(dataset.test), components(heldout), config.ensemble_size, alphas, seen_in_training)}
  logging.info('test: ensemble RMSE %.4g NLL %.4g CRPS %.4g 90%% coverage %.3f; mean member RMSE %.4g NLL %.4g '
               'CRPS %.4g 90%% coverage %.3f', *(results[who][name] for who in ('ensemble', 'mean_member')
                                                 for name in ('rmse', 'nll', 'crps', 'coverage_90')))
  write(results, output_dir or os.path.join(workdir, 'eval'))
  return results
