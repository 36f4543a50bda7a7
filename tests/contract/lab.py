"""The contract's tiny problem and its fits: each made once per test session and shared by every check that asks.

One problem serves every cell: 64 rows of 3 features on very different scales (standardising them matters), 3
classes, 3 labels of 0 and 1 (multi-label), a class at each of 4 positions (dense: a row of 4 such rows), or 2
regression targets on very different scales and far from 0 (standardising them matters too), and 16 rows to test
on. Every method trains 2 members of the built-in MLP for 2
epochs of 4 steps, so that a cell costs a fraction of a second once its programs are compiled; the programs are
shared by every cell that computes the same (a streamed source's and a converted folder's, a fit's and its refits').
"""

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Any, NamedTuple

import jax
import numpy as np

import ensemble
from ensemble import data, tasks
from ensemble.data import arrays as data_arrays, convert

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)

TRAIN_ROWS, TEST_ROWS = 64, 16
# A dense task's rows: sequences of 4 positions, a fifth of them without a label.
POSITIONS, UNLABELLED, IGNORED = 4, 0.2, -1
TARGET_SCALES, TARGET_OFFSETS = np.array([1.0, 1000.0]), np.array([0.5, 5000.0])
# What every cell trains with; a cell's method adds its own fields (`METHODS`).
COMMON = {'ensemble_size': 2, 'epochs': 2, 'batch_size': 16, 'optimizer': 'adamw', 'learning_rate': 0.01,
          'weight_decay': 0.0, 'standardize_features': True}
STEPS_PER_EPOCH = TRAIN_ROWS // COMMON['batch_size']
# Per method, what makes it train on the tiny problem. 'adversarial' is the deep ensemble with FGSM examples
# (adversarial training goes with any method; the deep ensemble stands for them).
METHODS = {
    'independent': {},
    'bagging': {'method': 'bagging'},
    'hyper': {'method': 'hyper', 'hyper_learning_rate': (0.005, 0.02)},
    'snapshot': {'method': 'snapshot', 'snapshot_cycles': 2},
    'batchensemble': {'method': 'batchensemble'},
    'mc_dropout': {'method': 'mc_dropout'},
    'mimo': {'method': 'mimo'},
    'packed': {'method': 'packed'},
    'multiswag': {'method': 'multiswag', 'swag_start': 0.5, 'swag_rank': 2, 'swag_samples': 2,
                  'swag_learning_rate': 0.005},
    'adversarial': {'adversarial_epsilon': 0.01},
    # K heads on one trunk (ensemble/sharing.py): its first layer frozen, its second trained by all members together.
    'shared_trunk': {'shared': ('Dense_0', 'Dense_1'), 'frozen': ('Dense_0',)},
    # K rank-2 adapters (LoRA) of one frozen trunk.
    'adapters': {'shared': ('Dense_0', 'Dense_1'), 'adapter_rank': 2},
    # The K heads' trunk split over all the devices (backend jit on every path: the members spread over 8 devices),
    # its small weights too.
    'shared_trunk_split': {'shared': ('Dense_0', 'Dense_1'), 'frozen': ('Dense_0',), 'backend': 'jit',
                           'shared_sharding': 'fsdp', 'min_weight_size': 1},
}
# What a workdir run checkpoints: every 2 steps, mid-epoch and at each epoch's end (steps 2, 4, 6, 8).
WORKDIR_FIELDS = {'checkpoint_every_steps': 2, 'checkpoints_to_keep': 10}


class Cell(NamedTuple):
  """One cell of the matrix: a method, a task, how the data reaches the trainer, and the backend."""
  method: str
  task: str
  path: str
  backend: str = 'pmap'

  @property
  def id(self) -> str:
    return '-'.join(self)

  def fields(self, **more) -> dict[str, Any]:
    """`fit`'s keywords for this cell."""
    return {**COMMON, 'backend': self.backend, **METHODS[self.method], 'task': self.task, **more}


def _classes(signal, rng, scale):
  del scale
  return np.digitize(signal[..., 0], [-0.5, 0.5]).astype(np.int32)


def _targets(signal, rng, scale):
  return ((signal + 0.1 * rng.normal(size=signal.shape)) * TARGET_SCALES + TARGET_OFFSETS) * scale


def _binary(signal, rng, scale):
  del scale
  return np.stack([signal[:, 0] > 0, signal[:, 1] > 0, signal[:, 0] > signal[:, 1]], 1).astype(np.int32)


