"""A Flax NNX model (Flax's current API) as a deep ensemble on MNIST: every member builds its own from its key.

  python examples/nnx_mnist.py            # 4 members, 3 epochs on 10,000 images
  python examples/nnx_mnist.py --quick    # a smoke run

NNX keeps state inside the model; `ensemble.fit` takes a function of
`nnx.Rngs` that builds one (here the class itself, with its other arguments
bound), so that each member starts from its own random initialisation.
BatchNorm's statistics and Dropout's keys are per member, as with linen.
"""

import functools
import sys

import ensemble

ensemble.cpu_devices(4)  # on a CPU: 4 simulated devices, one member each; must come before JAX starts

from flax import nnx

from ensemble import data


class MLP(nnx.Module):
  def __init__(self, din: int, width: int, num_classes: int, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(din, width, rngs=rngs)
    self.norm = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return self.head(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def main(quick: bool):
  mnist = data.load('mnist')
  n_train, n_test, epochs = (2048, 1000, 1) if quick else (10_000, 10_000, 3)
  build = functools.partial(MLP, din=28 * 28, width=256, num_classes=10)  # build(rngs=...) -> a member
  ens = ensemble.fit(build, (mnist.train['image'][:n_train], mnist.train['label'][:n_train]),
                     test=(mnist.test['image'][:n_test], mnist.test['label'][:n_test]), ensemble_size=4,
                     epochs=epochs, augment='none')
  scores = ens.evaluate(mnist.test['image'][:n_test], mnist.test['label'][:n_test])
  print(f'ensemble accuracy {scores["ensemble"]["accuracy"]:.4f}, mean member accuracy '
        f'{scores["mean_member"]["accuracy"]:.4f}; ensemble NLL {scores["ensemble"]["nll"]:.4f}')


if __name__ == '__main__':
  main(quick='--quick' in sys.argv)
