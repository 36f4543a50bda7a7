"""`check_task`: the task interface's invariants run on any task object, as scikit-learn's `check_estimator` runs an
estimator's, so that a new task is known to answer what the package asks before a fit finds out.

Each invariant is one function of (task, case) that raises `Broken` with what it saw; `check_task` names the one
that failed. They run on random outputs and labels of the task's declared kind (`Task.label_kind`), not on a
trained ensemble: what they check is the interface, and the contract (tests/contract/) checks the numbers.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ensemble.errors import DataError, UsageError
from ensemble.tasks import base

MEMBERS, ROWS, POSITIONS = 2, 6, (4,)


class Broken(Exception):
  """An invariant the task does not keep: what was seen."""


class Case(NamedTuple):
  """What the invariants hand the task: labels of its kind as it read them, and the members' random outputs."""
  width: int
  labels: np.ndarray
  outputs: np.ndarray  # (MEMBERS, ROWS, *positions, model outputs)


def labels_of_kind(kind: str, rng: np.random.Generator, count: int, width: int, positions: tuple[int, ...] = ()
                   ) -> np.ndarray:
  """`count` random labels of `kind` (`base.LABEL_KINDS`) for data of `width` classes, targets or labels."""
  if kind == 'classes':
    return rng.integers(0, width, count).astype(np.int32)
  if kind == 'targets':
    return rng.normal(size=(count, width)).astype(np.float32)
  if kind == 'binary':
    return rng.integers(0, 2, (count, width)).astype(np.int32)
  if kind == 'classes_per_position':
    labels = rng.integers(0, width, (count, *positions)).astype(np.int32)
    labels.reshape(-1)[::3] = base.IGNORED
    return labels
  raise UsageError(f'label_kind={kind!r} is not one of {", ".join(base.LABEL_KINDS)}: a new kind joins '
                   'ensemble/tasks/base.py (LABEL_KINDS) and ensemble/tasks/check.py (labels_of_kind)')


def _finite(values: Any, what: str):
  values = np.asarray(values, np.float64)
  if not np.isfinite(values).all():
    raise Broken(f'{what} holds NaN or infinite values: {values.ravel()[:6]}')


def declares_its_answers(task: base.Task, case: Case | None):
  del case
  if not isinstance(task, base.Task) or not task.name:
    raise Broken(f'{type(task).__name__} is not a Task with a name (ensemble/tasks/base.py)')
  lacking = base.missing(type(task))
  if lacking:
    raise Broken(f'it does not answer {", ".join(lacking)}')
  if not (isinstance(task.noun, tuple) and len(task.noun) == 2 and all(isinstance(n, str) for n in task.noun)):
    raise Broken(f'noun={task.noun!r}: give (singular, plural)')
  if not all(isinstance(score, str) for score in task.conformal_scores) or not isinstance(task.conformal_scores,
                                                                                           tuple):
    raise Broken(f'conformal_scores={task.conformal_scores!r}: give a tuple of names, the default first')
  if 'loss' not in task.eval_scores:
    raise Broken(f"eval_scores={task.eval_scores!r} has no 'loss': the summary's losses are its")


def reads_labels_of_its_kind(task: base.Task, case: Case):
  got = task.read_labels(case.labels, 'labels')
  if len(got) != len(case.labels):
    raise Broken(f'read_labels gave {len(got)} rows of {len(case.labels)}')
  if not 0 < task.examples(got) <= np.asarray(got).size:
    raise Broken(f'examples() counts {task.examples(got)} labelled examples in labels of shape {got.shape}')


def refuses_other_labels_in_one_line(task: base.Task, case: Case):
  del case
  try:
    task.read_labels(np.array(['a', 'b', 'c']), 'labels')
  except DataError as e:
    if '\n' in str(e) or 'labels' not in str(e):
      raise Broken(f'its refusal is not one line naming the labels: {e}') from None
    return
  except Exception as e:  # pylint: disable=broad-except
    raise Broken(f'read_labels of strings raised {type(e).__name__}: {e} (a DataError, one line, is the refusal)'
                 ) from None
  raise Broken('read_labels took labels of strings')


def counts_its_outputs(task: base.Task, case: Case):
  outputs = task.model_outputs(case.width)
  if task.width(outputs) != case.width:
    raise Broken(f'width(model_outputs({case.width}) = {outputs}) = {task.width(outputs)}, not {case.width}')
  one = (1, *case.outputs.shape[2:])  # one input's outputs, with its batch axis
  if task.output_error(one, case.width, case.outputs.shape[2:-1]) is not None:
    raise Broken(f'output_error refuses outputs of the shape model_outputs asks for, {one}')


