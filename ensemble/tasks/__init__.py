"""Tasks: what a member's outputs mean. A task says how a member is trained (its loss), how the members' outputs
combine into the ensemble's prediction, and what the trainer reports per epoch.

  classification  logits -> cross-entropy; the ensemble is the mean of the members' probabilities
  regression      a mean and a variance per target -> Gaussian NLL (or beta-NLL, MSE); the ensemble is the
                  uniform mixture of the members' Gaussians (Lakshminarayanan et al. 2017)

Steps, the trainer, evaluation and prediction ask the task; they do not look at the outputs themselves.
"""

from typing import Any

from ensemble.errors import UsageError
from ensemble.tasks import classification, regression

NAMES = ('classification', 'regression')


def name(config) -> str:
  """`config.task`; runs saved before tasks existed were classifiers."""
  return config.get('task', 'classification')


def create(config, data_info: dict[str, Any] | None = None):
  """The task `config` names, for data described by `data_info` (its target statistics, for regression)."""
  check(config)
  if name(config) == 'classification':
    return classification.Classification(temperature=float(config.get('distill_temperature', 1.0)))
  data_info = data_info or {}
  return regression.Regression(loss_name=config.get('loss', 'nll'), beta=float(config.get('beta', 0.5)),
                               target_mean=tuple(data_info.get('target_mean', (0.0,))),
                               target_std=tuple(data_info.get('target_std', (1.0,))))


def check(config):
  """Refuses an unknown task or loss before any data is read."""
  task = name(config)
  if task not in NAMES:
    raise UsageError(f'unknown task {task!r}: set --config.task to one of {list(NAMES)}')
  if task == 'regression':
    regression.check(config)
