"""The backends: placement only, so both must compute the same ensemble."""

import functools
import re

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import user_models
from configs import mlp as mlp_config
from conftest import MNIST_INFO, SAME_SUMS, assert_same_updates, make_member, small_config, synthetic_mnist
from ensemble import backends, members, models, recipe as recipe_lib, steps
from ensemble.errors import UsageError


def _backend(name, ensemble_size=8, num_devices=8, member_data='shared', config=None, **overrides):
  return backends.create(name, member=make_member(**overrides), devices=jax.devices()[:num_devices],
                         ensemble_size=ensemble_size, member_data=member_data,
                         config=recipe_lib.of(config) if config else None)


def _batches(num_steps, batch=16, ensemble_size=8, member_data='shared'):
  shape = (num_steps, batch) if member_data == 'shared' else (num_steps, ensemble_size, batch)
  (images, labels), _ = synthetic_mnist(num_train=int(np.prod(shape)))
  images = images[..., None].astype(np.float32) / 255
  labels = labels.astype(np.int32)
  return images.reshape(*shape, 28, 28, 1), labels.reshape(shape)


def _train(backend, ensemble_size, num_steps, member_data='shared', seed=0):
  state = backend.init(seed)
  images, labels = _batches(num_steps, ensemble_size=ensemble_size, member_data=member_data)
  losses = []
  for x, y in zip(images, labels):
    state, m = backend.train_step(state, x, y)
    losses.append(backend.to_host(m)['loss'])
  return backend.to_canonical(state), np.stack(losses)


def _params(canonical_state):
  return jax.tree.map(np.asarray, canonical_state.params)


def test_members_start_different_and_one_pmap_step_changes_each_differently():
  backend = _backend('pmap')
  state = backend.init(0)
  before = _params(backend.to_canonical(state))
  kernel = before['Conv_0']['kernel']
  assert kernel.shape == (8, 3, 3, 1, 32)
  assert all(not np.allclose(kernel[0], kernel[i]) for i in range(1, 8))

  images, labels = _batches(1)
  state, _ = backend.train_step(state, images[0], labels[0])
  after = _params(backend.to_canonical(state))
  for path_before, path_after in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    delta = (path_after - path_before).reshape(8, -1)
    assert np.all(np.abs(delta).max(axis=1) > 0), 'every member must change'
    assert all(not np.allclose(delta[0], delta[i]) for i in range(1, 8)), 'members change differently'


@pytest.mark.parametrize('name', ['pmap', 'jit'])
def test_ensemble_prediction_is_the_mean_of_member_probabilities(name):
  backend = _backend(name, ensemble_size=16)
  state = backend.init(3)
  images, labels = _batches(1)
  out = backend.to_host(backend.eval_step(state, images[0], labels[0]))
  params = _params(backend.to_canonical(state))
  member_probs = np.stack([
      jax.nn.softmax(models.cnn.CNN().apply({'params': jax.tree.map(lambda p, i=i: p[i], params)}, images[0]))
      for i in range(16)])
  ensemble = member_probs.mean(0)
  expected_nll = -np.log(ensemble[np.arange(16), labels[0]])
  np.testing.assert_allclose(out['ensemble_loss'][0], expected_nll, rtol=1e-5)
  np.testing.assert_allclose(out['ensemble_loss'][15], expected_nll, rtol=1e-5)
  np.testing.assert_array_equal(out['ensemble_correct'][0], ensemble.argmax(-1) == labels[0])
  member_nll = -np.log(member_probs[:, np.arange(16), labels[0]])
  np.testing.assert_allclose(out['member_loss'], member_nll, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('member_data', ['shared', 'shuffled'])
def test_pmap_and_jit_train_the_same_members(member_data):
  pmap_state, pmap_losses = _train(_backend('pmap', member_data=member_data), 8, 3, member_data)
  jit_state, jit_losses = _train(_backend('jit', member_data=member_data), 8, 3, member_data)
  np.testing.assert_allclose(pmap_losses, jit_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _params(pmap_state), _params(jit_state))


@pytest.mark.parametrize('name, num_devices', [('pmap', 4), ('jit', 1), ('pmap', 1)])
def test_member_i_does_not_depend_on_the_device_count(name, num_devices):
  reference, reference_losses = _train(_backend('jit', ensemble_size=16), 16, 2)
  state, losses = _train(_backend(name, ensemble_size=16, num_devices=num_devices), 16, 2)
  np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _params(state), _params(reference))