def _classes_per_position(signal, rng, scale):
  y = _classes(signal, rng, scale)
  return np.where(rng.random(y.shape) < UNLABELLED, IGNORED, y)


# What the lab draws for each kind of labels a task declares (`Task.label_kind`, ensemble/tasks/base.py): from the
# rows' signal, learnable; `scale` is the unit of real-valued targets. A task of a kind missing here fails in
# `rows`, never falls through to another kind's.
LABELS = {'classes': _classes, 'targets': _targets, 'binary': _binary,
          'classes_per_position': _classes_per_position}


def rows(task: str, count: int, seed: int = 0, scale: float = 1.0, features: int = 3):
  """(x, y): `count` rows of the tiny problem, drawn from `seed`, labelled as the task declares its labels
  (`LABELS`: classes, real-valued targets, 0/1 labels, a class per position); `scale` multiplies real-valued targets
  (their unit). A row of a task with a label per position is a sequence of `POSITIONS` such rows, a class each, or
  none (`IGNORED`: a share of them)."""
  rng, kind = np.random.default_rng(seed), tasks.named(task)
  if kind.label_kind not in LABELS:
    raise AssertionError(f'task {task!r} declares labels of kind {kind.label_kind!r}, which the lab does not draw: '
                         'add it to tests/contract/lab.py LABELS')
  positions = (POSITIONS,) if kind.per_position else ()
  x = rng.normal(size=(count, *positions, features)) * np.array([1.0, 100.0, 0.01][:features])
  signal = np.stack([np.sin(x[..., 0]) + x[..., -1] * 30, x[..., min(1, features - 1)] / 100 - x[..., 0]], -1)
  y = LABELS[kind.label_kind](signal, rng, scale)
  return x.astype(np.float32), (y.astype(np.float32) if np.issubdtype(y.dtype, np.floating) else y)


def problem(task: str, seed: int = 0, scale: float = 1.0, features: int = 3):
  """((x, y), (x_test, y_test)) of the tiny problem: TRAIN_ROWS and TEST_ROWS rows."""
  x, y = rows(task, TRAIN_ROWS + TEST_ROWS, seed, scale, features)
  return (x[:TRAIN_ROWS], y[:TRAIN_ROWS]), (x[TRAIN_ROWS:], y[TRAIN_ROWS:])


# Life after fit: the post-hoc steps, each fitted on its own fresh rows of the problem (CALIBRATION_ROWS, drawn
# from a seed of its own), and the chains of them that every method and task's ensemble goes through (matrix.py).
# A new post-hoc step joins with one line here, and the chains that end with it.
CALIBRATION_ROWS = {'calibrate': (300, 11), 'conformal': (1000, 12), 'class_conditional': (1000, 12),
                    'flags': (300, 13), 'fresh': (4000, 14), 'distance': (300, 15)}
CONFORMAL_ALPHA = 0.1
POSTHOC = {
    'calibrate': lambda ens, x, y: ens.calibrate(x, y),
    'conformal': lambda ens, x, y: ens.conformal(x, y, alpha=CONFORMAL_ALPHA),
    'class_conditional': lambda ens, x, y: ens.conformal(x, y, alpha=CONFORMAL_ALPHA, class_conditional=True),
    'flags': lambda ens, x, y: ens.flags(x, y, target_risk=0.2),
    'distance': lambda ens, x, y: ens.distance(x, y),
}
CHAINS = {'none': (), 'calibrate': ('calibrate',), 'conformal': ('conformal',),
          'calibrate_then_conformal': ('calibrate', 'conformal'),
          'conformal_then_calibrate': ('conformal', 'calibrate'), 'flags': ('flags',),
          'distance_then_conformal': ('distance', 'conformal'),
          'calibrate_then_class_conditional': ('calibrate', 'class_conditional'),
          'class_conditional_then_calibrate': ('class_conditional', 'calibrate')}
# The chains that only some methods go through, to keep the suite's time. The distance step's every cell passes (58
# cases, 200 s on 2 cores, ENSEMBLE_CONTRACT_CHAINS=all); the deep ensemble on every task and a method that refuses
# it (mimo: one line naming it) stand for them. The class-conditional chains' steps see nothing of the method but
# the outputs it gives: the deep ensemble stands for every method (the others' outputs go through the same steps in
# the chains above).
CHAIN_METHODS = ({} if os.environ.get('ENSEMBLE_CONTRACT_CHAINS') == 'all'
                 else {'distance_then_conformal': ('independent', 'mimo'),
                       'calibrate_then_class_conditional': ('independent',),
                       'class_conditional_then_calibrate': ('independent',)})


