"""Writes an evaluation's numbers as metrics.json, a Markdown report.md and PNG plots.

Everything here reads the results dict that `evaluate` returns (the content of
metrics.json), so a report can be redrawn from metrics.json alone.
"""

import json
import os
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state

SCORES = ('accuracy', 'nll', 'brier', 'ece')
TITLES = {'accuracy': 'accuracy', 'nll': 'NLL', 'brier': 'Brier', 'ece': 'ECE'}
PLOTS = ('reliability.png', 'rotation.png', 'gaussian_noise.png', 'ensemble_size.png')
ENSEMBLE_STYLE = {'color': 'C0', 'marker': 'o', 'label': 'ensemble'}
MEMBER_STYLE = {'color': 'C1', 'marker': 's', 'label': 'mean member'}


def _table(header: list[str], rows: list[list[Any]]) -> str:
  cell = lambda v: f'{v:.4f}' if isinstance(v, float) else str(v)
  lines = ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  return '\n'.join(lines + ['| ' + ' | '.join(cell(v) for v in row) + ' |' for row in rows])


def markdown(results: dict[str, Any]) -> str:
  scores_row = lambda name, scores: [name, *(scores[s] for s in SCORES)]
  test_rows = [scores_row('**ensemble**', results['ensemble']),
               scores_row('mean member', results['mean_member']),
               scores_row('best member', results['best_member']),
               scores_row('gain over mean member', results['gain_over_mean_member']),
               scores_row('gain over best member', results['gain_over_best_member'])]
  test_rows += [scores_row(f'member {i}', scores) for i, scores in enumerate(results['members'])]
  ensemble, temperature = results['ensemble'], results['temperature_scaling']
  seen = temperature['seen_in_training']
  columns = [(who, s) for who in ('ensemble', 'mean_member') for s in ('accuracy', 'nll', 'ece')]
  rotation_rows = [[row['angle'], *(row[who][s] for who, s in columns)] for row in results['rotation']]
  noise_rows = [[row['severity'], row['std'], *(row[who][s] for who, s in columns)]
                for row in results['gaussian_noise']]
  shift_columns = ['ensemble accuracy', 'ensemble NLL', 'ensemble ECE', 'member accuracy', 'member NLL', 'member ECE']
  return '\n'.join([
      f'# Evaluation of `{results["workdir"]}`',
      '',
      f'Checkpoint of epoch {results["epoch"]}, {results["ensemble_size"]} members; '
      f'{results["test_examples"]} test examples from {results["data"]}.',
      '',
      '## Test set',
      '',
      _table(['', *(TITLES[s] for s in SCORES)], test_rows),
      '',
      f'Ensemble predictive entropy {ensemble["entropy"]:.4f} nats; mean pairwise disagreement '
      f'between members {ensemble["disagreement"]:.4f}. ECE uses 15 equal-width confidence bins. '
      'Gains are positive where the ensemble is better; the best member is taken score by score.',
      '',
      '## Ensemble size',
      '',
      'The ensemble of the first k members.',
      '',
      _table(['members', 'accuracy', 'NLL'],
             [[row['members'], row['accuracy'], row['nll']] for row in results['ensemble_size_curve']]),
      '',
      '## Rotated test set',
      '',
      _table(['angle', *shift_columns], rotation_rows),
      '',
      '## Test set with Gaussian noise',
      '',
      'Pixels in [0, 1] plus Gaussian noise of the standard deviations of CIFAR-10-C\'s five severities, clipped.',
      '',
      _table(['severity', 'std', *shift_columns], noise_rows),
      '',
      '"member" is the mean over members of each member\'s score.',
      '',
      '## Temperature scaling after averaging',
      '',
      f'Temperature {temperature["temperature"]:.4f}, fitted on the last {temperature["fit_examples"]} '
      'examples of the training split '
      f'({"which the members were trained on" if seen else "held out of training"}) and applied to the log '
      'of the ensemble\'s mean probabilities; scores on the test set:',
      *(['', '**This run held out no training examples (`heldout_fraction=0`): on examples they were trained '
             'on the members are more confident than on new data, so this temperature sharpens the ensemble. '
             'Train with `--config.heldout_fraction=0.1` for a fair fit.**'] if seen else []),
      '',
      _table(['', 'NLL', 'ECE'], [[when, temperature[when]['nll'], temperature[when]['ece']]
                                  for when in ('before', 'after')]),
      '',
      '## Plots',
      '',
      *(f'![{name[:-4]}]({name})' for name in PLOTS),
      '',
  ])


