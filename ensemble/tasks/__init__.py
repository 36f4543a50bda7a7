"""Tasks: what a member's outputs mean. A task says how a member is trained (its loss), how the members' outputs
combine into the ensemble's prediction, and what the trainer reports per epoch.

  classification  logits -> cross-entropy; the ensemble is the mean of the members' probabilities
  regression      a mean and a variance per target -> Gaussian NLL (or beta-NLL, MSE); the ensemble is the
                  uniform mixture of the members' Gaussians (Lakshminarayanan et al. 2017)
  multilabel      a logit per label -> binary cross-entropy per label; the ensemble is the mean of the members'
                  probabilities, label by label
  dense           logits per position (a pixel, a token) -> cross-entropy over the labelled positions; the
                  ensemble is the mean of the members' probabilities, position by position

Steps, the trainer, evaluation and prediction ask the task; they do not look at the outputs themselves.
"""

from typing import Any

from ensemble.tasks import classification, dense, multilabel, regression

NAMES = ('classification', 'regression', 'multilabel', 'dense')


def create(config, data_info: dict[str, Any] | None = None):
  """The task a recipe names, for data described by `data_info`: a regression's targets in their units (its
  `target_mean` and `target_std`), or, where `data_info` leaves them out (what the programs are built for, so that
  they do not change when the data does), in standardised units, D = num_classes / 2 of them."""
  if config.task == 'classification':
    return classification.Classification(temperature=config.distill_temperature)
  if config.task == 'dense':
    return dense.Dense(temperature=config.distill_temperature)
  if config.task == 'multilabel':
    return multilabel.Multilabel(pos_weight=tuple(float(w) for w in config.pos_weight))
  info = data_info or {}
  targets = len(info['target_std']) if 'target_std' in info else max(info.get('num_classes', 2) // 2, 1)
  return regression.Regression(loss_name=config.loss, beta=config.beta,
                               target_mean=tuple(info.get('target_mean', (0.0,) * targets)),
                               target_std=tuple(info.get('target_std', (1.0,) * targets)))
