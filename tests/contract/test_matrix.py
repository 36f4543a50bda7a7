"""Every cell of the contract's matrix (matrix.py) keeps every invariant its data path promises (checks.py).

  python -m pytest tests/contract -k 'snapshot and regression'      # one method's cells
  python -m pytest tests/contract -k 'resume_equals_uninterrupted'  # one invariant everywhere
  python -m pytest tests/contract -k 'conformal_then_calibrate'      # one chain of post-hoc steps everywhere
"""

import pytest

import checks
import matrix
from ensemble.host_memory import release_compiled_programs_if_many
from lab import Lab


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
