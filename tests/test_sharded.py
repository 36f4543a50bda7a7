"""The mesh backends: the MLP on a ('data', 'model') mesh, DP and FSDP under shard_map."""

import collections
import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import default as default_config, dp as dp_config, fsdp as fsdp_config, mlp as mlp_config
from conftest import COMPILE_FLAGS, assert_same_updates, compiles, make_member, synthetic_mnist
from ensemble import backends, loop, models, trainer, writers
from ensemble.backends import sharded
from ensemble.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mlp_config(**overrides):
  config = mlp_config.get_config()
  config.update(dict(depth=16, num_layers=2, batch_size=32, eval_batch_size=32), **overrides)
  return config


def _default_config(**overrides):
  config = default_config.get_config()
  config.update(overrides)
  return config


def _classifier_config(backend, **overrides):
  config = (fsdp_config if backend == 'fsdp' else dp_config).get_config()
  config.update(dict(depth=64, num_layers=2, min_weight_size=1024, num_minibatches=2, batch_size=32,
                     eval_batch_size=32), **overrides)
  return config


def _backend(config, num_devices=8):
  return backends.create(config.backend, member=make_member(config), devices=jax.devices()[:num_devices],
                         ensemble_size=1, member_data='shared', config=config)


def _split(num_examples):
  (images, labels), _ = synthetic_mnist(num_train=num_examples)
  return {'image': (images[..., None] / 255).astype(np.float32), 'label': labels.astype(np.int32)}


def _train(backend, num_steps=3, batch=32):
  split = _split(num_steps * batch)
  state, losses = backend.init(0), []
  for idx in np.arange(num_steps * batch).reshape(num_steps, batch):
    state, metrics = backend.train_step(state, split['image'][idx], split['label'][idx])
    losses.append(backend.to_host(metrics)['loss'])
  return state, np.concatenate(losses)


def _params(state):
  return jax.tree.map(np.asarray, state.params)


@functools.cache
def _one_device_mlp(use_scan):
  return _train(_backend(_mlp_config(use_scan=use_scan, mesh_shape=(1, 1)), num_devices=1))


@pytest.mark.parametrize('use_scan, mesh_shape', [
    (False, (1, 8)), (False, (2, 4)), (False, (4, 2)), (False, (8, 1)), (True, (2, 4))])
def test_mlp_follows_the_one_device_trajectory_on_every_mesh(use_scan, mesh_shape):
  reference_state, reference_losses = _one_device_mlp(use_scan)
  state, losses = _train(_backend(_mlp_config(use_scan=use_scan, mesh_shape=mesh_shape)))
  assert reference_losses[-1] < reference_losses[0]
  np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               _params(state), _params(reference_state))


def _annotations(config, mesh):
  """The model's own boxes, read straight from its init: what each parameter asks for."""
  model = models.create(config, 10, (28, 28, 1))
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    boxed = jax.eval_shape(model.init, jax.random.key(0), np.ones((1, 28, 28, 1), np.float32))['params']
  return boxed


@pytest.mark.parametrize('logical, use_scan', [(False, False), (True, True)])
def test_each_parameter_is_sharded_as_its_annotation_asks(logical, use_scan):
  config = _mlp_config(logical=logical, use_scan=use_scan)
  backend = _backend(config)
  state = backend.init(0)
  boxes = _annotations(config, backend.mesh)
  flat_boxes = jax.tree_util.tree_leaves_with_path(boxes, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  # W1 and W2 per block (one stacked block under scan), kernel and bias of the input and the head.
  assert len(flat_boxes) == len(jax.tree.leaves(state.params)) == 2 * (1 if use_scan else 2) + 4
  for path, box in flat_boxes:
    assert isinstance(box, nn.LogicallyPartitioned if logical else nn.Partitioned)
    names = nn.logical_to_mesh_axes(box.names, config.logical_axis_rules) if logical else P(*box.names)
    adam = state.opt_state[0]
    for tree in (state.params, adam.mu, adam.nu):  # the weight and its two moments
      leaf = tree
      for key in path:
        leaf = leaf[key.key]
      assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(backend.mesh, names), leaf.ndim), path
  # The guide's layout, literally: W1 split by columns, W2 by rows over 'model'; the 'layer' axis whole.
  layer = (None,) if use_scan else ()
  block = state.params['blocks'] if use_scan else state.params['block_0']
  assert block['Dense_0']['kernel'].sharding.spec == P(*layer, None, 'model')
  assert block['W2'].sharding.spec == P(*layer, 'model', None)
  assert state.params['input']['kernel'].sharding.spec == P(None, None)


