"""A multi-label ensemble's report: report.md, metrics.json and the ensemble-size plot, drawn from the numbers
`tasks.multilabel.report_scores` makes (the ensemble, its members and their mean on the test split, per label and
over the labels; a temperature per label and conformal sets per label fitted on held-out examples; out-of-distribution
detection by the members' disagreement).
"""

from typing import Any

from absl import logging
from matplotlib.figure import Figure

from ensemble import report

SCORES = ('map', 'nll', 'brier', 'ece', 'subset_accuracy', 'hamming_loss')
TITLES = {'map': 'mAP', 'nll': 'NLL', 'brier': 'Brier', 'ece': 'ECE', 'subset_accuracy': 'subset accuracy',
          'hamming_loss': 'Hamming loss'}
PER_LABEL = (('average_precision_per_label', 'AP'), ('nll_per_label', 'NLL'), ('ece_per_label', 'ECE'))


def _ensemble_size_figure(results: dict[str, Any]) -> Figure:
  figure = Figure(figsize=(9, 4), layout='constrained')
  curve = results['ensemble_size_curve']
  sizes = [row['members'] for row in curve]
  for axis, score in zip(figure.subplots(1, 2), ('map', 'nll')):
    axis.plot(sizes, [row[score] for row in curve], **{**report.ENSEMBLE_STYLE, 'label': 'first k members'})
    axis.axhline(results['mean_member'][score], color=report.MEMBER_STYLE['color'], linestyle='--',
                 label='mean member')
    axis.set(xlabel='members k', title=f'test {TITLES[score]}', xticks=sizes)
    axis.grid(alpha=0.3)
  axis.legend()
  return figure


def markdown(results: dict[str, Any]) -> str:
  """report.md: the sections the results hold (without calibration examples, no temperature or conformal sets)."""
  row = lambda name, scores: [name, *(scores[s] for s in SCORES)]
  ensemble = results['ensemble']
  labels = len(ensemble['nll_per_label'])
  lines = [
      f'# Evaluation of `{results["workdir"]}` (multi-label)', '',
      f'Checkpoint of {results.get("checkpoint_unit", "epoch")} {results["epoch"]}, {results["ensemble_size"]} '
      f'members; {results["test_examples"]} test examples of {labels} labels from {results["data"]}.', '',
      '## Test set', '',
      report.table(['', *(TITLES[s] for s in SCORES)],
                    [row('**ensemble**', ensemble), row('mean member', results['mean_member']),
                     row('best member', results['best_member']),
                     row('gain over mean member', results['gain_over_mean_member']),
                     row('gain over best member', results['gain_over_best_member'])]
                    + [row(f'member {i}', scores) for i, scores in enumerate(results['members'])]), '',
      'NLL, Brier and ECE are means over the labels (ECE: 15 equal-width bins of each label\'s probability against '
      'the share of 1s); mAP is the mean average precision over the labels with a positive example; a label is '
      'predicted where its probability exceeds 0.5. Gains are positive where the ensemble is better.', '',
      '### Per label', '',
      report.table(['label', *(title for _, title in PER_LABEL)],
                    [[str(i), *(ensemble[key][i] for key, _ in PER_LABEL)] for i in range(labels)]), '',
      '## Ensemble size', '', '![ensemble_size](ensemble_size.png)', '']
  scaling = results.get('temperature_scaling')
  if scaling:
    calibrated_on = report.calibrated_on(results, scaling['heldout_examples'],
                                          scaling['seen_in_training'])
    lines += [
        '## Temperature per label', '',
        f'Fitted on {calibrated_on}: '
        + ', '.join(f'{t:.3g}' for t in scaling['temperature'])
        + f'. Test NLL {scaling["before"]["nll"]:.4f} -> {scaling["after"]["nll"]:.4f}, ECE '
        f'{scaling["before"]["ece"]:.4f} -> {scaling["after"]["ece"]:.4f}.', '']
  if 'conformal' in results:
    conformal = results['conformal']
    calibrated_on = report.calibrated_on(results, conformal['calibration_examples'],
                                          conformal['seen_in_training'])
    outside = [row for row in conformal['rows'] if not row['within_bounds']]
    lines += [
        '## Conformal sets per label', '',
        f'Each label of each test example gets a set of its values ({{0}}, {{1}} or {{0, 1}}), calibrated on '
        f'{calibrated_on}: for a new example drawn as they were, each label\'s set holds its value at least 1 - alpha '
        'of the time (label by label, not all labels at once). Where calibration and test examples are drawn alike, '
        'each label\'s measured coverage falls within the 99% bounds 99 times in 100.',
        *(['', f'**{len(outside)} of the {len(conformal["rows"])} rows have a label whose coverage is outside its '
               '99% bounds (marked): the test examples are not drawn as the calibration examples were.**']
          if outside else []), '',
        report.table(['alpha', '99% bounds', 'coverage per label', 'mean coverage',
                       'mean set size (of 2)'],
                      [[f'{row["alpha"]:g}', f'{row["bounds"][0]:.4f} to {row["bounds"][1]:.4f}',
                        ', '.join(f'{c:.3f}' for c in row['coverage_per_label'])
                        + ('' if row['within_bounds'] else ' (outside)'), row['coverage'], row['mean_set_size']]
                       for row in conformal['rows']]), '']
  lines += report.posthoc_conformal_markdown(results)
  if results.get('ood'):
    lines += [
        '## Out-of-distribution detection', '',
        f'Each set\'s inputs against the {results["test_examples"]} test inputs, by the members\' disagreement (mutual '
        'information) and by the predictive entropy, each summed over the labels: AUROC is the chance that an '
        'out-of-distribution input scores higher (0.5 is chance, 1 perfect); FPR95 the share of test inputs flagged '
        'when 95% of the others are.', '',
        report.table(['set', 'score', 'AUROC', 'AUPR', 'FPR95'],
                      [[name, score.replace('_', ' '), *(found['ensemble'][score][f] for f in ('auroc', 'aupr',
                                                                                                'fpr95'))]
                       for name, found in results['ood'].items() for score in found['ensemble']]), '']
  return '\n'.join(lines)


def write(results: dict[str, Any], output_dir: str):
  """metrics.json, report.md and ensemble_size.png in `output_dir`, as `report.save` writes a report."""
  report.save(results, markdown(results), {'ensemble_size.png': _ensemble_size_figure(results)}, output_dir)
  logging.info('Wrote metrics.json, report.md and ensemble_size.png to %s.', output_dir)
