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

from ensemble.methods.independent import Independent

# The built-in models that have a packed member (models/__init__.py); the mesh MLP and the classifier do not.
MODELS = ('cnn', 'resnet', 'mlp', 'segmenter')


@dataclasses.dataclass(frozen=True)
class Packed(Independent):
  """What differs from the deep ensemble is the member's architecture, which the model registry builds from
  packed_alpha and packed_gamma; the training, the prediction and `num_params` (K members' own parameters) are the
  deep ensemble's."""
  name: str = 'packed'
