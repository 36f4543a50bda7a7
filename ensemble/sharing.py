"""Which parameters the members share (one copy, trained by all of them) or keep frozen (never trained): filters of
module paths, as `fit(shared=..., frozen=...)` and `--config.shared` / `--config.frozen` name them.

A filter is a module path, 'backbone' or 'backbone/Dense_0' (its '/'-separated
names), and matches every parameter under a module of that path, at any depth:
'Dense_0' matches 'Dense_0/kernel' and 'head/Dense_0/bias'. The same names
find the parameter's optimizer state, which holds the parameters' tree. A
shared leaf is held once per device, as BatchEnsemble's shared weights are
(methods/batchensemble.py); a frozen leaf gets no optimizer state
(`optax.multi_transform` with `set_to_zero`) and no gradient: the backward
pass stops at it (`stop_frozen`), so a frozen backbone under trained heads costs
one forward pass a step. With `adapter_rank`, each member also has low-rank
adapters of the shared kernels, its own (`with_adapters`, `merged`).
"""

import math
import sys
from collections.abc import Mapping
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ensemble.errors import UsageError

# The parts of a member's state that hold the parameters' tree; the model's statistics, the key and the step are
# each member's own.
_PARAMETER_PARTS = ('params', 'opt_state')
# Where a member's low-rank adapters (`adapter_rank`) sit in its parameters, beside the model's: each member's own,
# never matched by a filter, merged into the kernels they adapt before the model runs (`merged`).
ADAPTERS = '_adapters'


def _name(key) -> str | None:
  for attribute in ('key', 'name'):  # DictKey, GetAttrKey
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return None


def names(path) -> tuple[str, ...]:
  """A key path's names (dict keys and attributes), indices left out."""
  return tuple(name for name in map(_name, path) if name is not None)


def as_filters(value: Any, name: str) -> tuple[str, ...]:
  """`value` (a module path, or a tuple or list of them) as a tuple of paths; a one-line error otherwise."""
  value = (value,) if isinstance(value, str) else value
  if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v.strip('/') for v in value):
    raise UsageError(f"{name}={value!r}: give a module path such as 'backbone' (or a tuple of them), whose "
                     'parameters it names')
  return tuple(v.strip('/') for v in value)


def matches(filters: Sequence[str], path_names: Sequence[str]) -> bool:
  """Whether any filter's names occur in `path_names`, one after another (never in an adapter's path)."""
  if ADAPTERS in path_names:
    return False
  for f in filters:
    parts = tuple(f.split('/'))
    if any(tuple(path_names[i:i + len(parts)]) == parts for i in range(len(path_names) - len(parts) + 1)):
      return True
  return False


def mask(filters: Sequence[str], params: Any) -> Any:
  """`params`' tree of bools: True where a filter matches the parameter's path."""
  return jax.tree_util.tree_map_with_path(lambda path, _: matches(filters, names(path)), params)


def in_state(filters: Sequence[str], path) -> bool:
  """Whether the leaf at `path` of a member's state (its parameters or their optimizer state) is matched."""
  found = names(path)
  return bool(found) and found[0] in _PARAMETER_PARTS and matches(filters, found[1:])


