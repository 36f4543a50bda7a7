"""A user's own model, linen or NNX, behind the `init` / `apply` interface that `steps.Member` calls.

`steps.Member` speaks linen's language: `init(key, x, train=False)` returns the
variables ({'params': ..., 'batch_stats': ..., any other collection}), and
`apply(variables, x, train=..., rngs=..., mutable=[...])` the logits (and the
updated collections).
The built-in models are linen Modules that take `train`; a user's model need
not, and may be a Flax NNX model. The wrappers here give both that interface,
so every backend, method, checkpoint and program treats a user's members as its
own.
"""

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import types
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np

from ensemble.errors import UsageError
from ensemble.methods.mc_dropout import nnx_dropout_on


def _takes_train(fn: Callable) -> bool:
  return 'train' in _parameters(fn)


@dataclasses.dataclass(frozen=True)
class Linen:
  """A linen Module whose `__call__` may or may not take `train` (BatchNorm and Dropout need it to switch modes).

  The parameter tree is the module's own, unwrapped.
  """
  module: nn.Module

  @functools.cached_property
  def takes_train(self) -> bool:
    return _takes_train(self.module.__call__)

  def _train(self, train: bool) -> dict[str, bool]:
    return {'train': train} if self.takes_train else {}

  def init(self, key: jax.Array, x, train: bool = False):
    params_key, dropout_key = jax.random.split(key)
    return self.module.init({'params': params_key, 'dropout': dropout_key}, x, **self._train(train))

  def apply(self, variables, x, *, train: bool = False, rngs=None, mutable=False):
    return self.module.apply(variables, x, rngs=rngs, mutable=mutable, **self._train(train))


@dataclasses.dataclass(frozen=True)
class NNX:
  """An NNX model, given as `build(rngs)`: every member builds its own from its own key.

  NNX keeps a model's state in the model; here it is split out as linen's
  collections and merged back for each call: nnx.Param as 'params', the one
  collection that trains; nnx.BatchStat as 'batch_stats'; every other
  Variable (nnx.Variable, nnx.Cache, a type of the user's: constants,
  counters) as 'state'. The members carry the last two as they carry a linen
  model's collections besides 'params': what a train call changes is kept,
  the rest keeps its value. The model's random streams (Dropout's) are not
  state that the members carry: every call re-seeds them from the key the step
  passes, a key per member and step, as for linen members; what a call sows
  (nnx.Intermediate) is dropped. `train` switches the model with `.train()` /
  `.eval()` (Dropout's `deterministic`, BatchNorm's `use_running_average`),
  and is passed on if its `__call__` takes it; MC dropout's prediction then
  switches its Dropout layers back on (`mc_dropout.nnx_dropout_on`).
  """
  build: Callable[..., Any]

  @functools.cached_property
  def _template(self):
    """`_split` of the model, abstract: built once, without computing."""
    from flax import nnx  # pylint: disable=g-import-not-at-top
    return _split(nnx.eval_shape(lambda: _build(self.build, nnx.Rngs(0))))

  def init(self, key: jax.Array, x, train: bool = False):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    params_key, call_key = jax.random.split(key)
    module = _build(self.build, nnx.Rngs(params_key))
    self._call(module, x, train, call_key)  # as linen's init runs the model: a shape error shows here
    variables = _variables(_split(module)[1])
    # Each call merges the variables into a model as built: one that a call creates would start afresh each time.
    built = {path for path, _ in jax.tree_util.tree_flatten_with_path(_variables(self._template[1]))[0]}
    created = ['.'.join(str(entry.key) for entry in path[1:])
               for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0] if path not in built]
    if created:
      raise UsageError(f'the NNX model creates variables when it is called ({", ".join(created)}): create them in '
                       '__init__, so that every member carries them from step to step')
    return {name: tree for name, tree in variables.items() if tree}

  def _call(self, module, x, train: bool, key: jax.Array | None):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    if key is not None:
      nnx.reseed(module, default=key, dropout=key)
    module.train() if train else module.eval()  # pylint: disable=expression-not-assigned
    nnx_dropout_on(module)  # MC dropout's prediction: its dropout layers drop in eval mode too
    return module(x, train=train) if _takes_train(module.__call__) else module(x)

  def apply(self, variables, x, *, train: bool = False, rngs=None, mutable=False):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    graphdef, collections, uncarried = self._template
    key = (rngs or {}).get('dropout')
    fresh = lambda state: jax.tree.map(lambda leaf: _placeholder(leaf, key), state)  # new containers, filled below
    collections, uncarried = {name: fresh(state) for name, state in collections.items()}, fresh(uncarried)
    for name, state in collections.items():
      if jax.tree.leaves(state):
        nnx.replace_by_pure_dict(state, variables[name])
    module = nnx.merge(graphdef, *collections.values(), uncarried)
    logits = self._call(module, x, train, key)
    if not mutable:
      return logits
    return logits, {name: tree for name, tree in _variables(_split(module)[1]).items()
                    if mutable is True or name in mutable}


