"""Ensembling methods, chosen by `config.method`: what makes the K members differ, and what each one predicts.

A method is a small frozen object that `steps.Member` consults at four points:
`init` (a member's fresh state), `after_update` (after each optimizer step),
`predict` (a member's test-time output) and, for methods whose members share
weights, `average_shared` (their gradients, inside the backends' step). A
method may also change what the model is given (`model_input`) and what a
step trains it on (`training_batch`, `loss`): MIMO's grouping. Data order
comes from `member_data`. Everything else (backends, checkpoints,
`ensemble.evaluate`, `ensemble.predict`) sees K members like any others, so
every method runs on both ensemble backends and is scored by the same report.

  independent    members differ by initialisation, data order and augmentation (Lakshminarayanan et al. 2017)
  bagging        ... and each trains on its own bootstrap resample of the training split (Breiman 1996)
  hyper          ... and each has its own learning rate and weight decay (Wenzel et al. 2020)
  snapshot       each member keeps C snapshots along a cyclic schedule; K x C are averaged (Huang et al. 2017)
  batchensemble  members share their weights and differ in rank-1 factors (Wen et al. 2020)
  mc_dropout     one network trained with dropout; each member a dropout sample of it (Gal and Ghahramani 2016)
  packed         members at alpha / K of the network's width, gamma groups in their inner layers (Laurent et al. 2023)
  mimo           one network with K inputs and K heads, trained on K examples at once (Havasi et al. 2021)
  multiswag      independent members, each a SWAG Gaussian over its weights; K x S samples (Wilson and Izmailov 2020)

`adversarial_epsilon` > 0 adds adversarial training to any of them (methods/adversarial.py).
"""

import math

from ensemble.errors import UsageError
from ensemble.methods import adversarial, batchensemble, hyper, mc_dropout, mimo, multiswag, packed, snapshot
from ensemble.methods.independent import Independent

METHODS = {
    'independent': lambda config, steps_per_epoch: Independent(),
    'bagging': lambda config, steps_per_epoch: Independent(name='bagging', member_data='bootstrap'),
    'hyper': lambda config, steps_per_epoch: hyper.Hyper.from_config(config),
    'snapshot': lambda config, steps_per_epoch: snapshot.Snapshot.from_config(config, steps_per_epoch),
    'batchensemble': lambda config, steps_per_epoch: batchensemble.BatchEnsemble(seed=config.seed),
    'mc_dropout': lambda config, steps_per_epoch: mc_dropout.MCDropout(seed=config.seed),
    'packed': lambda config, steps_per_epoch: packed.Packed(),
    'mimo': lambda config, steps_per_epoch: mimo.MIMO.from_config(config),
    'multiswag': lambda config, steps_per_epoch: multiswag.MultiSWAG.from_config(config, steps_per_epoch),
}
NAMES = tuple(METHODS)
# The methods whose members start from weights drawn from `config.seed` alone (their shared weights), so that what
# their programs compute depends on the seed.
SEEDED = ('batchensemble', 'mc_dropout', 'mimo')
# The models whose layers have rank-1 versions (models/rank1.py); 'mlp' is the plain one (the mesh MLP trains on the
# mesh backends, which take no method).
RANK1_MODELS = ('cnn', 'resnet', 'mlp')


def name(config) -> str:
  """`config.method`; runs saved before methods existed were independent ensembles."""
  return config.get('method', 'independent')


def _require(ok: bool, message: str):
  if not ok:
    raise UsageError(message)


def check(config):
  """Refuses an unknown method or options it cannot use, before any data is read."""
  method = name(config)
  _require(method in METHODS, f'unknown method {method!r}: set --config.method to one of {list(NAMES)}')
  if method == 'hyper':
    for field in ('hyper_learning_rate', 'hyper_weight_decay'):
      value = config[field]
      _require(isinstance(value, (tuple, list)) and len(value) == 2
               and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in value)
               and value[0] <= value[1],
               f'{field}={value!r} must be a range (low, high) of positive numbers with low <= high, '
               f"e.g. --config.{field}='(0.05, 0.2)'")
    (low, high), rate = config.hyper_learning_rate, config.learning_rate
    _require(low <= rate <= high,  # else the rate set would be silently replaced by draws far from it
             f'method hyper draws each member its learning rate from hyper_learning_rate=({low:g}, {high:g}) in '
             f'place of learning_rate={rate:g}, which that range leaves out: set one around it, e.g. '
             f"--config.hyper_learning_rate='({0.4 * rate:.3g}, {1.2 * rate:.3g})'")
  if method == 'snapshot':
    cycles, epochs = config.snapshot_cycles, config.num_epochs
    _require(isinstance(cycles, int) and cycles >= 1 and epochs % cycles == 0,
             f'snapshot_cycles={cycles} must be a positive divisor of num_epochs={epochs}: each cycle spans '
             f'whole epochs; set --config.snapshot_cycles to one of '
             f'{[c for c in range(1, epochs + 1) if epochs % c == 0]}')
    _require(config.warmup_epochs < epochs // cycles,
             f'warmup_epochs={config.warmup_epochs} must be shorter than a snapshot cycle '
             f'({epochs // cycles} epochs): lower --config.warmup_epochs or --config.snapshot_cycles')
    _require(config.schedule != 'constant',
             'method snapshot restarts the learning-rate schedule each cycle, and a constant rate has nothing to '
             'restart: set --config.schedule=cosine')
  if method == 'batchensemble':  # a user's model (an import path) is checked for rank-1 layers once it is built
    _require(config.model in RANK1_MODELS or ':' in config.model,
             f'method batchensemble needs a model with rank-1 layers, one of {list(RANK1_MODELS)}, not '
             f'{config.model!r}: set --config.model=cnn, or build a model of your own with ensemble.models.rank1')
  if method == 'mc_dropout':
    rate = config.get('dropout_rate')
    _require(isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < 1,
             f'dropout_rate={rate!r} must be in (0, 1) for method mc_dropout, the probability that a unit is dropped: '
             'set e.g. --config.dropout_rate=0.1')
  if method == 'multiswag':
    multiswag.check(config)
  if method == 'mimo':
    k, batch_size = config.ensemble_size, config.batch_size  # k 0: one member per device, checked once resolved
    _require(k != 1, 'method mimo trains one network of M = ensemble_size heads, and 1 head is a single network: '
             'set e.g. --config.ensemble_size=4')
    if k:
      _require(batch_size % k == 0,
               f'batch_size={batch_size} must be a multiple of ensemble_size={k} for method mimo, which groups each '
               f'member\'s batch into examples of {k} inputs: set e.g. '
               f'--config.batch_size={max(k, batch_size // k * k)}')
  if method == 'packed':
    packed.check(config)
  adversarial.check(config)
  _require(config.member_data != 'bootstrap' or method == 'bagging',
           "member_data='bootstrap' is what method bagging sets: run with --config.method=bagging instead")


def create(config, steps_per_epoch: int = 1):
  """The method `config` names. `steps_per_epoch` sets the snapshot cycles' length (only training needs it)."""
  check(config)
  return METHODS[name(config)](config, steps_per_epoch)
