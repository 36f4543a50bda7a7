"""The package's modules import one another without a circle: a circle is what made a module need a function-local
import to load at all, and a new task, step or model had to learn which. Counted from the source (ast) as
../shared/tools/imports.py counts them, a function-local import tying two modules as a top-level one does; and
checked by loading, since importing `ensemble.a.b` runs `ensemble/a/__init__.py` first, which the source's edges do
not show (models/user.py's import of methods/mc_dropout.py loaded methods/__init__.py, which imported it back)."""

import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The function-local imports of the package's own modules there are (49 with two circles): none may be added.
LOCAL_IMPORTS = 47
# Modules that each start an import of the layers below them, loaded first in a process of their own.
ENTRY_MODULES = ('ensemble.models', 'ensemble.models.user', 'ensemble.methods', 'ensemble.steps',
                 'ensemble.parallel.fsdp', 'ensemble.tasks', 'ensemble.data', 'ensemble.scoring', 'ensemble.posthoc',
                 'ensemble.recipe')


def _modules() -> dict[str, str]:
  found = {}
  for folder, _, names in os.walk(os.path.join(REPO, 'ensemble')):
    for name in names:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        found[os.path.relpath(path, REPO)[:-3].replace(os.sep, '.').removesuffix('.__init__')] = path
  return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
  """(module -> the package modules it imports, the function-local imports as 'module:line')."""
  modules = _modules()

  def resolve(name: str) -> str:
    while name and name not in modules:
      name = name.rpartition('.')[0]
    return name

  edges, local = {m: set() for m in modules}, []
  for module, path in modules.items():
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read())
    top = {id(node) for statement in tree.body if isinstance(statement, (ast.If, ast.Try))
           for node in ast.walk(statement)} | {id(node) for node in tree.body}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
      else:
        continue
      targets = {resolve(n) for n in names if n.split('.')[0] == 'ensemble'} - {'', module}
      edges[module] |= targets
      if targets and id(node) not in top:
        local.append(f'{module}:{node.lineno}')
  return edges, local


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module, but a package with its own submodules (its
  __init__ importing them, they it: Python loads that order)."""
  index, low, stack, on, found = {}, {}, [], set(), []

  def visit(v):  # Tarjan's algorithm
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on.discard(component[-1])
      root = min(component, key=len)
      if len(component) > 1 and not all(m == root or m.startswith(root + '.') for m in component):
        found.append(sorted(component))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in edges:
    if v not in index:
      visit(v)
  return found


def test_no_module_imports_itself_through_others():
  edges, local = _graph()
  assert not _circles(edges), '\n'.join(' '.join(c) for c in _circles(edges))
  assert len(local) <= LOCAL_IMPORTS, f'{len(local)} function-local imports of the package: {local}'


def test_the_check_finds_a_circle():
  edges, _ = _graph()
  assert 'ensemble.scoring' in edges['ensemble.tasks.dense']  # the dense task imports scoring; scoring importing it
  edges['ensemble.scoring'].add('ensemble.tasks.dense')
  assert any({'ensemble.scoring', 'ensemble.tasks.dense'} <= set(circle) for circle in _circles(edges))


def test_each_layer_loads_first():
  """Each entry module imported first in a new process: a circle through a package's __init__ fails here."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  runs = {m: subprocess.Popen([sys.executable, '-c', f'import {m}'], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for m in ENTRY_MODULES}
  failed = {m: run.communicate(timeout=300)[1].strip().splitlines()[-1:] for m, run in runs.items()}
  assert not {m: line for m, line in failed.items() if runs[m].returncode}
