"""Logical axis names for the MLP's annotations, and the rules that map them onto the mesh."""

import flax.linen as nn

from ensemble.errors import UsageError
from ensemble.parallel import DATA_AXIS, MESH_AXES, MODEL_AXIS

LOGICAL_AXES = ('batch', 'pixels', 'embed', 'hidden', 'classes', 'layer')
# What the mesh-axis spelling writes out: the batch over 'data', the hidden units over 'model'.
DEFAULT_RULES = (('batch', DATA_AXIS), ('hidden', MODEL_AXIS))


def check_rules(rules, logical_axes: tuple[str, ...] | None = LOGICAL_AXES) -> tuple[tuple[str, str | None], ...]:
  """The rules as a tuple of pairs, or a UsageError naming the first axis nobody knows.

  `logical_axes` None accepts any logical name: a user's model (member_sharding=model) names its own.
  """
  fix = (f'logical axes are {list(logical_axes)}, ' if logical_axes else '') + f'mesh axes {list(MESH_AXES)} or None'
  try:
    rules = tuple((logical, mesh) for logical, mesh in rules)
  except (TypeError, ValueError):
    raise UsageError(f'logical_axis_rules={rules!r} must be (logical axis, mesh axis) pairs; {fix}') from None
  for logical, mesh in rules:
    if logical_axes and logical not in logical_axes:
      raise UsageError(f'logical_axis_rules name an unknown logical axis {logical!r}; {fix}')
    if mesh is not None and mesh not in MESH_AXES:
      raise UsageError(f'logical_axis_rules map {logical!r} to an unknown mesh axis {mesh!r}; {fix}')
  return rules


def mesh_axes(box, rules) -> tuple:
  """The mesh axis (or None) each dimension of an annotated parameter is split along.

  An `nn.LogicallyPartitioned` box names logical axes, which its own rules or
  else `rules` map onto the mesh; an `nn.Partitioned` one names mesh axes.
  """
  if isinstance(box, nn.LogicallyPartitioned):
    return tuple(nn.logical_to_mesh_axes(box.names, box.rules or rules))
  return tuple(box.names)
