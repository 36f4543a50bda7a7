"""K=8 ResNet-20 members on CIFAR-10, with the ingredients of the uncertainty-baselines CIFAR recipes.

Random crops and flips, SGD with momentum 0.9, a linear warm-up into a cosine decay, and
decoupled weight decay. Needs the dataset prepared for tensorflow-datasets, or an .npz:

  python -m ensemble.train --workdir=/tmp/cifar10 --config=configs/cifar10.py [--config.data_dir=cifar10.npz]
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'cifar10'
  config.model = 'resnet'
  config.resnet_depth = 20
  config.backend = 'jit'
  config.ensemble_size = 8
  config.member_data = 'shuffled'
  config.augment = 'crop_flip'
  config.optimizer = 'sgd'
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.schedule = 'warmup_cosine'
  config.warmup_epochs = 1
  config.weight_decay = 5e-4
  config.num_epochs = 200
  config.batch_size = 128
  config.eval_batch_size = 500
  return config
