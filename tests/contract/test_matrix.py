"""Every cell of the contract's matrix (matrix.py) keeps every invariant its data path promises (checks.py).

  python -m pytest tests/contract -k 'snapshot and regression'      # one method's cells
  python -m pytest tests/contract -k 'resume_equals_uninterrupted'  # one invariant everywhere
  python -m pytest tests/contract -k 'conformal_then_calibrate'      # one chain of post-hoc steps everywhere
"""

import pytest

import checks
import matrix
from ensemble import tasks
from ensemble.host_memory import release_compiled_programs_if_many
from lab import LABELS, Lab, rows


@pytest.fixture(scope='session')
def lab(tmp_path_factory) -> Lab:
  return Lab(str(tmp_path_factory.mktemp('contract')))


_GROUP = []


@pytest.mark.parametrize('check, cell', list(matrix.cases()))
def test_cell_keeps_the_contract(check, cell, lab):
  if _GROUP != [cell.method, cell.task]:  # the last method and task's programs are not needed again: let them go
    _GROUP[:] = [cell.method, cell.task]  # if the process maps many regions
    release_compiled_programs_if_many()
  if check == 'save_load_predicts_the_same':  # one new process loads every ensemble that `save` wrote
    saved = [c for c in matrix.cells() if c.path == 'arrays' and check in matrix.CHECKS[c.path, c.backend]]
    checks.ALL[check](cell, lab, saved)
  else:
    checks.ALL[check](cell, lab)


@pytest.mark.parametrize('check, cell, chain', list(matrix.after_fit_cases()))
def test_life_after_fit_keeps_the_contract(check, cell, chain, lab):
  checks.AFTER_FIT[check](cell, lab, chain)


def test_the_lab_draws_every_kind_of_labels_a_task_declares():
  """A task's cells train on labels of the kind it declares (`Task.label_kind`): the lab draws each kind the package
  knows, and one it does not is refused, never drawn as another kind's (a count task once passed every contract case
  on 0/1 labels); every task has a reference loss (`checks.REFERENCE_LOSS`)."""
  assert set(LABELS) == set(tasks.LABEL_KINDS)
  assert set(checks.REFERENCE_LOSS) == set(tasks.NAMES) == set(matrix.TASKS)
  for name in tasks.NAMES:
    x, y = rows(name, 8)
    assert len(tasks.named(name).read_labels(y, 'lab')) == len(x) == 8
  try:
    tasks.TASKS['mystery'] = type('Mystery', (tasks.TASKS['regression'],), {'name': 'mystery'})
    tasks.named.cache_clear()
    tasks.TASKS['mystery'].label_kind = 'ranks'  # set after the class is defined, which would refuse it
    with pytest.raises(AssertionError, match="declares labels of kind 'ranks', which the lab does not draw"):
      rows('mystery', 8)
  finally:
    tasks.TASKS.pop('mystery', None)
    tasks.named.cache_clear()
