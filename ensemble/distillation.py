"""Distillation: one network trained on an ensemble's averaged predictive, so that one network is served.

  student = ensemble.distill(ens, MyModel(), x_train, test=(x_test, y_test), epochs=30)
  student.predict(x)              # an Ensemble of one member: predict, evaluate, save, export as any other
  student.distillation.retained   # the share of the ensemble's NLL gain over its mean member the student keeps

The student is trained by `ensemble.fit`'s own trainer (`api.fit_dataset`), on the teacher's predictive as
labels; what it becomes is an ordinary classifier or regressor of the teacher's task.

  classification  labels: the members' mean probabilities (N, C); the loss is Hinton et al.'s (2015), T^2 times
                  the cross-entropy of softmax(logits / T) against them at temperature T (`distill_temperature`,
                  `tasks.classification.distillation_loss`); the student predicts softmax(logits).
  regression      the student's Gaussian N(mu, s^2) fitted to the mixture's mean m and variance v by the expected
                  NLL under the moment-matched Gaussian N(m, v), 0.5 log(2 pi s^2) + ((mu - m)^2 + v) / (2 s^2)
                  (the KL divergence from it, up to a constant). The NLL is quadratic in the target, so that
                  expectation is exactly the mean of the ordinary NLL at the two targets m + sqrt(v) and
                  m - sqrt(v): each input is trained on both, and the task's loss is regression's own.
  multi-label     each label's mean probability, a soft target of its binary cross-entropy.
  quantile        the teacher's quantiles (N, Q, D), one target per head: each level's head is fitted to the
                  teacher's quantile at that level by half the absolute error (the pinball loss at 1/2), not by the
                  pinball loss at its level against all Q, whose least is the teacher's own only at evenly spread
                  levels.

Each task makes its student's labels (`Task.student_labels`).
"""

import dataclasses
import math
from typing import Any

import numpy as np
from absl import logging

from ensemble import api
from ensemble.data import base
from ensemble.errors import UsageError

# What the student is, which fit's keywords would change: one network, of the teacher's task and inputs.
_FIXED = {'ensemble_size': 'the student is one network',
          'method': 'the student is one network, trained as an independent member',
          'task': "the student learns the teacher's task",
          'inputs': "the student takes the teacher's inputs",
          'distill_temperature': 'give temperature=',
          'heldout_fraction': 'every input given is labelled by the teacher; test= scores the student',
          'eval_every': 'test= scores the student once it is trained'}


@dataclasses.dataclass(frozen=True)
class DistillationReport:
  """The test set's NLL (nats per example; `loss` says where it is another loss) of the teacher, its members and
  the student.

  `retained` is how much of the ensemble's gain over a single member the
  student keeps: (mean member - student) / (mean member - ensemble), the mean
  member being the average of the members' own NLLs (what training one network
  of the ensemble's recipe gives, on average). 1: the student is as good as the
  ensemble; 0: as a member; NaN when the ensemble gains nothing over its mean
  member. `retained_over_best` measures the same from the best member's NLL.
  """
  ensemble_nll: float
  mean_member_nll: float
  best_member_nll: float
  student_nll: float
  examples: int
  loss: str = 'nll'  # what the four figures are: the NLL, or a quantile ensemble's pinball loss

  @staticmethod
  def _share(reference: float, student: float, ensemble: float) -> float:
    gain = reference - ensemble
    return (reference - student) / gain if gain > 0 else math.nan

  @property
  def retained(self) -> float:
    return self._share(self.mean_member_nll, self.student_nll, self.ensemble_nll)

  @property
  def retained_over_best(self) -> float:
    return self._share(self.best_member_nll, self.student_nll, self.ensemble_nll)

  def as_dict(self) -> dict[str, float]:
    return {**dataclasses.asdict(self), 'retained': self.retained, 'retained_over_best': self.retained_over_best}


def _inputs(ens: api.Ensemble, data: Any) -> np.ndarray:
  """The inputs of `data` (x, or (x, y) whose y is left aside), checked against the teacher's as `fit` checks its."""
  if isinstance(data, tuple) and len(data) == 2:
    data = data[0]
  inputs = ens.check(data, 'distill')
  if len(inputs) < 1:
    raise UsageError('distill got 0 inputs; give the inputs to label with the ensemble (its training inputs)')
  return inputs


