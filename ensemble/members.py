"""The member a recipe describes, for the data its run trains on: its model, optimizer, method and task; the
data's description that checkpoints record; and the model's check against the data.

The trainer, the evaluator and the benchmark all build their members here, from a recipe that
ensemble/recipe.py resolved. What only the traced model can tell (its outputs against the data's classes or
targets, the layers a method needs) is checked here, once per program (ensemble/loop.py keeps them).
"""

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ensemble import methods, models, optim, steps, tasks
from ensemble import sharing
from ensemble.errors import UsageError


def _require(ok: bool, message: str):
  if not ok:
    raise UsageError(message)


def member(config: Any, data_info: dict[str, Any], steps_per_epoch: int = 1,
           model: Any = None) -> steps.Member:
  """The member that `config` describes, for data described by `data_info` (see `data_info`).

  The trainer, the evaluator and the benchmark all build their members here.
  `steps_per_epoch` only sets what a method keeps by step (snapshot's cycles,
  MultiSWAG's collections); the schedule reads the run's horizon (`optim.horizon`)
  from each member's state. `model`, a
  user's model object, replaces the one `config.model` names.
  """
  image_shape = tuple(data_info['image_shape'])
  inputs = data_info.get('inputs', 'images')
  return steps.Member(model=models.create(config, data_info['num_classes'], image_shape, model),
                      tx=optim.create(config), image_shape=image_shape,
                      mean=tuple(data_info['mean']), std=tuple(data_info['std']),
                      augment=config.augment if inputs == 'images' else 'none',
                      method=methods.create(config, steps_per_epoch), inputs=inputs,
                      dtype=config.dtype, task=tasks.create(config, data_info),
                      adversarial_epsilon=config.adversarial_epsilon, frozen=tuple(config.frozen),
                      adapter_rank=config.adapter_rank, positions=tuple(data_info.get('positions', ())),
                      horizon=tuple(int(v) for v in optim.horizon(config, steps_per_epoch)))


def data_info(image_shape: Sequence[int], num_classes: int, mean: Sequence[float], std: Sequence[float],
              inputs: str = 'images', target_stats: tuple[Sequence[float], Sequence[float]] | None = None,
              positions: Sequence[int] = ()) -> dict:
  """What a member needs to know of its data; checkpoints keep it, so a workdir can predict on its own.

  `image_shape` is one input's shape, whatever `inputs` (steps.INPUTS) it is.
  For regression, `num_classes` is the model's number of outputs (2 D) and
  `target_stats` the training targets' per-target mean and standard deviation.
  """
  info = {'image_shape': [int(s) for s in image_shape], 'num_classes': int(num_classes),
          'mean': [float(m) for m in mean], 'std': [float(s) for s in std], 'inputs': inputs}
  if target_stats is not None:
    info['target_mean'], info['target_std'] = ([float(v) for v in values] for values in target_stats)
  if positions:  # a dense task's: the shape of the labels of one input, a class at each position
    info['positions'] = [int(p) for p in positions]
  return info


def _batch_named(shape: Any) -> str:
  """A traced output's shape as a message says it: its batch of 1 example is '(batch, ...)'."""
  return str(tuple(shape)).replace('(1,', '(batch,', 1) if isinstance(shape, tuple) else str(shape)


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
  output_shape = tuple(logits.shape) if hasattr(logits, 'shape') else None
  problem = member.task.output_error(output_shape, member.task.width(num_classes), tuple(member.positions))
  if problem:
    got = _batch_named(output_shape if output_shape is not None else type(logits).__name__)
    raise UsageError(f'the model maps inputs {shape} to {got}, {problem}')
  sharing.check(member.method.shared_filters, variables['params'], 'shared')
  sharing.check(member.frozen, variables['params'], 'frozen')
  sharing.check_adapted(member.method.shared_filters, variables['params'], member.adapter_rank)
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
  return int(logits.shape[-1])


@functools.lru_cache(maxsize=64)
def _tables(member: steps.Member) -> tuple[int, ...]:
  """The rows of each embedding table of the member's model (a parameter named 'embedding', (V, E), as nn.Embed
  and nnx.Embed make), read off its initialisation traced once."""
  params = jax.eval_shape(member.init_variables, jax.random.key(0))['params']
  return tuple(leaf.shape[0] for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
               if getattr(path[-1], 'key', None) == 'embedding' and len(leaf.shape) == 2)


def vocabulary(member: steps.Member) -> int | None:
  """How many token ids the member's model can embed: the rows of its one embedding table. None for other inputs,
  or a model with no table or several (which one an id indexes is the model's business)."""
  if member.inputs != 'tokens':
    return None
  tables = _tables(member)
  return tables[0] if len(tables) == 1 else None


def embeds(member: steps.Member) -> bool:
  """Whether the member's model has an embedding table: what integer inputs are token ids to."""
  return bool(_tables(member))


def ids_checked(member: steps.Member, inputs: np.ndarray, name: str = 'inputs') -> np.ndarray:
  """Token ids as they are, once they are known to lie in the model's embedding table: an id beyond it would be
  embedded as NaN (JAX fills a gather out of bounds), and predict NaN, without a word."""
  rows = vocabulary(member)
  if rows is None or not inputs.size:
    return inputs
  beyond = (inputs >= rows).reshape(len(inputs), -1).any(1)
  if beyond.any():
    raise UsageError(f'{name}: {int(beyond.sum())} of {len(inputs)} inputs hold token ids beyond the model\'s '
                     f'embedding table of {rows} rows (the largest id is {int(inputs.max())}); give ids below {rows}, '
                     'or build the model with a larger table')
  return inputs
