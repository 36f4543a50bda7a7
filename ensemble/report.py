"""Writes an evaluation's numbers as metrics.json, a Markdown report.md and PNG plots.

Everything here reads the results dict that `evaluate` returns (the content of
metrics.json), so a report can be redrawn from metrics.json alone.
"""

import io
import json
import os
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state

from ensemble import files

SCORES = ('accuracy', 'nll', 'brier', 'ece')
TITLES = {'accuracy': 'accuracy', 'nll': 'NLL', 'brier': 'Brier', 'ece': 'ECE'}
PLOTS = ('reliability.png', 'rotation.png', 'gaussian_noise.png', 'ensemble_size.png')
ENSEMBLE_STYLE = {'color': 'C0', 'marker': 'o', 'label': 'ensemble'}
MEMBER_STYLE = {'color': 'C1', 'marker': 's', 'label': 'mean member'}


def table(header: list[str], rows: list[list[Any]]) -> str:
  cell = lambda v: f'{v:.4f}' if isinstance(v, float) else str(v)
  lines = ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  return '\n'.join(lines + ['| ' + ' | '.join(cell(v) for v in row) + ' |' for row in rows])


def markdown(results: dict[str, Any]) -> str:
  """report.md: every section the results hold (an ensemble of features has no rotations, one scored without
  calibration examples no temperature or conformal sets)."""
  dense = 'labelled_positions' in results  # a class per position: each labelled position scored as an example
  scores = SCORES + ('miou',) if dense else SCORES
  scores_row = lambda name, figures: [name, *(figures[s] for s in scores)]
  test_rows = [scores_row('**ensemble**', results['ensemble']),
               scores_row('mean member', results['mean_member']),
               scores_row('best member', results['best_member']),
               scores_row('gain over mean member', results['gain_over_mean_member']),
               scores_row('gain over best member', results['gain_over_best_member'])]
  test_rows += [scores_row(f'member {i}', scores) for i, scores in enumerate(results['members'])]
  ensemble = results['ensemble']
  columns = [(who, s) for who in ('ensemble', 'mean_member') for s in ('accuracy', 'nll', 'ece')]
  shift_columns = ['ensemble accuracy', 'ensemble NLL', 'ensemble ECE', 'member accuracy', 'member NLL', 'member ECE']
  lines = [
      f'# Evaluation of `{results["workdir"]}`' + (' (dense)' if dense else ''),
      '',
      f'Checkpoint of {results.get("checkpoint_unit", "epoch")} {results["epoch"]}, '
      f'{results["ensemble_size"]} members; '
      f'{results["test_examples"]} test examples from {results["data"]}'
      + (f', {results["labelled_positions"]} labelled positions of them, each scored as an example (mIoU: the '
         'mean over the classes of their intersection over union).' if dense else '.'),
      '',
      '## Test set',
      '',
      table(['', *(TITLES.get(s, 'mIoU') for s in scores)], test_rows),
      '',
      f'Ensemble predictive entropy {ensemble["entropy"]:.4f} nats; mean pairwise disagreement '
      f'between members {ensemble["disagreement"]:.4f}. ECE uses 15 equal-width confidence bins. '
      'Gains are positive where the ensemble is better; the best member is taken score by score.',
      '',
      '## Ensemble size',
      '',
      'The ensemble of the first k members.',
      '',
      table(['members', 'accuracy', 'NLL'],
             [[row['members'], row['accuracy'], row['nll']] for row in results['ensemble_size_curve']]),
      '']
  if results.get('rotation'):
    lines += ['## Rotated test set', '',
              table(['angle', *shift_columns], [[row['angle'], *(row[who][s] for who, s in columns)]
                                                 for row in results['rotation']]), '']
  if results.get('gaussian_noise'):
    lines += ['## Test set with Gaussian noise', '',
              'Pixels in [0, 1] plus Gaussian noise of the standard deviations of CIFAR-10-C\'s five severities, '
              'clipped.', '',
              table(['severity', 'std', *shift_columns], [[row['severity'], row['std'],
                                                            *(row[who][s] for who, s in columns)]
                                                           for row in results['gaussian_noise']]), '']
  if results.get('rotation') or results.get('gaussian_noise'):
    lines += ['"member" is the mean over members of each member\'s score.', '']
  temperature = results.get('temperature_scaling')
  if temperature:
    seen = temperature['seen_in_training']
    lines += [
        '## Temperature scaling after averaging',
        '',
        f'Temperature {temperature["temperature"]:.4f}, fitted on '
        f'{calibrated_on(results, temperature["fit_examples"], seen)} and applied to the log of the ensemble\'s '
        'mean probabilities; scores on the test set:',
        *(['', '**This run held out no training examples (`heldout_fraction=0`): on examples they were trained '
               'on the members are more confident than on new data, so this temperature sharpens the ensemble. '
               'Train with `--config.heldout_fraction=0.1` for a fair fit.**'] if seen else []),
        '',
        table(['', 'NLL', 'ECE'], [[when, temperature[when]['nll'], temperature[when]['ece']]
                                    for when in ('before', 'after')]),
        '']
  else:
    lines += ['No calibration examples were given: no temperature, conformal sets or flag thresholds '
              '(`Ensemble.report(..., calibration=(x_cal, y_cal))`).', '']
  plots = [name for name, _ in _plots(results)]
  return '\n'.join([*lines, *uncertainty_markdown(results), '## Plots', '',
                    *(f'![{name[:-4]}]({name})' for name in plots if name in PLOTS), ''])


