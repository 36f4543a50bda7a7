"""Tasks: what a member's outputs mean, a registry of one object each (ensemble/tasks/base.py says what a task
decides). Steps, the trainer, the data layer, evaluation, prediction, the post-hoc steps and the loops ask the task;
they do not compare its name. `check_task(task)` runs the interface's invariants on any task object (a new one
before it joins `TASKS`).

  classification  logits -> cross-entropy; the ensemble is the mean of the members' probabilities
  regression      a mean and a variance per target -> Gaussian NLL (or beta-NLL, MSE); the ensemble is the
                  uniform mixture of the members' Gaussians (Lakshminarayanan et al. 2017)
  multilabel      a logit per label -> binary cross-entropy per label; the ensemble is the mean of the members'
                  probabilities, label by label
  dense           logits per position (a pixel, a token) -> cross-entropy over the labelled positions; the
                  ensemble is the mean of the members' probabilities, position by position
  quantile        the quantiles of each target at given levels -> pinball loss; the ensemble's quantiles are the
                  mean of the members' (Vincentisation), its intervals conformalised by CQR (Romano et al. 2019)
"""

import functools
from typing import Any

from ensemble.tasks import classification, dense, multilabel, quantile, regression
from ensemble.tasks.base import IGNORED, LABEL_KINDS, Task
from ensemble.tasks.check import check_task

__all__ = ['DEFAULT', 'DEFAULT_FOR_TARGETS', 'IGNORED', 'LABEL_KINDS', 'NAMES', 'TASKS', 'Task', 'check_task',
           'create', 'named']

TASKS: dict[str, type[Task]] = {task.name: task for task in (
    classification.Classification, regression.Regression, multilabel.Multilabel, dense.Dense, quantile.Quantile)}
NAMES = tuple(TASKS)
DEFAULT = NAMES[0]  # what the programs, the data sources and the recipe take when no task is named
DEFAULT_FOR_TARGETS = regression.Regression.name  # what float targets are, where no task is named (convert)


@functools.lru_cache(maxsize=None)
def named(name: str) -> Task:
  """The task `name` with its default settings: what the host's decisions ask before a recipe is resolved."""
  return TASKS[name]()


def create(config, data_info: dict[str, Any] | None = None) -> Task:
  """The task a recipe names, for data described by `data_info` (`Task.of`)."""
  return TASKS[config.task].of(config, data_info)

