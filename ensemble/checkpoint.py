"""orbax checkpoints of the ensemble in the canonical (K, ...) member layout.

A checkpoint holds the train state (params, optimizer state, step counters) as
global arrays with the member axis first, plus a small JSON record of what it
is. Restoring gives the same layout on whatever devices the current run uses,
and a checkpoint that does not fit the config is refused before anything in
the workdir is touched.
"""

import os
from typing import Any

import orbax.checkpoint as ocp
from flax import serialization, traverse_util

from ensemble.errors import UsageError


def signature(state: Any) -> dict[str, list]:
  """{'params/Conv_0/kernel': [shape, dtype], ...}: what must match for a restore to make sense."""
  flat = traverse_util.flatten_dict(serialization.to_state_dict(state), sep='/')
  return {path: [list(leaf.shape), str(leaf.dtype)] for path, leaf in sorted(flat.items())}


class Checkpointer:
  """Saves one checkpoint per epoch under `workdir/checkpoints/<epoch>` and keeps the last few."""

  def __init__(self, workdir: str, max_to_keep: int = 3):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_names=('state', 'meta'),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=False, enable_async_checkpointing=False))

  def latest_epoch(self) -> int | None:
    return self._manager.latest_step()

  def epochs(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def meta(self, epoch: int) -> dict[str, Any]:
    """The JSON record saved beside the state: model, ensemble size, data description, ..."""
    return self._manager.restore(epoch, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def restore(self, epoch: int, abstract_state: Any, meta: dict[str, Any]) -> Any:
    """Restores the state saved at `epoch` onto the shardings of `abstract_state`'s leaves.

    `meta` describes what the current config expects; a checkpoint that differs
    raises a UsageError naming the difference.
    """
    saved = self.meta(epoch)
    self._check_compatible(epoch, saved, {**meta, 'signature': signature(abstract_state)})
    target = serialization.to_state_dict(abstract_state)
    restored = self._manager.restore(
        epoch, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))['state']
    return serialization.from_state_dict(abstract_state, restored)

  def _check_compatible(self, epoch: int, saved: dict[str, Any], expected: dict[str, Any]):
    where = f'checkpoint {self.directory}/{epoch}'
    fix = 'use a fresh --workdir, or the config this workdir was trained with'
    for key in ('model', 'ensemble_size'):
      if saved.get(key) != expected[key]:
        raise UsageError(f'{where} holds {key}={saved.get(key)!r} but the config asks for '
                         f'{key}={expected[key]!r}; {fix}')
    saved_sig, expected_sig = saved.get('signature', {}), expected['signature']
    for path in sorted(set(saved_sig) | set(expected_sig)):
      if saved_sig.get(path) != expected_sig.get(path):
        raise UsageError(f'{where} holds {path} as {saved_sig.get(path)} but the config builds '
                         f'{expected_sig.get(path)}; {fix}')

  def save(self, epoch: int, state: Any, meta: dict[str, Any]):
    """Writes atomically (orbax renames a finished temporary folder), so a crash never leaves half a checkpoint."""
    os.makedirs(self.directory, exist_ok=True)
    self._manager.save(epoch, args=ocp.args.Composite(
        state=ocp.args.StandardSave(serialization.to_state_dict(state)),
        meta=ocp.args.JsonSave({**meta, 'epoch': epoch, 'signature': signature(state)})))
    self._manager.wait_until_finished()

  def close(self):
    self._manager.close()
