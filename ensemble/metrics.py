"""clu metric collections of a test pass, made for each task from what it scores (`Task.eval_scores`).

They live here, not beside the tasks, so that only the trainer, which collects
metrics, imports clu: the step modules (steps, tasks, backends, models) import
with jax, flax, optax and numpy alone, as scripts/benchmark.py does on a GPU
host without clu.
"""

import functools

import flax
import jax.numpy as jnp
from clu import metrics as clu_metrics


@flax.struct.dataclass
class PerMember(clu_metrics.Metric):
  """The mean of a per-member value, one entry per member.

  clu's `Average` keeps only the grand mean; comparing members with the ensemble
  needs each member's own. `values` is (N, K), examples first as clu expects;
  `mask` (N,) marks real examples.
  """
  total: jnp.ndarray
  count: jnp.ndarray

  @classmethod
  def from_model_output(cls, values: jnp.ndarray, mask: jnp.ndarray | None = None, **_) -> 'PerMember':
    mask = jnp.ones(values.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    return cls(total=(values * mask[:, None]).sum(0), count=mask.sum())

  def merge(self, other: 'PerMember') -> 'PerMember':
    return type(self)(total=self.total + other.total, count=self.count + other.count)

  def compute(self) -> jnp.ndarray:
    return self.total / self.count


@flax.struct.dataclass
class PerPosition(clu_metrics.Metric):
  """A dense task's mean over labelled positions, from each input's mean over its own ('ensemble_labelled' of
  them, tasks/dense.py): weighted by those counts, every labelled position counts once, as in
  `Ensemble.evaluate`. Values (N,) give one mean, (N, K) one per member."""
  total: jnp.ndarray
  count: jnp.ndarray

  @classmethod
  def of(cls, name: str) -> type['PerPosition']:
    """The metric of the output `name`."""
    class Of(cls):
      @classmethod
      def from_model_output(cls, mask: jnp.ndarray | None = None, **outputs) -> 'PerPosition':
        values, weight = jnp.asarray(outputs[name]), jnp.asarray(outputs['ensemble_labelled'], jnp.float32)
        if mask is not None:
          weight = weight * jnp.asarray(mask, jnp.float32)
        return cls(total=(values * weight.reshape(weight.shape + (1,) * (values.ndim - 1))).sum(0),
                   count=weight.sum())
    return Of

  def merge(self, other: 'PerPosition') -> 'PerPosition':
    return type(self)(total=self.total + other.total, count=self.count + other.count)

  def compute(self) -> jnp.ndarray:
    return self.total / jnp.maximum(self.count, 1.0)


@functools.lru_cache(maxsize=None)
def _collection(scores: tuple[tuple[str, str], ...], per_position: bool) -> type[clu_metrics.Collection]:
  mean = PerPosition.of if per_position else clu_metrics.Average.from_output
  per_member = PerPosition.of if per_position else PerMember.from_output
  fields = {}
  for name, output in scores:
    fields[name] = mean(f'ensemble_{output}')
    fields[f'member_{name}'] = per_member(f'member_{output}')
  return clu_metrics.Collection.create(**fields)


def of(task) -> type[clu_metrics.Collection]:
  """A task's test-pass collection (`Task.eval_scores`): each score's mean of the ensemble's outputs over a split,
  and of each member's, one entry per member; over the labelled positions of a dense task's split, each counted
  once (`PerPosition`)."""
  return _collection(tuple(task.eval_scores.items()), task.per_position)