def test_pmap_canonical_round_trip_keeps_every_member_on_its_device():
  backend = _backend('pmap', ensemble_size=16)
  state = backend.init(0)
  canonical = backend.to_canonical(state)
  leaf = canonical.params['Dense_1']['bias']
  assert leaf.shape == (16, 10) and leaf.sharding.is_equivalent_to(backends.member_sharding(jax.devices()), 2)
  again = backend.from_canonical(canonical)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, again)
  assert np.asarray(again.params['Dense_1']['bias']).shape == (8, 2, 10)


def test_members_mapped_one_after_another_match_vmap():
  """On CPU a device's members are traced one after another (backends.map_members), elsewhere vmapped."""
  member = make_member()
  state = jax.vmap(member.init)(jax.random.split(jax.random.key(0), 2))
  images, labels = _batches(1)
  args, in_axes = (state, images[0], labels[0]), (0, None, None)
  (mapped_state, mapped), (vmapped_state, vmapped) = (
      jax.jit(backends.map_members(member.train_step, in_axes, jax.devices()))(*args),
      jax.jit(jax.vmap(member.train_step, in_axes=in_axes))(*args))
  assert mapped['loss'].shape == (2,)
  np.testing.assert_allclose(mapped['loss'], vmapped['loss'], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               mapped_state.params, vmapped_state.params)


def test_unrolled_steps_match_the_loop():
  """CPU backends unroll the fast path's steps; accelerators keep the lax.scan loop. Same steps."""
  images, labels = _batches(3)
  dataset = (images.reshape(-1, 28, 28, 1), labels.reshape(-1))
  indices = np.arange(len(dataset[1])).reshape(labels.shape)
  member = make_member()
  state = member.init(jax.random.key(0))
  run = lambda unroll: jax.jit(functools.partial(steps.train_steps, step_fn=member.train_step, unroll=unroll))(
      state, *dataset, indices)
  (looped, looped_metrics), (unrolled, unrolled_metrics) = run(False), run(True)
  assert unrolled_metrics['loss'].shape == (3,)
  np.testing.assert_allclose(unrolled_metrics['loss'], looped_metrics['loss'], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), unrolled.params, looped.params)


@pytest.mark.parametrize('name, member_data', [('pmap', 'shared'), ('jit', 'shuffled')])
def test_fast_path_matches_the_plain_path(name, member_data):
  """Resident data and several steps per dispatch (lax.scan) must not change the results."""
  plain_state, plain_losses = _train(_backend(name, member_data=member_data), 8, 4, member_data)
  backend = _backend(name, member_data=member_data)
  images, labels = _batches(4, member_data=member_data)
  split = {'image': images.reshape(-1, 28, 28, 1), 'label': labels.reshape(-1)}
  indices = np.arange(len(split['label'])).reshape(labels.shape)
  state, dataset = backend.init(0), backend.put_dataset(split)
  state, first = backend.train_steps(state, dataset, indices[:3])
  state, last = backend.train_steps(state, dataset, indices[3:])
  losses = np.concatenate([backend.to_host(first)['loss'], backend.to_host(last)['loss']], axis=1)
  np.testing.assert_allclose(losses, plain_losses.T, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _params(backend.to_canonical(state)), _params(plain_state))


RESNET = dict(model='resnet', resnet_depth=8, augment='crop_flip')


@functools.cache
def _pmap_resnet_on_eight_devices():
  return _train_with_stats(_backend('pmap', config=SAME_SUMS, **RESNET))


def _train_with_stats(backend):
  state, losses = _train(backend, 8, 2)
  return jax.tree.map(np.asarray, (state.params, state.batch_stats)), losses


@pytest.mark.parametrize('name, num_devices', [('jit', 8), ('jit', 4), ('pmap', 4)])
def test_augmented_resnet_members_do_not_depend_on_backend_or_device_count(name, num_devices):
  """Each member's augmentation and BatchNorm statistics are its own, wherever it runs."""
  (ref_params, ref_stats), ref_losses = _pmap_resnet_on_eight_devices()
  (params, stats), losses = _train_with_stats(_backend(name, num_devices=num_devices, config=SAME_SUMS, **RESNET))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for ours, reference in ((params, ref_params), (stats, ref_stats)):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), ours, reference)
  # The members really differ in their running averages: each saw its own views with its own weights.
  mean = ref_stats['BatchNorm_0']['mean']
  assert all(not np.allclose(mean[0], mean[i]) for i in range(1, 8))


