"""Ensembles on a shared or pretrained backbone (`fit(shared=..., frozen=..., init_params=...)`): K heads on one
copy of a backbone, frozen or trained by all members together, started from one model's parameters; refusals in one
line."""

import collections

import flax.linen as nn
import jax
import numpy as np
import pytest

import ensemble
import user_models
from conftest import assert_printed_as_the_page_says, compiles, run_guide_example
from ensemble import backends, checkpoint, loop, recipe as recipe_lib
from ensemble.errors import UsageError

FIT = {'ensemble_size': 4, 'epochs': 2, 'batch_size': 32, 'progress': False, 'optimizer': 'adamw',
       'learning_rate': 0.01, 'weight_decay': 0.0}


class Backbone(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(32)(nn.relu(nn.Dense(32)(x))))


class Net(nn.Module):
  """A backbone (two hidden layers) and a head, as a pretrained model's parameters are laid out."""

  @nn.compact
  def __call__(self, x, train=False):
    return nn.Dense(3, name='head')(Backbone(name='backbone')(x))


def _classes(n: int, seed: int):
  rng = np.random.default_rng(seed)
  y = rng.integers(0, 3, n).astype(np.int32)
  return (rng.normal(size=(n, 4)) + np.eye(3, 4)[y] * 2).astype(np.float32), y


def _one(tree):
  return jax.tree.map(lambda leaf: np.asarray(leaf), tree)


@pytest.fixture(scope='module')
def pretrained():
  """One model's parameters, as a 1-member fit leaves them."""
  return ensemble.fit(Net(), _classes(256, 0), **{**FIT, 'ensemble_size': 1})


def test_heads_on_a_frozen_shared_backbone(pretrained, tmp_path):
  """The backbone is the pretrained one, the same for every member and untouched by training (and has no optimizer
  state); each head starts where its key draws it and trains apart; the ensemble predicts, counts the backbone once,
  and saves and loads as it is."""
  backbone = _one(pretrained.params)['backbone']
  ens = ensemble.fit(Net(), _classes(256, 0), test=_classes(100, 1), shared='backbone', frozen='backbone',
                     init_params={'backbone': jax.tree.map(lambda leaf: leaf[0], backbone)}, **FIT)
  params = _one(ens.params)
  for got, want in zip(jax.tree.leaves(params['backbone']), jax.tree.leaves(backbone), strict=True):
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
  heads = params['head']['kernel']
  assert not np.allclose(heads[0], heads[1]) and ens.summary['test_accuracy'] > 0.6, ens.summary
  assert not jax.tree.leaves(ens.state.opt_state.inner_states['trained'].inner_state[0].mu['backbone'])
  assert ens.member.method.num_params(jax.tree.map(lambda leaf: leaf[0], ens.state.params), 4) == (
      sum(leaf[0].size for leaf in jax.tree.leaves(params['backbone']))
      + 4 * sum(leaf[0].size for leaf in jax.tree.leaves(params['head'])))
  x = _classes(50, 2)[0]
  loaded = ensemble.load(ens.save(str(tmp_path / 'saved')).workdir, model=Net())
  np.testing.assert_allclose(loaded.predict(x)['probs'], ens.predict(x)['probs'], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(ens.state), strict=True):
    np.testing.assert_array_equal(a, b)
  # The checkpoint holds the backbone once, each head per member.
  written = checkpoint.read_record(str(tmp_path / 'saved'), ens.epoch)['signature']
  assert written['params/backbone/Dense_0/kernel'][0] == [1, 32, 32] and written['params/head/kernel'][0] == [4, 32, 3]


