"""Writes a trained ensemble's forward pass as one `jax.export` artifact: serialized StableHLO, parameters inside.

  python -m ensemble.export --workdir=/tmp/mnist --output=/tmp/mnist.jax [--step=N] [--platforms=cpu,cuda]

A service runs it with JAX alone, without this package, Flax or the training
dependencies:

  exported = jax.export.deserialize(open('/tmp/mnist.jax', 'rb').read())
  out = exported.call(images)  # float32 (N, H, W, C) in [0, 1], any N
  out['probs']                 # (N, C): the members' mean, temperature-scaled as ensemble.predict does
  out['member_log_probs']      # (K, N, C): each member's log-probabilities, for the uncertainty split
  out['set']                   # (N, C) booleans: the conformal prediction sets, where Ensemble.conformal set them
  out['flag']                  # (N,) booleans: the inputs to refer, where Ensemble.flags fitted them
  out['distance']              # (N,) how far from the data in the members' features, where Ensemble.distance fitted it

A regression workdir's artifact takes its features and returns what
`Ensemble.predict` does, per target (N, D): 'mean', 'std', 'variance' =
'aleatoric' + 'epistemic', and the mixture's central intervals 'lower_P' and
'upper_P' for P = 50, 80, 90, 95, and where `Ensemble.conformal` calibrated it, the conformal interval
'conformal_lower', 'conformal_upper'. Every task's artifact returns its `Task.exported` (ensemble/tasks/): a
multi-label one 'member_logits' and per-label 'probs', a quantile one its 'quantiles', 'lower' and 'upper'.

The batch dimension is symbolic, so one artifact serves every batch size; the
program runs on one device. The parameters (and BatchNorm's running averages)
are constants of the program, so the file is about their size.
"""

import functools
import os
from typing import Callable, Sequence

from ensemble import console

console.quiet_libraries()  # before TensorFlow and JAX load

from absl import flags, logging  # pylint: disable=g-import-not-at-top,g-multiple-import
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

from ensemble import api, backends, cli, features, files, posthoc  # pylint: disable=g-import-not-at-top
from ensemble.errors import UsageError  # pylint: disable=g-import-not-at-top

# The artifact runs on any of these; lowering for a platform needs no device of it.
DEFAULT_PLATFORMS = ('cpu', 'cuda')
KNOWN_PLATFORMS = ('cpu', 'cuda', 'rocm', 'tpu')

FLAGS = flags.FLAGS


def forward(model: api.Ensemble) -> Callable[[jnp.ndarray], dict[str, jnp.ndarray]]:
  """float32 images (N, H, W, C) in [0, 1] (or the run's features, or int32 tokens) -> {'member_log_probs':
  (K, N, C), 'probs': (N, C)} on one device, after the ensemble's post-hoc chain (its temperature; 'set' and
  'flag' where it has a conformal or a flags step); another task's own (`Task.exported`); 'distance' beside it
  where the chain has a distance step.

  Each member's forward pass is `steps.Member.predict`, as in training and
  evaluation, mapped over the members as `backends.predict_members` maps
  them, the state fetched to the host so that it becomes the program's
  constants; the chain is `posthoc.apply`, traced.
  """
  state = jax.device_get(model.state.replace(opt_state=None))
  output = lambda state, images: model.task.member_output(model.member.predict(state, images))
  members = backends.predict_members(output, model.member, jax.devices()[:1])
  step = posthoc.last(model.posthoc, 'distance')
  if step is None:
    return lambda inputs: model.task.exported(members(state, model.standardise(inputs, xp=jnp)), model.posthoc, jnp)
  penultimate = backends.predict_members(functools.partial(features.penultimate, model.member), model.member,
                                         jax.devices()[:1])

  # The distance reads the features alone, and no other step reads it: the task's answer by the rest of the chain,
  # and the distance beside it.
  rest = [s for s in model.posthoc if s.kind != 'distance']

  def forward_with_distance(inputs):
    inputs = model.standardise(inputs, xp=jnp)
    found = step.apply({'features': penultimate(state, inputs)}, jnp)['distance']
    return {**model.task.exported(members(state, inputs), rest, jnp), 'distance': found}
  return forward_with_distance


def check_platforms(platforms: Sequence[str]):
  unknown = [p for p in platforms if p not in KNOWN_PLATFORMS]
  if unknown or not platforms:
    raise UsageError(f'--platforms={",".join(platforms)}: choose from {", ".join(KNOWN_PLATFORMS)}')


def export(model: api.Ensemble, platforms: Sequence[str] = DEFAULT_PLATFORMS) -> jax.export.Exported:
  """The ensemble's forward pass for any batch size on `platforms`, ready to `.serialize()`."""
  check_platforms(platforms)
  batch, = jax.export.symbolic_shape('batch')
  images = jax.ShapeDtypeStruct((batch, *model.image_shape), model.member.example_input().dtype)
  return jax.export.export(jax.jit(forward(model)), platforms=tuple(platforms))(images)


def write(workdir: str, output: str, step: int | None = None,
          platforms: Sequence[str] = DEFAULT_PLATFORMS) -> jax.export.Exported:
  """Exports the checkpoint to `output`; the file appears whole or not at all."""
  if not output:
    raise UsageError('--output is required: the file to write the exported ensemble to, e.g. model.jax')
  files.check_output('--output', output)
  check_platforms(platforms)
  model = api.read(workdir, step)
  exported = export(model, platforms)
  files.write_atomically(output, bytes(exported.serialize()))
  outputs = jax.tree_util.tree_unflatten(exported.out_tree, range(exported.out_tree.num_leaves))
  logging.info('Wrote %s (%.1f MB) for %s: %s %s %s%s -> %s.', output, os.path.getsize(output) / 1e6,
               ', '.join(exported.platforms), model.member.inputs, exported.in_avals[0].dtype,
               tuple(exported.in_avals[0].shape), ' in [0, 1]' if model.member.inputs == 'images' else '',
               ', '.join(outputs))
  return exported


def main(argv):
  def body():
    if not FLAGS.workdir:
      raise UsageError('--workdir is required: a folder trained by python -m ensemble.train')
    write(FLAGS.workdir, FLAGS.output, FLAGS.step, FLAGS.platforms)
  cli.run(argv, 'ensemble.export', body)


def define_flags():
  """The program's flags, defined when it runs; allow_override lets a test process define them beside
  `ensemble.evaluate`'s and `ensemble.predict`'s."""
  if 'platforms' in FLAGS:
    return
  flags.DEFINE_string('workdir', None, 'A folder trained by `python -m ensemble.train`.', allow_override=True)
  flags.DEFINE_integer('step', None, 'The checkpoint (epoch) to export; default: the latest.', allow_override=True)
  flags.DEFINE_string('output', None, 'The file to write, e.g. model.jax.', allow_override=True)
  flags.DEFINE_list('platforms', list(DEFAULT_PLATFORMS), f'Platforms the artifact runs on, of {KNOWN_PLATFORMS}.')


if __name__ == '__main__':
  define_flags()
  cli.start(main)