def as_source(split):
  """A pair of arrays as a random-access source: a list of (input, label) pairs, what `fit` streams."""
  x, y = split
  return [(x[i], y[i]) for i in range(len(x))]


def folder_digest(path: str) -> str:
  """A hash of every file's path, mode and bytes under `path`: 'left byte-for-byte untouched' is this unchanged."""
  digest = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files) + dirs:
      full = os.path.join(root, name)
      digest.update(os.path.relpath(full, path).encode())
      digest.update(str(os.stat(full).st_mode).encode())
      if os.path.isfile(full):
        with open(full, 'rb') as f:
          digest.update(f.read())
  return digest.hexdigest()


def timeless(summary: dict[str, Any]) -> dict[str, Any]:
  """A summary or metrics line without its timings: what two runs of the same steps agree on."""
  return {k: v for k, v in summary.items() if not k.endswith('_seconds')}


class Lab:
  """The session's fits, keyed by what they are: each cell's ensemble, made by its data path, once."""

  def __init__(self, root: str):
    self.root = root
    self._made: dict[Any, Any] = {}
    self._fresh = None

  def _once(self, key, make):
    if key not in self._made:
      self._made[key] = make()
    return self._made[key]

  def folder(self, task: str) -> str:
    """The tiny problem converted to a folder of ArrayRecord files (python -m ensemble.data.convert's output)."""
    def make():
      train, test = problem(task)
      path = os.path.join(self.root, f'folder-{task}')
      convert.write(data_arrays.from_arrays(train, test, 'features', task), path, examples_per_file=20)
      return path
    return self._once(('folder', task), make)

  def workdir(self, cell: Cell, name: str = 'run') -> str:
    return os.path.join(self.root, cell.id, name)

  def ensemble(self, cell: Cell, scale: float = 1.0) -> "ensemble.Ensemble":
    """The cell's ensemble, trained by its data path: in memory on arrays, on a streamed source, from a converted
    folder by the command line's trainer, or in a workdir."""
    return self._once(('ensemble', cell, scale), lambda: self._fit(cell, scale))

  def _fit(self, cell: Cell, scale: float) -> "ensemble.Ensemble":
    train, test = problem(cell.task, scale=scale)
    suffix = '' if scale == 1.0 else f'-x{scale:g}'
    if cell.path == 'arrays':
      return ensemble.fit('mlp', train, test=test, progress=False, **cell.fields())
    if cell.path == 'source':
      return ensemble.fit('mlp', as_source(train), test=as_source(test), progress=False, **cell.fields())
    if cell.path == 'workdir':
      return ensemble.fit('mlp', train, test=test, workdir=self.workdir(cell, 'run' + suffix), progress=False,
                          **cell.fields(**WORKDIR_FIELDS))
    if cell.path == 'folder':  # python -m ensemble.train --config.data_dir=FOLDER --config.streaming=always
      assert scale == 1.0, 'the folder holds the problem in its own units'
      workdir = self.workdir(cell)
      train_folder(cell, self.folder(cell.task), workdir, **WORKDIR_FIELDS)
      return ensemble.load(workdir)
    raise ValueError(cell.path)

  def early_stopped(self, cell: Cell) -> "ensemble.Ensemble":
    """The cell's fit in memory with early stopping (patience 1 over 4 epochs), scored on the problem's seed-7
    rows."""
    def make():
      train, test = problem(cell.task)
      return ensemble.fit('mlp', train, test=test, validation=problem(cell.task, seed=7)[0], progress=False,
                          **cell.fields(epochs=4, early_stopping=1))
    return self._once(('early_stopped', cell), make)

  def earlier(self, cell: Cell) -> "ensemble.Ensemble":
    """The cell's method and task, loaded from its workdir run at an earlier checkpoint than its last: epoch 1's end
    (step STEPS_PER_EPOCH, of the run's checkpoints every 2 steps)."""
    run = self.ensemble(cell._replace(path='workdir', backend='pmap'))
    return self._once(('earlier', cell.method, cell.task), lambda: ensemble.load(run.workdir, step=STEPS_PER_EPOCH))

  def chained(self, ens: "ensemble.Ensemble", chain: tuple[str, ...]) -> "ensemble.Ensemble":
    """`ens` after the post-hoc steps of `chain` in order (`POSTHOC`), each fitted on its own rows."""
    key = ('chained', id(ens), chain)
    if key not in self._made:
      for name in chain:
        ens = POSTHOC[name](ens, *self.calibration_rows(ens.task.name, name))
      self._made[key] = ens
    return self._made[key]

  def calibration_rows(self, task: str, role: str):
    """(x, y) of `role` (a post-hoc step's, or 'fresh': rows to judge them on), as `CALIBRATION_ROWS` draws them."""
    return self._once(('rows', task, role), lambda: rows(task, *CALIBRATION_ROWS[role]))

  def save(self, ens: "ensemble.Ensemble", name: str) -> str:
    """Where `ens` is saved, under a name of the caller's."""
    path = os.path.join(self.root, 'saved', name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return ens.save(path).workdir

  def saved(self, cell: Cell) -> str:
    """Where the cell's ensemble is on disk: its workdir, or where `save` wrote one trained in memory."""
    def make():
      ens = self.ensemble(cell)
      if ens.workdir is not None:
        return ens.workdir
      path = self.workdir(cell, 'saved')
      os.makedirs(os.path.dirname(path), exist_ok=True)
      return ens.save(path).workdir
    return self._once(('saved', cell), make)

  def fresh_predictions(self, cells: list[Cell]) -> dict[str, np.ndarray]:
    """Every cell's saved ensemble loaded and asked in one new process, which compiled and imported nothing
    before: {cell id: its member outputs}."""
    if self._fresh is None:
      asked = {}  # cell id -> (where its ensemble is, its task's test inputs)
      for cell in cells:
        inputs = os.path.join(self.root, f'fresh-inputs-{cell.task}.npy')
        np.save(inputs, problem(cell.task)[1][0])
        asked[cell.id] = (self.saved(cell), inputs)
      out = os.path.join(self.root, 'fresh.npz')
      code = ('import ensemble, json, sys, numpy as np; ensemble.cpu_devices(8); asked = json.loads(sys.argv[1]); '
              'np.savez(sys.argv[2], **{k: ensemble.load(p).member_outputs(np.load(x)) '
              'for k, (p, x) in asked.items()})')
      env = {**os.environ, 'PYTHONPATH': os.pathsep.join([TESTS, REPO])}
      result = subprocess.run([sys.executable, '-c', code, json.dumps(asked), out], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
      assert result.returncode == 0, result.stderr[-3000:]
      with np.load(out) as loaded:
        self._fresh = dict(loaded)
    return self._fresh


def train_folder(cell: Cell, folder: str, workdir: str, **more):
  """The command line's run on a converted folder, streamed, with the cell's fields as --config overrides."""
  from ensemble import defaults, trainer  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()
  fields = cell.fields(**more)
  fields['num_epochs'] = fields.pop('epochs')
  config.update({'heldout_fraction': 0.0, **fields, 'model': 'mlp', 'data_dir': folder, 'streaming': 'always',
                 'eval_every': 0, 'compilation_cache': '', 'augment': 'none'})
  for key in ('hyper_learning_rate',):
    if key in fields:
      config[key] = tuple(fields[key])
  return trainer.train_and_evaluate(config, workdir, progress=False)


def leaves(tree) -> list[np.ndarray]:
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def assert_same_members(got, want, rtol: float = 1e-4, atol: float = 1e-5, inputs=None):
  """The same members: every parameter, and every member's outputs on `inputs` (the problem's test inputs), to
  float32's tolerance."""
  got_leaves, want_leaves = leaves(got.state.params), leaves(want.state.params)
  assert len(got_leaves) == len(want_leaves)
  for a, b in zip(got_leaves, want_leaves):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
  x = problem(got.task.name)[1][0] if inputs is None else inputs
  np.testing.assert_allclose(got.member_outputs(x), want.member_outputs(x), rtol=rtol * 10, atol=atol * 10)


def assert_same_summary(got: dict, want: dict, rtol: float = 1e-4):
  got, want = timeless(got), timeless(want)
  assert sorted(got) == sorted(want), (sorted(got), sorted(want))
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-6, err_msg=key)


@functools.lru_cache(maxsize=None)
def mnist_train(rows: int = 64):
  """The bundled MNIST's first `rows` training examples, as `data.load` gives them ({'image', 'label'})."""
  train = data.load('mnist').train
  return {key: value[:rows] for key, value in train.items()}


def cut(workdir: str, copy: str, after_step: int) -> str:
  """A copy of `workdir` without its checkpoints after `after_step`: a run that stopped there."""
  shutil.copytree(workdir, copy)
  checkpoints = os.path.join(copy, 'checkpoints')
  for name in os.listdir(checkpoints):
    if name.isdigit() and int(name) > after_step:
      shutil.rmtree(os.path.join(checkpoints, name))
  return copy