def test_a_shared_backbone_that_trains_stays_one_copy(pretrained):
  """Not frozen, the shared backbone trains (it moves from where it started) on every member's loss, and stays the
  same for all of them; on 2 devices, each holds it once, where it holds each of its members' heads."""
  start = jax.tree.map(lambda leaf: np.asarray(leaf)[0], pretrained.params)
  ens = ensemble.fit(Net(), _classes(256, 0), shared='backbone', init_params=start, num_devices=2, **FIT)
  kernel = np.asarray(ens.params['backbone']['Dense_1']['kernel'])
  assert all(np.array_equal(kernel[0], kernel[i]) for i in range(4))
  assert not np.allclose(kernel[0], start['backbone']['Dense_1']['kernel'])
  run = loop.prepare(ens.config, jax.devices()[:2], ensemble.data.arrays.from_arrays(_classes(256, 0), None,
                                                                                     'features', 'classification'),
                     Net())
  state = run.init()
  assert state.params['backbone']['Dense_0']['kernel'].shape[:2] == (2, 1)  # (devices, one copy)
  assert state.params['head']['kernel'].shape[:2] == (2, 2)  # (devices, members each)


@pytest.mark.parametrize('ensemble_size', [8, 16, 2])
def test_a_shared_backbone_split_over_the_devices_trains_the_same_members(pretrained, ensemble_size):
  """shared_sharding=fsdp on backend jit, 8 devices: each holds 1/8 of the shared backbone and of its optimizer
  state (its biases too, under min_weight_size=1), whatever the members per device (1, 2, or a member spread over 4
  devices), and the members are those of the replicated layout."""
  start = jax.tree.map(lambda leaf: np.asarray(leaf)[0], pretrained.params)
  fields = {**FIT, 'ensemble_size': ensemble_size, 'backend': 'jit', 'shared': 'backbone', 'init_params': start,
            'min_weight_size': 1}
  split = ensemble.fit(Net(), _classes(256, 0), shared_sharding='fsdp', **fields)
  whole = ensemble.fit(Net(), _classes(256, 0), **fields)
  for got, want in zip(jax.tree.leaves(split.params), jax.tree.leaves(whole.params), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(split.params['backbone']['Dense_1']['kernel'][0], start['backbone']['Dense_1']['kernel'])
  data = ensemble.data.arrays.from_arrays(_classes(256, 0), None, 'features', 'classification')
  state = loop.prepare(split.config, jax.devices(), data, Net()).init()
  moments = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
             if "['backbone']['Dense_1']['kernel']" in jax.tree_util.keystr(path)]
  assert len(moments) == 2  # Adam's two
  for leaf in (state.params['backbone']['Dense_1']['kernel'], *moments, state.params['backbone']['Dense_0']['bias']):
    assert leaf.shape[0] == 1 and {shard.data.size for shard in leaf.addressable_shards} == {leaf.size // 8}
  replicated = loop.prepare(whole.config, jax.devices(), data, Net()).init()
  assert backends.bytes_per_device(state) < backends.bytes_per_device(replicated)


def test_a_split_shared_layer_beside_members_split_by_their_annotations():
  """shared_sharding=fsdp with member_sharding=model: K=2 members spread over 4 devices each, their annotated
  hidden units split over 'model', their shared first layer split over all 8 devices; the members of the
  replicated shared layer."""
  x, y = _classes(128, 0)
  fields = {**FIT, 'ensemble_size': 2, 'backend': 'jit', 'member_sharding': 'model',
            'logical_axis_rules': [('mlp', 'model')], 'shared': 'Dense_0', 'min_weight_size': 1}
  split = ensemble.fit(user_models.Annotated(num_classes=3), (x, y), shared_sharding='fsdp', **fields)
  whole = ensemble.fit(user_models.Annotated(num_classes=3), (x, y), **fields)
  for got, want in zip(jax.tree.leaves(split.params), jax.tree.leaves(whole.params), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('fields, message', [
    ({'shared': 'trunk'}, r"shared='trunk' matches no parameter of the model, whose parameters are backbone/"),
    ({'frozen': ('backbone', 'neck')}, r"frozen='neck' matches no parameter"),
    ({'shared': 3}, r"shared=3: give a module path such as 'backbone'"),
    ({'shared': 'backbone', 'method': 'hyper'}, "method hyper gives each member its own learning rate"),
    ({'frozen': 'backbone', 'method': 'mimo'}, 'frozen=.*method mimo already shares every weight'),
    ({'init_params': {'backbone': {'Dense_0': {'kernel': np.zeros((5, 32))}}}},
     r'init_params holds backbone/Dense_0/kernel as \(5, 32\), where the model has \(32, 32\)'),
    ({'init_params': {'neck': {'kernel': np.zeros((4, 32))}}}, 'init_params holds neck/kernel, where the model has no'),
    ({'adapter_rank': 2}, 'adapter_rank=2 adapts the kernels of the shared layers, and shared names none'),
    ({'adapter_rank': 2, 'shared': 'head/bias'}, r"adapter_rank=2 adapts .* shared=\['head/bias'\] holds none"),
    ({'shared_sharding': 'fsdp', 'shared': 'backbone'}, "shared_sharding=fsdp splits .* backend 'pmap' holds a copy"),
    ({'shared_sharding': 'fsdp', 'backend': 'jit'}, 'shared_sharding=fsdp splits .* here the members share none'),
    ({'shared_sharding': 'zero3'},
     r"unknown shared_sharding 'zero3': set shared_sharding= to one of \['replicated', 'fsdp'\]"),
])
def test_sharing_is_refused_in_one_line(fields, message):
  with pytest.raises(UsageError, match=message) as refused:
    ensemble.fit(Net(), _classes(64, 0), **{**FIT, 'epochs': 1, **fields})
  assert '\n' not in str(refused.value)


def test_the_cli_refuses_sharing_on_a_mesh_backend():
  with pytest.raises(UsageError, match="backend 'fsdp' trains one model on a mesh"):
    recipe_lib.resolve({'backend': 'fsdp', 'model': 'mlp', 'num_layers': 1, 'depth': 8, 'mesh_shape': (-1, 1),
                        'frozen': ('Dense_0',)}, jax.devices())


def test_adapters_on_a_frozen_shared_backbone(pretrained, tmp_path):
  """`adapter_rank=r`: the backbone one frozen copy (frozen follows shared), each member its own rank-r adapters of
  its kernels, which start at zero (B) and train apart; the members then differ in what the backbone computes, and
  save, load and export predict the same."""
  from ensemble import export  # pylint: disable=g-import-not-at-top
  from ensemble import sharing  # pylint: disable=g-import-not-at-top
  start = jax.tree.map(lambda leaf: np.asarray(leaf)[0], pretrained.params)
  ens = ensemble.fit(Net(), _classes(256, 0), test=_classes(100, 1), shared='backbone', adapter_rank=2,
                     init_params=start, **FIT)
  assert ens.config.frozen == ('backbone',)
  params = _one(ens.params)
  for got, want in zip(jax.tree.leaves(params['backbone']), jax.tree.leaves(start['backbone']), strict=True):
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
  adapter = params[sharing.ADAPTERS]['backbone']['Dense_0']['kernel']
  assert adapter['a'].shape == (4, 32, 2) and adapter['b'].shape == (4, 2, 32)
  assert np.abs(adapter['b']).max() > 0 and not np.allclose(adapter['b'][0], adapter['b'][1])
  assert 'bias' not in params[sharing.ADAPTERS]['backbone']['Dense_0']  # kernels only
  x = _classes(50, 2)[0]
  member_probs = ens.member_probs(x)
  assert not np.allclose(member_probs[0], member_probs[1]) and ens.summary['test_accuracy'] > 0.6
  saved = ens.save(str(tmp_path / 'saved'))
  np.testing.assert_allclose(ensemble.load(saved.workdir, model=Net()).predict(x)['probs'], ens.predict(x)['probs'],
                             rtol=1e-6)
  served = jax.export.deserialize(bytearray(export.export(ens, ['cpu']).serialize()))
  np.testing.assert_allclose(np.asarray(served.call(x)['probs']), ens.predict(x)['probs'], rtol=1e-4, atol=1e-6)


@pytest.mark.compute_bound  # 2,000 rows of real digits, 5 ensembles: 53 s of CPU against 83 s compiled quickly
def test_the_guide_s_backbone_example_runs_as_written(capsys):
  """docs/python-api.md's pretrained-backbone example runs as written and prints what the page shows (to 0.01: the
  page's figures are one device's, these eight simulated devices'): fresh heads and adapters end below the
  pretrained model's NLL in the epochs it took, and each ensemble beats its best member in NLL and accuracy. Issue
  76: at the pretraining's rate (Adam, 1e-3), fresh heads learned too slowly (member accuracies 0.87, 0.56, 0.58,
  0.49) and the ensemble was worse than its best member."""
  printed, expected = run_guide_example('## A pretrained backbone', capsys)
  figures = assert_printed_as_the_page_says(printed, expected)
  pretrained_nll, pretrained_accuracy, *ensembles = figures
  for nll, best_nll, accuracy, best_accuracy in (ensembles[:4], ensembles[4:]):
    assert nll < best_nll < pretrained_nll and accuracy > best_accuracy > pretrained_accuracy, printed


def test_a_predicate_names_the_parameters_by_path():
  """`shared=` and `frozen=` as predicates of a parameter's path: the recipe records the paths they accept, and the
  members share (and keep frozen) exactly those."""
  ens = ensemble.fit(Net(), _classes(128, 0), shared=lambda path: path.startswith('backbone/'),
                     frozen=lambda path: path == 'backbone/Dense_1/kernel', **FIT)
  assert ens.config.shared == ('backbone/Dense_0/bias', 'backbone/Dense_0/kernel', 'backbone/Dense_1/bias',
                               'backbone/Dense_1/kernel')
  assert ens.config.frozen == ('backbone/Dense_1/kernel',)
  params = _one(ens.params)
  for leaf in jax.tree.leaves(params['backbone']):
    assert all(np.array_equal(leaf[0], leaf[i]) for i in range(4))
  with pytest.raises(UsageError, match="shared=<lambda> accepts none of the model's parameter paths"):
    ensemble.fit(Net(), _classes(64, 0), shared=lambda path: False, **FIT)


@pytest.mark.parametrize('fields', [{'frozen': 'backbone'},
                                    {'backend': 'jit', 'shared_sharding': 'fsdp', 'min_weight_size': 1}],
                         ids=['frozen', 'trained_and_split'])
def test_an_nnx_model_shares_its_backbone(fields):
  """An NNX model's parameters are named by its attributes: `shared='backbone'` finds them as it finds a linen
  module's, frozen, or trained and split over the devices."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.backbone = nnx.Linear(4, 32, rngs=rngs)
      self.head = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.backbone(x)))

  ens = ensemble.fit(NNXNet, _classes(128, 0), shared='backbone', **fields, **FIT)
  leaves = jax.tree_util.tree_leaves_with_path(ens.params)
  backbone = [leaf for path, leaf in leaves if 'backbone' in jax.tree_util.keystr(path)]
  head = [leaf for path, leaf in leaves if 'head' in jax.tree_util.keystr(path)]
  assert backbone and head
  for leaf in backbone:
    assert all(np.array_equal(leaf[0], leaf[i]) for i in range(4))
  assert not np.allclose(head[0][0], head[0][1])
  assert ens.summary['train_accuracy'] > 0.5


def test_the_cli_starts_heads_from_a_pretrained_workdir(make_config, tmp_path):
  """`--config.init_from=WORKDIR` with `--config.shared`: the backbone is that run's first member's (only the layers
  shared names), one frozen copy; the heads are drawn from the members' keys; a folder that is not there is refused
  before anything is written."""
  from ensemble import trainer  # pylint: disable=g-import-not-at-top
  backbone = ('Conv_0', 'Conv_1', 'Dense_0')
  pretrained = str(tmp_path / 'pretrained')
  trainer.train_and_evaluate(make_config(ensemble_size=1), pretrained)
  heads = str(tmp_path / 'heads')
  trainer.train_and_evaluate(make_config(shared=backbone, frozen=backbone, init_from=pretrained), heads)
  before, after = _one(ensemble.load(pretrained).params), _one(ensemble.load(heads).params)
  for name in backbone:
    for key in ('kernel', 'bias'):
      np.testing.assert_array_equal(after[name][key], np.broadcast_to(before[name][key][0], after[name][key].shape))
  assert not np.allclose(after['Dense_1']['kernel'][0], before['Dense_1']['kernel'][0])
  assert not np.allclose(after['Dense_1']['kernel'][0], after['Dense_1']['kernel'][1])
  with pytest.raises(UsageError, match="init_from='/nowhere' is no folder"):
    trainer.train_and_evaluate(make_config(init_from='/nowhere'), str(tmp_path / 'refused'))
  assert not (tmp_path / 'refused').exists()


def test_init_noise_makes_members_that_start_from_one_model_differ(pretrained):
  """`init_noise=s`: every member's copy of the pretrained head plus its own Gaussian draw of standard deviation s
  (the shared backbone stays one copy, untouched); without it, they start equal."""
  start = jax.tree.map(lambda leaf: np.asarray(leaf)[0], pretrained.params)
  fields = {**FIT, 'epochs': 1, 'learning_rate': 1e-9, 'shared': 'backbone', 'init_params': start}
  same = _one(ensemble.fit(Net(), _classes(64, 0), **fields).params)
  noisy = _one(ensemble.fit(Net(), _classes(64, 0), init_noise=0.01, **fields).params)
  np.testing.assert_allclose(same['head']['kernel'][1], same['head']['kernel'][0], atol=1e-6)
  spread = noisy['head']['kernel'] - start['head']['kernel']
  assert 0.007 < spread.std() < 0.013 and not np.allclose(spread[0], spread[1])
  for got, want in zip(jax.tree.leaves(noisy['backbone']), jax.tree.leaves(same['backbone'])):
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize('method, fields', [('bagging', {}), ('snapshot', {'snapshot_cycles': 2}),
                                            ('multiswag', {'swag_start': 0.5, 'swag_rank': 2, 'swag_samples': 2})])
def test_frozen_parameters_stay_as_they_start_under_every_method_that_takes_them(pretrained, method, fields):
  """The methods that keep each member's parameters their own take `frozen=` (and bagging `shared=`): the frozen
  backbone ends as init_params started it (a snapshot or a SWAG sample of it is itself), the ensemble predicts."""
  start = jax.tree.map(lambda leaf: np.asarray(leaf)[0], pretrained.params)
  sharing_fields = {'shared': 'backbone'} if method == 'bagging' else {}
  ens = ensemble.fit(Net(), _classes(128, 0), method=method, frozen='backbone', init_params={'backbone':
                     start['backbone']}, **sharing_fields, **fields, **{**FIT, 'epochs': 2})
  for got, want in zip(jax.tree.leaves(_one(ens.state.params)['backbone']), jax.tree.leaves(start['backbone'])):
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
  assert np.isfinite(ens.predict(_classes(20, 3)[0])['probs']).all()


def test_the_shared_weights_follow_the_seed_in_a_loop_of_fits():
  """Fits that differ by their seed share their compiled programs; the shared weights are drawn from the seed, so
  each fit's are its own (the programs must not keep the first fit's seed)."""
  fields = {**FIT, 'epochs': 1, 'learning_rate': 1e-9, 'shared': 'backbone', 'frozen': 'backbone'}
  first, second = (_one(ensemble.fit(Net(), _classes(64, 0), seed=seed, **fields).params) for seed in (0, 1))
  assert not np.allclose(first['backbone']['Dense_0']['kernel'], second['backbone']['Dense_0']['kernel'])


def test_a_loop_of_fits_with_shared_weights_and_a_new_seed_each_compiles_nothing_after_the_first(pretrained,
                                                                                                 monkeypatch):
  """The loop of fits with `shared=` and `init_params`, another seed (and other data of the same shapes) each, and
  predictions: after the first, nothing compiles, as the seed is an argument of the programs, not in their key. A
  fit in the loop is the one that programs built for its seed alone make: the same members, bit for bit."""
  fields = {**FIT, 'shared': 'backbone',
            'init_params': {'backbone': jax.tree.map(lambda leaf: np.asarray(leaf[0]), pretrained.params['backbone'])}}
  x_test = _classes(16, 9)[0]

  def fit(seed):
    ens = ensemble.fit(Net(), _classes(64, seed), seed=seed, **fields)
    ens.predict(x_test)
    return ens
  fit(1)
  with compiles() as counts:
    looped = [fit(seed) for seed in (2, 3)]
  assert not counts, f'{sum(counts.values())} programs compiled'
  heads = [_one(ens.params)['head']['kernel'] for ens in looped]
  assert not np.allclose(heads[0], heads[1])  # each seed's own heads
  monkeypatch.setattr(loop, '_PROGRAMS', collections.OrderedDict())  # programs built anew, for seed 3
  jax.tree.map(np.testing.assert_array_equal, _one(looped[1].params), _one(fit(3).params))


class NormedBackbone(nn.Module):
  """A dense layer and BatchNorm: running statistics that a pretrained backbone carries beside its parameters."""

  @nn.compact
  def __call__(self, x, train=False):
    return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(16)(x)))


class NormedNet(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    return nn.Dense(3, name='head')(NormedBackbone(name='backbone')(x, train))


def _normed_variables():
  """One NormedNet's variables, with running statistics far from BatchNorm's fresh ones (mean 0, variance 1)."""
  variables = NormedNet().init(jax.random.key(7), np.zeros((1, 4), np.float32))
  rng = np.random.default_rng(7)
  stats = {'mean': rng.normal(size=16).astype(np.float32), 'var': rng.uniform(0.5, 2.0, 16).astype(np.float32)}
  return {'params': _one(variables['params']), 'batch_stats': {'backbone': {'BatchNorm_0': stats}}}


def _assert_frozen_backbone(ens, variables):
  """Every member holds the given backbone, its parameters and its running statistics, and computes the same
  features with it (at evaluation, on the running averages)."""
  params, stats = _one(ens.params), _one(ens.state.batch_stats)
  want = variables['batch_stats']['backbone']['BatchNorm_0']
  for name in ('mean', 'var'):
    got = stats['backbone']['BatchNorm_0'][name]
    np.testing.assert_array_equal(got, np.broadcast_to(want[name], got.shape))
  x = _classes(20, 5)[0]
  member = lambda tree, k: jax.tree.map(lambda leaf: leaf[k], tree)
  features = [NormedBackbone().apply({'params': member(params['backbone'], k),
                                      'batch_stats': member(stats['backbone'], k)}, x) for k in range(ens.size)]
  for k in range(1, ens.size):
    np.testing.assert_array_equal(features[k], features[0])
  assert not np.allclose(params['head']['kernel'][0], params['head']['kernel'][1])


def test_init_params_takes_the_variables_and_a_frozen_backbone_keeps_its_statistics(tmp_path):
  """`init_params` as a model's variables: the given running statistics fill every member, and under `frozen=` no
  step updates them (they would drift apart per member, each from its own batches). `init_from` carries them from
  a run's first member alike."""
  from ensemble import evaluation  # pylint: disable=g-import-not-at-top
  variables = _normed_variables()
  start = {'params': {'backbone': variables['params']['backbone']}, 'batch_stats': variables['batch_stats']}
  fields = {**FIT, 'ensemble_size': 2, 'epochs': 1, 'shared': 'backbone', 'frozen': 'backbone'}
  _assert_frozen_backbone(ensemble.fit(NormedNet(), _classes(64, 0), init_params=start, **fields), variables)

  one = ensemble.fit(NormedNet(), _classes(64, 0), init_params=variables, **{**fields, 'ensemble_size': 1})
  saved = one.save(str(tmp_path / 'one')).workdir
  carried = evaluation.first_member_params(saved, ('backbone',))
  assert set(carried) == {'params', 'batch_stats'} and not jax.tree.leaves(carried['params']['head'])
  np.testing.assert_array_equal(carried['batch_stats']['backbone']['BatchNorm_0']['mean'],
                                variables['batch_stats']['backbone']['BatchNorm_0']['mean'])
  _assert_frozen_backbone(ensemble.fit(NormedNet(), _classes(64, 0), init_from=saved, **fields), variables)


def test_init_params_takes_an_nnx_model_s_state():
  """An NNX model's state (`nnx.state(model)`) as init_params: its parameters and its BatchNorm's statistics start
  every member, and a frozen backbone keeps both."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class NNXNormed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.backbone = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs))
      self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.backbone(x)))

  pretrained = NNXNormed(nnx.Rngs(3))
  pretrained.backbone.layers[1].mean[...] = np.linspace(-1, 1, 8, dtype=np.float32)
  ens = ensemble.fit(NNXNormed, _classes(64, 0), init_params=nnx.state(pretrained), shared='backbone',
                     frozen='backbone', **{**FIT, 'ensemble_size': 2, 'epochs': 1, 'learning_rate': 1e-9})
  mean = _one(ens.state.batch_stats)['backbone']['layers'][1]['mean']
  np.testing.assert_array_equal(mean, np.broadcast_to(np.linspace(-1, 1, 8, dtype=np.float32), mean.shape))
  kernel = _one(ens.params)['head']['kernel']
  np.testing.assert_allclose(kernel[1], np.asarray(pretrained.head.kernel[...]), atol=1e-6)


@pytest.mark.parametrize('fields, message', [
    ({'init_noise': 0.01}, r'init_noise=0.01 adds noise to the start that init_params= \(or init_from=\) gives'),
    ({'init_params': np.zeros(3)}, r"init_params= is of type ndarray, not a tree: give a tree of the model's"),
    ({'init_params': {'head': {'bias': 'abc'}}}, 'init_params holds head/bias as a str that is no array'),
    ({'init_params': {'params': {}, 'batch_stats': {}}},
     r"init_params holds the collection 'batch_stats' beside 'params', and the model has none"),
])
def test_init_settings_that_would_do_nothing_or_crash_are_refused_in_one_line(fields, message):
  with pytest.raises(UsageError, match=message) as refused:
    ensemble.fit(Net(), _classes(64, 0), **{**FIT, 'epochs': 1, **fields})
  assert '\n' not in str(refused.value)


def test_init_from_is_refused_beside_init_and_named_when_it_is_no_run(pretrained, tmp_path):
  """`init_from=` beside `init=` is refused as init_params= is; a folder that holds no run says init_from=, not
  workdir=."""
  with pytest.raises(UsageError, match="init= starts every member from an ensemble's members, init_from= from"):
    ensemble.fit(Net(), _classes(64, 0), init=pretrained, init_from=str(tmp_path), **{**FIT, 'ensemble_size': 1})
  with pytest.raises(UsageError, match=r'config.json: missing; init_from= must name a trained run') as refused:
    ensemble.fit(Net(), _classes(64, 0), init_from=str(tmp_path), **FIT)
  assert 'workdir=' not in str(refused.value) and '--' not in str(refused.value)


def test_init_params_leaves_as_lists_are_arrays():
  """A leaf given as a (nested) Python list is the array it spells."""
  ens = ensemble.fit(Net(), _classes(64, 0), init_params={'head': {'bias': [1.0, 2.0, 3.0]}},
                     **{**FIT, 'epochs': 1, 'learning_rate': 1e-9})
  np.testing.assert_allclose(_one(ens.params)['head']['bias'], [[1.0, 2.0, 3.0]] * 4, atol=1e-5)


def test_init_params_that_do_not_fit_are_refused_before_the_workdir_is_written(tmp_path):
  workdir = tmp_path / 'new'
  with pytest.raises(UsageError, match=r'init_params holds head/bias as \(5,\), where the model has \(3,\)'):
    ensemble.fit(Net(), _classes(64, 0), workdir=str(workdir), init_params={'head': {'bias': np.zeros(5)}},
                 **{**FIT, 'epochs': 1})
  assert not workdir.exists()


def test_members_with_no_source_of_diversity_are_named_in_one_warning(pretrained):
  """Every parameter from init_params, the same batches, no augmentation, noise or dropout: one EnsembleWarning,
  naming the fixes. Heads drawn per member, a plain fit, or a model with dropout say nothing."""
  import warnings  # pylint: disable=g-import-not-at-top
  start = jax.tree.map(lambda leaf: np.asarray(leaf)[0], pretrained.params)
  fields = {**FIT, 'ensemble_size': 2, 'epochs': 1, 'member_data': 'shared'}
  with pytest.warns(ensemble.errors.EnsembleWarning) as caught:
    ens = ensemble.fit(Net(), _classes(64, 0), init_params=start, **fields)
  messages = [str(w.message) for w in caught if issubclass(w.category, ensemble.errors.EnsembleWarning)]
  assert len(messages) == 1 and '\n' not in messages[0], messages
  assert "init_noise=0.01, member_data='shuffled'" in messages[0] and 'no dropout layer' in messages[0]
  np.testing.assert_array_equal(_one(ens.params)['head']['kernel'][0], _one(ens.params)['head']['kernel'][1])
  dropping = user_models.TinyNet(width=8, num_classes=3)  # its nn.Dropout draws each member's own units
  with warnings.catch_warnings():
    warnings.simplefilter('error', ensemble.errors.EnsembleWarning)
    ensemble.fit(Net(), _classes(64, 0), init_params={'backbone': start['backbone']}, **fields)
    ensemble.fit(Net(), _classes(64, 0), **fields)
    ensemble.fit(dropping, _classes(64, 0), init_params=dropping.init(jax.random.key(0), np.zeros((1, 4))), **fields)


def test_the_cli_refuses_init_noise_without_init_from_before_writing(make_config, tmp_path):
  from ensemble import trainer  # pylint: disable=g-import-not-at-top
  with pytest.raises(UsageError, match=r'--config.init_noise=0.01 adds noise to the start that --config.init_from'):
    trainer.train_and_evaluate(make_config(init_noise=0.01), str(tmp_path / 'refused'))
  assert not (tmp_path / 'refused').exists()


def test_a_frozen_backbone_given_without_its_statistics_is_refused_in_one_line():
  """init_params of a frozen BatchNorm backbone's parameters alone (the form the docs give for parameters) would
  leave its running statistics at BatchNorm's fresh 0 and 1, which no step updates: the members train normalised by
  their batches and test by those (NLL 3.7 against a training loss of 0.24). Refused, naming the whole variables."""
  variables = _normed_variables()
  fields = {**FIT, 'ensemble_size': 2, 'epochs': 1, 'shared': 'backbone', 'frozen': 'backbone'}
  for params in ({'backbone': variables['params']['backbone']}, {'params': variables['params']}):
    with pytest.raises(UsageError, match=r"but not their batch_stats \(backbone/BatchNorm_0: .*"
                                         r"init_params=\{'params': \.\.\., 'batch_stats': \.\.\.\}") as refused:
      ensemble.fit(NormedNet(), _classes(64, 0), init_params=params, **fields)
    assert '\n' not in str(refused.value)
  # Not frozen, the statistics train on from the given parameters: nothing to refuse.
  ensemble.fit(NormedNet(), _classes(64, 0), init_params=variables['params'], **{**fields, 'frozen': ()})
