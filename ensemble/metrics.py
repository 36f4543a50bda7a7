"""clu metric collections for training and evaluation, a pair for each task.

They live here, not beside the tasks, so that only the trainer, which collects
metrics, imports clu: the step modules (steps, tasks, backends, models) import
with jax, flax, optax and numpy alone, as scripts/benchmark.py does on a GPU
host without clu.
"""

from typing import NamedTuple

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


@flax.struct.dataclass
class TrainMetrics(clu_metrics.Collection):
  """Training loss and accuracy, averaged over the members and the steps."""
  loss: clu_metrics.Average.from_output('loss')
  accuracy: clu_metrics.Average.from_output('accuracy')


@flax.struct.dataclass
class EvalMetrics(clu_metrics.Collection):
  """Test NLL and accuracy of the ensemble (mean probabilities) and of each member."""
  loss: clu_metrics.Average.from_output('ensemble_loss')
  accuracy: clu_metrics.Average.from_output('ensemble_correct')
  member_loss: PerMember.from_output('member_loss')
  member_accuracy: PerMember.from_output('member_correct')


@flax.struct.dataclass
class RegressionTrainMetrics(clu_metrics.Collection):
  """The members' training loss and Gaussian NLL, in standardised units, averaged over the members and the steps."""
  loss: clu_metrics.Average.from_output('loss')
  nll: clu_metrics.Average.from_output('nll')


@flax.struct.dataclass
class RegressionEvalMetrics(clu_metrics.Collection):
  """Test NLL of the mixture and of each member (nats per input, original units) and their squared errors."""
  loss: clu_metrics.Average.from_output('ensemble_loss')
  squared_error: clu_metrics.Average.from_output('ensemble_squared_error')
  member_loss: PerMember.from_output('member_loss')
  member_squared_error: PerMember.from_output('member_squared_error')


@flax.struct.dataclass
class DenseEvalMetrics(clu_metrics.Collection):
  """`EvalMetrics` of a dense task: over the labelled positions of the split, each counted once."""
  loss: PerPosition.of('ensemble_loss')
  accuracy: PerPosition.of('ensemble_correct')
  member_loss: PerPosition.of('member_loss')
  member_accuracy: PerPosition.of('member_correct')


class TaskMetrics(NamedTuple):
  """A task's collections: of its train steps' outputs, and of its eval steps' outputs over a split."""
  train: type[clu_metrics.Collection]
  eval: type[clu_metrics.Collection]


BY_TASK = {
    'classification': TaskMetrics(TrainMetrics, EvalMetrics),
    'regression': TaskMetrics(RegressionTrainMetrics, RegressionEvalMetrics),
    # The same fields: a label's loss and accuracy averaged over the labels (tasks/multilabel.py).
    'multilabel': TaskMetrics(TrainMetrics, EvalMetrics),
    'dense': TaskMetrics(TrainMetrics, DenseEvalMetrics),
}
