"""Snapshot ensembles (Huang et al. 2017): each member keeps its parameters at the end of every learning-rate cycle.

`optim.create` restarts the schedule C times for this method; after the last
step of each cycle the member's parameters (and BatchNorm statistics) go into
the next of its C slots in `TrainState.snapshots`, so checkpoints hold them and
a resume continues exactly. A member predicts with the mean probability of its
kept snapshots (its current parameters until the first cycle ends), so the
ensemble's mean over K members is the mean over all K x C snapshots. For regression each snapshot is a
component of the mixture (`tasks.regression`).
"""

import dataclasses

import jax
import jax.numpy as jnp

from ensemble.methods.independent import Independent


@dataclasses.dataclass(frozen=True)
class Snapshot(Independent):
  name: str = 'snapshot'
  cycles: int = 1
  cycle_steps: int = 1  # optimizer steps per cycle; only training reads it

  @classmethod
  def from_config(cls, config, steps_per_epoch: int):
    cycles = config.snapshot_cycles
    return cls(cycles=cycles, cycle_steps=config.num_epochs // cycles * steps_per_epoch)

  def init(self, member, state, key: jax.Array, seed_key: jax.Array | None = None):
    del member, key, seed_key
    slots = lambda tree: jax.tree.map(lambda x: jnp.zeros((self.cycles, *x.shape), x.dtype), tree)
    return state.replace(snapshots={'count': jnp.zeros((), jnp.int32), 'params': slots(state.params),
                                    'batch_stats': slots(state.batch_stats)})

  def after_update(self, state):
    """After the last step of a cycle, the parameters go into the next free slot (the last, once all are full).

    A `lax.cond`: where members are traced one after another (CPU) the slots are written once a cycle,
    not selected every step; vmapped members turn it into a select.
    """
    def keep(kept):
      slot = jnp.minimum(kept['count'], self.cycles - 1)
      put = lambda slots, x: slots.at[slot].set(x)
      return {'count': kept['count'] + 1, 'params': jax.tree.map(put, kept['params'], state.params),
              'batch_stats': jax.tree.map(put, kept['batch_stats'], state.batch_stats)}
    cycle_ends = state.step % self.cycle_steps == 0
    return state.replace(snapshots=jax.lax.cond(cycle_ends, keep, lambda kept: kept, state.snapshots))

  def params_of(self, state):
    """The current parameters and the kept snapshots' (each leaf (C, ...)): a member predicts with the snapshots
    once the first cycle has ended, with the current parameters before."""
    return {'params': state.params, 'snapshots': state.snapshots['params']}

  def with_params(self, state, params):
    return state.replace(params=params['params'], snapshots={**state.snapshots, 'params': params['snapshots']})

  def predict(self, member, state, images):
    """The kept snapshots combined as the task combines them (classification: log of their mean probability; the
    current parameters' logits before the first); regression: each snapshot a mixture component."""
    kept = state.snapshots
    count = jnp.minimum(kept['count'], self.cycles)
    slot = lambda c: state.replace(params=jax.tree.map(lambda x: x[c], kept['params']),
                                   batch_stats=jax.tree.map(lambda x: x[c], kept['batch_stats']))
    outputs = jnp.stack([member.logits(slot(c), images) for c in range(self.cycles)])
    return member.task.combine_snapshots(outputs, count, member.logits(state, images))