def _train_fast(backend, ensemble_size, num_steps, member_data='shared'):
  """`_train` on the fast path: the batches resident, every step in one dispatch."""
  images, labels = _batches(num_steps, ensemble_size=ensemble_size, member_data=member_data)
  split = {'image': images.reshape(-1, 28, 28, 1), 'label': labels.reshape(-1)}
  indices = np.arange(len(split['label'])).reshape(labels.shape)
  state, metrics = backend.train_steps(backend.init(0), backend.put_dataset(split), indices)
  return backend.to_canonical(state), backend.to_host(metrics)['loss'].T


SPREAD_MODELS = {'cnn': {}, 'resnet': RESNET, 'batchensemble': dict(method='batchensemble')}


@functools.cache
def _two_members_on_two_devices(model, member_data):
  state, losses = _train(_backend('jit', 2, 2, member_data, **SPREAD_MODELS[model]), 2, 2, member_data)
  return jax.tree.map(np.asarray, (state.params, state.batch_stats)), losses


@pytest.mark.parametrize('model, member_data, fast', [
    ('cnn', 'shared', False), ('cnn', 'shuffled', True), ('resnet', 'shuffled', False), ('resnet', 'shared', True),
    ('batchensemble', 'shared', False)])
def test_fewer_members_than_devices_train_as_on_devices_of_their_own(model, member_data, fast):
  """K=2 on 8 devices: each member data-parallel over 4, its gradients and BatchNorm statistics over its whole batch."""
  backend = _backend('jit', 2, 8, member_data, **SPREAD_MODELS[model])
  state, losses = (_train_fast if fast else _train)(backend, 2, 2, member_data)
  kernel = jax.tree.leaves(state.params)[0]
  assert kernel.sharding.mesh.shape == {'ensemble': 2, 'data': 4}
  assert kernel.sharding.is_equivalent_to(backends.member_sharding(jax.devices(), 2), kernel.ndim)
  (ref_params, ref_stats), ref_losses = _two_members_on_two_devices(model, member_data)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_same_updates(state.params, ref_params, _params(backend.to_canonical(backend.init(0))))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5), state.batch_stats,
               ref_stats)


def test_fewer_members_than_devices_split_each_members_batch_and_reduce_among_its_devices():
  backend = _backend('jit', 2, 8, 'shuffled')
  images, labels = _batches(1, ensemble_size=2, member_data='shuffled')
  batch = jax.make_array_from_process_local_data(backend._data, (images[0], labels[0]))  # pylint: disable=protected-access
  assert batch[0].addressable_shards[0].data.shape == (1, 4, 28, 28, 1)  # 16 rows of a member over its 4 devices
  hlo = backend._train.lower(backend.init(0), *batch).compile().as_text()  # pylint: disable=protected-access
  assert 'all-gather(' not in hlo
  assert 'replica_groups=[2,4]<=[8]' in hlo  # the gradient sum: among each member's 4 devices only
  # The fast path splits the batches it gathers from the resident set likewise: 4 of a member's 16 per device.
  indices = np.zeros((2, 3, 16), np.int32)
  indices = jax.make_array_from_process_local_data(backend._indices, indices, indices.shape)  # pylint: disable=protected-access
  dataset = backend.put_dataset({'image': images[0, 0], 'label': labels[0, 0]})
  hlo = backend._train_steps.lower(backend.init(0), *dataset, indices).compile().as_text()  # pylint: disable=protected-access
  assert re.search(r'= f32\[4,14,14,64\]\S* convolution', hlo) and 'all-gather(' not in hlo  # the second convolution


@pytest.mark.parametrize('backend, k, message', [
    ('jit', 3, 'ensemble_size=3 cannot be placed on 8 devices: use a multiple of 8 (8, 16, 24, ...) or a divisor '
     '(1, 2, 4), or set --config.num_devices to a divisor of 3'),
    ('pmap', 2, "ensemble_size=2 is fewer members than the 8 devices, which backend 'pmap' cannot spread a member "
     'over: set --config.backend=jit'),
    ('pmap', 12, 'ensemble_size=12 cannot be placed on 8 devices: use a multiple of 8 (8, 16, 24, ...), or set'),
])
def test_sizes_that_do_not_fit_the_devices_named_are_refused_in_one_line(backend, k, message):
  with pytest.raises(UsageError, match=re.escape(message)):
    recipe_lib.resolve(small_config('', backend=backend, ensemble_size=k, num_devices=8), jax.devices())


