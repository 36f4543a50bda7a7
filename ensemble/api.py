"""The library: `fit` an ensemble of your own Flax model on your own arrays, `load` one, ask it with `Ensemble`.

  import ensemble
  ensemble.cpu_devices(8)                        # on a CPU, before JAX starts: 8 simulated devices
  ens = ensemble.fit(MyModel(), (x_train, y_train), test=(x_test, y_test), ensemble_size=8, epochs=10)
                                                 # in memory: nothing is written unless workdir= is given
  ens.predict(x)                                 # probabilities, class, entropy, mutual information, ...
  ens.evaluate(x_test, y_test)                   # accuracy, NLL, Brier, ECE: ensemble and mean member
  ens.save('/tmp/run')                           # python -m ensemble.evaluate / predict / export read it

Nothing here defines flags, sets up logging, changes JAX's settings or exits: the programs
(`ensemble.train`, `.evaluate`, `.predict`, `.export`) are shells over these
calls and `ensemble.loop`'s, and turn `UsageError` into one `error:` line.
Every mistake a caller can make raises `UsageError`, a ValueError, and its
message names `fit`'s keywords (`learning_rate=`), not the programs' flags.
"""

import dataclasses
import functools
import math
import numbers
import os
import re
from typing import Any

import jax
import numpy as np
from absl import logging

from ensemble import console, data, devices as devices_lib, errors, host_memory, loop, manifest, members, posthoc
from ensemble import files, standardise, starts, tasks
from ensemble import recipe as recipe_lib
from ensemble.data import arrays
from ensemble.errors import UsageError
from ensemble import sharing
from ensemble.trained import Ensemble, check_flag

__all__ = ['Ensemble', 'fit', 'load', 'read']


def _evaluation():
  """ensemble.evaluation, imported where a workdir is read: it brings orbax, scipy's optimizers and matplotlib,
  which a fit in memory does without."""
  from ensemble import evaluation  # pylint: disable=g-import-not-at-top
  return evaluation


