"""The settings resolved once, at the boundary: every rule, every refusal, one immutable `Recipe`.

  recipe, devices = resolve(config, jax.devices(), model=model, dataset=dataset)   # the command line, `fit`
  recipe = from_record(config_json)                                                # `load`, evaluate, predict

A setting travels one way: the command line's config file and `--config.FIELD`
overrides, `fit`'s keywords, or a workdir's config.json, become a `Recipe`
here (ensemble/defaults.py lists its fields); the loop, the trainer, the
backends, the tasks and the methods read it and never check or change it.
Each field is checked alone (`of`: its type and range), then with the others,
the devices and the data (`resolve`); a broken rule is one `UsageError` that
names the field and the fix, in the command line's terms (`--config.FIELD`;
`fit` rewrites them as `FIELD=`). What needs the model traced (its outputs
against the data's, its annotated shapes against the mesh) is checked where
the model is built, once per program (ensemble/members.py).
"""

import difflib
import json
import math
import numbers
import os
from typing import Any, Mapping, Sequence

import jax
from absl import logging

from ensemble import backends, data, methods, models, optim, steps, tasks
from ensemble.data import augment, stream
from ensemble.tasks.base import is_number, positive
from ensemble.defaults import FIELDS, Kwargs, Recipe, frozen, is_import_path
from ensemble.backends import sharded
from ensemble.errors import UsageError
from ensemble.models import user

__all__ = ['Recipe', 'of', 'resolve', 'from_record']

MEMBER_DATA = ('shared', 'shuffled', 'bootstrap')
DTYPES = ('float32', 'bfloat16')
MAX_SEED = 2**32 - 1  # jax.random.key folds larger seeds onto the same keys
# The members of `ensemble_size=0` on a single device (a laptop's CPU, one GPU): several on the device, as 0 means one
# per device only where there are several devices; an ensemble of one would be no ensemble.
ONE_DEVICE_MEMBERS = 8
# What decides which examples each member trains on, in which order, and which are held out for
# `ensemble.evaluate`: a resume must keep these as the workdir was started with them.
DATA_SETTINGS = ('dataset', 'train_split', 'test_split', 'data_dir', 'heldout_fraction', 'seed', 'batch_size',
                 'member_data', 'inputs', 'standardize_features', 'target')
# What else a resume must keep: another method's or another task's members have another state, and checkpoints
# are numbered by epoch, or by step where they are saved every checkpoint_every_steps steps.
RESUME_SETTINGS = DATA_SETTINGS + ('method', 'task', 'checkpoint_every_steps')
# What a method's run must keep besides, and why: a snapshot ensemble's cycles span num_epochs / snapshot_cycles
# epochs (another length would end a cycle mid-schedule and write the next snapshots over the last slot); MultiSWAG's
# collection phase starts at swag_start of the run, and its members keep swag_rank deviations.
METHOD_SETTINGS = {
    'snapshot': (('num_epochs', 'snapshot_cycles'), 'a snapshot ensemble keeps the length of its cycles '
                 '(num_epochs / snapshot_cycles epochs) for the whole run'),
    'multiswag': (('num_epochs', 'num_train_steps', 'swag_start', 'swag_rank'),
                  'MultiSWAG keeps the steps of its collection phase (swag_start of the run) and the shape of its '
                  'moments (swag_rank) for the whole run'),
}
# What every run's config.json holds, whatever its version: how a workdir's record is told from another file.
RECORD_KEYS = ('model', 'ensemble_size', 'learning_rate', 'momentum', 'eval_batch_size', 'data_dir')
# What a run recorded before a field existed ran as, where that is not the field's default today: nothing was
# streamed, and nothing held out.
LEGACY = {'streaming': 'never', 'heldout_fraction': 0.0}
# Values each field takes, where they are names: checked alone, before anything is read.
CHOICES = {
    'backend': backends.NAMES, 'member_sharding': backends.MEMBER_SHARDINGS, 'method': methods.NAMES,
    'shared_sharding': backends.SHARED_SHARDINGS,
    'task': tasks.NAMES, 'member_data': MEMBER_DATA, 'streaming': stream.MODES,
    'inputs': ('auto', *steps.INPUTS), 'augment': tuple(augment.AUGMENTATIONS), 'optimizer': tuple(optim.OPTIMIZERS),
    'schedule': tuple(optim.SCHEDULES), 'dtype': DTYPES,
}