def calibration_data(results: dict[str, Any]) -> str:
  """What a post-hoc step was fitted on, in a few words: the rows given, or the held-out slice."""
  return ('the calibration examples given' if results.get('calibration') == 'given'
          else "the training split's held-out slice")


def calibrated_on(results: dict[str, Any], count: int, seen: bool) -> str:
  """Which examples a temperature or the conformal sets were fitted on, in words."""
  if results.get('calibration') == 'given':
    return f'the {count} calibration examples given'
  return (f'the last {count} examples of the training split '
          f'({"which the members were trained on" if seen else "held out of training"})')


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


OOD_SCORE_TITLES = {'max_probability': '1 - max probability', 'entropy': 'predictive entropy',
                    'mutual_information': 'mutual information', 'distance': 'distance (features)'}
CONFORMAL_SCORE_TITLES = {'thr': '1 - p(class)', 'aps': 'APS'}


def posthoc_conformal_markdown(results: dict[str, Any]) -> list[str]:
  """The section on the ensemble's own conformal step (its chain's): coverage per class beside the marginal, which
  averages a hard class's misses away; a dense ensemble's on boundary and interior positions too."""
  found = results.get('posthoc_conformal')
  if not found:
    return []
  name = lambda g: f'class {g["class"]}' if 'class' in g else f'label {g["label"]} = {g["value"]}'
  own = found['class_conditional']
  per_class = lambda g: [name(g), g['test_examples'], g['coverage'], *(
      [g['calibration_examples'], 'pooled: the marginal quantile' if g['pooled'] else
       f'{g["bounds"][0]:.4f} to {g["bounds"][1]:.4f}' + ('' if g['within_bounds'] else ' (outside)')] if own else [])]
  judged = (f'Its post-hoc step {found["step"]}, fitted on {found["calibration_examples"]} examples, judged on the '
            f'test set: {found["coverage"]:.4f} of {found["test_examples"]} covered (marginal; 1 - alpha = '
            f'{1 - found["alpha"]:g}).')
  if not found['groups']:  # intervals of real-valued targets
    return ['## The ensemble\'s conformal intervals', '', judged, '']
  lines = ['## The ensemble\'s conformal sets', '',
           judged + ' ' + ('A quantile per class: each class is covered at 1 - alpha, within its 99% bounds where the '
                           'test examples are drawn as the calibration ones.'
                           if own else 'One quantile for all classes: a class can be covered far less than 1 - alpha, '
                           'hidden by the others (`conformal(..., class_conditional=True)` fits one per class).'), '',
           table(['', 'test examples', 'coverage', *(['calibration examples', '99% bounds'] if own else [])],
                 [per_class(g) for g in found['groups']]), '']
  if found.get('regions'):
    lines += ['Positions with a 4-neighbour labelled otherwise (boundary) and the rest (interior):', '',
              table(['positions', 'test positions', 'coverage'],
                    [[region, r['test_examples'], r['coverage']] for region, r in found['regions'].items()]), '']
  return lines


