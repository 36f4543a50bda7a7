"""What `pip install -e .` must bring: every package the package imports, declared in setup.cfg's install_requires
(or, where a one-line message names it, in an extra), and what its imports need at run time without importing it
by name (JAX's serialization of an exported program reads flatbuffers)."""

import ast
import configparser
import importlib.metadata
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Distributions that a library the package calls needs at run time, found by no import statement of ours:
# jax.export's serialize() (python -m ensemble.export) imports flatbuffers, which jax does not require.
RUNTIME_NEEDS = {'flatbuffers': 'ensemble/export.py'}


def _requirements() -> tuple[set[str], set[str]]:
  """(install_requires, every extra's) as normalised distribution names."""
  config = configparser.ConfigParser()
  config.read(os.path.join(REPO, 'setup.cfg'))
  names = lambda text: {_normal(re.split(r'[\[<>=!~; ]', line.strip())[0]) for line in text.splitlines()
                        if line.strip() and not line.strip().startswith('#')}
  extras = set().union(*(names(text) for text in config['options.extras_require'].values()))
  return names(config['options']['install_requires']), extras


def _normal(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


def _imports() -> dict[str, str]:
  """Every top-level module the package's code imports, but the standard library's and its own: -> a file that
  imports it."""
  found = {}
  for folder, _, names in os.walk(os.path.join(REPO, 'ensemble')):
    for name in names:
      if not name.endswith('.py'):
        continue
      path = os.path.join(folder, name)
      with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                   else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        for module in modules:
          top = module.split('.')[0]
          if top not in sys.stdlib_module_names and top != 'ensemble':
            found.setdefault(top, os.path.relpath(path, REPO))
  return found


def test_every_import_is_declared():
  required, extras = _requirements()
  distributions = importlib.metadata.packages_distributions()
  undeclared = []
  for module, where in sorted(_imports().items()):
    names = {_normal(name) for name in distributions.get(module, [module])}
    if not names & (required | extras):
      undeclared.append(f'{module} ({where}; distribution {sorted(names)})')
  assert not undeclared, f'imported but not in setup.cfg: {undeclared}'


def test_what_imports_need_at_run_time_is_declared():
  required, _ = _requirements()
  missing = {name: where for name, where in RUNTIME_NEEDS.items() if _normal(name) not in required}
  assert not missing, f'needed at run time but not in install_requires: {missing}'


def test_the_check_fails_on_an_undeclared_import(monkeypatch):
  """The check can fail: with clu left out of install_requires, clu's imports are reported."""
  real = _requirements()
  monkeypatch.setattr(sys.modules[__name__], '_requirements', lambda: (real[0] - {'clu'}, real[1]))
  try:
    test_every_import_is_declared()
  except AssertionError as e:
    assert 'clu' in str(e)
  else:
    raise AssertionError('an undeclared import passed the check')


def test_pytest_approx_refuses_a_jax_array_on_every_pytest_version():
  """pytest 9.2's approx reads `expected.flat`, which JAX arrays refuse: the suite's approx (tests/conftest.py)
  refuses them on any version, so that a test passing here passes on a fresh install too."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  for expected in (jnp.float32(1.0), [1.0, jnp.ones(2)], {'nll': jnp.zeros(())}):
    with pytest.raises(TypeError, match='JAX array'):
      pytest.approx(expected, rel=1e-6)
  assert 1.0 == pytest.approx(float(jnp.float32(1.0)), rel=1e-6)
  assert np.ones(2) == pytest.approx(np.asarray(jnp.ones(2)), rel=0.1)