def _split(module):
  """(graphdef, {collection: its nnx.State}, the state that is not carried: random streams, what a call sowed)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  graphdef, params, batch_stats, uncarried, state = nnx.split(
      module, nnx.Param, nnx.BatchStat, (nnx.RngState, nnx.Intermediate), ...)
  return graphdef, {'params': params, 'batch_stats': batch_stats, 'state': state}, uncarried


def _variables(collections: dict[str, Any]) -> dict[str, Any]:
  """{collection: its nnx.State} -> {collection: its values as nested dicts}, linen's variables."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return {name: nnx.to_pure_dict(state) for name, state in collections.items()}


def _parameters(fn: Callable[..., Any]) -> Sequence[str]:
  """The argument names of a function or class, through partials; NNX classes hide theirs behind a metaclass."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  try:
    return list(inspect.signature(fn.__init__ if isinstance(fn, type) else fn).parameters)
  except (TypeError, ValueError):
    return []


def _build(build: Callable[..., Any], rngs):
  """`build(rngs=rngs)` when it names an `rngs` argument (an NNX Module class, a partial of one), else `build(rngs)`.

  What builds no NNX model (a plain function of the inputs, given as the model) is refused in one line here, where
  it would otherwise fail on the `nnx.Rngs` it was given and be reported as a model that fails on the inputs."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  fn = build
  while isinstance(fn, functools.partial):
    fn = fn.func
  name = getattr(fn, '__name__', type(fn).__name__)
  fix = ('the model must be a flax.linen Module, a function of nnx.Rngs that builds a Flax NNX model, or a model '
         "name ('cnn', 'package.module:Name')")
  try:
    module = build(rngs=rngs) if 'rngs' in _parameters(build) else build(rngs)
  except UsageError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # the user's code failed on the Rngs: say so, in one line
    if isinstance(fn, type) and issubclass(fn, nnx.Module):
      raise
    message = str(e).strip().splitlines()[0][:200] if str(e).strip() else ''
    raise UsageError(f'model {name}, called with nnx.Rngs to build an NNX model, failed ({type(e).__name__}: '
                     f'{message}): {fix}') from None
  if not isinstance(module, nnx.Module):
    raise UsageError(f'model {name}, called with nnx.Rngs to build an NNX model, returned a '
                     f'{type(module).__name__}: {fix}')
  return module