def check(filters: Sequence[str], params: Any, name: str):
  """Refuses, in one line, a filter that matches no parameter of the model (naming a few paths it has)."""
  paths = [names(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  for f in filters:
    if not any(matches((f,), path) for path in paths):
      shown = ', '.join('/'.join(path) for path in paths[:4]) + (f' and {len(paths) - 4} more' if len(paths) > 4
                                                                  else '')
      raise UsageError(f"{name}={f!r} matches no parameter of the model, whose parameters are {shown}: name one of "
                       'their module paths')


def stop_frozen(filters: Sequence[str], params: Any) -> Any:
  """`params` with the frozen leaves behind `stop_gradient`: nothing flows back into them, so XLA drops the part of
  the backward pass that only they needed."""
  if not filters:
    return params
  return jax.tree_util.tree_map_with_path(
      lambda path, p: jax.lax.stop_gradient(p) if matches(filters, names(path)) else p, params)


def kept_frozen(filters: Sequence[str], before: Any, after: Any) -> Any:
  """A member's collections as a train call left them (`after`: BatchNorm's running averages updated from the
  batch), but those under a frozen module as they were (`before`): a frozen pretrained backbone keeps the statistics
  it came with, the same for every member, as it keeps its parameters."""
  if not filters:
    return after
  return jax.tree_util.tree_map_with_path(lambda path, new, old: old if matches(filters, names(path)) else new,
                                          after, before)


def labels(filters: Sequence[str]):
  """`optax.multi_transform`'s labels of a parameter tree: 'frozen' or 'trained'."""
  return lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: 'frozen' if matches(filters, names(path)) else 'trained', params)


def as_variables(init_params: Any, params: Any, collections: Sequence[str]) -> dict[str, Any]:
  """`init_params` as {'params': one model's parameters, collection: its values, ...}, every leaf an array.

  It is either one model's parameters (a tree of them by module name), or the
  model's whole variables: a dict that holds 'params' beside the model's
  collections ('batch_stats': BatchNorm's running averages; where the model
  has a module named 'params' of its own, only a dict whose keys are all
  collection names), or an NNX model or its `nnx.state`, split as the members
  hold it (nnx.Param as 'params', nnx.BatchStat as 'batch_stats', the other
  variables but random streams as 'state'). `params` is the members' parameter
  tree (its top names), `collections` the model's collections besides 'params'.
  A leaf given as a Python list or number is taken as the array it spells.
  """
  nnx = sys.modules.get('flax.nnx')  # imported wherever an NNX object was made
  if nnx is not None and isinstance(init_params, nnx.Module):
    init_params = nnx.state(init_params)
  if nnx is not None and isinstance(init_params, nnx.State):
    parts = nnx.split_state(init_params, nnx.Param, nnx.BatchStat, (nnx.RngState, nnx.Intermediate), ...)
    init_params = {name: nnx.to_pure_dict(part) for name, part in zip(('params', 'batch_stats', None, 'state'), parts)
                   if name and jax.tree.leaves(part)}
  if not isinstance(init_params, Mapping) or not init_params:
    got = 'an empty dict' if isinstance(init_params, Mapping) else f'of type {type(init_params).__name__}, not a tree'
    raise UsageError(f'init_params= is {got}: give a tree of the model\'s parameters by module name (a 1-member '
                     "fit's ens.params), or its variables {'params': ..., 'batch_stats': ...}")
  own_names = set(params) if isinstance(params, Mapping) else set()
  keys = set(init_params)
  if 'params' in keys and ('params' not in own_names or keys <= {'params', *collections}):
    unknown = sorted(map(str, keys - {'params', *collections}))
    if unknown:
      raise UsageError(f"init_params holds the collection {', '.join(map(repr, unknown))} beside 'params', and the "
                       f"model has {'the collections ' + ', '.join(map(repr, collections)) if collections else 'none'}"
                       f"; give only the model's variables, or its parameters alone")
    variables = dict(init_params)
  else:
    variables = {'params': init_params}
  return {name: _arrays(tree, 'init_params' if name == 'params' and len(variables) == 1 else
                        f'init_params[{name!r}]') for name, tree in variables.items()}


def _arrays(tree: Any, what: str) -> Any:
  """`tree` with each leaf that is no array (a Python list, tuple or number) as the array it spells; one that
  spells none is refused in one line naming its path."""
  def array(path, leaf):
    if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
      return leaf
    try:
      value = np.asarray(leaf)
    except ValueError:
      value = None
    if value is None or not (np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
      raise UsageError(f"{what} holds {'/'.join(names(path)) or 'its root'} as a {type(leaf).__name__} that is no "
                       'array of numbers; give arrays (or nested lists of numbers of one shape)')
    return value
  return jax.tree_util.tree_map_with_path(array, tree, is_leaf=lambda x: isinstance(x, (list, tuple)))


def given_leaves(init_params: Any, params: Any, what: str = 'init_params', kind: str = 'parameter'
                 ) -> dict[tuple[str, ...], Any]:
  """The leaves of `init_params` (one model's tree: its parameters, or one of its collections) by path, checked
  against the members' (`params`, (K, ...) per leaf, concrete or abstract): one of another shape, or at a path the
  model lacks, is refused in one line naming the path. A 1-member ensemble's, (1, ...) per leaf, loses that axis."""
  given = {names(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(init_params)}
  known = {names(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  if given and all(path in known and tuple(leaf.shape) == (1, *known[path].shape[1:]) for path, leaf in given.items()):
    given = {path: leaf[0] for path, leaf in given.items()}  # a 1-member ensemble's params, (1, ...) per leaf
  for path, leaf in given.items():
    if not path:
      raise UsageError(f'{what} is one array, not a tree: give the {kind}s of this model by module name')
    if path not in known:
      raise UsageError(f"{what} holds {'/'.join(path)}, where the model has no {kind}; give the {kind}s of this "
                       "model (a 1-member fit's ens.params[0], or a checkpoint of the model)")
    if tuple(leaf.shape) != tuple(known[path].shape[1:]):
      raise UsageError(f"{what} holds {'/'.join(path)} as {tuple(leaf.shape)}, where the model has "
                       f'{tuple(known[path].shape[1:])}; give the {kind}s of this model')
  return given


def fill_from(init_params: Any, params: Any, noise: float = 0.0, seed: int = 0, shared: Any = None,
              what: str = 'init_params', kind: str = 'parameter') -> Any:
  """The stacked members' `params` ((K, ...) per leaf) with every leaf that `init_params` (one model's tree) holds at
  the same path replaced by it, for every member, plus Gaussian `noise` (a standard deviation; each member and leaf
  its own draw from `seed`) where `shared` (a tree of bools) does not say the leaf is one copy. One of another
  shape, or at a path the model lacks, is refused in one line naming the path (`given_leaves`); a leaf that
  `init_params` lacks stays as the member's key drew it. The same fills a collection (`what` names it)."""
  given = given_leaves(init_params, params, what, kind)

  rng = np.random.default_rng([seed, 0x1a17])

  def fill(path, leaf, one_copy):  # placed as the member's leaf is: over the members' devices
    found = given.get(names(path))
    if found is None:
      return leaf
    value = np.broadcast_to(np.asarray(found, leaf.dtype), leaf.shape)
    if noise and not one_copy:
      value = (value + noise * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
    return jax.device_put(value, leaf.sharding)
  shared = jax.tree.map(lambda _: False, params) if shared is None else shared
  return jax.tree_util.tree_map_with_path(fill, params, shared)


def _kernels(filters: Sequence[str], params: Any) -> dict[tuple[str, ...], Any]:
  """The matched leaves that are kernels (2 or more axes: Dense (in, out), Conv (..., in, out)), by path."""
  return {names(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
          if matches(filters, names(path)) and len(leaf.shape) >= 2}


def check_adapted(filters: Sequence[str], params: Any, rank: int):
  """Refuses `adapter_rank` where the shared parameters hold no kernel to adapt."""
  if rank and not _kernels(filters, params):
    raise UsageError(f'adapter_rank={rank} adapts the kernels of the shared layers, and shared={list(filters)} holds '
                     'none (no parameter of 2 or more axes): name layers with a kernel (Dense, Conv), or set '
                     'adapter_rank=0')


def with_adapters(filters: Sequence[str], rank: int, params: Any, key: jax.Array) -> Any:
  """One member's `params` and, for each kernel the filters match, a rank-`rank` adapter of its own: A (fan in,
  rank) drawn from `key` at 1/sqrt(fan in), B (rank, out) zeros, so that the member starts as the model (LoRA, Hu et
  al. 2021; an ensemble of them, Wang et al. 2023)."""
  if not rank:
    return params
  adapters = {}
  for i, (path, kernel) in enumerate(sorted(_kernels(filters, params).items())):
    fan_in, out = int(math.prod(kernel.shape[:-1])), kernel.shape[-1]
    node = adapters
    for name in path[:-1]:
      node = node.setdefault(name, {})
    a = jax.random.normal(jax.random.fold_in(key, i), (fan_in, rank), kernel.dtype) / math.sqrt(fan_in)
    node[path[-1]] = {'a': a, 'b': jnp.zeros((rank, out), kernel.dtype)}
  return {**params, ADAPTERS: adapters}


def merged(params: Any) -> Any:
  """The model's parameters: `params` without the adapters, each adapted kernel plus A B (reshaped to it)."""
  if not isinstance(params, dict) or ADAPTERS not in params:
    return params
  adapters = params[ADAPTERS]
  model = {key: value for key, value in params.items() if key != ADAPTERS}

  def merge(path, kernel):
    node = adapters
    for name in names(path):
      node = node.get(name) if isinstance(node, dict) else None
      if node is None:
        return kernel
    return kernel + (node['a'] @ node['b']).reshape(kernel.shape).astype(kernel.dtype)
  return jax.tree_util.tree_map_with_path(merge, model)
