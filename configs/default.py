"""The classic deep ensemble: one CNN per device, trained with pmap on MNIST."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = 'cnn'
  # 'pmap' (the classic recipe) or 'jit' (NamedSharding over an 'ensemble' mesh axis).
  config.backend = 'pmap'
  # Members; 0 means one per device. K members need a device count that divides K.
  config.ensemble_size = 0
  # Devices to use; 0 means all of them.
  config.num_devices = 0
  # 'shared': every member sees the same batches (the classic recipe). 'shuffled': each
  # member its own order of the training set, for more diversity between members.
  config.member_data = 'shared'
  # A folder with the four MNIST IDX files; empty means tensorflow-datasets.
  config.data_dir = ''
  # 0: the plain path, a host batch per step. N > 0: the fast path, the training set kept
  # on the devices and N steps run per dispatch (same results). Meant for accelerators; on CPU
  # it pays with several members per device, at N=8 (BENCHMARKS.md).
  config.steps_per_dispatch = 0
  # The last fraction of the training split is never trained on: `ensemble.evaluate` fits the
  # ensemble's temperature there (a temperature fitted on training data would sharpen it).
  config.heldout_fraction = 0.1
  config.num_epochs = 10
  config.batch_size = 128
  config.eval_batch_size = 1000
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.seed = 0
  config.checkpoints_to_keep = 3
  return config
