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

from ensemble.errors import UsageError
from ensemble.methods import batchensemble, hyper, mc_dropout, mimo, multiswag, packed, snapshot
from ensemble.methods.independent import Independent

def _independent(config, name: str) -> Independent:
  """The deep ensemble (or bagging), with the parameters `shared` names one copy, drawn from the seed's key (an
  argument of `init`, as a program's: the method does not depend on the seed)."""
  return Independent(name=name, shared_filters=tuple(config.shared))


METHODS = {
    'independent': lambda config, steps_per_epoch: _independent(config, 'independent'),
    'bagging': lambda config, steps_per_epoch: _independent(config, 'bagging'),
    'hyper': lambda config, steps_per_epoch: hyper.Hyper.from_config(config),
    'snapshot': lambda config, steps_per_epoch: snapshot.Snapshot.from_config(config, steps_per_epoch),
    'batchensemble': lambda config, steps_per_epoch: batchensemble.BatchEnsemble(),
    'mc_dropout': lambda config, steps_per_epoch: mc_dropout.MCDropout(),
    'packed': lambda config, steps_per_epoch: packed.Packed(),
    'mimo': lambda config, steps_per_epoch: mimo.MIMO.from_config(config),
    'multiswag': lambda config, steps_per_epoch: multiswag.MultiSWAG.from_config(config, steps_per_epoch),
}
NAMES = tuple(METHODS)
# The data a method's members train on, where the method decides it (config.member_data otherwise).
MEMBER_DATA = {'bagging': 'bootstrap'}
# The models whose layers have rank-1 versions (models/rank1.py); 'mlp' is the plain one (the mesh MLP trains on the
# mesh backends, which take no method).
RANK1_MODELS = ('cnn', 'resnet', 'mlp', 'segmenter')


def create(config, steps_per_epoch: int = 1):
  """The method a recipe names (ensemble/recipe.py checked it). `steps_per_epoch` sets the snapshot cycles' length
  (only training needs it)."""
  return METHODS[config.method](config, steps_per_epoch)


# The methods whose members may share parameters (`shared`) or keep them frozen (`frozen`), and why the others may
# not.
SHARING_METHODS = ('independent', 'bagging')
FREEZING_METHODS = ('independent', 'bagging', 'snapshot', 'multiswag')
SHARING_METHODS_REFUSE = {
    'hyper': "gives each member its own learning rate and weight decay in its optimizer's state",
    'snapshot': "averages each member's snapshots of all its parameters",
    'multiswag': "samples each member's parameters from its own Gaussian",
    'batchensemble': 'already shares the weights of its rank-1 layers, by their name',
    'mc_dropout': 'already shares every weight',
    'mimo': 'already shares every weight',
    'packed': 'builds each member at its own width',
}