def _require(ok: bool, message: str):
  if not ok:
    raise UsageError(message)


# --- each field alone --------------------------------------------------------------------------------------------

_DEFAULTS = Recipe()


def _typed(name: str, value: Any) -> Any:
  """`value` as field `name`'s type (that of its default), or a UsageError saying what the field takes."""
  default = getattr(_DEFAULTS, name)
  if isinstance(default, bool):
    _require(isinstance(value, bool) or type(value).__name__ == 'bool_', f'{name}={value!r} must be True or False')
    return bool(value)
  if isinstance(default, int):
    _require(isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != 'bool_',
             f'{name}={value!r} must be a whole number')
    return int(value)
  if isinstance(default, float):
    _require(is_number(value), f'{name}={value!r} must be a number')
    return float(value)
  if isinstance(default, str):
    _require(isinstance(value, str), f'{name}={value!r} must be a string')
    return value
  if isinstance(default, Kwargs):
    _require(isinstance(value, Mapping) or hasattr(value, 'to_dict'),
             f'{name}={value!r} must be a dict of the model\'s arguments')
    return _frozen(name, value, 'its values must be numbers, strings, lists or dicts of them')
  # A tuple: hyper's ranges, the logical axis rules, the mesh's shape, the labels' weights (a numpy array too).
  if hasattr(value, '__array__') and hasattr(value, 'tolist'):
    value = value.tolist()
  _require(isinstance(value, (tuple, list)), f'{name}={value!r} must be a tuple, e.g. {default!r}')
  return _frozen(name, value, f'it must be a tuple of numbers or names, e.g. {default!r}')


def _frozen(name: str, value: Any, what: str) -> Any:
  """`value` made hashable (`defaults.frozen`), or a UsageError saying `what` the field holds."""
  try:
    value = frozen(value)
    hash(value)
  except TypeError:
    raise UsageError(f'{name}={value!r}: {what}') from None
  return value


def _range(low, high, value, *, open_low=False, open_high=True) -> bool:
  above = value > low if open_low else value >= low
  below = value < high if open_high else value <= high
  return math.isfinite(value) and above and below


