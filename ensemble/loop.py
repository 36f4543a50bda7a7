"""The training core, in memory: a run's checks and programs, then the epoch loop with hooks at each epoch's end.

  run = loop.prepare(recipe, devices, dataset, model)  # standardises, builds (or reuses) the compiled programs
  state, summary = loop.train(run, run.init(), hooks=[...])

`ensemble.fit` runs it alone and nothing is written anywhere; `python -m
ensemble.train` and `fit(workdir=...)` attach the workdir's hooks
(ensemble/trainer.py: checkpoints, metrics.jsonl, TensorBoard, resume), in the
style of Flax's periodic actions and Keras callbacks: one loop, not two.

Programs are kept for the process (`_PROGRAMS`), keyed by what they compute: a
loop of fits of the same model and recipe on data of the same shapes traces
and compiles once. What changes from fit to fit stays out of the programs:
feature and target standardisation happen on the host, in float64, and the
training set is padded to a size bucket, so a set that grows by a few rows
reuses the programs (padded rows are never drawn into a batch), and the seed
enters them as arguments (the members' keys and the seed's, `keys.seed_key`),
so a fit with another seed reuses them too, under any method.
"""

import collections
import concurrent.futures
import dataclasses
import functools
import json
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from ensemble import backends, console, data, devices as devices_lib, distributed, divergence, errors, members
from ensemble import methods, optim
from ensemble import sigterm, standardise
from ensemble import steps, tasks
from ensemble import recipe as recipe_lib
from ensemble.defaults import Recipe
from ensemble.errors import UsageError
from ensemble.models import user

# A training set up to this size (its inputs and labels, one copy per device) goes to the devices once, and a whole
# epoch runs as one program (steps_per_dispatch = -1), unless the steps must be unrolled (convolutions on CPU,
# `backends.unrolls`). Larger sets are fed a batch at a time from the host.
RESIDENT_LIMIT_BYTES = 64 << 20
# steps_per_dispatch's "choose": -1 for a set under RESIDENT_LIMIT_BYTES whose steps run as a loop, else 0.
AUTO_DISPATCH = -2
# How many runs' programs a process keeps.
_CACHE_SIZE = 8
class Hook:
  """What the loop calls as it goes; each does nothing unless a hook says otherwise. The workdir's checkpoints,
  metrics and event files are hooks (ensemble/trainer.py)."""

  def after_steps(self, step: int):
    """After each dispatch, `step` steps in."""

  def save_point(self, epoch: int, position: 'Position', state: Any, summary: dict[str, float]):
    """At each epoch's end, once its summary is known, and every `checkpoint_every_steps` steps (`summary` then has
    the epoch's training metrics so far); `state` is canonical (what checkpoints store), and checked finite."""

  def stop_point(self, epoch: int, position: 'Position', state: Any, summary: dict[str, float]):
    """Where SIGTERM stopped the run inside an epoch: as `save_point`, for the position a resume goes on from."""

  def close(self):
    """However the run ends."""


@dataclasses.dataclass
class Programs:
  """What a run compiles, kept across the runs that share it: the member and its backend."""
  member: steps.Member
  backend: Any
  num_outputs: int


@dataclasses.dataclass
class Run:
  """A training run once its recipe and data are resolved: the loop's input.

  `train` and `test` are the host splits as the programs take them (features
  and targets standardised); `data_info` describes the data as checkpoints
  record it (with the standardisation's statistics), `task` the outputs in the
  data's own units. `member` is what the programs compute (in standardised
  units), `steps_per_dispatch` how many steps each dispatch runs (-1: an epoch).
  """
  recipe: Recipe
  devices: list[jax.Device]
  dataset: data.Dataset
  train: data.Split
  test: data.Split | None
  data_info: dict[str, Any]
  member: steps.Member
  task: Any
  backend: Any
  steps_per_epoch: int
  steps_per_dispatch: int
  validation: data.Split | None = None  # scored after every epoch, for early stopping (`recipe.early_stopping`)

  @property
  def num_train(self) -> int:
    return len(self.train['label'])

  def init(self) -> Any:
    """Every member's fresh state, from the recipe's seed."""
    return self.backend.init(self.recipe.seed)