def loss_is_a_finite_scalar_it_can_descend(task: base.Task, case: Case):
  labels = jnp.asarray(task.read_labels(case.labels, 'labels'))
  outputs = jnp.asarray(case.outputs[0])
  (loss, metrics), grad = jax.value_and_grad(task.loss, has_aux=True)(outputs, labels)
  if np.shape(loss) != ():
    raise Broken(f'loss is of shape {np.shape(loss)}, not a scalar')
  _finite(loss, 'the loss')
  for name, value in metrics.items():
    if np.shape(value) != ():
      raise Broken(f'metric {name!r} of the loss is of shape {np.shape(value)}, not a scalar')
    _finite(value, f'metric {name!r}')
  _finite(grad, "the loss's gradient")
  if not np.any(np.asarray(grad)):
    raise Broken("the loss's gradient with respect to the outputs is 0 everywhere")
  kept = task.member_output(outputs)
  if np.shape(kept)[0] != ROWS:
    raise Broken(f'member_output of {ROWS} inputs gave {np.shape(kept)}')


def _eval(task: base.Task, case: Case) -> dict[str, np.ndarray]:
  labels = jnp.asarray(task.read_labels(case.labels, 'labels'))
  scores = jax.vmap(lambda o: task.eval_outputs(o, labels, axis_name='members'), axis_name='members')
  return {name: np.asarray(value) for name, value in scores(jnp.asarray(case.outputs)).items()}


def eval_outputs_give_every_score(task: base.Task, case: Case):
  outputs = _eval(task, case)
  for suffix in task.eval_scores.values():
    for who in ('member', 'ensemble'):
      name = f'{who}_{suffix}'
      if name not in outputs:
        raise Broken(f'eval_outputs gives no {name!r} (eval_scores asks for {suffix!r}); it gave {sorted(outputs)}')
      if outputs[name].shape[:2] != (MEMBERS, ROWS):
        raise Broken(f'{name} of shape {outputs[name].shape[1:]} for {ROWS} inputs; give one per input')
      _finite(outputs[name], name)


def summary_is_finite_in_the_data_units(task: base.Task, case: Case):
  labels = jnp.asarray(task.read_labels(case.labels, 'labels'))
  _, metrics = task.loss(jnp.asarray(case.outputs[0]), labels)
  outputs = task.in_data_units(_eval(task, case))
  test = {}
  for name, suffix in task.eval_scores.items():
    test[name] = float(np.mean(outputs[f'ensemble_{suffix}'][0]))
    test[f'member_{name}'] = [float(np.mean(outputs[f'member_{suffix}'][k])) for k in range(MEMBERS)]
  summary = task.summary({name: float(value) for name, value in metrics.items()}, test)
  for key in ('train_loss', 'test_loss', 'member_test_loss/0'):
    if key not in summary:
      raise Broken(f'summary has no {key!r}: it gave {sorted(summary)}')
  _finite(list(summary.values()), 'the summary')


def refusals_are_one_line(task: base.Task, case: Case):
  del case
  for step in ('calibrate', 'conformal'):
    why = task.refuses(step)
    if why is not None and (not isinstance(why, str) or '\n' in why):
      raise Broken(f'refuses({step!r}) gave {why!r}: give None or the end of a one-line error')
    if why is None and step == 'conformal' and not task.conformal_scores:
      raise Broken('it takes conformal with no conformal score')


INVARIANTS = (declares_its_answers, reads_labels_of_its_kind, refuses_other_labels_in_one_line, counts_its_outputs,
              loss_is_a_finite_scalar_it_can_descend, eval_outputs_give_every_score,
              summary_is_finite_in_the_data_units, refusals_are_one_line)


def check_task(task: base.Task, seed: int = 0) -> None:
  """Runs every invariant of the task interface on `task` (an instance, as `Task.of` makes one); raises
  `UsageError` naming the first it breaks and what was seen, returns None where it keeps them all."""
  name = getattr(task, 'name', type(task).__name__)
  declared = None
  for invariant in INVARIANTS:
    try:
      if declared is None and invariant is not declares_its_answers:
        declared = _case(task, np.random.default_rng(seed))
      invariant(task, declared)
    except (Broken, UsageError, NotImplementedError) as e:
      raise UsageError(f'check_task({name}): {invariant.__name__}: {e or type(e).__name__}') from None


def _case(task: base.Task, rng: np.random.Generator) -> Case:
  width = task.targets if isinstance(task, base.Targets) else 3  # a `Targets` task's are its statistics'
  positions = POSITIONS if task.per_position else ()
  labels = labels_of_kind(task.label_kind, rng, ROWS, width, positions)
  outputs = rng.normal(size=(MEMBERS, ROWS, *positions, task.model_outputs(width))).astype(np.float32)
  return Case(width, labels, outputs)
