"""Deep ensembles of Flax models, trained across devices with JAX.

Importing the package is cheap on purpose: it does not import jax, so that
`ensemble.train` can choose the number of simulated CPU devices first.
"""
