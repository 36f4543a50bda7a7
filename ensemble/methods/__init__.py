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