@dataclasses.dataclass
class Best:
  """Early stopping's best epoch so far: its validation NLL, its members (canonical, in buffers of their own) and its
  summary."""
  loss: float
  epoch: int
  members: Any
  summary: dict[str, float]


_PROGRAMS: 'collections.OrderedDict[Any, Programs]' = collections.OrderedDict()


def _program_key(recipe: Recipe, program_info: dict, model: Any, devices: Sequence[jax.Device],
                 steps_per_epoch: int) -> Any:
  """What the programs depend on: the recipe but what they do not read (`recipe.for_programs`), the data's shapes,
  the model, the devices, and the method, whose fields may count steps (snapshot's cycles). Not the run's length
  nor its images' statistics: the programs read them from the members' state (`with_run`)."""
  images = program_info.get('inputs') == 'images'
  shapes = {k: v for k, v in program_info.items() if not (images and k in IMAGE_STATS)}
  return (recipe_lib.for_programs(recipe), json.dumps(shapes, sort_keys=True), user.key(model),
          tuple(d.id for d in devices), methods.create(recipe, steps_per_epoch))


# What the programs take of images' statistics as data (`steps.TrainState.inputs`), not in their key.
IMAGE_STATS = ('mean', 'std')


def _programs(recipe: Recipe, program_info: dict, model: Any, devices, steps_per_epoch: int) -> Programs:
  """The member and backend for `program_info`'s data: kept from an earlier run with the same key, or built."""
  key = _program_key(recipe, program_info, model, devices, steps_per_epoch)
  if key in _PROGRAMS:
    _PROGRAMS.move_to_end(key)
    return _PROGRAMS[key]
  outputs = program_info['num_classes']
  member = members.member(recipe, program_info, steps_per_epoch, model)
  # The mesh backends' models are the package's own, built for their mesh (backends/sharded.py).
  num_outputs = (outputs if recipe.backend in backends.MESH_MODELS
                 else members.check_model(member, outputs, recipe.method))
  if num_outputs != outputs:  # a user's model with more outputs than the training labels use
    member = members.member(recipe, {**program_info, 'num_classes': num_outputs}, steps_per_epoch, model)
  backend = backends.create(recipe.backend, member=member, devices=devices, ensemble_size=recipe.ensemble_size,
                            member_data=recipe.member_data, config=recipe)
  programs = Programs(member, backend, num_outputs)
  _PROGRAMS[key] = programs
  while len(_PROGRAMS) > _CACHE_SIZE:
    _PROGRAMS.popitem(last=False)
  return programs