def _in_fit_terms(fn):
  """`fn`'s UsageError in the terms of `fit`'s keywords: `--config.FIELD` becomes `FIELD=`, `--workdir` `workdir=`;
  and the caller's root logger as it was (`console.root_logging_kept`)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    try:
      with console.root_logging_kept():
        return fn(*args, **kwargs)
    except UsageError as e:
      message = re.sub(r'--config\.(\w+)(=?)', r'\1=', str(e))
      e.args = (re.sub(r'--(workdir|step)\b=?', r'\1=', message),)
      raise
  return wrapped


def read(workdir: str, step: int | None = None, *, model: Any = None, batch_size: int | None = None,
         temperature: float | None = None) -> Ensemble:
  """`load` for the programs: its errors name their flags (`--step`, `--workdir`)."""
  with console.root_logging_kept():
    evaluation = _evaluation()
    config = evaluation.load_run_config(workdir)
    evaluation.refuse_single_model(config, workdir)
    devices = devices_lib.evaluation_devices(config.ensemble_size)
    member, state, epoch = evaluation.restore(workdir, config, manifest.saved_epoch(workdir) if step is None else step,
                                              devices, model)
    from ensemble import checkpoint  # pylint: disable=g-import-not-at-top  # orbax: only where files are read
    record = checkpoint.read_record(workdir, epoch)
    chain, summary = manifest.read(workdir, config, epoch, member.task,
                                   (record.get('summary') or {}).get('scalars', {}))
    if temperature is not None:
      given = posthoc.given_temperature(member.task, temperature, epoch, chain)
      chain = posthoc.replaced(chain, given.kind, given)
    data_info = record.get('data')
    if data_info and standardise.feature_transform(data_info) is not None:  # the host standardises, as for `fit`'s
      member = dataclasses.replace(member, mean=(0.0,), std=(1.0,))
    ens = Ensemble(workdir, config, member, state, devices, epoch,
                   batch_size=config.eval_batch_size if batch_size is None else batch_size, summary=summary,
                   data_info=data_info, chain=chain)
    logging.info('Restored %s %d of %s: %s on %s%s.', config.checkpoint_unit, epoch, workdir,
                 console.count(config.ensemble_size, 'member'), console.count(len(devices), 'device'),
                 f'; post-hoc: {posthoc.describe(chain)}' if chain else '; no post-hoc steps')
    return ens


@_in_fit_terms
def load(workdir: str, step: int | None = None, *, model: Any = None, batch_size: int | None = None,
         temperature: float | None = None) -> Ensemble:
  """The ensemble in `workdir`, on as many of the available devices as divide its members: a saved ensemble
  (`Ensemble.save`) whole, with its post-hoc chain; a run's workdir at checkpoint `step` (default: the newest),
  with what `python -m ensemble.evaluate` fitted for that checkpoint (its temperature).

  `model` is needed only for a model that config.json cannot rebuild (one
  defined in a script's `__main__`): the same model `fit` was given.
  `temperature` replaces the chain's temperature (a regression's variance
  scale) where no later step was fitted on it; `batch_size` defaults to the
  run's eval_batch_size.
  """
  return read(workdir, step, model=model, batch_size=batch_size, temperature=temperature)


# Where `fit` departs from ensemble/defaults.py (a program's recipe): no held-out slice and one test pass at the end
# unless asked, and no persistent compilation cache unless asked (it is a setting of the caller's whole process).
FIT_DEFAULTS = {'heldout_fraction': 0.0, 'eval_every': 0, 'compilation_cache': '',
                'steps_per_dispatch': loop.AUTO_DISPATCH}


def fit_defaults(task: str | None) -> dict[str, Any]:
  """Where `fit` (and `distill`) start from other values than ensemble/defaults.py's, for `task` (None: the
  default's): `FIT_DEFAULTS`, and the task's own (`Task.fit_defaults`: for regression, Adam on standardised
  features)."""
  return {**FIT_DEFAULTS, **(tasks.named(task).fit_defaults if task in tasks.TASKS else {})}


def fit_recipe(config: Any, fields: dict[str, Any]) -> recipe_lib.Recipe:
  """`fit`'s keywords as a recipe, each field checked alone (ensemble/recipe.py): on `config` (a ConfigDict, a dict
  or a Recipe) when given, else on ensemble/defaults.py's recipe with `fit_defaults` for the task."""
  if 'epochs' in fields:
    if 'num_epochs' in fields:
      raise UsageError('epochs= and num_epochs= are one setting: give one of them')
    fields['num_epochs'] = fields.pop('epochs')
  fields = {key: value for key, value in fields.items() if value is not None}
  if config is None:
    task = fields.get('task')
    base = recipe_lib.of(fit_defaults(task if isinstance(task, str) else None))
  else:
    base = recipe_lib.of(config)
  return recipe_lib.of(fields, base=base)


