"""Loops of fits in which the ensemble chooses its next data: active learning (`active_learning.py`: which pool
inputs to label) and Bayesian optimisation (`bayesian_optimization.py`: where to evaluate a function), both run
on one round engine (`record.py`: a locked workdir, the data's fingerprints, every answer kept the moment it is
given, a record that a stopped loop resumes from). The acquisition functions they score with
are `ensemble.acquire`'s."""
