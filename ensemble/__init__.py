"""Deep ensembles of Flax models, trained across devices with JAX.

Importing the package is cheap on purpose: it does not import jax, so that
`ensemble.train` can choose the number of simulated CPU devices first.
`ensemble.load(workdir)` (from `ensemble.predict`) is imported on first use.
"""


def __getattr__(name: str):
  if name == 'load':
    from ensemble.predict import load  # pylint: disable=g-import-not-at-top  # on first use: it imports jax
    return load
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