def _check(ens: Any, temperature: Any, fit_kwargs: dict[str, Any]):
  """The refusals that need nothing computed, made before the teacher labels anything."""
  if not isinstance(ens, api.Ensemble):
    raise UsageError(f'distill got a teacher of type {type(ens).__name__}; give the Ensemble that fit or load '
                     'returned')
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
    raise UsageError(f'temperature={temperature!r} must be a positive number (1: the ensemble\'s probabilities as '
                     'they are)')
  if 'distill_temperature' not in ens.task.fields and temperature != 1:
    raise UsageError(f'temperature={temperature} sharpens or softens class probabilities, and {ens._name} is a '
                     f'{ens.task.name} ensemble: leave temperature= out')
  for key, why in _FIXED.items():
    if key in fit_kwargs:
      raise UsageError(f'distill sets {key}= itself ({why}): leave {key}= out')
  loss = fit_kwargs.get('loss', 'nll')
  if 'loss' in ens.task.fields and loss != 'nll':
    raise UsageError(f"loss={loss!r}: a regression student matches the ensemble's mixture by the Gaussian NLL; "
                     "leave loss= out")


@api._in_fit_terms  # pylint: disable=protected-access
def distill(ens: api.Ensemble, student_model: Any, data: Any, *, temperature: float = 1.0,
            test: tuple[Any, Any] | None = None, config: Any = None, workdir: str | None = None,
            init: api.Ensemble | None = None, keep_optimizer: bool = False, keep_freed_memory: bool = False,
            progress: bool = True, **fit_kwargs) -> api.Ensemble:
  """Trains one `student_model` network on `ens`'s predictive at the inputs `data`; returns it, an `Ensemble` of
  one member that predicts, evaluates, saves and exports like any other.

  `student_model` is what `fit` takes (a linen Module, a function of
  `nnx.Rngs`, or a built-in model's name). `data` is the inputs to label with
  the teacher, usually its training inputs: x, or (x, y) with y left aside.
  `temperature` (classification) softens (> 1) or sharpens (< 1) the
  teacher's probabilities in the loss (Hinton et al. 2015); the student
  predicts at 1 (at T > 1, lower the learning rate: the T^2 factor scales
  the gradients up). The other keywords are `fit`'s (epochs, learning_rate,
  batch_size, workdir, seed, ...), from the same defaults: give more epochs
  than the teacher's members had (docs/methods.md, "Distillation"). With `test`, an
  (inputs, labels) pair, `student.distillation` is a `DistillationReport` (else None).
  """
  _check(ens, temperature, fit_kwargs)
  for name, value in (('keep_optimizer', keep_optimizer), ('keep_freed_memory', keep_freed_memory)):
    api.check_flag(name, value)
  api.check_flag('progress', progress, none=True)
  inputs = _inputs(ens, data)
  if test is not None:  # before the training it would score
    test = _test_pair(test)
    ens.check(test[0], 'test')
  task = ens.task
  # What the student is, whatever `config` says: one network of the teacher's task (with the task's own settings of
  # a student: `Task.student_settings`), trained on every input given.
  settings = api.fit_recipe(config, {**fit_kwargs, 'ensemble_size': 1, 'method': 'independent', 'task': task.name,
                                     'heldout_fraction': 0.0, **task.student_settings(ens.config, temperature)})
  x, y = task.student_labels(ens, inputs)  # the teacher's predictive as the task's labels
  dataset = base.Dataset({'image': x, 'label': y}, None, f'the predictive of {ens._name}',  # pylint: disable=protected-access
                         task.width(ens.num_classes), inputs=ens.member.inputs, task=task.name)
  student = api.fit_dataset(student_model, dataset, settings, workdir=workdir, init=init, keep_optimizer=keep_optimizer,
                            keep_freed_memory=keep_freed_memory, progress=progress)
  if test is not None:
    student = student._replace(distillation=report(ens, student, *test))  # pylint: disable=protected-access
    logging.info('Distilled %s into one %s: %s', ens._name, student.config.model,  # pylint: disable=protected-access
                 ', '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}'
                           for k, v in student.distillation.as_dict().items()))
  return student


def _test_pair(test: Any) -> tuple[Any, Any]:
  if not isinstance(test, (tuple, list)) or len(test) != 2:
    raise UsageError(f'test= is a {type(test).__name__}; give a pair (inputs, labels) to score the student on')
  return test[0], test[1]


def report(ens: api.Ensemble, student: api.Ensemble, inputs: Any, labels: Any) -> DistillationReport:
  """The teacher's and the student's NLL on labelled `inputs`, as their `evaluate` scores them (the task's own
  metrics: the mixture's exact density for regression); a quantile ensemble's pinball loss (`loss`)."""
  teacher, scored = ens.evaluate(inputs, labels), student.evaluate(inputs, labels)
  key = ens.task.loss_score
  return DistillationReport(ensemble_nll=teacher['ensemble'][key], mean_member_nll=teacher['mean_member'][key],
                            best_member_nll=min(member[key] for member in teacher['members']),
                            student_nll=scored['ensemble'][key], examples=len(np.asarray(labels)), loss=key)