def prepare(recipe: Recipe, devices: Sequence[jax.Device], dataset: data.Dataset, model: Any = None,
            validation: data.Split | None = None) -> Run:
  """Builds (or reuses) the programs of a resolved recipe (ensemble/recipe.py) for `dataset`, and standardises the
  data for them; writes nothing, and neither checks nor changes the recipe. `model` is a user's model object, which
  replaces the one the recipe names. With `recipe.early_stopping`, `validation` (a split of the dataset's kind;
  default: the held-out slice of the training split) is scored after every epoch."""
  devices = list(devices)
  if recipe.early_stopping and validation is None:
    if not recipe.heldout_fraction:
      raise UsageError(f'early_stopping={recipe.early_stopping} scores the held-out slice of the training split after '
                       'every epoch, and heldout_fraction=0 holds out none: set --config.heldout_fraction (e.g. 0.1), '
                       'or give ensemble.fit validation=(x_val, y_val)')
    validation = data.hold_out(dataset.train, recipe.heldout_fraction)[1]
  devices_lib.compilation_cache(recipe.compilation_cache)
  train, test, data_info, program_info = standardise.splits(dataset, train_before(dataset, recipe), recipe)
  if validation is not None:  # converted as a test split is, by the training split's statistics
    validation = standardise.splits(dataclasses.replace(dataset, test=validation), train_before(dataset, recipe),
                                    recipe)[1]
  steps_per_epoch = data.steps_per_epoch(len(train['label']), recipe.batch_size)
  programs = _programs(recipe, program_info, model, devices, steps_per_epoch)
  data_info = {**data_info, 'num_classes': programs.num_outputs}
  if dataset.inputs == 'tokens' and recipe.inputs == 'auto' and not members.embeds(programs.member):
    where = 'train' if dataset.source == data.ARRAYS else dataset.source
    raise UsageError(f'{where}: the inputs are integers, which are token ids only to a model that embeds them, and '
                     'this model has no embedding table (nn.Embed): set --config.inputs=features if they are numbers '
                     '(counts, codes, levels), or --config.inputs=tokens if the model takes ids its own way')
  vocabulary = members.vocabulary(programs.member) is not None

  def checked(split, name):
    """Labels the outputs can score, and token ids the model can embed, checked as they are read."""
    if split is None:
      return None
    if dataset.kind.has_classes:
      split = data.stream.with_classes_checked(split, programs.num_outputs)
    if vocabulary:
      split = data.stream.transformed(split, image=functools.partial(members.ids_checked, programs.member,
                                                                     name=f'{dataset.source}: {name}'))
    return split
  train, test, validation = checked(train, 'train'), checked(test, 'test'), checked(validation, 'validation')
  per_dispatch = recipe.steps_per_dispatch
  if per_dispatch == AUTO_DISPATCH:
    per_dispatch = -1 if resident_eligible(train, programs.member, devices) else 0
  return Run(recipe=recipe, devices=devices, dataset=dataset, train=train, test=test, data_info=data_info,
             member=programs.member, task=tasks.create(recipe, data_info),
             backend=backends.for_seed(programs.backend, recipe.seed),  # programs shared by every seed
             steps_per_epoch=steps_per_epoch, steps_per_dispatch=per_dispatch, validation=validation)


def train_before(dataset: data.Dataset, recipe: Recipe) -> data.Split:
  """The training split as the dataset holds it, without the held-out slice: what the statistics come from."""
  return data.hold_out(dataset.train, recipe.heldout_fraction)[0]


def resident_eligible(train: data.Split, member: steps.Member, devices: Sequence[jax.Device]) -> bool:
  """Whether a whole epoch can run as one program: the set is small (and in memory), and the steps run as a loop on
  the devices."""
  if data.stream.is_streamed(train):
    return False
  size = sum(np.asarray(v).nbytes for v in train.values())
  return size <= RESIDENT_LIMIT_BYTES and not backends.unrolls(devices, member)


def evaluate(backend, state, split: data.Split, batch_size: int, task: Any) -> dict[str, Any]:
  """The `task`'s ensemble and member metrics over the whole split, each example counted once, in the data's units.

  Each process feeds only its rows of every batch; the outputs cover whole
  batches. The programs score in standardised units (they do not change when
  the data does); `task.in_data_units` converts on the host.
  """
  from ensemble import metrics  # pylint: disable=g-import-not-at-top  # clu: only where a test pass runs
  outputs, masks = [], []
  rows = distributed.process_rows(backend.devices, batch_size)
  for images, labels, mask in data.eval_batches(split, batch_size, rows):
    outputs.append(backend.eval_step(state, images, labels))
    masks.append(mask)
  outputs = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *backend.to_host(outputs))  # (K, N, ...)
  outputs = task.in_data_units(outputs)
  # The ensemble outputs are the same on every member; member 0's copy is enough.
  outputs = {k: v[0] if k.startswith('ensemble_') else v.T for k, v in outputs.items()}
  return metrics.of(task).single_from_model_output(**outputs, mask=np.concatenate(masks)).compute()


def _train_summary(outputs: list[dict[str, np.ndarray]], earlier: tuple[int, dict[str, float]] | None = None,
                   ensemble_size: int = 1) -> dict[str, float]:
  """The epoch's training metrics, each averaged over the members and the steps; with `earlier`, (the number of
  steps, their averages) that the epoch trained before a resume, over all of its steps."""
  means = {name: float(np.concatenate([np.ravel(chunk[name]) for chunk in outputs]).mean(dtype=np.float64))
           for name in outputs[0]}
  if not earlier:
    return means
  done, before = earlier
  steps = sum(np.size(chunk['loss']) for chunk in outputs) // ensemble_size
  return {name: (before[name] * done + mean * steps) / (done + steps) for name, mean in means.items()}


