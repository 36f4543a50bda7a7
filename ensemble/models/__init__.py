"""The models, chosen by `config.model`: a registry name, or a user's model by import path (`models.user`).

Every built-in model takes `(images, train)` and returns logits; the class
count comes from the data, never from a constant. Adding a model is one module
and one line in `MODELS`; using one of your own needs no edit here.
"""

import dataclasses
import sys
from typing import Callable

import flax.linen as nn

from ensemble import tasks
from ensemble.defaults import is_import_path
from ensemble.errors import UsageError
from ensemble.models import classifier, cnn, mimo, mlp, packed, resnet, segmenter, user


@dataclasses.dataclass(frozen=True)
class Entry:
  build: Callable[..., nn.Module]  # (recipe, num_classes) -> module
  min_image_size: int = 0  # smallest height and width of the images it takes; 0: any inputs, flattened
  why: str = ''


def _rank1(config) -> bool:
  """BatchEnsemble members are the model with rank-1 layers (models/rank1.py)."""
  return config.method == 'batchensemble'


def _dropout_rate(config) -> float:
  """The built-in models' dropout: method mc_dropout's `dropout_rate`, none for the other methods."""
  return config.dropout_rate if config.method == 'mc_dropout' else 0.0


def _packed(config, widths) -> dict:
  """Method packed's member: the model at packed_alpha / K of each of its layers' `widths`, packed_gamma groups in
  its inner layers (models/packed.py); no options for the other methods."""
  if config.method != 'packed':
    return {}
  width = lambda features: packed.width(features, config.packed_alpha, config.ensemble_size, config.packed_gamma)
  return {'widths': tuple(width(features) for features in widths), 'groups': config.packed_gamma}


def _mlp(config, num_classes: int) -> nn.Module:
  """The mesh MLP where the config has its fields (configs/mlp.py: num_layers, depth, ...), whose blocks split over
  'model'; else the plain one, which is what a config without them (the default, on feature vectors) means."""
  if not config.num_layers:
    return mlp.Plain(num_classes=num_classes, rank1=_rank1(config), dropout_rate=_dropout_rate(config),
                     per_position=tasks.named(config.task).per_position, **_packed(config, mlp.Plain.widths))
  return mlp.MLP(config.num_layers, config.depth, use_scan=config.use_scan, logical=config.logical,
                 num_classes=num_classes)


MODELS = {
    'cnn': Entry(lambda config, num_classes: cnn.CNN(num_classes=num_classes, rank1=_rank1(config),
                                                     dropout_rate=_dropout_rate(config),
                                                     **_packed(config, cnn.WIDTHS)),
                 min_image_size=4, why='its two 2x2 poolings need at least 4x4 pixels'),
    'resnet': Entry(lambda config, num_classes: resnet.ResNet(
        config.resnet_depth, config.resnet_width, num_classes, rank1=_rank1(config),
        dropout_rate=_dropout_rate(config),
        **_packed(config, tuple(filters * config.resnet_width for filters in resnet.STAGE_FILTERS))),
                    min_image_size=1),
    'mlp': Entry(_mlp),
    # A class per pixel (a dense task's default on images: tasks/dense.py).
    'segmenter': Entry(lambda config, num_classes: segmenter.Segmenter(
        num_classes=num_classes, rank1=_rank1(config), dropout_rate=_dropout_rate(config),
        **_packed(config, segmenter.WIDTHS)), min_image_size=4, why='it halves the image twice'),
    'classifier': Entry(lambda config, num_classes: classifier.Classifier(
        config.num_layers, config.depth, dropout_rate=config.dropout_rate, num_classes=num_classes)),
}


# What the default config's CNN gives way to on feature vectors (`recipe.resolve`, once the data is known).
FEATURES_MODEL = 'mlp'


def _imported(config):
  """The object `config.model` names by import path; one made in a script's `__main__` only in that script (a
  notebook, a script that fits, saves and loads), where `__main__` still defines it."""
  if dict(config.model_kwargs).get('unrecorded'):
    raise UsageError(f'model {config.model!r} was trained with arguments that config.json cannot record: load the '
                     'workdir from Python with ensemble.load(workdir, model=...)')
  if config.model.startswith('__main__:'):
    obj = sys.modules.get('__main__')
    for part in config.model.partition(':')[2].split('.'):
      obj = getattr(obj, part, None)
    if obj is not None:
      return obj
    raise UsageError(f'model {config.model!r} was defined in the script that trained it, so no other program can '
                     'build it: move it into an importable module, or load the workdir from Python with '
                     'ensemble.load(workdir, model=...)')
  return user.import_object(config.model)


def _wrap_imported(config, num_classes: int | None = None):
  kwargs = config.model_kwargs.to_dict()
  return user.wrap(_imported(config), kwargs, num_classes, name=config.model)


def check(config):
  """Refuses a model named by import path whose module does not import or whose arguments do not build it: what
  ensemble/recipe.py asks before any data is read."""
  _wrap_imported(config)


def check_inputs(name: str, image_shape: tuple[int, ...]):
  """Refuses a built-in model for inputs it cannot take (ensemble/recipe.py asks, once the data is known)."""
  entry = MODELS.get(name)
  if entry is None or not entry.min_image_size:
    return
  if len(image_shape) != 3:
    raise UsageError(f'model {name!r} takes images (height, width, channels), not inputs of shape '
                     f'{tuple(image_shape)}: set --config.model={FEATURES_MODEL}, or name a model of your own as '
                     'package.module:Name')
  height, width = image_shape[:2]
  if min(height, width) < entry.min_image_size:
    raise UsageError(f'model {name!r} does not fit {height}x{width} images: {entry.why}; choose another '
                     '--config.model, e.g. resnet')


def create(config, num_classes: int, image_shape: tuple[int, ...], model=None):
  """The model `config.model` (or the user's `model` object) for inputs of `image_shape` and `num_classes` classes.

  Built-in models are linen Modules; a user's model comes wrapped (`models.user`).
  """
  if model is not None:
    return user.wrap(model)
  if is_import_path(config.model):
    return _wrap_imported(config, num_classes)
  entry = MODELS[config.model]
  if config.method == 'mimo':  # one network of M inputs and M heads, each head the outputs of one member
    heads = config.ensemble_size
    return mimo.MIMO(entry.build(config, num_classes * heads), heads=heads)
  return entry.build(config, num_classes)