@pytest.mark.parametrize('backend, k, devices', [('jit', 3, 3), ('jit', 2, 8), ('pmap', 2, 2), ('pmap', 12, 6),
                                                 ('pmap', 16, 8)])
def test_without_num_devices_the_members_go_on_as_many_devices_as_take_them(backend, k, devices):
  """All of them where the backend can place the members there, else as many as K is a multiple of: what the
  refusals above suggest, and what `fit` does too."""
  recipe, used = recipe_lib.resolve(small_config('', backend=backend, ensemble_size=k, num_devices=0), jax.devices())
  assert len(used) == recipe.num_devices == devices


def test_fsdp_members_hold_a_quarter_of_their_state_per_device_and_train_the_same():
  """K=2 on 8 devices with member_sharding=fsdp: the large leaves split over a member's 4 devices."""
  spread = lambda layout: backends.create('jit', member=make_member(), devices=jax.devices(), ensemble_size=2,
                                          member_data='shuffled', config=small_config('', member_sharding=layout))
  state, losses = _train(spread('fsdp'), 2, 2, 'shuffled')
  assert state.params['Dense_0']['kernel'].sharding.spec == P('ensemble', 'data', None)
  (ref_params, _), ref_losses = _two_members_on_two_devices('cnn', 'shuffled')
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5), state.params,
               ref_params)
  replicated = backends.bytes_per_device(spread('replicated').init(0))
  # Biases and the small kernels stay whole (FSDP_MIN_WEIGHT_SIZE); they are 1% of the CNN's bytes.
  assert replicated / 4 <= backends.bytes_per_device(state) < replicated / 4 * 1.02


def _mlp_member(logical=True, **overrides):
  """The mesh MLP, small: its blocks' weights annotated ('hidden' over 'model'), their momentum likewise.

  SGD, not the config's Adam: Adam's first steps scale near-zero gradients to full steps, rounding and all.
  """
  return make_member(mlp_config.get_config(), **{'depth': 64, 'logical': logical, 'optimizer': 'sgd',
                                                 'learning_rate': 0.05, **overrides})


def _spread(member, layout, **config):
  return backends.create('jit', member=member, devices=jax.devices(), ensemble_size=2, member_data='shuffled',
                         config=small_config('', member_sharding=layout, **config))


@functools.cache
def _mlp_on_two_devices():
  member = _mlp_member()
  state, losses = _train(backends.create('jit', member=member, devices=jax.devices()[:2], ensemble_size=2,
                                         member_data='shuffled'), 2, 2, 'shuffled')
  return jax.tree.map(np.asarray, state.params), losses


@pytest.mark.parametrize('logical', [True, False], ids=['logical', 'mesh'])
def test_model_members_split_their_annotated_weights_over_their_devices_and_train_the_same(logical):
  """K=2 on 8 with member_sharding=model: each member's hidden units over its 4 devices, its trajectory its own.

  Both spellings of the MLP's annotations (logical names and rules, or mesh axes) split the same weights.
  """
  backend = _spread(_mlp_member(logical), 'model')
  state, losses = _train(backend, 2, 2, 'shuffled')
  w1, w2 = state.params['block_0']['Dense_0']['kernel'], state.params['block_0']['W2']
  assert w1.value.sharding.spec == P('ensemble', None, 'model')
  assert w2.value.sharding.spec == P('ensemble', 'model', None)
  assert w1.value.addressable_shards[0].data.shape == (1, 64, 16)  # a quarter of each member's 64 hidden units
  assert state.params['input']['kernel'].value.sharding.spec == P('ensemble', None, None)  # not annotated 'hidden'
  ref_params, ref_losses = _mlp_on_two_devices()
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for ours, reference in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params)):  # boxes of either kind
    np.testing.assert_allclose(np.asarray(ours), reference, rtol=1e-4, atol=1e-5)
  # The blocks' weights and their momentum, all annotated, hold a quarter of a member's bytes on each device.
  blocks = [x for path, x in jax.tree_util.tree_flatten_with_path(state)[0] if 'block_' in jax.tree_util.keystr(path)]
  assert len(blocks) == 8
  assert backends.bytes_per_device(blocks) * 4 == sum(x.nbytes for x in blocks) / 2


