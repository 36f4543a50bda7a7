"""Where the members start: a fresh draw from the seed (the backend's `init`), one model's variables for every member
(`init_params`, `init_from`: a pretrained checkpoint, K heads on its backbone), or another ensemble's members
(`init=`, a warm start); and the check that members so started can still differ.

  state = starts.from_variables(run, run.init(), init_params)     # ensemble.fit(init_params=...), the trainer
  state = starts.from_ensemble(run, ens, keep_optimizer=False)    # ensemble.fit(init=ens)
"""

from typing import Any

import jax
import jax.numpy as jnp
from ensemble import distributed, errors, loop, optim, sharing, steps
from ensemble.errors import UsageError


def given(run: loop.Run, init_params: Any) -> Any:
  """What starts the members: `init_params`, or where it is None the first member of the run `recipe.init_from`
  names (`evaluation.first_member_params`); None for neither."""
  if init_params is None and run.recipe.init_from:
    from ensemble import evaluation  # pylint: disable=g-import-not-at-top  # only to start from another run
    return evaluation.first_member_params(run.recipe.init_from, run.recipe.shared)
  return init_params


def from_variables(run: loop.Run, state: Any, init_params: Any) -> Any:
  """`state` (fresh members, the backend's layout) with every parameter that `init_params` (`given`: one model's
  tree, a pretrained checkpoint's, a 1-member fit's `params`; or its whole variables, {'params': ...,
  'batch_stats': ...}; or `init_from`'s first member) holds, for every member (ensemble/sharing.py's `fill_from`),
  and `recipe.init_noise` added to the members' own copies; the model's collections that it holds (BatchNorm's
  running averages) fill every member's alike. The optimizer's state is a fresh one's either way. Members left with
  no source of diversity are named in one warning (`warn_if_alike`). Neither given: `state` as it is."""
  init_params = given(run, init_params)
  if init_params is None:
    return state
  canonical = run.backend.to_canonical(state)
  parts = variables(run, init_params, canonical)
  params = canonical.params
  if 'params' in parts:
    params = sharing.fill_from(parts['params'], params, run.recipe.init_noise, run.recipe.seed,
                               run.member.method.shared(params))
  batch_stats = canonical.batch_stats
  if set(parts) - {'params'}:
    collections = run.member._collections(batch_stats)  # pylint: disable=protected-access
    for name, tree in parts.items():
      if name != 'params':
        collections[name] = sharing.fill_from(tree, collections[name], what=f'init_params[{name!r}]', kind='variable')
    batch_stats = steps._held(collections)  # pylint: disable=protected-access  # as `Member.init` holds them
  canonical = canonical.replace(params=params, batch_stats=batch_stats)
  warn_if_alike(run, canonical)
  return run.backend.from_canonical(canonical)


def variables(run: loop.Run, init_params: Any, canonical: Any = None) -> dict[str, Any]:
  """`init_params` as {'params': ..., collection: ...} (`sharing.as_variables`), each part checked against the
  members' (`canonical`: their state, or by default the abstract one, so that a run refuses them before it writes
  anything)."""
  canonical = run.backend.abstract_state() if canonical is None else canonical
  member = run.member
  names = member._collection_names  # pylint: disable=protected-access
  given = sharing.as_variables(init_params, canonical.params, names)
  collections = member._collections(canonical.batch_stats)  # pylint: disable=protected-access
  for name, tree in given.items():
    if name == 'params':
      sharing.given_leaves(tree, canonical.params, 'init_params' if len(given) == 1 else "init_params['params']")
    else:
      sharing.given_leaves(tree, collections[name], f'init_params[{name!r}]', 'variable')
  for name, tree in collections.items():  # a frozen layer's statistics, which no step updates, left fresh
    frozen = [path for path, _ in jax.tree_util.tree_leaves_with_path(tree)
              if sharing.matches(member.frozen, sharing.names(path))]
    if name not in given and 'params' in given and frozen:
      where = '/'.join(sharing.names(frozen[0])[:-1])
      raise UsageError(f"init_params gives the frozen layers' parameters but not their {name} ({where}: "
                       "BatchNorm's running statistics), which frozen layers never update, so the members would "
                       f"normalise by fresh ones at test time; give the pretrained model's whole variables, "
                       f"init_params={{'params': ..., '{name}': ...}}")
  return given


# The methods whose members differ by something of their own beside their start, data and augmentation: their own
# rates (hyper), their bootstrap resamples (bagging), their dropout passes or heads of one network (mc_dropout, mimo),
# their SWAG samples, each drawn from the member's key (multiswag).
DIVERSE_METHODS = ('hyper', 'bagging', 'mc_dropout', 'mimo', 'multiswag')


def warn_if_alike(run: loop.Run, canonical: Any):
  """One hint (`errors.hint`: an `EnsembleWarning`; a log line in the programs) where the members have no source of
  diversity that the run can see: each one's own parameters the same as every other's (`init_params` gave them all,
  with no `init_noise`), the same batches (member_data='shared'), no augmentation, and a method that adds none of its
  own: they would train into K copies of one network, whose disagreement is 0. A warning, not a refusal: a model may
  draw random numbers of its own (a noise layer of its own: each member's key is its own), which the run cannot
  see; only dropout layers (nn.Dropout, nnx.Dropout) are found, traced."""
  config = run.recipe
  if (config.ensemble_size < 2 or config.member_data != 'shared' or config.init_noise
      or (run.member.inputs == 'images' and config.augment != 'none') or config.method in DIVERSE_METHODS):
    return
  shared = jax.tree.leaves(run.member.method.shared(canonical.params))
  own = [leaf for leaf, one_copy in zip(jax.tree.leaves(canonical.params), shared, strict=True) if not one_copy]
  if (own and not all(distributed.to_numpy([_alike(leaf) for leaf in own]))) or _drops_out(run.member):
    return
  message = (f'the {config.ensemble_size} members start alike (init_params, or init_from, gave every parameter they '
             "own), see the same batches (member_data='shared') and no augmentation, the model has no dropout layer, "
             f'and method {config.method} adds no diversity: unless the model draws random numbers of its own, they '
             "train into copies of one network; set init_noise=0.01, member_data='shuffled' or an augment, or give "
             'init_params only the layers to share')
  errors.hint(message)


