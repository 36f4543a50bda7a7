"""Logical axis names for the MLP's annotations, and the rules that map them onto the mesh."""

from ensemble.errors import UsageError
from ensemble.parallel import DATA_AXIS, MESH_AXES, MODEL_AXIS

LOGICAL_AXES = ('batch', 'pixels', 'embed', 'hidden', 'classes', 'layer')
# What the mesh-axis spelling writes out: the batch over 'data', the hidden units over 'model'.
DEFAULT_RULES = (('batch', DATA_AXIS), ('hidden', MODEL_AXIS))


def check_rules(rules) -> tuple[tuple[str, str | None], ...]:
  """The rules as a tuple of pairs, or a UsageError naming the first axis nobody knows."""
  fix = f'logical axes are {list(LOGICAL_AXES)}, mesh axes {list(MESH_AXES)} or None'
  try:
    rules = tuple((logical, mesh) for logical, mesh in rules)
  except (TypeError, ValueError):
    raise UsageError(f'logical_axis_rules={rules!r} must be (logical axis, mesh axis) pairs; {fix}') from None
  for logical, mesh in rules:
    if logical not in LOGICAL_AXES:
      raise UsageError(f'logical_axis_rules name an unknown logical axis {logical!r}; {fix}')
    if mesh is not None and mesh not in MESH_AXES:
      raise UsageError(f'logical_axis_rules map {logical!r} to an unknown mesh axis {mesh!r}; {fix}')
  return rules