def test_a_users_model_splits_the_weights_its_own_logical_names_map_onto_model():
  member = members.member(small_config(''), MNIST_INFO, model=user_models.Annotated())
  backend = _spread(member, 'model', logical_axis_rules=(('mlp', 'model'),))
  params = backend.init(0).params
  assert params['Dense_0']['kernel'].value.sharding.spec == P('ensemble', None, 'model')
  assert params['Dense_1']['kernel'].value.sharding.spec == P('ensemble', 'model', None)
  assert params['Dense_1']['bias'].sharding.spec == P('ensemble', None)


@pytest.mark.parametrize('member, message', [
    (lambda: make_member(), "member_sharding=model splits the parameters a model annotates onto the 'model' mesh "
     "axis, and this model annotates none: annotate its large weights with nn.with_logical_partitioning"),
    (lambda: _mlp_member(depth=66), "['block_0']['Dense_0']['kernel'] has shape (66, 66)"),
], ids=['none', 'indivisible'])
def test_model_members_whose_annotations_cannot_split_them_are_refused_in_one_line(member, message):
  with pytest.raises(UsageError, match=re.escape(message)):
    _spread(member(), 'model')


def test_model_members_are_refused_where_each_has_one_device_and_keep_their_batch_whole():
  with pytest.raises(UsageError, match=re.escape('member_sharding=model splits a member over the devices it has')):
    recipe_lib.resolve(small_config('', backend='jit', ensemble_size=8, member_sharding='model'), jax.devices())
  # Each of a member's devices computes on its whole batch, so the batch need not split over them.
  config, _ = recipe_lib.resolve(small_config('', backend='jit', ensemble_size=2, member_sharding='model',
                                              batch_size=30, eval_batch_size=30), jax.devices())
  assert config.member_sharding == 'model'


def test_training_programs_on_cpu_run_xlas_own_kernels_and_the_others_keep_jaxs():
  """Training without YNNPACK (backends.train_program); its results are the same, one program per signature."""
  from jaxlib import version  # pylint: disable=g-import-not-at-top
  conv = jax.jit(lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), 'SAME',
                                                           dimension_numbers=('NHWC', 'HWIO', 'NHWC')))
  rng = np.random.default_rng(0)
  x, k = rng.normal(size=(16, 14, 14, 32)).astype(np.float32), rng.normal(size=(3, 3, 32, 64)).astype(np.float32)
  program = backends.train_program(conv, jax.devices())
  np.testing.assert_allclose(program(x, k), conv(x, k), rtol=1e-4, atol=1e-4)
  (compiled,) = program.programs.values()
  if version.__version_info__ >= (0, 9):  # JAX's default hands this convolution to YNNPACK
    assert '__ynn' in conv.lower(x, k).compile().as_text()
  assert '__ynn' not in compiled.as_text()
  program(x[:8], k)
  assert len(program.programs) == 2
  assert backends.train_program(conv, jax.devices(), ml_collections.ConfigDict({'xla_cpu_ynnpack': True})) is conv
  unknown = backends.CompiledWith(conv, {'xla_cpu_no_such_option': ''})  # a jaxlib without the option
  np.testing.assert_array_equal(unknown(x, k), conv(x, k))
  # A member without convolutions keeps JAX's default: its steps loop (backends.unrolls) and dispatch from C++.
  dense = make_member(model='user_models:TinyNet', augment='none')
  assert not backends.has_convolutions(dense) and backends.has_convolutions(make_member())
  assert backends.train_program(conv, jax.devices(), member=dense) is conv
  # Nor does one whose convolutions run forward only: heads on a frozen convolutional backbone.
  backbone = ('Conv_0', 'Conv_1', 'Dense_0')
  heads = make_member(shared=backbone, frozen=backbone)
  assert not backends.trains_through_convolutions(heads) and backends.trains_through_convolutions(make_member())
  assert backends.trains_through_convolutions(make_member(frozen=('Conv_0',)))  # Conv_1's weights still train
  assert backends.trains_through_convolutions(make_member(shared=backbone, adapter_rank=2))  # through its adapters
  assert backends.train_program(conv, jax.devices(), member=heads) is conv
  for name in ('pmap', 'jit'):
    backend = _backend(name, ensemble_size=2, num_devices=2)
    assert isinstance(backend._train, backends.CompiledWith) and isinstance(backend._train_steps, backends.CompiledWith)