def _drops_out(member: steps.Member) -> bool:
  """Whether the member's model has a dropout layer with a rate above 0, traced abstractly (as MC dropout finds
  them, `members.check_model`): each member then drops its own units, from its own key."""
  from ensemble.methods import mc_dropout  # pylint: disable=g-import-not-at-top
  variables = jax.eval_shape(member.init_variables, jax.random.key(0))
  with mc_dropout.dropout_kept_on() as dropped:
    jax.eval_shape(lambda v, x: member.model.apply(v, member.method.model_input(x), train=False,
                                                   rngs={'dropout': jax.random.key(0)}), variables,
                   member.example_input())
  return bool(dropped)


@jax.jit
def _alike(x: jax.Array) -> jax.Array:
  """Whether every member's slice of a (K, ...) leaf is the first member's."""
  return jnp.all(x == x[:1])


# The methods whose members are K independent networks of one architecture: a warm start from one of them into
# another keeps each member's network. The others' members share weights or are built for their method.
MEMBERWISE = ('independent', 'bagging', 'hyper', 'snapshot', 'multiswag')


def _require(ok: bool, message: str):
  if not ok:
    raise UsageError(message)


def check_warm_start(r: Any, started: Any, keep_optimizer: bool):
  """`init=` trains on from another ensemble's members where both are the same method, or both K independent
  networks (`MEMBERWISE`: each member's network carried over); a warm start into or out of a method whose members
  share weights or are built for it is refused. A kept optimizer needs the same optimizer and method."""
  same = r.method == started.method
  _require(same or (r.method in MEMBERWISE and started.method in MEMBERWISE),
           f'init= is an ensemble of method {started.method}, and this fit trains method {r.method}: '
           f'{"their members share weights or are built for their method" if not same else ""}, so no member carries '
           f'over; start from an ensemble of method {r.method}, or leave init= out')
  _require(tuple(r.shared) == tuple(started.shared),
           f'init= is an ensemble whose members share {list(started.shared) or "no parameters"}, and this fit shares '
           f'{list(r.shared) or "none"}: no member carries over as it was; start from one model\'s parameters with '
           'init_params= instead, or give the same shared=')
  _require(not keep_optimizer or tuple(r.frozen) == tuple(started.frozen),
           f'keep_optimizer=True keeps an optimizer state without one for the frozen {list(started.frozen)}, and this '
           f'fit freezes {list(r.frozen)}: set keep_optimizer=False, or give the same frozen=')
  _require(not keep_optimizer or (same and r.optimizer == started.optimizer),
           f'keep_optimizer=True keeps the optimizer state of an ensemble of method {started.method} with optimizer '
           f'{started.optimizer}, and this fit trains method {r.method} with {r.optimizer}: set keep_optimizer=False')


def from_ensemble(run: loop.Run, init: Any, keep_optimizer: bool) -> Any:
  """A fresh state of `run`'s members with `init`'s parameters and other model state (and optimizer state, if
  `keep_optimizer`: its moments kept, its schedule restarted, so that the new fit trains for its own epochs),
  copied: the steps donate what they train, and `init` stays usable. Refused where no member carries over
  (`check_warm_start`)."""
  check_warm_start(run.recipe, init.config, keep_optimizer)
  fresh = run.backend.to_canonical(run.init())
  parts = ('params', 'batch_stats') + (('opt_state',) if keep_optimizer else ())
  for part in parts:
    target, source = getattr(fresh, part), getattr(init.state, part)
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    if jax.tree.structure(target) != jax.tree.structure(source) or shapes(target) != shapes(source):
      raise UsageError(f'init=: its members\' {part} do not match this fit\'s ({init.size} members of '
                       f'{init.config.model}, method {init.config.method}; now {run.recipe.ensemble_size} of '
                       f'{run.recipe.model}, method {run.recipe.method}); start from an ensemble of the same model, '
                       'size and data shapes, or leave init= out')
  def copied(part):
    """`init`'s part in new buffers laid out as this fit's. Where the layout changes (members spread over more
    devices, backend jit), `device_put(..., may_alias=False)` kept the buffers of the shards that stay on their
    device, and the steps donated them: those are copied where they are first (one program)."""
    target, source = getattr(fresh, part), getattr(init.state, part)
    same = jax.tree.leaves(jax.tree.map(lambda t, s: s.sharding.is_equivalent_to(t.sharding, t.ndim), target, source))
    source = source if all(same) else loop.copied(source)
    return jax.tree.map(lambda t, s: jax.device_put(s, t.sharding, may_alias=False), target, source)
  state = fresh.replace(**{part: copied(part) for part in parts})
  if keep_optimizer:
    state = state.replace(opt_state=optim.restart_schedule(state.opt_state))
  return run.backend.from_canonical(state)
