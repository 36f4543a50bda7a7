"""Loops of fits in which the ensemble chooses its next data: active learning (`active_learning.py`: which pool
inputs to label) and Bayesian optimisation (`bayesian_optimization.py`: where to evaluate a function), each
recorded round by round so that a stopped loop resumes (`record.py`). The acquisition functions they score with
are `ensemble.acquire`'s."""
