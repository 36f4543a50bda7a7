"""A CNN of your own, written in Flax linen with BatchNorm and Dropout, as an 8-member deep ensemble on MNIST.

  python examples/linen_cnn_mnist.py            # 8 members, 3 epochs on 10,000 images: a few minutes on a CPU
  python examples/linen_cnn_mnist.py --quick    # a smoke run

The model is yours: no registry, no config file. `ensemble.fit` trains the
eight members in parallel, one per (simulated) device, each from its own
initialisation, with its own data order and dropout keys.
"""

import sys

import ensemble

ensemble.cpu_devices(8)  # on a CPU: 8 simulated devices, one member each; must come before JAX starts

import flax.linen as nn

from ensemble import data


class CNN(nn.Module):
  """Two convolutions with BatchNorm, dropout before the head: `train` switches both, as in Flax's examples."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    for features in (16, 32):
      x = nn.Conv(features, (3, 3), use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.Dropout(0.2, deterministic=not train)(x.reshape((x.shape[0], -1)))
    return nn.Dense(self.num_classes)(x)


def main(quick: bool):
  mnist = data.load('mnist')  # the copy inside the package: no download
  n_train, n_test, epochs = (2048, 1000, 1) if quick else (10_000, 10_000, 3)
  x_train, y_train = mnist.train['image'][:n_train], mnist.train['label'][:n_train]
  x_test, y_test = mnist.test['image'][:n_test], mnist.test['label'][:n_test]

  ens = ensemble.fit(CNN(), (x_train, y_train), test=(x_test, y_test), ensemble_size=8, epochs=epochs,
                     learning_rate=0.05)
  scores = ens.evaluate(x_test, y_test)
  for who in ('ensemble', 'mean_member'):
    print(f'{who:12s} accuracy {scores[who]["accuracy"]:.4f}  NLL {scores[who]["nll"]:.4f}  '
          f'ECE {scores[who]["ece"]:.4f}')
  doubtful = ens.predict(x_test)['mutual_information'].argsort()[-5:]
  print('the test images the members disagree on most:', doubtful.tolist())


if __name__ == '__main__':
  main(quick='--quick' in sys.argv)