def uncertainty_markdown(results: dict[str, Any]) -> list[str]:
  """The report's sections on using the uncertainty: selective prediction, conformal sets, OOD detection."""
  lines = []
  if 'selective' in results:
    selective = results['selective']
    lines += [
        '## Selective prediction',
        '',
        'Test images are answered from the least uncertain (predictive entropy) up and the rest referred elsewhere; '
        'the risk is the error rate among the answered ones. AURC is the area under the risk-coverage curve '
        '(lower is better); each member ranks by its own entropy.',
        '',
        table(['coverage', 'ensemble risk', 'member risk'],
               [[f'{row["coverage"]:.0%}', row['ensemble'], row['mean_member']] for row in selective['table']]
               + [['AURC', selective['ensemble']['aurc'], selective['mean_member']['aurc']]]),
        '',
        '![risk_coverage](risk_coverage.png)',
        '']
  if 'conformal' in results:
    conformal = results['conformal']
    n = conformal['calibration_examples']
    alphas = sorted({row['alpha'] for row in conformal['rows']}, reverse=True)
    example = alphas[0]
    outside = [row for row in conformal['rows'] if not row.get('within_bounds', True)]
    lines += [
        '## Conformal prediction sets',
        '',
        'Each test example gets a set of classes, calibrated on '
        f'{calibrated_on(results, n, conformal["seen_in_training"])}. '
        f'What this guarantees, in plain words: for a new example drawn the way the calibration examples were, the '
        f'set contains the true class at least 1 - alpha of the time (at alpha = {example:g}, at least '
        f'{1 - example:.0%} of examples), whatever the model, and with {n} calibration examples not much more often: '
        f'at most 1 - alpha + 1/{n + 1} on average over draws of them ("expected"). On one test set of '
        f'{results["test_examples"]} examples the measured coverage varies around that: where calibration and test '
        'examples are drawn alike, it falls within the "99% bounds" 99 times in 100. It is a promise about the share '
        'of examples over many examples, not about any one example, and it does not hold for examples unlike the '
        'calibration data (the out-of-distribution sets below). At the same coverage, smaller sets are more useful. '
        'Scores: 1 - p(class) gives the smallest sets on average; APS (adaptive prediction sets, randomised) gives '
        'small sets to easy examples and larger ones to hard ones. The mean member is each member calibrated on its '
        'own.',
        *(['', '**The calibration examples were seen in training (`heldout_fraction=0`): the members are more '
               'confident on them than on new examples, so the sets are too small and the guarantee does not '
               'hold.**'] if conformal['seen_in_training'] else []),
        *(['', f'**{len(outside)} of the {len(conformal["rows"])} rows measure a coverage outside their 99% bounds '
               '(marked): the test examples are not drawn as the calibration examples were '
               f'({calibration_data(results)} and the test set differ), so the guarantee holds for examples like the '
               'calibration ones, not for this test set.**'] if outside else []),
        '',
        table(['alpha', 'score', 'expected coverage', '99% bounds on this test set', 'ensemble coverage',
                'ensemble set size', 'member coverage', 'member set size'],
               [[f'{row["alpha"]:g}', CONFORMAL_SCORE_TITLES[row['score']],
                 f'{row["guaranteed"][0]:.4f} to {row["guaranteed"][1]:.4f}',
                 f'{row["bounds"][0]:.4f} to {row["bounds"][1]:.4f}' if 'bounds' in row else '-',
                 f'{row["ensemble"]["coverage"]:.4f}' + ('' if row.get('within_bounds', True) else ' (outside)'),
                 row['ensemble']['mean_size'], row['mean_member']['coverage'], row['mean_member']['mean_size']]
                for row in conformal['rows']]),
        '']
  lines += posthoc_conformal_markdown(results)
  if results.get('ood'):
    rows = []
    for name, result in results['ood'].items():
      for score, title in _titles(result):
        member = result.get('mean_member', {}).get(score)  # the chain's distance has no member of its own
        rows.append([name, title, *(result['ensemble'][score][f] for f in ('auroc', 'aupr', 'fpr95')),
                     *((member[f] for f in ('auroc', 'aupr', 'fpr95')) if member else ['-'] * 3)])
    lines += [
        '## Out-of-distribution detection',
        '',
        f'Each set\'s images against the {results["test_examples"]} test images; a higher score means "more likely '
        'out of distribution". AUROC is the chance that an out-of-distribution image scores higher than a test image '
        '(0.5 is chance, 1 perfect); AUPR treats the out-of-distribution images as positives; FPR95 is the share of '
        'test images flagged when 95% of the out-of-distribution images are (lower is better). A single member has '
        'no mutual information.',
        '',
        table(['set', 'score', 'ensemble AUROC', 'ensemble AUPR', 'ensemble FPR95', 'member AUROC', 'member AUPR',
                'member FPR95'], rows),
        '',
        '![ood_scores](ood_scores.png)',
        '']
  return lines


