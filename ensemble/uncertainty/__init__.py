"""What an ensemble's probabilities say about how far to trust it, as plain numpy in float64.

- `decomposition`: per example, the total predictive entropy split into its
  aleatoric and epistemic parts, and the members' disagreement.
- `ood`: how well a score separates in-distribution from out-of-distribution
  inputs (AUROC, AUPR, FPR at 95% TPR).
- `selective`: the error rate left when the most uncertain inputs are referred
  elsewhere (risk-coverage curve), and the threshold that meets a target.
- `conformal`: split-conformal prediction sets that hold the true class with a
  stated probability.

Accuracy, NLL, Brier score, ECE and temperature scaling are in `ensemble.calibration`.
None of these modules imports jax.
"""
