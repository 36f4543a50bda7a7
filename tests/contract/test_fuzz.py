"""Generated inputs: `fit` and `predict` either work, with finite answers, or raise the package's one exception
(UsageError, of which DataError is one) in one line: never another exception, never a silent NaN.

hypothesis draws the arrays: a training set that would train, then one thing wrong with it (or nothing): a dtype,
NaN or an infinity somewhere, values beyond float32, no rows, a rank too many or too few, labels of another
length, kind or range. Derandomized, so that CI runs the same examples every time; a failure prints the smallest
example that fails.
"""

import numpy as np
import pytest

import ensemble
from lab import COMMON, problem

hypothesis = pytest.importorskip('hypothesis')
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402  pylint: disable=g-import-not-at-top
from hypothesis.extra import numpy as hnp  # noqa: E402  pylint: disable=g-import-not-at-top

FIT = {**COMMON, 'epochs': 1, 'batch_size': 4, 'progress': False}
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_, np.float16, np.complex64]
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _values(draw, shape, dtypes=DTYPES):
  """An array of one of `dtypes`, its values anything the dtype holds: NaN, infinities, the largest values."""
  return draw(hnp.arrays(np.dtype(draw(st.sampled_from(dtypes))), shape))


def _broken(draw, array: np.ndarray) -> np.ndarray:
  """`array` with one thing wrong, drawn; or as it was."""
  fault = draw(st.sampled_from(['none', 'none', 'dtype', 'special', 'huge', 'empty', 'rank+', 'rank-', 'length']))
  if fault == 'dtype':
    return _values(draw, array.shape)
  if fault == 'special' and array.dtype.kind == 'f':
    array = array.copy()
    array.flat[draw(st.integers(0, array.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
  if fault == 'huge' and array.dtype.kind == 'f':
    array = array.astype(np.float64) * draw(st.sampled_from([1e30, 1e39, 1e300]))
  if fault == 'empty':
    return array[:0]
  if fault == 'rank+':
    return array[..., None]
  if fault == 'rank-':
    return array.reshape(-1)[:len(array)] if array.ndim > 1 else array[:, None][:, :0]
  if fault == 'length':
    return array[:max(len(array) - 1, 0)]
  return array


@st.composite
def training_sets(draw):
  """(task, x, y): a problem that trains (5 to 40 rows of 3 or 2x3 features; 3 classes or 1-2 targets), then
  broken in its inputs or its labels, or neither."""
  task = draw(st.sampled_from(['classification', 'regression']))
  rows = draw(st.sampled_from([5, 16, 40]))
  example = draw(st.sampled_from([(3,), (2, 3)]))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  x = rng.normal(size=(rows, *example)).astype(np.float32)
  y = (rng.integers(0, 3, rows).astype(np.int64) if task == 'classification'
       else rng.normal(size=(rows, draw(st.sampled_from([1, 2])))).astype(np.float32))
  if draw(st.booleans()):
    x = _broken(draw, x)
  else:
    y = _broken(draw, y)
  return task, x, y


def _check_answer(ens, x):
  result = ens.predict(x)
  for key, value in result.items():
    assert np.isfinite(np.asarray(value, np.float64)).all(), f'predict returned non-finite {key!r}'


@FUZZ
@given(training_sets())
def test_fit_works_or_raises_usage_error(case):
  task, x, y = case
  try:
    ens = ensemble.fit('mlp', (x, y), task=task, **FIT)
  except ensemble.UsageError as e:
    assert str(e) and '\n' not in str(e), str(e)
    return
  _check_answer(ens, x)


@pytest.fixture(scope='module')
def fitted():
  return {task: ensemble.fit('mlp', problem(task)[0], task=task, **FIT) for task in ('classification', 'regression')}


@st.composite
def inputs(draw):
  """Inputs for an ensemble of 3 features: well formed, or broken as the training sets are."""
  rows = draw(st.sampled_from([1, 5, 33]))
  x = np.random.default_rng(draw(st.integers(0, 2**16))).normal(size=(rows, 3)).astype(np.float32)
  return _broken(draw, x)


@FUZZ
@given(inputs(), st.sampled_from(['classification', 'regression']))
def test_predict_works_or_raises_usage_error(fitted, x, task):
  try:
    _check_answer(fitted[task], x)
  except ensemble.UsageError as e:
    assert str(e) and '\n' not in str(e), str(e)
