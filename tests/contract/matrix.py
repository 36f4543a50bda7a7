"""The contract's matrix: which cells there are, and which invariants each must keep.

A cell is (method, task, data path, backend). `cases()` yields every cell with every check its path runs: a new
method or task joins `lab.METHODS` / `TASKS` and inherits them all; a new data path or entry point adds a row to
`CHECKS`. Where a combination cannot hold a check, `UNSUPPORTED` says why, and the case is reported as skipped with
that reason rather than left out.
"""

import os

import pytest

from lab import CHAIN_METHODS, CHAINS, METHODS, Cell

TASKS = ('classification', 'regression', 'multilabel', 'dense', 'quantile')
# The whole matrix, every method on every task and path (`ENSEMBLE_CONTRACT_TASKS=all`: 2,660 cases, 3,185 with
# `ENSEMBLE_CONTRACT_CHAINS=all`, more than 14 minutes on 2 cores), has no room in CI's 25 minutes on a machine
# whose compilation cache is empty; by default a cell is left out only where another covers each pair of its axes:
# - every method on classification and regression on arrays in memory (the checks that see what a method trains and
#   answers: units, `apply`, warm starts, save/load, refits, early stopping) and after fit;
# - every method on every other data path on classification: a path changes how rows reach the same trainer;
# - the deep ensemble on every task and every path: a task changes what the rows and the outputs are, not a path.
FULL = os.environ.get('ENSEMBLE_CONTRACT_TASKS') == 'all'
EVERY_METHOD = TASKS if FULL else TASKS[:2]
# The data paths: arrays in memory; a random-access source, streamed; a converted folder of ArrayRecord files
# trained by the command line's trainer, streamed; `fit(workdir=...)`. And the jit backend, on arrays: where it
# differs from pmap is placement, which every other check leaves to pmap (what an ensemble answers, `apply` and
# `save` among it, is computed where the members are, whichever backend trained them).
PATHS = (('arrays', 'pmap'), ('arrays', 'jit'), ('source', 'pmap'), ('folder', 'pmap'), ('workdir', 'pmap'))
# Which checks each path runs.
CHECKS = {
    ('arrays', 'pmap'): ('summary_is_finite_in_one_unit', 'apply_is_a_function_of_params', 'warm_start_continues',
                         'warm_start_across_methods', 'save_load_predicts_the_same', 'refit_compiles_nothing',
                         'workdir_knows_its_data', 'warm_start_under_every_schedule', 'calibration_is_kept',
                         'early_stopping_keeps_the_best_epoch', 'the_test_loss_is_the_reference_computation'),
    ('arrays', 'jit'): ('same_members_as_in_memory',),
    # Each path's summary is the in-memory one's (same_members_as_in_memory): its unit is checked there.
    ('source', 'pmap'): ('same_members_as_in_memory', 'refit_compiles_nothing', 'early_stopping_keeps_the_best_epoch'),
    ('folder', 'pmap'): ('same_members_as_in_memory', 'resume_equals_uninterrupted',
                         'early_stopping_keeps_the_best_epoch'),
    ('workdir', 'pmap'): ('same_members_as_in_memory', 'save_load_predicts_the_same', 'resume_equals_uninterrupted',
                          'workdir_knows_its_data', 'calibration_is_kept', 'early_stopping_keeps_the_best_epoch',
                          'sigterm_resumes_exactly'),
}
# (check, method or None for any) -> why the combination does not hold it.
UNSUPPORTED = {
    ('warm_start_under_every_schedule', None): 'the deep ensemble stands for every method: a schedule is the '
                                               "optimizer's, which no method changes but snapshot and multiswag, "
                                               'whose own checks run under their schedules',
}


def _unsupported(check: str, cell: Cell) -> str | None:
  if check == 'warm_start_under_every_schedule' and cell.method != 'independent':
    return UNSUPPORTED[check, None]
  return UNSUPPORTED.get((check, cell.method))


def _tasks(method: str) -> tuple[str, ...]:
  """The tasks whose cells `method` has (`EVERY_METHOD`)."""
  return TASKS if method == 'independent' else EVERY_METHOD


def _paths(method: str, task: str) -> tuple[tuple[str, str], ...]:
  """The (path, backend) pairs of `method`'s cells on `task`: every one, but arrays in memory alone for a method
  other than the deep ensemble on a task other than classification (`FULL`: every one)."""
  return PATHS if FULL or method == 'independent' or task == 'classification' else PATHS[:1]


def cells() -> list[Cell]:
  """Every cell, a method's and task's paths one after another: they share their compiled programs."""
  return [Cell(method, task, path, backend) for method in METHODS for task in _tasks(method)
          for path, backend in _paths(method, task)]


def cases():
  """pytest params (check name, cell), one per check a cell runs, with ids 'check[method-task-path-backend]'."""
  for cell in cells():
    for check in CHECKS[cell.path, cell.backend]:
      why = _unsupported(check, cell)
      marks = [pytest.mark.skip(reason=why)] if why else []
      yield pytest.param(check, cell, id=f'{check}[{cell.id}]', marks=marks)


# Life after fit: every method and task's ensemble (trained in memory on arrays, and its workdir run loaded at an
# earlier checkpoint) through every chain of post-hoc steps (lab.CHAINS), keeping checks.AFTER_FIT's invariants; the
# conformal coverage where the chain has a conformal step.
AFTER_FIT_CHECKS = ('the_value_is_the_same_wherever_it_goes', 'conformal_covers_fresh_data',
                    'the_report_gives_predict_s_numbers')


# The deep ensemble goes through every chain on every task; another method through the chain with both of the steps
# that read its outputs (a temperature, then a conformal quantile), the flag thresholds, and the chains that name it
# (`CHAIN_METHODS`: mimo refuses the distance step). A method changes the outputs a chain's steps read and what is
# saved of it; a chain's order and its steps' other combinations are the chain's, on each task (`FULL`: every chain
# everywhere).
EVERY_CHAIN = ('calibrate_then_conformal', 'flags')


def _chains(method: str) -> tuple[str, ...]:
  """The chains of `method`'s ensemble on every task (those of `CHAIN_METHODS` that take it)."""
  every = FULL or method == 'independent'
  return tuple(chain for chain in CHAINS if method in CHAIN_METHODS.get(chain, (method,))
               and (every or chain in EVERY_CHAIN or method in CHAIN_METHODS.get(chain, ())))


def after_fit_cases():
  """pytest params (check name, cell, chain), with ids 'check[method-task-chain]'."""
  for method in METHODS:
    for task in _tasks(method):
      for chain in _chains(method):
        steps = CHAINS[chain]
        for check in AFTER_FIT_CHECKS:
          if check == 'conformal_covers_fresh_data' and not {'conformal', 'class_conditional'} & set(steps):
            continue
          # The report reads what `predict` and `evaluate` answer, which the other checks hold for every method:
          # the deep ensemble's every chain on every task stands for them (`FULL`: every method's).
          if check == 'the_report_gives_predict_s_numbers' and not (FULL or method == 'independent'):
            continue
          yield pytest.param(check, Cell(method, task, 'arrays'), chain, id=f'{check}[{method}-{task}-{chain}]')