@_in_fit_terms
def fit(model: Any, train: Any, test: Any = None, *, ensemble_size: int | None = None, epochs: int | None = None,
        method: str | None = None, workdir: str | None = None, config: Any = None, init: 'Ensemble | None' = None,
        keep_optimizer: bool = False, keep_freed_memory: bool = False, progress: bool = True,
        validation: Any = None, early_stopping: int = 0, init_params: Any = None, **fields) -> Ensemble:
  """Trains an ensemble of `model` on arrays, its members in parallel on the devices there are; returns it.

  `model`: a `flax.linen.Module` mapping a batch of inputs to logits (it gets
  `train=True` in training if its `__call__` takes `train`, so BatchNorm and
  Dropout work); a function of `nnx.Rngs` that builds a Flax NNX model (each
  member builds its own); or a model name of ensemble/defaults.py ('cnn',
  'resnet', 'package.module:Name'). `train` and `test` are (inputs, labels)
  pairs of arrays: images, feature vectors or token ids (`inputs`:
  ensemble/defaults.py says how they are told apart), labels integer classes
  (float targets for task='regression'; 0/1 labels (N, L) for task='multilabel'); or a split of `ensemble.data.load`
  ({'image', 'label'} arrays, or a streamed one); or any random-access source
  of (input, label) pairs (a list, a `grain.MapDataset`), streamed. `test` is
  optional: its scores go to `Ensemble.summary` after the last epoch (and
  every `eval_every` epochs). `fields` are ensemble/defaults.py's fields
  (learning_rate, optimizer, augment, member_data, backend, seed, ...),
  starting from its values (but `fit_defaults`: for task='regression', Adam at
  0.01 on standardised features) or from `config`. Unless `num_devices` is
  given, the members go on the devices as `python -m ensemble.train` places
  them (ensemble/recipe.py: all of them where they divide the members, else as
  many as do).

  `workdir=None` trains in memory and writes nothing anywhere; the
  `Ensemble` holds the members (`save` writes a workdir). A loop of fits of
  the same model and recipe compiles once (ensemble/loop.py), and `init=ens`
  starts every member from `ens`'s (same model and size; the optimizer starts
  afresh unless `keep_optimizer`, which keeps its moments and restarts its
  schedule). With `workdir`, the run writes checkpoints, metrics and event
  files there, and an existing workdir resumes by the rules of
  `python -m ensemble.train` if it was trained on the same arrays; a folder
  that is not a workdir is refused. `progress` shows a bar and a line per
  epoch. `keep_freed_memory=True` makes glibc keep the memory XLA:CPU frees,
  as `python -m ensemble.train` does (`ensemble/host_memory.py`;
  convolutional members trained 1.44x faster): a setting of the whole
  process, never undone, so only if asked.

  `shared='backbone'` (a module path, a tuple of them, or a predicate of a
  parameter's path such as 'backbone/Dense_0/kernel') makes those
  parameters one copy that every member trains (K heads on one backbone),
  `frozen=` keeps the parameters it names out of training (no optimizer
  state, no backward pass through them), and `init_params` (one model's
  parameters: a pretrained checkpoint's, or `ens.params` of a 1-member fit;
  or its whole variables, {'params': ..., 'batch_stats': ...}, whose frozen
  statistics stay as given) starts every member from those it holds
  (ensemble/sharing.py).

  `early_stopping=N` with `validation=(x_val, y_val)` (rows the members do
  not train on; or, without it, the held-out slice of `heldout_fraction`)
  scores the validation NLL after every epoch, stops once N epochs pass
  without a lower one, and returns the members of the best epoch; `summary`
  says which ('best_epoch', 'validation_loss', 'epochs_trained'). A workdir
  checkpoints only the epochs that lower it, so its last checkpoint is the
  best.
  """
  for name, value in (('keep_optimizer', keep_optimizer), ('keep_freed_memory', keep_freed_memory)):
    check_flag(name, value)
  check_flag('progress', progress, none=True)
  validation = _validation(validation, early_stopping, fields)
  predicates = {key: fields.pop(key) for key in ('shared', 'frozen') if callable(fields.get(key))}
  for key in ('shared', 'frozen'):
    if fields.get(key) is not None:
      fields[key] = sharing.as_filters(fields[key], key)
  settings = fit_recipe(config, {'ensemble_size': ensemble_size, 'epochs': epochs, 'method': method,
                                 'early_stopping': early_stopping or None, **fields})
  dataset = _dataset(train, test, settings)
  if predicates:
    settings = recipe_lib.of(_accepted_paths(model, dataset, settings, predicates), base=settings)
  validation = _validation_split(validation, dataset, settings)
  if dataset.inputs != 'images' and settings.augment != 'none' and 'augment' in fields:  # else the recipe sets it
    raise UsageError(f'augment={settings.augment!r} transforms images, and these inputs are {dataset.inputs}: '
                     "leave augment out, or set it to 'none'")
  return fit_dataset(model, dataset, settings, workdir=workdir, init=init, keep_optimizer=keep_optimizer,
                     keep_freed_memory=keep_freed_memory, progress=progress, validation=validation,
                     init_params=init_params)