def _risk_coverage_figure(results: dict[str, Any]) -> Figure:
  figure = Figure(figsize=(6, 4.5), layout='constrained')
  axis = figure.subplots()
  for who, style in (('ensemble', ENSEMBLE_STYLE), ('mean_member', MEMBER_STYLE)):
    curve = results['selective'][who]
    axis.plot(curve['curve']['coverage'], curve['curve']['risk'], color=style['color'],
              label=f'{style["label"]} (AURC {curve["aurc"]:.4f})')
  axis.set(xlabel='coverage (share of test images answered)', ylabel='risk (error rate of the answered)',
           xlim=(0, 1), ylim=(0, None), title='Risk-coverage: rejecting the most uncertain first')
  axis.grid(alpha=0.3)
  axis.legend()
  return figure


def _titles(result: dict[str, Any]) -> list[tuple[str, str]]:
  """(score, title) of the scores a set was scored by: the distance too where the chain has a distance step."""
  return [(score, title) for score, title in OOD_SCORE_TITLES.items() if score in result['ensemble']]


def _ood_figure(results: dict[str, Any]) -> Figure:
  """Per set (rows) and score (columns): the ensemble's scores on the test set and on the out-of-distribution set."""
  sets = results['ood']
  figure = Figure(figsize=(13, 3.2 * len(sets)), layout='constrained')
  axes = figure.subplots(len(sets), max(len(_titles(result)) for result in sets.values()), squeeze=False)
  for row, (name, result) in zip(axes, sets.items()):
    for axis, (score, title) in zip(row, _titles(result)):
      histogram = result['histogram'][score]
      share = lambda counts: np.asarray(counts) / max(sum(counts), 1)
      axis.stairs(share(histogram['test']), histogram['edges'], color=ENSEMBLE_STYLE['color'], fill=True, alpha=0.5,
                  label='test set')
      axis.stairs(share(histogram['ood']), histogram['edges'], color='C3', fill=True, alpha=0.5,
                  label=f'{name} (AUROC {result["ensemble"][score]["auroc"]:.3f})')
      axis.set(xlabel=f'ensemble\'s {title}', ylabel='share of images', yscale='log')
      axis.legend(fontsize='small')
  figure.suptitle('Out-of-distribution scores: test set vs each set')
  return figure


def uncertainty_plots(results: dict[str, Any]) -> list[tuple[str, Any]]:
  """(file name, drawing function) of the plots the uncertainty sections link to."""
  plots = [('risk_coverage.png', _risk_coverage_figure)] if 'selective' in results else []
  return plots + ([('ood_scores.png', _ood_figure)] if results.get('ood') else [])


def _plots(results: dict[str, Any]) -> list[tuple[str, Any]]:
  """(file name, drawing function) of every plot the results hold."""
  held = {'rotation.png': 'rotation', 'gaussian_noise.png': 'gaussian_noise'}
  return [(name, draw) for name, draw in zip(PLOTS, (_reliability_figure, _rotation_figure, _noise_figure,
                                                     _ensemble_size_figure))
          if results.get(held.get(name, 'ensemble'))] + uncertainty_plots(results)


def write(results: dict[str, Any], output_dir: str):
  """metrics.json, report.md and the PNGs of the results (`_plots`), into `output_dir` (`save`)."""
  save(results, markdown(results), {name: draw(results) for name, draw in _plots(results)}, output_dir)


def save(results: dict[str, Any], report_md: str, figures: dict[str, Figure], output_dir: str):
  """A report's files, each whole or not at all (`files.write_atomically`): predict and export read the
  temperature (or a regression's variance scale) in metrics.json.

  Everything is rendered before the first file is written, so an error in
  rendering leaves the previous report as it was; metrics.json goes last, so
  a report whose metrics.json is new is whole.
  """
  contents = {'report.md': report_md}
  for name, figure in figures.items():
    png = io.BytesIO()
    figure.savefig(png, format='png', dpi=100)
    contents[name] = png.getvalue()
  contents['metrics.json'] = json.dumps(results, indent=2)
  os.makedirs(output_dir, exist_ok=True)
  for name, content in contents.items():
    files.write_atomically(os.path.join(output_dir, name), content)