def _check_field(name: str, value: Any):
  """The rules of one field alone: a name among its choices, a number in its range; a task's fields by the task
  that reads them (`Task.field_error`)."""
  for task in tasks.TASKS.values():
    if name in task.fields:
      problem = task.field_error(name, value)
      _require(problem is None, problem)
  if name in CHOICES:
    _require(value in CHOICES[name], f'unknown {name} {value!r}: set --config.{name} to one of {list(CHOICES[name])}')
  one_of = lambda ok, what: _require(ok, f'{name}={value!r} must be {what}')
  rules = {
      'num_epochs': (lambda v: v > 0, 'positive'), 'batch_size': (lambda v: v > 0, 'positive'),
      'eval_batch_size': (lambda v: v > 0, 'positive'), 'checkpoints_to_keep': (lambda v: v > 0, 'positive'),
      'num_train_steps': (lambda v: v >= 0, 'a whole number of steps, or 0 for none'),
      'checkpoint_every_steps': (lambda v: v >= 0, 'a whole number of steps, or 0 for none'),
      'ensemble_size': (lambda v: v >= 0, f'positive (0: one member per device, {ONE_DEVICE_MEMBERS} on a single '
                                          'device)'),
      'num_devices': (lambda v: v >= 0, 'a number of devices, or 0 for all of them'),
      'learning_rate': (positive, 'positive and finite'),
      'momentum': (lambda v: _range(0, 1, v), 'in [0, 1)'),
      'weight_decay': (lambda v: _range(0, math.inf, v), '0 or positive, and finite'),
      'warmup_epochs': (lambda v: v >= 0, '0 or a positive number of epochs'),
      'seed': (lambda v: 0 <= v <= MAX_SEED, f'in [0, {MAX_SEED}]: set --config.seed'),
      'heldout_fraction': (lambda v: _range(0, 1, v), 'in [0, 1)'),
      'init_noise': (lambda v: v >= 0 and math.isfinite(v), '0 or a positive standard deviation'),
      'adapter_rank': (lambda v: v >= 0, 'a whole number, the rank of each member\'s adapters, or 0 for none'),
      'early_stopping': (lambda v: v >= 0, 'a whole number of epochs without a lower validation NLL after which '
                                           'training stops, or 0 to train every epoch'),
      'eval_every': (lambda v: v >= 0, '0 (a test pass after the last epoch only) or a positive number of epochs'),
      'steps_per_dispatch': (lambda v: v >= -2, '0 (plain path), positive (fast path), -1 (a whole epoch per '
                                               'dispatch) or -2 (-1 for a small training set, else 0)'),
      'dropout_rate': (lambda v: _range(0, 1, v), 'in [0, 1), the probability that a unit is dropped'),
      'adversarial_epsilon': (lambda v: _range(0, 1, v), "a fraction of each input's range in [0, 1), e.g. "
                                                         "--config.adversarial_epsilon=0.01 (the paper's), or 0 for "
                                                         'no adversarial training'),
      'snapshot_cycles': (lambda v: v >= 1, 'a positive number of cycles'),
      'packed_alpha': (positive, "a positive number, the width of the packed ensemble as a multiple of one "
                                  "network's (each member has alpha / ensemble_size of it): set e.g. "
                                  '--config.packed_alpha=2'),
      'packed_gamma': (lambda v: v >= 1, 'a positive whole number, the groups of each member\'s inner layers: set '
                                         'e.g. --config.packed_gamma=1'),
      'swag_samples': (lambda v: v >= 1, 'a whole number >= 1, the parameter samples each member predicts with: '
                                         'set e.g. --config.swag_samples=10'),
      'swag_rank': (lambda v: v >= 2, 'a whole number >= 2, the deviations each member keeps for its low-rank '
                                      'covariance: set e.g. --config.swag_rank=10'),
      'swag_start': (lambda v: _range(0, 1, v, open_low=True), 'in (0, 1), the fraction of the run before the '
                                                               'moments are collected: set e.g. '
                                                               '--config.swag_start=0.5'),
      'swag_learning_rate': (lambda v: v >= 0 and math.isfinite(v), '0 (a tenth of learning_rate) or positive, the '
                             'constant rate of the collection phase'),
      'resnet_width': (lambda v: v >= 1, 'a positive width multiplier (1, 2, 4, ...)'),
      'num_minibatches': (lambda v: v >= 1, 'a positive number of chunks'),
  }
  if name in rules:
    ok, what = rules[name]
    one_of(ok(value), what)
  elif name == 'resnet_depth':
    _require(value >= 8 and (value - 2) % 6 == 0, f'resnet_depth={value} is not 6n+2 with n >= 1: set '
             '--config.resnet_depth to 8, 14, 20, 32, 44, 56 or 110')
  elif name in ('hyper_learning_rate', 'hyper_weight_decay'):
    _require(len(value) == 2 and all(positive(v)
                                     for v in value) and value[0] <= value[1],
             f'{name}={value!r} must be a range (low, high) of positive numbers with low <= high, '
             f"e.g. --config.{name}='{getattr(_DEFAULTS, name)}' (the default)")
  elif name == 'init_from':
    _require(not value or os.path.isdir(os.path.expanduser(value)),
             f'init_from={value!r} is no folder: give the workdir of a trained run (a 1-member run of the same model, '
             'or an ensemble saved with Ensemble.save)')
  elif name in ('shared', 'frozen'):
    _require(all(isinstance(v, str) and v.strip('/') for v in value),
             f"{name}={value!r} must be module paths, e.g. --config.{name}=\"('backbone',)\"")
  elif name == 'model':
    _require(value in models.MODELS or is_import_path(value),
             f'unknown model {value!r}: set --config.model to one of {sorted(models.MODELS)}, or name a model of '
             'your own as package.module:Name')
  elif name == 'mesh_shape':
    _require(len(value) in (0, 2) and all(isinstance(s, int) and (s > 0 or s == -1) for s in value)
             and value != (-1, -1), f'mesh_shape={value!r} is not a (data, model) pair of positive sizes (one of '
             'them may be -1: whatever the devices leave)')