# Draws the next epoch's batch indices while the devices train on this one.
_DRAWER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='ensemble-batches')


def _epoch_indices(run: Run, start_epoch: int):
  """(epoch, its batch indices) from `start_epoch + 1` (the epoch in progress) on. On small data an epoch's program
  is as short as the host's draw of its K orders (0.2 ms for 5 members of 450 rows), so the next epoch's are drawn
  in a thread while this one trains (the loop waits on the devices with the GIL released)."""
  config = run.recipe
  draw = lambda epoch: data.train_batch_indices(run.num_train, config.batch_size, config.seed, epoch,
                                                config.ensemble_size, config.member_data)
  upcoming = _DRAWER.submit(draw, start_epoch + 1)
  for epoch in range(start_epoch + 1, config.num_epochs + 1):
    indices = upcoming.result()
    if epoch < config.num_epochs:
      upcoming = _DRAWER.submit(draw, epoch + 1)
    yield epoch, indices


def _numbers(summary: dict[str, Any]) -> dict[str, float]:
  """The summary's figures as floats, its epochs as the whole numbers they are (metrics.jsonl's step lines write
  them so)."""
  return {k: int(v) if k in ('epoch', 'best_epoch', 'epochs_trained') else float(v) for k, v in summary.items()}


def _test_due(config: Recipe, epoch: int) -> bool:
  every = config.eval_every
  return epoch == config.num_epochs or (every > 0 and epoch % every == 0)


@dataclasses.dataclass(frozen=True)
class Position:
  """Where training stands: `step` steps done, and where the reading of the current epoch's batches stands
  (`data.stream.batches`' iterator state); a checkpoint records it, and a run resumes from it exactly."""
  step: int = 0
  data_state: dict[str, Any] | None = None
  # The epoch's training metrics so far (`_train_summary`), so that a resumed epoch's summary covers all its steps.
  epoch_metrics: dict[str, float] | None = None
  # The seconds the epoch trained so far, so that a resumed epoch's train_seconds covers all its steps.
  train_seconds: float = 0.0

  def epoch(self, steps_per_epoch: int) -> tuple[int, int]:
    """(completed epochs, steps done in the epoch in progress)."""
    return divmod(self.step, steps_per_epoch)


def total_steps(config: Recipe, steps_per_epoch: int) -> int:
  return config.num_train_steps or config.num_epochs * steps_per_epoch


def with_run(state: Any, run: Run) -> Any:
  """`state` (any layout) with what the programs take from the run as data, every member's alike, placed as it was:
  the schedule's horizon (`optim.horizon`) and images' statistics (`steps.TrainState.inputs`)."""
  def filled(like, value):
    full = np.broadcast_to(np.asarray(value, like.dtype), like.shape)
    return jax.make_array_from_callback(like.shape, like.sharding, lambda index: full[index])
  stats = {'mean': run.data_info['mean'], 'std': run.data_info['std']}
  return state.replace(horizon=filled(state.horizon, optim.horizon(run.recipe, run.steps_per_epoch)),
                       inputs={name: filled(like, stats[name]) for name, like in state.inputs.items()})


