"""Checks a config against the machine before anything runs, fills in its defaults, and builds its member."""

import json
import os
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from ensemble import backends, defaults, distributed, methods, models, optim, steps, tasks
from ensemble.data import augment, stream
from ensemble.errors import UsageError

MEMBER_DATA = ('shared', 'shuffled', 'bootstrap')
# What decides which examples each member trains on, in which order, and which are held out for
# `ensemble.evaluate`: a resume must keep these as the workdir was started with them. Add new dataset
# fields here.
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
MAX_SEED = 2**32 - 1  # jax.random.key folds larger seeds onto the same keys
# The members of `ensemble_size=0` on a single device (a laptop's CPU, one GPU): several on the device, as 0 means one
# per device only where there are several devices; an ensemble of one would be no ensemble.
ONE_DEVICE_MEMBERS = 8
DTYPES = ('float32', 'bfloat16')


def checkpoint_unit(config: ml_collections.ConfigDict) -> str:
  """What a run's checkpoints are numbered by: 'step' where they are saved every checkpoint_every_steps steps,
  else 'epoch' (what a log line names a checkpoint by)."""
  return 'step' if config.get('checkpoint_every_steps', 0) > 0 else 'epoch'


def data_location(data_dir: str) -> str:
  """`data_dir` as a run records it and compares it: the absolute path with links resolved ('' stays '': no
  folder, tensorflow-datasets or the bundled copy), so that neither depends on the folder a command runs in."""
  return os.path.realpath(os.path.expanduser(data_dir)) if data_dir else ''


def read_run_config(path: str, fix: str) -> dict[str, Any]:
  """The config.json that `ensemble.train` wrote beside its checkpoints; `fix` ends the UsageError that a missing
  or unreadable one raises."""
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


def _require(ok: bool, message: str):
  if not ok:
    raise UsageError(message)


def _check_single_model(config: ml_collections.ConfigDict):
  """A mesh backend splits one model over all the devices: an ensemble of one."""
  backend, model = config.backend, backends.MESH_MODELS[config.backend]
  example = f"configs/{'mlp' if backend == 'sharded' else backend}.py"
  _require('mesh_shape' in config,
           f'backend {backend!r} needs the mesh fields (mesh_shape, ...) of {example}: '
           f'run with --config={example}')
  _require(config.model == model,
           f'backend {backend!r} trains model {model!r}, not {config.model!r}: set --config.model={model}')
  _require(config.ensemble_size in (0, 1),
           f'backend {backend!r} trains one model, not an ensemble: set --config.ensemble_size=1, or '
           'use backend pmap or jit for ensembles')
  _require(methods.name(config) == 'independent',
           f'backend {backend!r} trains one model, not an ensemble: leave --config.method at independent, or use '
           'backend pmap or jit for the ensembling methods')
  _require(config.member_data == 'shared',
           f"backend {backend!r} trains one model: set --config.member_data=shared")
  _require(tasks.name(config) == 'classification',
           f'backend {backend!r} trains one classifier: use backend pmap or jit for --config.task=regression')
  _require(config.augment == 'none',
           f'backend {backend!r} trains one model on plain batches: set --config.augment=none, or use backend '
           'pmap or jit for augmented training')
  _require(not config.get('adversarial_epsilon', 0.0),
           f'backend {backend!r} trains one model on plain batches: set --config.adversarial_epsilon=0, or use '
           'backend pmap or jit for adversarial training')
  _require(jax.process_count() == 1,
           f'backend {backend!r} runs in a single process; use backend pmap or jit across processes')
  config.ensemble_size = 1


def _check_placement(backend: str, k: int, num_devices: int):
  """K members go on D devices when K is a multiple of D (K/D a device) or, on jit, a divisor (D/K devices each)."""
  _require(k > 0, f'ensemble_size={k} must be positive (0: one member per device, {ONE_DEVICE_MEMBERS} on a single '
           'device)')
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