def of(fields: Any, base: Recipe | None = None, *, ranges: bool = True) -> Recipe:
  """`base` (default: ensemble/defaults.py's recipe) with `fields` (a dict, an ml_collections ConfigDict or a
  Recipe), each field checked alone: its type and (unless not `ranges`) its range. An unknown field is refused
  with the closest names."""
  if isinstance(fields, Recipe):
    return fields
  if hasattr(fields, 'to_dict'):  # a ConfigDict
    fields = fields.to_dict()
  _require(isinstance(fields, Mapping), f'config={fields!r} must be an ml_collections ConfigDict or a dict of '
                                        'fields (ensemble/defaults.py)')
  unknown = [key for key in fields if key not in FIELDS]
  if unknown:
    close = difflib.get_close_matches(unknown[0], FIELDS, n=3)
    hint = f' (did you mean {", ".join(close)}?)' if close else ''
    raise UsageError(f'unknown field {unknown[0]!r}{hint}; the fields are those of ensemble/defaults.py')
  typed = {}
  for name, value in fields.items():
    typed[name] = value = _typed(name, value)
    if ranges:
      _check_field(name, value)
  return (base or _DEFAULTS).replace(**typed)


# --- the fields together, the devices, the data ------------------------------------------------------------------

def data_location(data_dir: str) -> str:
  """`data_dir` as a run records it and compares it: the absolute path with links resolved ('' stays '': no
  folder, tensorflow-datasets or the bundled copy), so that neither depends on the folder a command runs in."""
  return os.path.realpath(os.path.expanduser(data_dir)) if data_dir else ''


def default_ensemble_size(num_devices: int) -> int:
  """What `ensemble_size=0` means on `num_devices` devices: one member each, or several on a single one."""
  return num_devices if num_devices > 1 else ONE_DEVICE_MEMBERS


def devices_for(k: int, available: Sequence[jax.Device], backend: str = 'pmap') -> list[jax.Device]:
  """The devices `k` members go on when num_devices is 0: all of them where the backend can place the members on
  them (k a multiple of their number, or on jit a divisor), else the most that k is a multiple of. The command
  line, `fit` and `load` place alike."""
  n = len(available)
  if not k or k % n == 0 or (backend == 'jit' and n % k == 0):
    return list(available)
  return list(available[:max(d for d in range(1, n) if k % d == 0)])  # the most devices that split the members


def _check_placement(backend: str, k: int, num_devices: int):
  """K members go on D devices when K is a multiple of D (K/D a device) or, on jit, a divisor (D/K devices each)."""
  if k % num_devices == 0:
    return
  _require(backend == 'jit' or k > num_devices,
           f'ensemble_size={k} is fewer members than the {num_devices} devices, which backend {backend!r} cannot '
           'spread a member over: set --config.backend=jit, or --config.num_devices to a divisor of '
           f'{k}')
  divisors = [str(d) for d in range(1, num_devices) if num_devices % d == 0]
  _require(backend == 'jit' and num_devices % k == 0,
           f'ensemble_size={k} cannot be placed on {num_devices} devices: use a multiple of {num_devices} '
           f'({num_devices}, {2 * num_devices}, {3 * num_devices}, ...)'
           + (f" or a divisor ({', '.join(divisors)})" if backend == 'jit' else '')
           + f', or set --config.num_devices to a divisor of {k}')


def _check_optimizer(r: Recipe):
  """The rules between the schedule's fields."""
  if r.warmup_epochs >= r.num_epochs:
    raise UsageError(f'warmup_epochs={r.warmup_epochs} must be in [0, num_epochs={r.num_epochs})')
  if r.warmup_epochs and r.schedule != 'warmup_cosine':
    raise UsageError(f'warmup_epochs={r.warmup_epochs} needs --config.schedule=warmup_cosine (schedule is '
                     f'{r.schedule!r})')