def _shardings(backend):
  """{'.params['block_0']['W2']': P('model', None), ...} for the whole state the backend restores."""
  return {jax.tree_util.keystr(path): x.sharding.spec
          for path, x in jax.tree_util.tree_leaves_with_path(backend.abstract_state())}


@pytest.mark.parametrize('use_scan', [False, True])
def test_logical_and_mesh_annotations_give_the_same_shardings(use_scan):
  plain = _shardings(_backend(_mlp_config(use_scan=use_scan)))
  logical = _shardings(_backend(_mlp_config(use_scan=use_scan, logical=True)))
  assert logical == plain
  # The rules, not the model, decide: putting 'embed' on 'model' moves W2's split to its columns.
  moved = _shardings(_backend(_mlp_config(use_scan=use_scan, logical=True, logical_axis_rules=(
      ('batch', 'data'), ('embed', 'model')))))
  block = "['blocks']" if use_scan else "['block_0']"
  assert moved[f".params{block}['W2']"] == P(*((None,) if use_scan else ()), None, 'model')
  for moment in ('mu', 'nu'):
    assert moved[f".opt_state[0].{moment}{block}['W2']"] == P(*((None,) if use_scan else ()), None, 'model')


def _split_by_size(tree, min_size):
  leaves = jax.tree.leaves(tree)
  return [x for x in leaves if x.size >= min_size], [x for x in leaves if x.size < min_size]


def test_fsdp_follows_dp_with_an_eighth_of_its_large_weights_per_device():
  dp = _backend(_classifier_config('dp', dropout_rate=0.1))
  dp_state, dp_losses = _train(dp)
  fsdp_state, fsdp_losses = _train(_backend(_classifier_config('fsdp', dropout_rate=0.1)))
  assert dp_losses[-1] < dp_losses[0]
  np.testing.assert_allclose(fsdp_losses, dp_losses, rtol=1e-5)
  # In norm, leaf by leaf: element by element, one of the first kernel's 50,176 (a pixel row's, its terms nearly
  # cancelling) missed rtol=1e-4 by 5x on an AVX2 CPU, where the two programs' sums round otherwise.
  assert_same_updates(fsdp_state.params, _params(dp_state), _params(dp.init(0)))

  device = jax.devices()[0]
  for part, copies in (('params', 1), ('opt_state', 2)):  # the weights, and Adam's two moments of each
    dp_large, dp_small = _split_by_size(getattr(dp_state, part), 1024)
    fsdp_large, fsdp_small = _split_by_size(getattr(fsdp_state, part), 1024)
    assert len(fsdp_large) == 2 * copies  # the hidden kernels; the head's (64, 10) and the biases are smaller
    assert sharded.bytes_on_device(dp_large, device) == sum(x.nbytes for x in dp_large)
    assert sharded.bytes_on_device(fsdp_large, device) * 8 == sharded.bytes_on_device(dp_large, device)
    assert sharded.bytes_on_device(fsdp_small, device) == sum(x.nbytes for x in fsdp_small)


@pytest.mark.parametrize('config', [_mlp_config(), _classifier_config('fsdp', dropout_rate=0.1)],
                         ids=['sharded', 'fsdp'])
def test_fast_path_matches_the_plain_path(config):
  """The training set resident on the mesh and several steps per dispatch: the same steps."""
  plain_state, plain_losses = _train(_backend(config), num_steps=4)
  backend = _backend(config)
  indices = np.arange(4 * 32).reshape(4, 32)
  state, dataset = backend.init(0), backend.put_dataset(_split(4 * 32))
  state, first = backend.train_steps(state, dataset, indices[:3])
  state, last = backend.train_steps(state, dataset, indices[3:])
  losses = np.concatenate([backend.to_host(first)['loss'], backend.to_host(last)['loss']], axis=1)
  assert losses.shape == (1, 4)
  np.testing.assert_allclose(losses[0], plain_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _params(state), _params(plain_state))


@pytest.mark.parametrize('backend', ['dp', 'fsdp'])
def test_a_run_with_another_seed_drops_as_a_fresh_one_and_compiles_nothing(mnist_dir, tmp_path, monkeypatch, backend):
  """dp's and fsdp's dropout keys are folded from the seed's key, an argument of their programs: a run with another
  seed after one in the same process compiles nothing, and trains what programs built for its seed alone train (it
  once kept the first run's dropout key)."""
  def run(seed, name):
    config = _classifier_config(backend, data_dir=mnist_dir, num_epochs=1, dropout_rate=0.5, seed=seed)
    return _params(trainer.train_and_evaluate(config, str(tmp_path / name))[0])
  run(5, 'first')
  with compiles() as counts:
    looped = run(9, 'looped')
  assert not counts, f'{sum(counts.values())} programs compiled'
  monkeypatch.setattr(loop, '_PROGRAMS', collections.OrderedDict())  # programs built anew, for seed 9
  jax.tree.map(np.testing.assert_array_equal, looped, run(9, 'fresh'))