def _accepted_paths(model: Any, dataset: data.Dataset, settings: recipe_lib.Recipe,
                    predicates: dict[str, Any]) -> dict[str, tuple[str, ...]]:
  """`shared=` or `frozen=` given as a predicate of a parameter's path ('backbone/Dense_0/kernel') -> the paths of
  the model's parameters it accepts: what config.json records, and a resume or `load` reads."""
  outputs = tasks.create(settings).model_outputs(dataset.num_classes)
  info = members.data_info(dataset.image_shape, outputs, [0.0], [1.0], inputs=dataset.inputs)
  recipe = settings.replace(shared=(), frozen=(), adapter_rank=0)
  if isinstance(model, str):
    recipe, model = recipe.replace(model=model), None
  member = members.member(recipe, info, model=model)
  params = jax.eval_shape(member.init_variables, jax.random.key(0))['params']
  paths = ['/'.join(sharing.names(path)) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  accepted = {}
  for key, predicate in predicates.items():
    accepted[key] = tuple(path for path in paths if predicate(path))
    if not accepted[key]:
      raise UsageError(f'{key}={getattr(predicate, "__name__", predicate)} accepts none of the model\'s parameter '
                       f'paths ({", ".join(paths[:4])}{", ..." if len(paths) > 4 else ""}): it is called with each '
                       'of them, a string such as those')
  return accepted


def _validation(validation: Any, early_stopping: Any, fields: dict[str, Any]) -> Any:
  """`validation=`, checked with `early_stopping=`, which it serves, before anything else is read."""
  if isinstance(early_stopping, bool) or not isinstance(early_stopping, numbers.Integral) or early_stopping < 0:
    raise UsageError(f'early_stopping={early_stopping!r} must be a whole number of epochs >= 0 (0: train every '
                     'epoch), the epochs without a lower validation NLL after which training stops')
  if not early_stopping and validation is not None:
    raise UsageError('validation= is what early_stopping=N scores after every epoch: give early_stopping too, or '
                     'leave validation out (test= scores a test set)')
  if early_stopping and validation is None and not fields.get('heldout_fraction'):
    raise UsageError(f'early_stopping={early_stopping} needs validation=(x_val, y_val): rows the members do not '
                     'train on, scored after every epoch (or heldout_fraction=0.1 to hold out the last tenth of the '
                     'training rows)')
  return validation


def _validation_split(validation: Any, dataset: data.Dataset, settings: recipe_lib.Recipe) -> data.Split | None:
  """`validation=` as a split of the training data's kind."""
  if validation is None:
    return None
  if _is_source(validation) or data.stream.is_streamed(validation):
    raise UsageError('validation= is a source of examples; give it as (inputs, labels) arrays')
  split = arrays.split(_as_pair(validation, 'validation'), dataset.inputs, 'validation', settings.task,
                       outputs=dataset.num_classes, ignore=settings.ignore_label)
  if split['image'].shape[1:] != dataset.image_shape or split['label'].shape[1:] != dataset.train['label'].shape[1:]:
    raise UsageError(f'validation= holds inputs {split["image"].shape[1:]} and labels {split["label"].shape[1:]}, '
                     f'the training data {dataset.image_shape} and {dataset.train["label"].shape[1:]}; give rows of '
                     'the same kind')
  return split


def fit_dataset(model: Any, dataset: data.Dataset, settings: recipe_lib.Recipe, *, workdir: str | None = None,
                init: 'Ensemble | None' = None, keep_optimizer: bool = False, keep_freed_memory: bool = False,
                progress: bool | None = True, validation: data.Split | None = None,
                init_params: Any = None) -> Ensemble:
  """`fit` once its arrays are a checked `dataset` and its keywords a recipe: what `ensemble.distill` trains its
  student with, on labels that no array of `fit` carries (the teacher's probabilities)."""
  model_object = None
  if isinstance(model, str):
    settings = recipe_lib.of({'model': model}, base=settings)
  else:
    model_object = model
  if workdir is not None and not (isinstance(workdir, (str, os.PathLike)) and str(workdir).strip()):
    raise UsageError(f'workdir={workdir!r} names no folder; give the folder to write the run in, or leave workdir= '
                     'out to train in memory')
  if init is not None and not isinstance(init, Ensemble):
    raise UsageError(f'init={type(init).__name__}: give an Ensemble (what fit or load returned) to start from')
  if init is not None and init_params is not None:
    raise UsageError('init= starts every member from an ensemble\'s members, init_params= from one model\'s '
                     'parameters: give one of them')
  if init is not None and settings.init_from:
    raise UsageError('init= starts every member from an ensemble\'s members, init_from= from a run\'s first '
                     'member: give one of them')
  if settings.init_noise and init_params is None and not settings.init_from:
    raise UsageError(f'init_noise={settings.init_noise} adds noise to the start that init_params= (or init_from=) '
                     'gives every member, and neither is given: give one of them, or leave init_noise out')
  if workdir is not None and init is not None:
    raise UsageError('init= starts a fit in memory, and a workdir resumes from its own checkpoints: leave out one of '
                     'init= and workdir=')
  settings = settings.replace(dataset=data.ARRAYS, data_dir='', data_fingerprint=_fingerprint(dataset))
  settings = _batch_within_rows(settings, dataset)
  recipe, devices = recipe_lib.resolve(settings, jax.devices(), model=model_object, dataset=dataset)
  if keep_freed_memory:  # once the arguments are checked
    host_memory.keep_freed_memory_on_cpu()
  if workdir is not None:
    from ensemble import trainer  # pylint: disable=g-import-not-at-top  # only here: its writers import TensorFlow
    workdir = os.path.abspath(os.path.expanduser(workdir))
    _, summary = trainer.train(recipe, workdir, devices=devices, dataset=dataset, model=model_object,
                               progress=progress, validation=validation, init_params=init_params)
    ens = read(workdir, model=model_object)
    # What the run ended with, as a fit in memory reports it: early stopping's test pass on the best members and
    # the epochs trained, which no checkpoint's record holds (the best one was written before them).
    return ens._replace(summary=summary) if summary else ens  # pylint: disable=protected-access
  run = loop.prepare(recipe, devices, dataset, model_object, validation=validation)
  state = (starts.from_variables(run, run.init(), init_params) if init is None
           else starts.from_ensemble(run, init, keep_optimizer))
  state, summary = loop.train(run, state, progress=progress)
  devices = devices_lib.evaluation_devices(recipe.ensemble_size)
  if devices != run.devices:  # members spread over several devices each (backend jit): one device's worth each
    from ensemble import backends  # pylint: disable=g-import-not-at-top
    state = jax.device_put(state, backends.member_sharding(devices))
  return Ensemble(None, recipe, run.member, state, devices, summary['epoch'], batch_size=recipe.eval_batch_size,
                  task=run.task, data_info=run.data_info, summary=summary)


def _batch_within_rows(settings: recipe_lib.Recipe, dataset: data.Dataset) -> recipe_lib.Recipe:
  """A batch of the whole training set where `batch_size` exceeds it: a Bayesian-optimisation or active-learning
  loop starts from fewer rows than the batch it will grow into (Keras takes the whole set alike). The CLI, whose
  data is the run's, refuses instead (ensemble/recipe.py). Said in a hint that names no row count, so that Python
  shows it once for such a loop's line, not once for each fit as the rows grow."""
  rows = len(dataset.train['label'])
  num_train = rows - data.heldout_count(rows, settings.heldout_fraction)
  if not 0 < num_train < settings.batch_size:
    return settings
  errors.hint(f'batch_size={settings.batch_size} exceeds the training rows: each step takes all of them, one step an '
              'epoch; give a batch_size below the number of rows for more steps an epoch')
  return settings.replace(batch_size=num_train)


def _fingerprint(dataset: data.Dataset) -> str:
  """The arrays' shapes and dtypes and a hash of their bytes: what a workdir records to refuse other arrays. A
  source read as training asks is not read whole for it: its shapes and length."""
  return files.fingerprint([(name, split[key], not data.stream.is_streamed(split))
                            for name, split in (('train', dataset.train), ('test', dataset.test))
                            if split is not None for key in ('image', 'label')])


def _is_source(split: Any) -> bool:
  """Whether `split` is a random-access source of examples (a `grain.MapDataset`, a `tfds.data_source`, a list of
  pairs), not a pair of arrays nor one of `data.load`'s splits."""
  return (hasattr(split, '__len__') and hasattr(split, '__getitem__') and not isinstance(split, (np.ndarray, dict))
          and not data.stream.is_streamed(split)
          and not (isinstance(split, (tuple, list)) and len(split) == 2 and not isinstance(split[0], tuple)))


def _as_pair(split: Any, name: str) -> Any:
  """One of `data.load`'s in-memory splits ({'image', 'label'} arrays) as the pair of arrays it holds; any other
  dict is refused in one line."""
  if not isinstance(split, dict):
    return split
  if set(split) != {'image', 'label'}:
    raise UsageError(f'{name}= is a dict of {sorted(split)}; give (inputs, labels) arrays, a split of '
                     "ensemble.data.load ({'image': inputs, 'label': labels}), or a source of (input, label) pairs")
  return split['image'], split['label']


def _dataset(train: Any, test: Any, settings: recipe_lib.Recipe) -> data.Dataset:
  """The arrays (or sources, streamed) as a Dataset; without `test`, the held-out slice of `train` tests (the loop
  holds it out too), or nothing when no slice is held out."""
  train, test = _as_pair(train, 'train'), _as_pair(test, 'test')
  if _is_source(train) or data.stream.is_streamed(train):
    return _streamed(train, test, settings)
  if test is not None and (_is_source(test) or data.stream.is_streamed(test)):
    raise UsageError(f'test= is a source of examples ({type(test).__name__}) and train= is not: give train= as a '
                     'source too, or both as (inputs, labels) arrays')
  if test is None and settings.heldout_fraction:
    inputs, labels = arrays.pair(train, 'train')
    _, heldout = data.hold_out({'image': inputs, 'label': labels}, settings.heldout_fraction)
    test = (heldout['image'], heldout['label'])
  return arrays.from_arrays(train, test, settings.inputs, settings.task, ignore=settings.ignore_label)


def _streamed(train: Any, test: Any, settings: recipe_lib.Recipe) -> data.Dataset:
  """Random-access sources (or `data.load`'s streamed splits) as streamed splits (`data.stream`): read a batch at a
  time, in grain's threads, as the arrays they hold would be read."""
  if test is not None and not (_is_source(test) or data.stream.is_streamed(test)):
    raise UsageError(f'train= is a source of examples ({type(train).__name__}) and test= is not: give test= as a '
                     'source too, or both as (inputs, labels) arrays')

  def records(split, name):
    if split is None or data.stream.is_streamed(split):
      return split
    return data.stream.Records(data.stream.RandomAccessSource(split, f'{name}= source', settings.task,
                                                              settings.inputs, settings.ignore_label))
  splits = {'train': records(train, 'train'), 'test': records(test, 'test')}
  if splits['test'] is None and settings.heldout_fraction:
    _, splits['test'] = data.hold_out(splits['train'], settings.heldout_fraction)
  first = splits['train'].source
  inputs = first.inputs
  # Classes from a sample of the labels; the loop checks every label it reads against the model's outputs.
  task = tasks.named(settings.task)
  outputs = (task.num_outputs(data.stream.sample(splits['train'])['label']) if task.has_classes
             else math.prod(first.label.shape))
  return data.Dataset(splits['train'], splits['test'], f'{type(train).__name__} source, streamed', outputs,
                      inputs=inputs, task=settings.task)