def check(r):
  """The rules between a recipe's method and its other fields (ensemble/recipe.py checks them with the rest); a
  broken one is one UsageError that names the fix."""
  method, k = r.method, r.ensemble_size
  refusals = [
      (r.shared and method not in SHARING_METHODS,
       f'shared={list(r.shared)} makes those parameters one copy that every member trains, and method {method} '
       f'{SHARING_METHODS_REFUSE.get(method, "keeps its own per member")}: use method independent or bagging, or '
       'leave shared out'),
      (r.frozen and method not in FREEZING_METHODS,
       f'frozen={list(r.frozen)} keeps those parameters out of training, and method {method} '
       f'{SHARING_METHODS_REFUSE.get(method, "changes them otherwise")}: use one of {list(FREEZING_METHODS)}, or '
       'leave frozen out'),
      (r.shared_sharding != 'replicated' and not (r.backend == 'jit' and (r.shared or method == 'batchensemble')),
       f'shared_sharding={r.shared_sharding} splits the parameters that all members share over the devices, on '
       f'backend jit; ' + ('here the members share none' if r.backend == 'jit' else f'backend {r.backend!r} '
                           'holds a copy on each device') + ': set --config.backend=jit and --config.shared (or '
       'method batchensemble), or leave --config.shared_sharding at replicated'),
      (r.member_data == 'bootstrap' and method != 'bagging',
       "member_data='bootstrap' is what method bagging sets: run with --config.method=bagging instead"),
  ]
  if method == 'hyper':
    (low, high), rate = r.hyper_learning_rate, r.learning_rate
    refusals.append((not low <= rate <= high,  # else the rate set would be silently replaced by draws far from it
                     f'method hyper draws each member its learning rate from hyper_learning_rate=({low:g}, {high:g}) '
                     f'in place of learning_rate={rate:g}, which that range leaves out: set one around it, e.g. '
                     f"--config.hyper_learning_rate='({0.4 * rate:.3g}, {1.2 * rate:.3g})'"))
  if method == 'snapshot':
    cycles, epochs = r.snapshot_cycles, r.num_epochs
    refusals += [
        (r.num_train_steps, 'method snapshot counts its cycles in epochs: set --config.num_epochs (a multiple of '
                            'snapshot_cycles) and leave --config.num_train_steps at 0'),
        (epochs % cycles, f'snapshot_cycles={cycles} must be a positive divisor of num_epochs={epochs}: each cycle '
                          'spans whole epochs; set --config.snapshot_cycles to one of '
                          f'{[c for c in range(1, epochs + 1) if epochs % c == 0]}'),
        (r.warmup_epochs >= epochs // cycles,
         f'warmup_epochs={r.warmup_epochs} must be shorter than a snapshot cycle ({epochs // cycles} epochs): lower '
         '--config.warmup_epochs or --config.snapshot_cycles'),
        (r.schedule == 'constant', 'method snapshot restarts the learning-rate schedule each cycle, and a constant '
                                   'rate has nothing to restart: set --config.schedule=cosine')]
  if method == 'batchensemble':  # a user's model (an import path) is checked for rank-1 layers once it is built
    refusals.append((r.model not in RANK1_MODELS and not r.own_model,
                     f'method batchensemble needs a model with rank-1 layers, one of {list(RANK1_MODELS)}, not '
                     f'{r.model!r}: set --config.model=cnn, or build a model of your own with ensemble.models.rank1'))
  if method == 'mc_dropout':
    refusals.append((r.dropout_rate <= 0, f'dropout_rate={r.dropout_rate!r} must be in (0, 1) for method mc_dropout, '
                                          'the probability that a unit is dropped: set e.g. --config.dropout_rate=0.1'))
  if method == 'multiswag':
    refusals += [
        (r.swag_learning_rate > r.learning_rate,
         f'swag_learning_rate={r.swag_learning_rate!r} must be in (0, learning_rate={r.learning_rate}], the constant '
         f'rate of the collection phase: set e.g. --config.swag_learning_rate={r.learning_rate / 10:g}'),
        (not r.num_train_steps and r.warmup_epochs >= r.swag_start * r.num_epochs,
         f'warmup_epochs={r.warmup_epochs} must end before the collection phase starts (epoch '
         f'{r.swag_start * r.num_epochs:g} of {r.num_epochs}): lower --config.warmup_epochs or raise '
         '--config.swag_start')]
  if method == 'mimo':
    refusals += [
        (k == 1, 'method mimo trains one network of M = ensemble_size heads, and 1 head is a single network: set '
                 'e.g. --config.ensemble_size=4'),
        (r.batch_size % k, f'batch_size={r.batch_size} must be a multiple of ensemble_size={k} for method mimo, which '
                           f"groups each member's batch into examples of {k} inputs: set e.g. "
                           f'--config.batch_size={max(k, r.batch_size // k * k)}')]
  if method == 'packed':
    model = r.model
    refusals.append((not r.own_model
                     and (model not in packed.MODELS or (model == 'mlp' and r.num_layers)),
                     f'method packed has packed members of models {list(packed.MODELS)} (the plain mlp), not of '
                     f'{model!r}{" with the mesh fields" if model == "mlp" else ""}: set --config.model=cnn, or '
                     'build a model of your own with ensemble.models.packed'))
  for refused, message in refusals:
    if refused:
      raise UsageError(message)