def _save_points(config: Recipe, first: int, last: int, per_dispatch: int) -> list[int]:
  """The steps after `first` up to `last` (an epoch's end or the run's) where a dispatch ends: every
  `per_dispatch` steps of the epoch, and every `checkpoint_every_steps` steps of the run, where state is saved."""
  ends = set(range(first + per_dispatch, last, per_dispatch)) | {last}
  every = config.checkpoint_every_steps
  if every:
    ends |= set(range(-(-(first + 1) // every) * every, last, every))
  return sorted(ends)


def train(run: Run, state: Any, *, start: Position = Position(), hooks: Sequence[Hook] = (),
          progress: bool | None = None, best: Best | None = None,
          earlier_losses: Sequence[float] | None = None) -> tuple[Any, dict[str, float]]:
  """Trains `state` (the backend's) from `start` to `config.num_epochs` (or `num_train_steps`); returns it in the
  canonical layout and the last epoch's summary.

  The test pass (when there is a test split) runs after the last epoch and
  every `eval_every` epochs. Hooks see the state at each epoch's end and every
  `checkpoint_every_steps` steps. `progress=True` shows a bar (on a terminal
  or in a notebook) and writes a line per epoch, `False` neither; None: the
  bar on a terminal at absl's INFO verbosity, the lines logged. Every dispatch
  is waited for: with several simulated CPU devices, a deep queue of in-flight
  multi-device programs starves XLA's collective rendezvous and aborts the
  process (docs/backends-and-devices.md, "Many devices on a CPU"); fetching
  the losses waits, and lets a diverged member stop the run at once.

  `recipe.early_stopping` = N > 0 (with `run.validation`): each epoch's
  validation NLL ('validation_loss', in the targets' units) is scored, and
  'best_epoch' says the best so far (the hooks keep only the epochs that are
  it); the run stops once N epochs pass without a lower one, and returns the
  members of the best epoch with that epoch's summary (and 'epochs_trained'),
  the test pass run on them. `best`: the best epoch of the run resumed.

  `earlier_losses`: the training loss of each epoch a resume completed before `start` (metrics.jsonl's), so that
  the notes on the run's losses (`note_if_still_falling`) speak of all its epochs; where a resume does not give
  them, none is made.
  """
  config, backend, per_epoch = run.recipe, run.backend, run.steps_per_epoch
  state = with_run(state, run)
  patience = config.early_stopping
  show = progress is not False and (progress or logging.level_info())
  if not patience and _at_once(run, start, hooks, show):
    return _train_at_once(run, state)
  losses, improved, judged = [], False, False  # each epoch's training loss; whether `note_if_near_chance` ran
  history = [] if start.step == 0 else earlier_losses  # the epochs before a resume's (None: not known)
  per_dispatch = run.steps_per_dispatch
  resident = None
  if per_dispatch:
    resident = backend.put_dataset(data.batches.padded_rows(run.train))
  per_dispatch = per_epoch if per_dispatch < 0 else per_dispatch or 1
  last_step = total_steps(config, per_epoch)
  step, summary, canonical, dispatches, stopping = start.step, {}, None, 0, False
  streamed = data.stream.is_streamed(run.train)
  rows_read = run.train.source.rows_read if streamed else 0
  try:
    for epoch, indices in _epoch_indices(run, start.epoch(per_epoch)[0]):
      first = (epoch - 1) * per_epoch
      done = step - first  # steps of this epoch trained before a resume
      indices = indices[:last_step - first]
      bar = console.Progress(len(indices), f'epoch {epoch}/{config.num_epochs}',
                             items_per_step=config.batch_size * config.ensemble_size, loss=run.task.reported_loss,
                             bar=None if progress is None else progress and console.interactive()) if show else None
      if bar is not None and done:
        bar.update(done)
      started = time.perf_counter()
      outputs = []
      reads = None
      if resident is None:  # each step's rows read (streamed) or gathered on the host, this process's only
        blocks = [distributed.process_block(backend.devices, batch) for batch in indices]
        reads = data.stream.batches(run.train, blocks, (start.data_state or {'next_index': done}) if done else None)
      earlier = (done, start.epoch_metrics) if done and start.epoch_metrics else None
      origin = started - (start.train_seconds if done else 0.0)  # of the epoch's train_seconds, resumed or not
      so_far = functools.partial(_train_summary, outputs, earlier, config.ensemble_size)
      for end in _save_points(config, step, first + len(indices), per_dispatch):
        with jax.profiler.StepTraceAnnotation('train', step_num=step):
          state, chunk_metrics = backends.train_chunk(backend, state, run.train, resident,
                                                      indices[step - first:end - first],
                                                      None if reads is None else next(reads))
        outputs.append(backend.to_host(chunk_metrics))
        count, step = end - step, end
        divergence.stop_if_diverged(outputs[-1]['loss'], config, epoch, step)
        for hook in hooks:
          hook.after_steps(step)
        if bar is not None:
          bar.update(count, chunk_metrics)
        dispatches += 1
        stopping, every = sigterm.stopping(dispatches), config.checkpoint_every_steps
        if step < first + len(indices) and (stopping or (every and step % every == 0)):
          summary = {'epoch': epoch, 'train_seconds': time.perf_counter() - origin, **run.task.summary(so_far())}
          _keep(run, hooks, epoch, state, summary,
                Position(step, data.stream.stream_position(reads, step - first), so_far(),
                         time.perf_counter() - origin), stop=stopping)
          if stopping:
            raise sigterm.Stopped(f'SIGTERM at step {step}')
      summary = {'epoch': epoch, 'train_seconds': time.perf_counter() - origin}
      train_metrics = so_far()
      if (not judged and epoch >= min(NEAR_CHANCE_EPOCH, config.num_epochs)
          and step >= NEAR_CHANCE_STEPS):
        judged = True  # once, after the first epochs: each member's loss over this epoch's steps
        note_if_near_chance(run, epoch, np.concatenate(
            [np.reshape(chunk['loss'], (config.ensemble_size, -1)) for chunk in outputs], axis=1).mean(1))
      test = None
      if run.test is not None and _test_due(config, epoch):
        started = time.perf_counter()
        test = evaluate(backend, state, run.test, config.eval_batch_size, run.task)
        summary['test_seconds'] = time.perf_counter() - started
      summary.update(run.task.summary(train_metrics, test))
      if patience:
        scored = evaluate(backend, state, run.validation, config.eval_batch_size, run.task)
        summary['validation_loss'] = run.task.summary(None, scored)['test_loss']
        if not np.isfinite(summary['validation_loss']):  # NaN < best never holds: the first epoch would be kept
          raise UsageError(f'validation: the NLL after epoch {epoch} is {summary["validation_loss"]}, so no epoch can '
                           'be told better than another; give validation rows the members can score (finite inputs '
                           'in the training data\'s range, labels of its classes)')
        improved = best is None or summary['validation_loss'] < best.loss
        summary['best_epoch'] = epoch if improved else best.epoch
      summary = _numbers(summary)
      losses.append(summary['train_loss'])
      canonical = None
      if hooks or epoch == config.num_epochs:  # a state that may be kept
        canonical = _keep(run, hooks, epoch, state, summary, Position(step))
      if patience and improved:
        best = Best(summary['validation_loss'], epoch,
                    copied(backend.to_canonical(state) if canonical is None else canonical), summary)
      if (stopping if distributed.preemption_synced() else sigterm.requested()) and epoch < config.num_epochs:
        raise sigterm.Stopped(f'SIGTERM at step {step}')
      if bar is not None:
        console.log_epoch(summary, config.num_epochs, bar.close(), echo=bool(progress),
                          num_classes=run.dataset.num_classes if run.task.chance_hint else None,
                          method=config.method)
      if patience and epoch - best.epoch >= patience:
        logging.info('Early stopping after epoch %d: no lower validation NLL in %d epochs since epoch %d (%.4g).',
                     epoch, patience, best.epoch, best.loss)
        break
  finally:
    for hook in hooks:
      hook.close()
  if streamed:  # across processes, each reads its own share (docs/data-and-models.md)
    logging.info('Process %d read %d rows of %s for its training batches.', jax.process_index(),
                 run.train.source.rows_read - rows_read, run.train.source.name)
  if patience and best is not None:
    return _best(run, best, summary)
  if history is not None:
    note_if_still_falling([*history, *losses])
  return backend.to_canonical(state) if canonical is None else canonical, summary


def _best(run: Run, best: Best, last: dict[str, float]) -> tuple[Any, dict[str, float]]:
  """Early stopping's result: the best epoch's members, and its summary, with the test pass run on them where that
  epoch had none."""
  summary = dict(best.summary)
  if run.test is not None and 'test_loss' not in summary:
    started = time.perf_counter()
    test = evaluate(run.backend, run.backend.from_canonical(copied(best.members)), run.test,
                    run.recipe.eval_batch_size, run.task)
    summary.update(run.task.summary(None, test), test_seconds=time.perf_counter() - started)
  summary.update(best_epoch=best.epoch, epochs_trained=last.get('epoch', best.epoch))
  return best.members, _numbers(summary)


@jax.jit
def copied(tree: Any) -> Any:
  """`tree`'s arrays in new buffers where they are (a jitted program's outputs never alias its inputs): a state
  kept while the steps go on donating theirs."""
  return jax.tree.map(jnp.copy, tree)


def note_if_still_falling(losses: Sequence[float]):
  """One hint (`errors.hint`) where the training loss was still falling when training ended (over the last quarter
  of the run's epochs, `losses` every one of them, by at least 1% of its whole fall an epoch): the members are likely
  under-trained, whatever their intervals' coverage says (10 epochs of the regression recipe on 500 rows fell 2% an
  epoch; 70, 0.03%)."""
  if len(losses) < 4:
    return
  recent = max(1, len(losses) // 4)
  total, last = losses[0] - losses[-1], losses[-1 - recent] - losses[-1]
  if total > 0 and last / recent >= 0.01 * total:
    errors.hint(f'The training loss was still falling when training ended ({losses[-1 - recent]:.4g} -> '
                f'{losses[-1]:.4g} over the last {recent} of {len(losses)} epochs): more epochs would likely fit '
                'better; early_stopping=N with validation= stops when they stop helping.')


# After this many epochs (or the run's last, where it has fewer), and once this many steps are trained, each
# member's training loss over its latest epoch is compared with chance's (`note_if_near_chance`).
NEAR_CHANCE_EPOCH = 2
NEAR_CHANCE_STEPS = 50
# A member is still at chance while its training loss is above this share of log C (C classes): it has learned
# less than 5% of the way from chance, or its loss rose above it.
NEAR_CHANCE_SHARE = 0.95


def note_if_near_chance(run: Run, epoch: int, member_losses: np.ndarray):
  """One hint (`errors.hint`) naming the members whose mean training loss over epoch `epoch` (`member_losses`, one
  per member) is still at chance's, log C for C classes, or above it (`NEAR_CHANCE_SHARE`), with the likely causes;
  for a classifier trained on labels (not a student on a teacher's probabilities). Such a member learns nothing and
  blurs the ensemble's average, with no NaN to stop the run; the test set's accuracy (`console.log_epoch`) shows it
  only where there is a test set, and only as a log line."""
  if not run.task.chance_hint or run.data_info['num_classes'] < 2:
    return
  if not data.stream.is_streamed(run.train) and not np.issubdtype(np.asarray(run.train['label']).dtype, np.integer):
    return  # `ensemble.distill`'s student: its loss against soft targets stays above log C's share where they are
  chance = float(np.log(run.data_info['num_classes']))  # cross-entropy of uniform probabilities
  near = np.flatnonzero(np.asarray(member_losses) >= NEAR_CHANCE_SHARE * chance)
  if not len(near):
    return
  config = run.recipe
  which = (f'member {near[0]}' if len(near) == 1 else f'members {near.tolist()}') + (
      f' of {config.ensemble_size}' if config.ensemble_size > 1 else '')
  rate = ('each member\'s own learning rate, which method hyper draws from hyper_learning_rate: narrow it'
          if config.method == 'hyper' else f'learning_rate={config.learning_rate:g} ({config.optimizer})')
  scale = ('; or inputs on another scale than the model expects (images arrive standardised, mean 0 and std 1 per '
           'channel)' if run.dataset.inputs == 'images' else
           '; or features on another scale than the model expects (standardize_features=True)'
           if run.dataset.inputs == 'features' and not config.standardize_features else '')
  classes = run.data_info['num_classes']
  losses = ', '.join(f'{member_losses[i]:.3g}' for i in near)
  errors.hint(f'{which}: training loss still at or above chance after epoch {epoch} ({losses}; uniform probabilities '
              f'over {classes} classes score log {classes} = {chance:.3g}): likely a learning rate too low or too high '
              f'for {"it" if len(near) == 1 else "them"}, {rate}{scale}')


def _at_once(run: Run, start: Position, hooks: Sequence[Hook], show: bool) -> bool:
  """Whether the whole run can be one program (`_train_at_once`): nothing looks in between its epochs (no hook, no
  progress shown, no test pass before the last), it starts afresh, and its epochs already run as a loop each on a
  resident set, in one process."""
  config = run.recipe
  return (run.steps_per_dispatch < 0 and not hooks and not show and start == Position()
          and not config.num_train_steps and getattr(run.backend, 'trains_epochs', False)
          and not backends.unrolls(run.devices, run.member)
          and (run.test is None or not 0 < config.eval_every < config.num_epochs))


def _train_at_once(run: Run, state: Any) -> tuple[Any, dict[str, float]]:
  """`train` as one dispatch and one host sync: every epoch's order drawn inside the program, the divergence check
  on its outputs (every step's losses and each member's final state, finite or not), and the test pass after.

  What an in-memory fit in a loop (Bayesian optimisation, active learning) costs
  besides its compute; the members are the ones the epoch-by-epoch loop trains
  (the same draws, the same steps). The summary's `train_seconds` is the
  epochs' mean.
  """
  config, backend, per_epoch = run.recipe, run.backend, run.steps_per_epoch
  started = time.perf_counter()
  resident = backend.put_dataset(data.batches.padded_rows(run.train))
  state, metrics, finite = backend.train_epochs(state, resident, config.seed, 1, config.num_epochs, run.num_train,
                                                per_epoch, config.batch_size, config.member_data == 'bootstrap')
  metrics, finite = backend.to_host((metrics, finite))  # (K, epochs, most steps) per name; (K,)
  metrics = {name: value[..., :per_epoch] for name, value in metrics.items()}  # the steps the epochs took
  losses = metrics['loss']
  bad = ~np.isfinite(losses).all(axis=(0, 2))
  if bad.any():
    epoch = int(np.argmax(bad))
    divergence.stop_if_diverged(losses[:, epoch], config, epoch + 1, (epoch + 1) * per_epoch)
  if not finite.all():
    divergence.diverged(config, config.num_epochs, config.num_epochs * per_epoch,
             f'members {np.flatnonzero(~finite).tolist()} have non-finite parameters')
  summary = {'epoch': config.num_epochs, 'train_seconds': (time.perf_counter() - started) / config.num_epochs}
  test = None
  if run.test is not None:
    started = time.perf_counter()
    test = evaluate(backend, state, run.test, config.eval_batch_size, run.task)
    summary['test_seconds'] = time.perf_counter() - started
  summary.update(run.task.summary(_train_summary([{k: v[:, -1] for k, v in metrics.items()}]), test))
  summary = _numbers(summary)
  judge = next((epoch for epoch in range(min(NEAR_CHANCE_EPOCH, config.num_epochs), config.num_epochs + 1)
                if epoch * per_epoch >= NEAR_CHANCE_STEPS), None)  # the epoch `train` judges at
  if judge is not None:
    note_if_near_chance(run, judge, losses[:, judge - 1].reshape(config.ensemble_size, -1).mean(1))
  per_epoch_losses = run.task.summary({k: v.mean((0, 2)) for k, v in metrics.items()})['train_loss']
  note_if_still_falling(per_epoch_losses.tolist())
  return backend.to_canonical(state), summary


def _keep(run: Run, hooks: Sequence[Hook], epoch: int, state: Any, summary: dict[str, float],
          position: Position, stop: bool = False) -> Any:
  """The canonical state, checked finite, handed to the hooks with where training stands (`stop`: where SIGTERM
  stopped it)."""
  canonical = run.backend.to_canonical(state)
  nonfinite = divergence.nonfinite_members(canonical, run.recipe.ensemble_size)
  if nonfinite:
    divergence.diverged(run.recipe, epoch, position.step, f'members {nonfinite} have non-finite parameters')
  for hook in hooks:
    (hook.stop_point if stop else hook.save_point)(epoch, position, canonical, summary)
  return canonical
