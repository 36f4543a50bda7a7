"""A small sequence classifier on integer token ids, with `nn.Embed`: an ensemble of text-like models.

  python examples/sequence_tokens.py            # 8 members on 20,000 sequences
  python examples/sequence_tokens.py --quick    # a smoke run

The inputs are (N, T) integer ids, which `ensemble.fit` recognises as tokens
and passes to the model as they are (no image scaling or augmentation). The
task: does the sequence contain token 7 followed, anywhere later, by token 3?
A convolution over the embeddings and a max over time can tell.
"""

import sys

import ensemble

ensemble.cpu_devices(8)

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

VOCABULARY, LENGTH = 32, 24


class SequenceClassifier(nn.Module):
  num_classes: int = 2

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    x = nn.Embed(VOCABULARY, 32)(tokens)                      # (N, T, 32)
    x = nn.relu(nn.Conv(64, (5,))(x))                         # local patterns
    seen_before = jnp.cumsum(x, axis=1) / (1 + jnp.arange(x.shape[1]))[:, None]  # what came earlier
    x = nn.relu(nn.Dense(64)(jnp.concatenate([x, seen_before], -1)))
    x = nn.Dropout(0.1, deterministic=not train)(jnp.max(x, axis=1))
    return nn.Dense(self.num_classes)(x)


def make_sequences(n: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCABULARY, (n, LENGTH))
  first_7 = np.where(tokens == 7, np.arange(LENGTH), LENGTH).min(1)
  last_3 = np.where(tokens == 3, np.arange(LENGTH), -1).max(1)
  return tokens.astype(np.int32), (last_3 > first_7).astype(np.int32)


def main(quick: bool):
  n = 4000 if quick else 20_000
  tokens, labels = make_sequences(n)
  split = int(0.8 * n)
  ens = ensemble.fit(SequenceClassifier(), (tokens[:split], labels[:split]), test=(tokens[split:], labels[split:]),
                     ensemble_size=8, epochs=2 if quick else 10, optimizer='adamw', learning_rate=3e-3,
                     weight_decay=1e-4)
  scores = ens.evaluate(tokens[split:], labels[split:])
  print(f'ensemble accuracy {scores["ensemble"]["accuracy"]:.4f} ({labels[split:].mean():.0%} of the sequences are '
        f'positive), mean member accuracy {scores["mean_member"]["accuracy"]:.4f}')


if __name__ == '__main__':
  main(quick='--quick' in sys.argv)