@pytest.mark.parametrize('first, then', [
    (_mlp_config(mesh_shape=(2, 4)), dict(mesh_shape=(4, 2))),
    (_classifier_config('fsdp', dropout_rate=0.0), dict(backend='dp', num_devices=4)),
])
def test_a_sharded_checkpoint_resumes_on_another_mesh(mnist_dir, tmp_path, first, then):
  """Trained one epoch on one mesh, resumed on another: the same run as one that never stopped.

  The first run is told 1 epoch and the resumed one 2, so the rate must not depend on num_epochs: a cosine
  schedule spans the epochs a run is given.
  """
  def config(**overrides):
    config = first.copy_and_resolve_references()
    config.update(data_dir=mnist_dir, schedule='constant', **overrides)
    return config

  trainer.train_and_evaluate(config(num_epochs=1), str(tmp_path / 'resumed'))
  resumed, _ = trainer.train_and_evaluate(config(num_epochs=2, **then), str(tmp_path / 'resumed'))
  straight, _ = trainer.train_and_evaluate(config(num_epochs=2), str(tmp_path / 'straight'))
  lines = writers.read_jsonl(str(tmp_path / 'resumed' / 'metrics.jsonl'))
  assert [line['epoch'] for line in lines] == [1, 2]
  assert len(lines[-1]['member_test_accuracy']) == 1
  mesh = dict(resumed.params['head']['kernel'].sharding.mesh.shape)
  assert mesh == ({'data': 4, 'model': 2} if first.backend == 'sharded' else {'data': 4, 'model': 1})
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               _params(resumed), _params(straight))


@pytest.mark.parametrize('config, message', [
    pytest.param(_mlp_config(mesh_shape=(2, 2)), r'mesh_shape=\(2, 2\) has 4 devices but 8 are in use',
                 id='mesh-size'),
    pytest.param(_mlp_config(mesh_shape=(3, -1)), r'mesh_shape=\(3, -1\): 3 does not divide the 8 devices',
                 id='mesh-rest'),
    pytest.param(_mlp_config(mesh_shape=(1, 8), depth=12),
                 "cannot be split over 8 devices of mesh axis 'model'; set --config.depth to a multiple of 8",
                 id='depth'),
    pytest.param(_mlp_config(logical=True, logical_axis_rules=(('batch', 'data'), ('hiden', 'model'))),
                 "unknown logical axis 'hiden'", id='logical-axis'),
    pytest.param(_mlp_config(logical=True, logical_axis_rules=(('batch', 'data'), ('hidden', 'tensor'))),
                 "unknown mesh axis 'tensor'", id='mesh-axis'),
    pytest.param(_mlp_config(mesh_shape=(4, 2), batch_size=30),
                 'batch_size=30 cannot be split over the 4 devices of the data axis', id='batch'),
    pytest.param(_mlp_config(ensemble_size=8), "backend 'sharded' trains one model, not an ensemble",
                 id='ensemble'),
    pytest.param(_mlp_config(model='cnn'), "backend 'sharded' trains model 'mlp', not 'cnn'", id='model'),
    pytest.param(_default_config(backend='fsdp'),
                 r"backend 'fsdp' needs the mesh fields \(mesh_shape, \.\.\.\) of configs/fsdp\.py",
                 id='not-a-mesh-config'),
    pytest.param(_classifier_config('fsdp', mesh_shape=(4, 2)), 'dp and fsdp split over the data axis only',
                 id='fsdp-model-axis'),
    pytest.param(_classifier_config('dp', num_minibatches=3),
                 'num_minibatches=3 does not divide the 4 examples', id='minibatches'),
])
def test_bad_mesh_configs_are_refused_before_the_workdir_is_touched(mnist_dir, tmp_path, config, message):
  config.data_dir = mnist_dir
  with pytest.raises(UsageError, match=message):
    trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_cli_bad_mesh_is_one_line_and_exit_2(mnist_dir, tmp_path):
  message = 'error: mesh_shape=(4, 4) has 16 devices but 8 are in use'
  result = subprocess.run(
      [sys.executable, '-m', 'ensemble.train', '--config', 'configs/mlp.py', '--workdir',
       str(tmp_path / 'run'), '--cpu_devices=8', f'--config.data_dir={mnist_dir}',
       '--config.mesh_shape=(4, 4)'],
      cwd=REPO, env={**os.environ, 'XLA_FLAGS': COMPILE_FLAGS}, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
  assert 'Traceback' not in result.stderr
  assert not (tmp_path / 'run').exists()