def _reliability_figure(results: dict[str, Any]) -> Figure:
  """Accuracy against confidence per bin (on the diagonal is calibrated), above each bin's example count."""
  figure = Figure(figsize=(6, 7), layout='constrained')
  top, bottom = figure.subplots(2, 1, height_ratios=[3, 1], sharex=True)
  top.plot([0, 1], [0, 1], color='grey', linestyle='--', linewidth=1, label='calibrated')
  edges = np.linspace(0, 1, len(results['reliability']['ensemble']['count']) + 1)
  for who, style, ece in (('ensemble', ENSEMBLE_STYLE, results['ensemble']['ece']),
                          ('mean_member', MEMBER_STYLE, results['mean_member']['ece'])):
    bins = results['reliability'][who]
    filled = [i for i, n in enumerate(bins['count']) if n]
    top.plot([bins['confidence'][i] for i in filled], [bins['accuracy'][i] for i in filled],
             **{**style, 'label': f'{style["label"]} (ECE {ece:.4f})'})
    share = np.asarray(bins['count']) / max(sum(bins['count']), 1)
    bottom.stairs(share, edges, color=style['color'], label=style['label'])
  top.set(ylabel='accuracy', xlim=(0, 1), ylim=(0, 1),
          title=f'Reliability on the test set ({results["ensemble_size"]} members)')
  top.legend(loc='upper left')
  bottom.set(xlabel='confidence (top probability)', ylabel='share of examples', yscale='log')
  return figure


def _shift_figure(rows: list[dict[str, Any]], level: str, xlabel: str, title: str) -> Figure:
  """Accuracy, NLL and ECE of the ensemble and the mean member against the shift's `level`."""
  figure = Figure(figsize=(13, 4), layout='constrained')
  levels = [row[level] for row in rows]
  for axis, score in zip(figure.subplots(1, 3), ('accuracy', 'nll', 'ece')):
    for who, style in (('ensemble', ENSEMBLE_STYLE), ('mean_member', MEMBER_STYLE)):
      axis.plot(levels, [row[who][score] for row in rows], **style)
    axis.set(xlabel=xlabel, title=TITLES[score], xticks=levels[::2] if len(levels) > 7 else levels)
    axis.grid(alpha=0.3)
  axis.legend()
  figure.suptitle(title)
  return figure


def _rotation_figure(results: dict[str, Any]) -> Figure:
  return _shift_figure(results['rotation'], 'angle', 'rotation (degrees)', 'Rotated test set')


def _noise_figure(results: dict[str, Any]) -> Figure:
  return _shift_figure(results['gaussian_noise'], 'severity', 'severity', 'Test set with Gaussian noise')


def _ensemble_size_figure(results: dict[str, Any]) -> Figure:
  figure = Figure(figsize=(9, 4), layout='constrained')
  curve = results['ensemble_size_curve']
  sizes = [row['members'] for row in curve]
  for axis, score in zip(figure.subplots(1, 2), ('accuracy', 'nll')):
    axis.plot(sizes, [row[score] for row in curve], **{**ENSEMBLE_STYLE, 'label': 'first k members'})
    axis.axhline(results['mean_member'][score], color=MEMBER_STYLE['color'], linestyle='--', label='mean member')
    axis.set(xlabel='members k', title=f'test {TITLES[score]}', xticks=sizes)
    axis.grid(alpha=0.3)
  axis.legend()
  return figure


def write(results: dict[str, Any], output_dir: str):
  """metrics.json, report.md and the PNGs in `PLOTS`, into `output_dir`."""
  os.makedirs(output_dir, exist_ok=True)
  with open(os.path.join(output_dir, 'metrics.json'), 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=2)
  with open(os.path.join(output_dir, 'report.md'), 'w', encoding='utf-8') as f:
    f.write(markdown(results))
  for name, draw in zip(PLOTS, (_reliability_figure, _rotation_figure, _noise_figure, _ensemble_size_figure)):
    draw(results).savefig(os.path.join(output_dir, name), dpi=100)
