"""Packed-Ensembles (Laurent et al. 2023): K members, each the base network at alpha / K of its width, with gamma
groups in its inner layers.

A packed ensemble is one network whose every layer after the first is an
M-group convolution: M subnetworks that never exchange a feature, computed by
one grouped operation. Here the K members already are computed together, one
compiled program whose member axis the backends vmap (or pmap) over: a layer
applied to K members' stacked weights is exactly the K-group layer, and the
stacked member state is the packed network's grouped weights. So the method is
the deep ensemble (own keys, own data order) of the narrowed, grouped member
that models/__init__.py builds (models/packed.py has the layers and the width
rule; a model of your own uses them).
"""

import dataclasses
import math

from ensemble.errors import UsageError
from ensemble.methods.independent import Independent

# The built-in models that have a packed member (models/__init__.py); the mesh MLP and the classifier do not.
MODELS = ('cnn', 'resnet', 'mlp')


def check(config):
  """Refuses alpha, gamma or a model that cannot make packed members, in one line, before any data is read."""
  alpha, gamma = config.packed_alpha, config.packed_gamma
  if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0):
    raise UsageError(f'packed_alpha={alpha!r} must be a positive number, the width of the packed ensemble as a '
                     'multiple of one network\'s (each member has alpha / ensemble_size of it): set e.g. '
                     '--config.packed_alpha=2')
  if not (isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 1):
    raise UsageError(f'packed_gamma={gamma!r} must be a positive whole number, the groups of each member\'s inner '
                     'layers: set e.g. --config.packed_gamma=1')
  model = config.model
  if ':' not in model and (model not in MODELS or (model == 'mlp' and 'num_layers' in config)):
    raise UsageError(f'method packed has packed members of models {list(MODELS)} (the plain mlp), not of '
                     f'{model!r}{" with the mesh fields" if model == "mlp" else ""}: set --config.model=cnn, or '
                     'build a model of your own with ensemble.models.packed')


@dataclasses.dataclass(frozen=True)
class Packed(Independent):
  """What differs from the deep ensemble is the member's architecture, which the model registry builds from
  packed_alpha and packed_gamma; the training, the prediction and `num_params` (K members' own parameters) are the
  deep ensemble's."""
  name: str = 'packed'