def resolve(config: ml_collections.ConfigDict, available: Sequence[jax.Device],
            model: Any = None) -> tuple[ml_collections.ConfigDict, list[jax.Device]]:
  """Returns a validated copy of `config` with `ensemble_size` filled in, and the devices to use.

  `model` is a user's model object (`ensemble.fit`); then `config.model` only records it.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  config.data_dir = data_location(config.data_dir)
  # Positivity first: the method's checks divide by these.
  for name in ('num_epochs', 'batch_size', 'eval_batch_size', 'checkpoints_to_keep'):
    _require(config[name] > 0, f'{name}={config[name]} must be positive')
  for name in ('num_train_steps', 'checkpoint_every_steps'):
    value = config.get(name, 0)
    _require(isinstance(value, int) and value >= 0, f'{name}={value!r} must be a whole number of steps, or 0 for none')
  _require(not (config.get('num_train_steps', 0) and config.get('method') == 'snapshot'),
           'method snapshot counts its cycles in epochs: set --config.num_epochs (a multiple of snapshot_cycles) '
           'and leave --config.num_train_steps at 0')
  _require(config.get('streaming', 'never') in stream.MODES,
           f'unknown streaming {config.get("streaming")!r}: set --config.streaming to one of {list(stream.MODES)}')
  if model is None:
    models.check(config)
  _require(config.get('dtype', 'float32') in DTYPES,
           f'unknown dtype {config.get("dtype")!r}: set --config.dtype to one of {list(DTYPES)}')
  _require(config.get('inputs', 'auto') in ('auto', *steps.INPUTS),
           f'unknown inputs {config.inputs!r}: set --config.inputs to auto or one of {list(steps.INPUTS)}')
  method = methods.create(config)
  if method.member_data:
    config.member_data = method.member_data
  _require(config.augment in augment.AUGMENTATIONS,
           f'unknown augment {config.augment!r}: set --config.augment to one of {list(augment.AUGMENTATIONS)}')
  _require(config.backend in backends.NAMES,
           f'unknown backend {config.backend!r}: set --config.backend to one of {list(backends.NAMES)}')
  _require(config.member_data in MEMBER_DATA,
           f'unknown member_data {config.member_data!r}: set --config.member_data to one of {list(MEMBER_DATA)}')
  _require(0 <= config.num_devices <= len(available),
           f'num_devices={config.num_devices} but {len(available)} devices are available; set '
           f'--config.num_devices between 1 and {len(available)} (0 uses all), or run with '
           '--cpu_devices=N to simulate N CPU devices')
  devices = list(available[:config.num_devices or len(available)])
  num_devices = len(devices)
  single_model = config.backend in backends.MESH_MODELS
  if single_model:
    _check_single_model(config)
  elif config.ensemble_size == 0:
    config.ensemble_size = default_ensemble_size(num_devices)
  k = config.ensemble_size
  if not single_model:
    _check_placement(config.backend, k, num_devices)
  layout = config.get('member_sharding', 'replicated')
  _require(layout in backends.MEMBER_SHARDINGS, f'unknown member_sharding {layout!r}: set '
           f'--config.member_sharding to one of {list(backends.MEMBER_SHARDINGS)}')
  _require(layout == 'replicated' or (config.backend == 'jit' and k < num_devices),
           f'member_sharding={layout} splits a member over the devices it has when there are fewer members than '
           f'devices, on backend jit; here each member has one: set --config.backend=jit and --config.ensemble_size '
           f'to a divisor of {num_devices} below it, or leave --config.member_sharding at replicated')
  # A member's batch is split over its devices, except under member_sharding=model: there each holds it whole.
  per_member = 1 if single_model or layout == 'model' else backends.devices_per_member(k, num_devices)
  for name in ('batch_size', 'eval_batch_size'):
    _require(config[name] % per_member == 0,
             f"{name}={config[name]} cannot be split over each member's {per_member} devices: set "
             f'--config.{name} to a multiple of {per_member}')
  _require(isinstance(config.get('eval_every', 1), int) and config.get('eval_every', 1) >= 0,
           f'eval_every={config.get("eval_every")!r} must be 0 (a test pass after the last epoch only) or a positive '
           'number of epochs')
  _require(config.steps_per_dispatch >= -2,
           f'steps_per_dispatch={config.steps_per_dispatch} must be 0 (plain path), positive (fast path), -1 (a '
           'whole epoch per dispatch) or -2 (-1 for a small training set, else 0)')
  optim.check(config)
  tasks.check(config)
  _require(0 <= config.heldout_fraction < 1, f'heldout_fraction={config.heldout_fraction} must be in [0, 1)')
  _require(0 <= config.seed <= MAX_SEED, f'seed={config.seed} must be in [0, {MAX_SEED}]: set --config.seed')
  distributed.check_layout(config, devices)
  return config, devices


def default_ensemble_size(num_devices: int) -> int:
  """What `ensemble_size=0` means on `num_devices` devices: one member each, or several on a single one."""
  return num_devices if num_devices > 1 else ONE_DEVICE_MEMBERS


def fit_to_data(config: ml_collections.ConfigDict, inputs: str, source: str, model: Any = None):
  """Fills in, in place, what the data decides before anything is built: on feature vectors the default config's
  CNN gives way to the plain MLP (`models.FEATURES_MODEL`), so that configs/default.py trains a table as it trains
  images; only images are augmented, and config.json records what ran. Another image model on other inputs is
  refused by `models.create`; `model`, a user's model object, is left as it is. Adversarial training on inputs
  without a range (token ids, unstandardised features) is refused here.
  """
  methods.adversarial.check_inputs(config, inputs)
  if inputs == 'images':
    return
  config.augment = 'none'
  if model is None and inputs == 'features' and config.model == defaults.get_config().model:
    logging.info('%s holds feature vectors, which model %r cannot take: training the built-in MLP '
                 '(--config.model=%s) without augmentation; set --config.model to choose another.', source,
                 config.model, models.FEATURES_MODEL)
    config.model = models.FEATURES_MODEL


def member(config: ml_collections.ConfigDict, data_info: dict[str, Any], steps_per_epoch: int = 1,
           model: Any = None) -> steps.Member:
  """The member that `config` describes, for data described by `data_info` (see `data_info`).

  The trainer, the evaluator and the benchmark all build their members here.
  `steps_per_epoch` only sets the learning-rate schedule's length: a restore
  target needs the optimizer state's structure, not its schedule. `model`, a
  user's model object, replaces the one `config.model` names.
  """
  image_shape = tuple(data_info['image_shape'])
  inputs = data_info.get('inputs', 'images')
  return steps.Member(model=models.create(config, data_info['num_classes'], image_shape, model),
                      tx=optim.create(config, steps_per_epoch), image_shape=image_shape,
                      mean=tuple(data_info['mean']), std=tuple(data_info['std']),
                      augment=config.augment if inputs == 'images' else 'none',
                      method=methods.create(config, steps_per_epoch), inputs=inputs,
                      dtype=config.get('dtype', 'float32'), task=tasks.create(config, data_info),
                      adversarial_epsilon=config.get('adversarial_epsilon', 0.0))


def data_info(image_shape: Sequence[int], num_classes: int, mean: Sequence[float], std: Sequence[float],
              inputs: str = 'images', target_stats: tuple[Sequence[float], Sequence[float]] | None = None) -> dict:
  """What a member needs to know of its data; checkpoints keep it, so a workdir can predict on its own.

  `image_shape` is one input's shape, whatever `inputs` (steps.INPUTS) it is.
  For regression, `num_classes` is the model's number of outputs (2 D) and
  `target_stats` the training targets' per-target mean and standard deviation.
  """
  info = {'image_shape': [int(s) for s in image_shape], 'num_classes': int(num_classes),
          'mean': [float(m) for m in mean], 'std': [float(s) for s in std], 'inputs': inputs}
  if target_stats is not None:
    info['target_mean'], info['target_std'] = ([float(v) for v in values] for values in target_stats)
  return info


def check_model(member: steps.Member, num_classes: int, method: str) -> int:
  """Runs the model on one input, abstractly, before anything is written; returns its number of logits.

  A model that fails on the input shape, gives other than one logit per class
  (at least `num_classes`, the largest label + 1), or lacks the rank-1 layers
  that BatchEnsemble needs or the dropout layers that MC dropout needs, is
  refused in one line.
  """
  example = jax.ShapeDtypeStruct(member.example_input().shape,
                                 jnp.int32 if member.inputs == 'tokens' else jnp.float32)
  shape = f'{tuple(example.shape)} {example.dtype}'.replace('(1,', '(batch,')
  if method == 'mimo':
    heads = models.mimo.heads(member.model)
    _require(heads == member.method.heads,
             f'method mimo trains one network of M = ensemble_size = {member.method.heads} inputs and heads, and this '
             f'model {"has " + str(heads) + " heads" if heads else "is not one"}: wrap a model of one input and M '
             'times the outputs of one member, ensemble.models.mimo.MIMO(YourNet(num_classes=C * M), heads=M) '
             '(linen) or ensemble.models.mimo.nnx_mimo(build, heads=M) (NNX)')
  try:
    variables = jax.eval_shape(member.init_variables, jax.random.key(0))
    logits = jax.eval_shape(lambda v, x: member.model.apply(v, member.method.model_input(x), train=False), variables,
                            example)
    if method == 'mimo':  # (batch, M, outputs): one head's are one member's
      logits = jax.eval_shape(lambda outputs: outputs[:, 0], logits)
  except UsageError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # the user's model code failed: say where, in one line
    message = str(e).strip().splitlines()[0] if str(e).strip() else ''
    raise UsageError(f'the model fails on inputs of shape {shape} ({type(e).__name__}: {message[:300]}); make it '
                     f'take a batch of {member.inputs} of that shape, or reshape the data') from None
  if member.task.name == 'regression':
    targets = num_classes // 2
    if not hasattr(logits, 'shape') or len(logits.shape) != 2 or logits.shape[1] != num_classes:
      got = getattr(logits, 'shape', type(logits).__name__)
      raise UsageError(f'the model maps inputs {shape} to {got}, not to (batch, {num_classes}): for {targets} '
                       f'target(s) give its last layer {num_classes} outputs, a mean and a raw scale per target')
  elif (not hasattr(logits, 'shape') or len(logits.shape) != 2 or logits.shape[0] != 1
        or logits.shape[1] < num_classes):
    got = getattr(logits, 'shape', type(logits).__name__)
    raise UsageError(f'the model maps inputs {shape} to {got}, not to (batch, {num_classes}) logits, one per class; '
                     f'give its last layer {num_classes} outputs (the labels run 0..{num_classes - 1})')
  if method == 'batchensemble' and not any('shared' in jax.tree_util.keystr(path)
                                           for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0]):
    raise UsageError('method batchensemble needs a model built with rank-1 layers, and this one has none: build it '
                     'with ensemble.models.rank1.Dense and .Conv (as models/cnn.py does), or choose another '
                     '--config.method')
  # The built-in models are linen Modules that models.create sized for packing; a user's (wrapped) must use the layers.
  _require(method != 'packed' or isinstance(member.model, nn.Module) or models.packed.has_packed_layers(variables),
           'method packed needs a model built with packed layers, and this one has none (it would train a deep '
           'ensemble of it, ignoring packed_alpha and packed_gamma): size its layers with '
           'ensemble.models.packed.width and group its inner ones with ensemble.models.packed.Dense and .Conv (NNX: '
           '.NNXDense, .NNXConv), or choose another --config.method')
  if method == 'mc_dropout':
    with methods.mc_dropout.dropout_kept_on() as dropped:
      jax.eval_shape(lambda v, x: member.model.apply(v, x, train=False, rngs={'dropout': jax.random.key(0)}),
                     variables, example)
    _require(dropped, 'method mc_dropout samples the model with its dropout on, and this model has no dropout '
             'layer (nn.Dropout or nnx.Dropout) with a rate above 0: add one, e.g. nn.Dropout(0.1, '
             'deterministic=not train) before its last layer, or use a built-in model (cnn, resnet, mlp), which take '
             '--config.dropout_rate')
  return int(logits.shape[1])


def check_resume(config: ml_collections.ConfigDict, saved: dict[str, Any], path: str):
  """Refuses to resume a workdir with other data settings or another method than `saved` (its config.json) records,
  or a method's own settings changed (`METHOD_SETTINGS`: a snapshot ensemble's cycles, MultiSWAG's collection phase).

  Other members' data, or a held-out slice the members were trained on, would
  make the checkpoints and the evaluation describe a run that never happened.
  Settings that `saved` lacks (a run from before they existed) are not compared;
  data_dir is compared as `data_location` resolves it.
  """
  recorded = lambda key, value: data_location(value) if key == 'data_dir' else value
  changed = lambda keys: [f'{key}={saved[key]!r} (now {config[key]!r})' for key in keys
                          if key in saved and recorded(key, saved[key]) != recorded(key, config[key])]
  data_changes = changed(RESUME_SETTINGS)
  _require(not data_changes,
           f'{path} records {", ".join(data_changes)}: a resume must keep the data settings and the method '
           f'({", ".join(RESUME_SETTINGS)}); set them as recorded there, or train in a new --workdir')
  # ensemble.fit's arrays: what `dataset='arrays'` alone does not tell apart.
  fingerprint = saved.get('data_fingerprint', '')
  _require(not fingerprint or fingerprint == config.get('data_fingerprint', ''),
           f'{os.path.dirname(path)} was trained on other arrays ({fingerprint}; now '
           f'{config.get("data_fingerprint", "") or "none recorded"}): fit into a new --workdir, or give it the '
           'arrays it was trained on to resume')
  settings, why = METHOD_SETTINGS.get(methods.name(config), ((), ''))
  method_changes = changed(settings)
  _require(not method_changes,
           f'{path} records {", ".join(method_changes)}: {why}; resume with {", ".join(settings)} as recorded there, '
           'or train in a new --workdir')
