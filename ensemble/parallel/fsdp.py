"""Data parallelism inside `shard_map`, plain (DP) or fully sharded (FSDP).

Both run the same step on every device of the 'data' axis, each on its slice
of the batch. DP keeps a full copy of the parameters and optimizer state on
every device and averages the gradients with `pmean`. FSDP keeps 1/N of each
large weight per device: a layer all-gathers its weights just before it runs,
and the gradient of that gather is a reduce-scatter, so every device ends up
with the mean gradient of its own slice only and updates only that slice
(and only that slice of the optimizer state). The two follow the same
trajectory; FSDP trades two collectives per layer for N times less memory. The layers' side is here (what the
models import); the step that runs them is the mesh backend's (ensemble/backends/sharded.py).
"""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _is_partitioned(x) -> bool:
  return isinstance(x, nn.Partitioned)


def unbox(tree: PyTree) -> PyTree:
  """The arrays inside the boxes, as stored.

  Unlike `nn.meta.unbox` (and `nn.meta.replace_boxed`), `unbox` and `rebox` add
  no sharding constraint: inside `shard_map` the mesh axes are manual and
  refuse one.
  """
  return jax.tree.map(lambda x: x.value if _is_partitioned(x) else x, tree, is_leaf=_is_partitioned)


def rebox(template: PyTree, tree: PyTree) -> PyTree:
  """`tree`'s arrays in the boxes of `template`: undoes `unbox`."""
  return jax.tree.map(lambda box, x: box.replace_boxed(x) if _is_partitioned(box) else x,
                      template, tree, is_leaf=_is_partitioned)


def split_dimension(shape: tuple[int, ...], size: int, min_weight_size: int,
                    names: tuple[str | None, ...] | None = None) -> int | None:
  """The dimension a weight of `shape` is split along over `size` devices, None to keep it whole.

  Its largest dimension that `size` divides and no other axis splits
  already; weights under `min_weight_size` values stay whole, since gathering
  them would cost more than storing them. `shard_params` and the ensemble's
  fsdp members (`backends.state_shardings`) split by this one rule.
  """
  if size == 1 or int(np.prod(shape)) < min_weight_size:
    return None
  names = names or (None,) * len(shape)
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if names[dim] is None and shape[dim] % size == 0:
      return dim
  return None


def shard_params(params: PyTree, axis_name: str, min_weight_size: int) -> PyTree:
  """Keeps this device's slice of every weight of at least `min_weight_size` values.

  A weight is split along its largest dimension that the axis divides and
  wrapped in `nn.Partitioned` naming the axis there, which tells
  `gather_params` what to gather and `shard_map` how the global array is laid
  out. Smaller weights stay replicated: gathering them would cost more than
  storing them.
  """
  index, size = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)

  def split(x):
    value, names = (x.value, x.names) if _is_partitioned(x) else (x, (None,) * x.ndim)
    dim = None if axis_name in names else split_dimension(value.shape, size, min_weight_size, names)
    if dim is None:
      return x
    part = value.shape[dim] // size
    return nn.Partitioned(jax.lax.dynamic_slice_in_dim(value, index * part, part, axis=dim),
                          names=names[:dim] + (axis_name,) + names[dim + 1:])

  return jax.tree.map(split, params, is_leaf=_is_partitioned)


def _all_gather_with_mean_grads(x: jnp.ndarray, axis: int, axis_name: str) -> jnp.ndarray:
  """all_gather whose gradient is each slice's mean gradient over the devices.

  The plain transpose of all_gather sums the devices' gradients; data
  parallelism wants their mean, and folding the division into the
  reduce-scatter saves a separate pmean.
  """
  size = jax.lax.axis_size(axis_name)

  @jax.custom_gradient
  def gather(x):
    def grad(g):
      return jax.lax.psum_scatter(g, axis_name, scatter_dimension=axis, tiled=True) / size
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True), grad

  return gather(x)


def gather_params(params: PyTree, axis_name: str) -> PyTree:
  """The full weights for compute, from the slices `shard_params` kept."""
  def gather(p):
    if not (_is_partitioned(p) and axis_name in p.names):
      return p
    axis = p.names.index(axis_name)
    value = _all_gather_with_mean_grads(p.value, axis, axis_name)
    names = p.names[:axis] + (None,) + p.names[axis + 1:]
    return nn.Partitioned(value, names) if any(n is not None for n in names) else value

  return jax.tree.map(gather, params, is_leaf=_is_partitioned)


def shard_module_params(target: Callable, axis_name: str, min_weight_size: int) -> Callable:
  """`target` (a Module class) whose parameters are stored sharded and gathered when it runs."""
  return nn.map_variables(
      target, mapped_collections='params', mutable=True,
      trans_in_fn=functools.partial(gather_params, axis_name=axis_name),
      trans_out_fn=functools.partial(shard_params, axis_name=axis_name, min_weight_size=min_weight_size))


def sync_gradients(grads: PyTree, axis_name: str) -> PyTree:
  """Averages the gradients of replicated weights; sharded ones are averaged by their gather already."""
  def sync(g):
    if _is_partitioned(g) and axis_name in g.names:
      return g
    return jax.lax.pmean(g, axis_name)
  return jax.tree.map(sync, grads, is_leaf=_is_partitioned)