def _placeholder(leaf: jax.ShapeDtypeStruct, key: jax.Array | None):
  """A concrete value for an abstract leaf of the model's state, until the variables replace it: the random
  streams' keys (re-seeded) and counts are the only ones that keep it."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return key if key is not None else jax.random.key(0)
  return jax.numpy.zeros(leaf.shape, leaf.dtype)


def import_object(path: str) -> Any:
  """'package.module:Name' (or 'package.module:Outer.Inner') -> the object; a one-line error when it fails."""
  module_name, _, name = path.partition(':')
  fix = 'give --config.model as package.module:Name, importable from where the program runs'
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  # any failure of the user's module is theirs to fix
    raise UsageError(f'model {path!r}: module {module_name!r} does not import ({type(e).__name__}: '
                     f'{str(e).splitlines()[0] if str(e) else ""}); {fix}') from None
  obj = module
  for part in name.split('.'):
    obj = getattr(obj, part, None)
    if obj is None:
      raise UsageError(f'model {path!r}: module {module_name!r} has no {name!r}; {fix}')
  return obj


def wrap(model: Any, kwargs: dict[str, Any] | None = None, num_classes: int | None = None,
         name: str | None = None) -> Linen | NNX:
  """A linen Module (instance or class), an NNX Module class, or a function of `nnx.Rngs` -> its wrapper.

  A class is built with `kwargs`, and with `num_classes` from the data when it
  has such a field or argument that `kwargs` leaves out. `name` (an import
  path) names the model in errors.
  """
  name = name or (repr(model) if len(repr(model)) <= 80 else type(model).__name__)
  kwargs = dict(kwargs or {})
  if isinstance(model, nn.Module):
    return Linen(model)
  if isinstance(model, type) and issubclass(model, nn.Module):
    if num_classes is not None and 'num_classes' in {f.name for f in dataclasses.fields(model)}:
      kwargs.setdefault('num_classes', num_classes)
    try:
      return Linen(model(**kwargs))
    except TypeError as e:
      raise UsageError(f'model {name}: {e}; fix --config.model_kwargs') from None
  if callable(model):
    if num_classes is not None and 'num_classes' in _parameters(model):
      kwargs.setdefault('num_classes', num_classes)
    _check_arguments(model, kwargs, name)
    return NNX(functools.partial(_build_nnx, model, kwargs) if kwargs else model)
  raise UsageError(f'model {name} is neither a flax.linen Module nor an NNX model (a function of nnx.Rngs that '
                   'builds one); pass one of those')


def _check_arguments(build: Callable[..., Any], kwargs: dict[str, Any], name: str):
  """An NNX class (or a partial of one) given without the arguments its `__init__` requires besides `rngs`: the fix
  is to bind them, not to reshape the data (what the failed build would otherwise be reported as)."""
  fn, bound = build, set(kwargs)
  while isinstance(fn, functools.partial):
    bound |= set(fn.keywords)
    fn, bound = fn.func, bound | {f'#{i}' for i in range(len(fn.args))}
  if not isinstance(fn, type):
    return
  try:
    parameters = list(inspect.signature(fn.__init__).parameters.values())[1:]
  except (TypeError, ValueError):
    return
  positional = sum(1 for b in bound if b.startswith('#'))
  missing = [p.name for i, p in enumerate(parameters)
             if p.default is inspect.Parameter.empty and p.name != 'rngs' and p.name not in bound
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and not (p.kind != p.KEYWORD_ONLY and i < positional)]
  if missing:
    args = ', '.join(f'{m}=...' for m in missing)
    raise UsageError(f'model {name}: its __init__ needs {", ".join(missing)} besides rngs; pass the model with them '
                     f'bound: functools.partial({fn.__name__}, {args}), or lambda rngs: {fn.__name__}({args}, '
                     'rngs=rngs)')


def _build_nnx(build, kwargs, rngs):
  return build(**kwargs, rngs=rngs)


def describe(model: Any) -> tuple[str, dict[str, Any]]:
  """(import path, constructor arguments) that rebuild `model` in another process, for config.json.

  A linen Module records its class and its fields; an NNX builder its
  function (a `functools.partial`'s keywords become the arguments). A model
  defined in `__main__` records that path too: the programs then say how to
  load it (`ensemble.load(workdir, model=...)`).
  """
  kwargs: dict[str, Any] = {}
  if isinstance(model, functools.partial):
    kwargs, model = ({'unrecorded': True} if model.args else dict(model.keywords)), model.func
  if isinstance(model, nn.Module):
    kwargs = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.name not in ('parent', 'name') and f.init}
    model = type(model)
  path = f'{getattr(model, "__module__", "?")}:{getattr(model, "__qualname__", type(model).__name__)}'
  try:
    json.dumps(kwargs)
  except TypeError:
    kwargs = {'unrecorded': True}
  return path, kwargs


def key(model: Any) -> Any:
  """A user's model object as what it computes, hashable: what `ensemble.loop` keys its compiled programs by, so
  that equal models share them though each fit is given an object of its own (a fresh `functools.partial` of the
  same class and arguments, a lambda of the same code, closure and globals, a linen Module with the same fields,
  lists among them). Objects are keyed by their contents (a ConfigDict's `to_dict()`, an object's attributes),
  so that one changed between fits keys other programs; classes, modules and what cannot be looked into, by
  identity (the programs' cache keeps the object alive, so its id stays its own)."""
  return _key(model, set())


def _key(value: Any, seen: set[int]) -> Any:
  if value is None or isinstance(value, (str, int, float, bool, bytes, complex, type, types.ModuleType)):
    return value
  if id(value) in seen:  # a cycle: its contents are keyed where it was first met
    return ('seen', id(value))
  seen = seen | {id(value)}
  contents = lambda item: _key(item, seen)
  if isinstance(value, nn.Module):
    return ('linen', type(value), tuple((f.name, contents(getattr(value, f.name))) for f in dataclasses.fields(value)
                                        if f.name not in ('parent', 'name')))
  if isinstance(value, functools.partial):
    return ('partial', contents(value.func), contents(value.args), contents(sorted(value.keywords.items())))
  if isinstance(value, types.FunctionType):
    globals_ = value.__globals__
    referenced = tuple((name, contents(globals_[name])) for name in sorted(_global_names(value.__code__))
                       if name in globals_)
    closure = tuple(contents(cell.cell_contents) for cell in value.__closure__ or ())
    return ('function', value.__code__, closure, contents(value.__defaults__), contents(value.__kwdefaults__),
            referenced)
  if isinstance(value, (list, tuple)):
    return (type(value).__name__, tuple(contents(item) for item in value))
  if isinstance(value, dict):
    return ('dict', tuple(sorted((repr(k), contents(v)) for k, v in value.items())))
  if isinstance(value, np.ndarray) or isinstance(value, jax.Array):
    array = np.ascontiguousarray(value)
    return ('array', array.shape, str(array.dtype), hashlib.sha256(memoryview(array).cast('B')).hexdigest())
  if dataclasses.is_dataclass(value):
    return ('dataclass', type(value), tuple((f.name, contents(getattr(value, f.name)))
                                            for f in dataclasses.fields(value)))
  if hasattr(value, 'to_dict') and callable(value.to_dict):
    return ('to_dict', type(value), contents(value.to_dict()))
  if hasattr(value, '__dict__') and not callable(value):
    return ('object', type(value), contents(vars(value)))
  try:
    hash(value)
    return value
  except TypeError:
    return ('id', id(value))


def _global_names(code: types.CodeType) -> set[str]:
  """The global names a function's code reads, its nested functions' (a comprehension's, a lambda's) included."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _global_names(const)
  return names