def _check_processes(r: Recipe, devices: Sequence[jax.Device]):
  """Refuses, on every process alike, a run that the processes could not share out evenly."""
  if jax.process_count() == 1:
    return
  per_process = {}
  for device in devices:
    per_process[device.process_index] = per_process.get(device.process_index, 0) + 1
  if len(per_process) != jax.process_count() or len(set(per_process.values())) != 1:
    raise UsageError(f'the {jax.process_count()} processes would train on {per_process} of their devices; give '
                     'every process the same number of devices (--cpu_devices on CPU) and leave --config.num_devices '
                     'at 0')
  num_processes, local = len(per_process), len(devices) // len(per_process)
  # Batches that all members share are split over all devices and gathered back on each: every eval batch, and the
  # train batches of the plain path (the fast path gathers on device).
  split = ['eval_batch_size'] + (['batch_size'] if r.member_data == 'shared' and not r.steps_per_dispatch else [])
  for name in split:
    value = getattr(r, name)
    if value % len(devices):
      raise UsageError(f'{name}={value} gives each of the {num_processes} processes {value / num_processes:g} '
                       f'examples per step, which its {local} devices cannot split evenly; set --config.{name} to a '
                       f'multiple of {len(devices)}')


def _fit_to_data(r: Recipe, dataset: data.Dataset, model: Any) -> dict[str, Any]:
  """What the data decides: the inputs and the task it holds; only images augmented; the default CNN giving way to
  the plain MLP on feature vectors; a batch no larger than the training split; a test batch no larger than the test
  split; the epochs that hold num_train_steps; streamed data fed a batch at a time."""
  changes = {}
  _require(r.inputs in ('auto', dataset.inputs), f'{dataset.source} holds {dataset.inputs}, not {r.inputs}: set '
           '--config.inputs=auto')
  _require(dataset.task == r.task, f'{dataset.source} holds {dataset.task} data but task={r.task!r}: set '
           f'--config.task={dataset.task}')
  task = dataset.kind  # the recipe's: refused above where it is not
  reads_weights = 'pos_weight' in task.fields
  _require(not r.pos_weight or (reads_weights and len(r.pos_weight) == dataset.num_classes),
           f'pos_weight holds {len(r.pos_weight)} weights, but {dataset.source} has '
           + (f'{dataset.num_classes} labels: give one weight per label' if reads_weights
              else f'{r.task} data: pos_weight weighs the labels of task=multilabel; leave it out'))
  if task.per_position:
    _require(dataset.inputs != 'images' or r.augment == 'none',
             f'augment={r.augment!r} moves the pixels of an image but not its labels, which task=dense places on '
             'them: set --config.augment=none')
    _require(r.ignore_label < 0 or r.ignore_label >= dataset.num_classes,
             f'ignore_label={r.ignore_label} is also a class of {dataset.source} (labels 0..'
             f'{dataset.num_classes - 1}): give the label that marks positions without one a value no class has (-1, '
             'or one above every class)')
  if r.adversarial_epsilon:
    _require(dataset.inputs != 'tokens', 'adversarial_epsilon perturbs inputs along their gradient, and token ids '
             'have none: set --config.adversarial_epsilon=0')
    _require(dataset.inputs != 'features' or r.standardize_features,
             "adversarial_epsilon is a fraction of each feature's range, taken from its standard deviation, which the "
             'members know only for standardised features: set --config.standardize_features=True')
  if dataset.inputs != 'images':
    changes['augment'] = 'none'
    if model is None and dataset.inputs == 'features' and r.model == _DEFAULTS.model:
      changes['model'] = models.FEATURES_MODEL
  elif model is None and task.images_model and r.model == _DEFAULTS.model:  # e.g. a class per pixel
    changes['model'] = task.images_model
  if model is None:
    models.check_inputs(changes.get('model', r.model), dataset.image_shape)
  rows = len(dataset.train['label'])
  heldout = data.heldout_count(rows, r.heldout_fraction)
  if r.heldout_fraction and rows and not heldout:
    raise UsageError(f'heldout_fraction={r.heldout_fraction} of the {rows} training examples holds out none; set '
                     f'--config.heldout_fraction to at least {1 / rows:.2g}, or to 0 to hold out nothing')
  if rows and heldout == rows:
    most = math.floor(100 * (rows - 1) / rows) / 100
    raise UsageError(f'heldout_fraction={r.heldout_fraction} of the {rows} training examples holds out all of them, '
                     'leaving none to train on; lower it: --config.heldout_fraction='
                     + (f'{most:g} or less, or 0 to hold out nothing' if most else '0, to hold out nothing'))
  num_train = rows - heldout
  _require(r.batch_size <= num_train, f'batch_size={r.batch_size} exceeds the {num_train} training examples; lower '
           '--config.batch_size')
  if dataset.test is not None:  # one batch of the whole test set, not one padded to many times its size
    num_test = len(dataset.test['label'])
    fitting = -(-num_test // r.num_devices) * r.num_devices
    if r.eval_batch_size > fitting:
      logging.info('Evaluating in batches of %d, the %d test examples, not of eval_batch_size=%d.', fitting, num_test,
                   r.eval_batch_size)
      changes['eval_batch_size'] = fitting
  if r.num_train_steps:  # the epochs that hold them, the last one cut short
    changes['num_epochs'] = -(-r.num_train_steps // data.steps_per_epoch(num_train, r.batch_size))
  if stream.is_streamed(dataset.train):
    _require(r.steps_per_dispatch in (0, -2), f'steps_per_dispatch={r.steps_per_dispatch} keeps the training set on '
             f'the devices, and {dataset.source} is read a batch at a time: set --config.steps_per_dispatch=0, or '
             '--config.streaming=never to read it whole')
  return changes


def resolve(fields: Any, available: Sequence[jax.Device], *, model: Any = None,
            dataset: data.Dataset | None = None) -> tuple[Recipe, list[jax.Device]]:
  """The recipe `fields` describe (a config, a dict, a Recipe), checked against each other, the devices and the
  data, with what they leave open filled in (ensemble_size 0, the devices, a user's model by its import path); and
  the devices to use. `model` is a user's model object (`ensemble.fit`), which `fields`' model then only records.
  Without `dataset`, what the data decides is left as it is (a resume is checked before the data is read)."""
  r = of(fields)
  changes: dict[str, Any] = {'data_dir': data_location(r.data_dir)}
  if model is not None:
    user.wrap(model)  # refuses what is no model before anything runs
    name, kwargs = user.describe(model)
    changes.update(model=name, model_kwargs=frozen(kwargs))
  elif is_import_path(r.model):
    models.check(r)  # the module imports, and the arguments build the model
  if r.method in methods.MEMBER_DATA:
    changes['member_data'] = methods.MEMBER_DATA[r.method]
  if not r.swag_learning_rate:
    changes['swag_learning_rate'] = r.learning_rate / 10
  r = r.replace(**changes)
  _require(r.num_devices <= len(available),
           f'num_devices={r.num_devices} but {len(available)} devices are available; set --config.num_devices '
           f'between 1 and {len(available)} (0 uses all), or run with --cpu_devices=N to simulate N CPU devices')
  single_model = r.backend in backends.MESH_MODELS
  if r.adapter_rank:
    _require(r.shared, f'adapter_rank={r.adapter_rank} adapts the kernels of the shared layers, and shared names '
             "none: set shared (e.g. --config.shared=\"('backbone',)\"), or adapter_rank=0")
    if not r.frozen:  # the adapted kernels are the pretrained ones: they stay as they are
      r = r.replace(frozen=r.shared)
  _require(not (single_model and (r.shared or r.frozen)), f'backend {r.backend!r} trains one model on a mesh, and '
           'shared and frozen name parameters of an ensemble\'s members: set --config.backend=pmap or jit')
  k = r.ensemble_size
  if r.num_devices:
    devices = list(available[:r.num_devices])
  elif single_model:
    devices = list(available)
  else:
    devices = devices_for(k, available, r.backend)
  if single_model:
    r = r.replace(**sharded.resolved(r, devices))
  elif not k:
    r = r.replace(ensemble_size=default_ensemble_size(len(devices)))
  k, num_devices = r.ensemble_size, len(devices)
  r = r.replace(num_devices=num_devices)
  if not single_model:
    _check_placement(r.backend, k, num_devices)
  _require(r.member_sharding == 'replicated' or (r.backend == 'jit' and k < num_devices),
           f'member_sharding={r.member_sharding} splits a member over the devices it has when there are fewer '
           f'members than devices, on backend jit; here each member has one: set --config.backend=jit and '
           f'--config.ensemble_size to a divisor of {num_devices} below it, or leave --config.member_sharding at '
           'replicated')
  # A member's batch is split over its devices, except under member_sharding=model: there each holds it whole.
  per_member = 1 if single_model or r.member_sharding == 'model' else backends.devices_per_member(k, num_devices)
  for name in ('batch_size', 'eval_batch_size'):
    value = getattr(r, name)
    _require(value % per_member == 0, f"{name}={value} cannot be split over each member's {per_member} devices: set "
             f'--config.{name} to a multiple of {per_member}')
  _require(not (r.early_stopping and r.checkpoint_every_steps),
           f'early_stopping={r.early_stopping} keeps the best epoch as the last checkpoint, and checkpoint_every_steps='
           f'{r.checkpoint_every_steps} saves later steps after it: set one of --config.early_stopping and '
           '--config.checkpoint_every_steps to 0')
  methods.check(r)
  _check_optimizer(r)
  _check_processes(r, devices)
  if dataset is not None:
    r = r.replace(**_fit_to_data(r, dataset, model))
  return r, devices


# --- what the programs depend on -------------------------------------------------------------------------------

# Fields that change nothing the programs compute: the data's name and order (the seed enters as arguments, the
# members' keys and `keys.seed_key`), checkpointing, evaluation's batch and the dispatch plan (each its own program,
# as jit keys them by shape).
NOT_IN_PROGRAMS = ('seed', 'dataset', 'data_dir', 'train_split', 'test_split', 'heldout_fraction', 'target',
                   'checkpoints_to_keep', 'compilation_cache', 'eval_every', 'data_fingerprint', 'inputs',
                   'standardize_features', 'eval_batch_size', 'steps_per_dispatch', 'streaming',
                   'checkpoint_every_steps', 'num_devices', 'early_stopping', 'init_from', 'init_noise')
_MESH_FIELDS = ('mesh_shape', 'num_layers', 'depth', 'use_scan', 'logical', 'num_minibatches')
# Fields that only some recipes read, and which: another recipe's programs do not depend on them.
_READ_BY = {
    **dict.fromkeys(('hyper_learning_rate', 'hyper_weight_decay'), lambda r: r.method == 'hyper'),
    'snapshot_cycles': lambda r: r.method == 'snapshot',
    **dict.fromkeys(('packed_alpha', 'packed_gamma'), lambda r: r.method == 'packed'),
    **dict.fromkeys(('swag_samples', 'swag_rank', 'swag_start', 'swag_learning_rate'),
                    lambda r: r.method == 'multiswag'),
    # A task's own fields (`Task.fields`): the loss's, the labels' weights, the quantile levels.
    **{name: (lambda r, name=name: name in tasks.TASKS[r.task].fields)
       for name in sorted({field for task in tasks.TASKS.values() for field in task.fields})},
    'ignore_label': lambda r: False,  # mapped to tasks.IGNORED as the labels are read
    # The built-in models' dropout is method mc_dropout's (and the mesh classifier's); a user's model keeps its own.
    'dropout_rate': lambda r: r.method == 'mc_dropout' or r.model == 'classifier',
    **dict.fromkeys(('resnet_depth', 'resnet_width'), lambda r: r.model == 'resnet'),
    **dict.fromkeys(('member_sharding', 'shared_sharding'), lambda r: r.backend == 'jit'),
    'logical_axis_rules': lambda r: r.backend != 'pmap',
    **dict.fromkeys(_MESH_FIELDS, lambda r: r.backend in backends.MESH_MODELS or bool(r.num_layers)),
    'min_weight_size': lambda r: r.backend in backends.MESH_MODELS or bool(r.num_layers) or r.shared_sharding == 'fsdp',
}


def for_programs(r: Recipe) -> Recipe:
  """`r` with what its programs do not depend on set to the defaults (`NOT_IN_PROGRAMS`, and the fields only
  other recipes read): the key under which a loop of fits shares its compiled programs (ensemble/loop.py). The
  seed is never in it, for any method: where weights are drawn from it (shared ones, BatchEnsemble's, MC
  dropout's and MIMO's network), the programs take its key as an argument."""
  unread = {name: getattr(_DEFAULTS, name) for name, read in _READ_BY.items() if not read(r)}
  kept = {name: getattr(_DEFAULTS, name) for name in NOT_IN_PROGRAMS}
  # The programs know only whether the members share their batches; which rows each draws is the host's.
  data = {'member_data': 'shared' if r.member_data == 'shared' else 'shuffled'}
  # Bagging is the deep ensemble on other rows: the same programs.
  method = {'method': 'independent'} if r.method == 'bagging' else {}
  return r.replace(**unread, **kept, **data, **method)


# --- a run's record ----------------------------------------------------------------------------------------------

def read_record(path: str, fix: str) -> dict[str, Any]:
  """The config.json that a run wrote beside its checkpoints; `fix` ends the UsageError that a missing or
  unreadable one raises."""
  try:
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
  except FileNotFoundError:
    raise UsageError(f'{path}: missing; {fix}') from None
  except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
    lines = str(e).strip().splitlines()
    raise UsageError(f'{path}: cannot be read ({lines[0] if lines else type(e).__name__}); {fix}') from None
  if not isinstance(saved, dict):
    raise UsageError(f'{path}: holds a JSON {type(saved).__name__}, not the object of a config; {fix}')
  return saved


def from_record(saved: Mapping[str, Any]) -> Recipe:
  """The recipe a run recorded (its config.json, of this version or an older one): the fields it lacks as older
  versions ran them (`LEGACY`), fields this version no longer knows left out. Its values are taken as the run
  resolved them, types checked but not ranges: a field the run never read may hold what today's rules refuse."""
  known = {key: value for key, value in saved.items() if key in FIELDS}
  return of({**{key: value for key, value in LEGACY.items() if key not in saved}, **known}, ranges=False)


def check_resume(r: Recipe, saved: Mapping[str, Any], path: str):
  """Refuses to resume a workdir with other data settings or another method than `saved` (its config.json) records,
  or a method's own settings changed (`METHOD_SETTINGS`: a snapshot ensemble's cycles, MultiSWAG's collection phase).

  Other members' data, or a held-out slice the members were trained on, would make the checkpoints and the
  evaluation describe a run that never happened. A workdir trained on arrays in memory knows them by their
  fingerprint, which must match.
  """
  recorded = from_record(saved)
  location = lambda key, value: data_location(value) if key == 'data_dir' else value
  changed = lambda keys: [f'{key}={getattr(recorded, key)!r} (now {getattr(r, key)!r})' for key in keys
                          if location(key, getattr(recorded, key)) != location(key, getattr(r, key))]
  data_changes = changed(RESUME_SETTINGS)
  _require(not data_changes,
           f'{path} records {", ".join(data_changes)}: a resume must keep the data settings and the method '
           f'({", ".join(RESUME_SETTINGS)}); set them as recorded there, or train in a new --workdir')
  if recorded.dataset == data.ARRAYS or r.dataset == data.ARRAYS:
    fingerprint = recorded.data_fingerprint
    _require(fingerprint and fingerprint == r.data_fingerprint,
             f'{os.path.dirname(path)} was trained on other arrays ({fingerprint or "none recorded"}; now '
             f'{r.data_fingerprint or "none recorded"}): fit into a new --workdir, or give it the arrays it was '
             'trained on to resume')
  settings, why = METHOD_SETTINGS.get(r.method, ((), ''))
  method_changes = changed(settings)
  _require(not method_changes,
           f'{path} records {", ".join(method_changes)}: {why}; resume with {", ".join(settings)} as recorded there, '
           'or train in a new --workdir')
