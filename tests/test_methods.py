"""The ensembling methods keep their promises: bagging, hyper, snapshot, batchensemble, on both backends."""

import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ensemble import backends, calibration, data, devices as devices_lib, evaluation, methods, models, optim, predictor
from ensemble import recipe as recipe_lib
from ensemble import steps, trainer
from ensemble.errors import UsageError
from ensemble.methods import batchensemble

from conftest import MNIST_INFO, make_member, small_config, write_mnist

K = 4  # members in the trained runs
# Per method, the fields that make it fit the small synthetic runs (1 epoch unless a test says otherwise).
METHODS = {
    'independent': {},
    'bagging': {},
    'hyper': {'hyper_learning_rate': (0.01, 0.1), 'hyper_weight_decay': (1e-4, 1e-2)},
    'snapshot': {'schedule': 'cosine', 'snapshot_cycles': 2, 'num_epochs': 2},
    'batchensemble': {},
}


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """`trained(method, backend)`: (config, workdir, state, summary) of one small run, trained once per module.

  Two devices with two members each, so that members meet on a device and across devices.
  """
  root = tmp_path_factory.mktemp('methods')
  mnist = write_mnist(str(root / 'mnist'))
  runs = {}

  def run(method, backend='pmap'):
    if (method, backend) not in runs:
      config = small_config(mnist, method=method, backend=backend, num_devices=2, ensemble_size=K,
                            **METHODS[method])
      workdir = str(root / f'{method}-{backend}')
      runs[method, backend] = (config, workdir, *trainer.train_and_evaluate(config, workdir))
    return runs[method, backend]
  return run


def _tree_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))


def test_bootstrap_resamples_depend_on_the_seed_and_the_member_only():
  # 20 batches of 50 take all 1,000 draws of a member's resample: its epoch's indices are the resample, reordered.
  draw = lambda seed=3, epoch=1, size=8: data.train_batch_indices(1000, 50, seed=seed, epoch=epoch,
                                                                   ensemble_size=size, member_data='bootstrap')
  first, resample = draw(), lambda indices, member: np.sort(indices[:, member].ravel())
  np.testing.assert_array_equal(first, draw())
  assert not np.array_equal(resample(first, 5), resample(first, 6))
  assert not np.array_equal(resample(first, 5), resample(draw(seed=4), 5))
  # Drawn with replacement: about 1 - 1/e of the examples appear, some of them several times.
  assert 0.58 < len(np.unique(first[:, 5])) / 1000 < 0.68
  # Member 1's batches are the same in an ensemble of 2 and of 8.
  np.testing.assert_array_equal(draw(size=2)[:, 1], first[:, 1])
  # A new epoch reorders the same resample.
  later = draw(epoch=2)
  assert not np.array_equal(later[:, 1], first[:, 1])
  np.testing.assert_array_equal(resample(later, 1), resample(first, 1))


def test_bagging_trains_each_member_on_its_own_resample(make_config):
  config, _ = recipe_lib.resolve(make_config(method='bagging'), jax.devices())
  assert config.member_data == 'bootstrap'


def test_hyper_members_train_with_their_own_rates_in_one_program():
  member = make_member(method='hyper', hyper_learning_rate=(0.01, 1.0), hyper_weight_decay=(1e-4, 1e-2),
                       schedule='constant')
  keys = steps.member_keys(0, 3)
  states = jax.vmap(member.init)(keys)
  drawn = states.opt_state.hyperparams
  rates, decays = np.asarray(drawn['learning_rate']), np.asarray(drawn['weight_decay'])
  assert len(set(rates.tolist())) == 3 and len(set(decays.tolist())) == 3
  assert ((0.01 <= rates) & (rates <= 1.0)).all() and ((1e-4 <= decays) & (decays <= 1e-2)).all()
  # Member i's draw is a function of the seed and i alone, like its key.
  np.testing.assert_array_equal(np.asarray(jax.vmap(member.init)(keys[:2]).opt_state.hyperparams['learning_rate']),
                                rates[:2])
  # Give every member the same parameters and batch: one vmapped step moves each bias (not decayed) by its
  # own rate times the same gradient.
  same = jax.tree.map(lambda x: jnp.broadcast_to(x[0], x.shape), states.params)
  states = states.replace(params=same, opt_state=jax.vmap(member.tx.init)(same)._replace(
      hyperparams=states.opt_state.hyperparams))
  images = jax.random.randint(jax.random.key(1), (16, 28, 28, 1), 0, 256).astype(jnp.uint8)
  labels = jnp.arange(16) % 10
  member_no_augment = make_member(method='hyper', schedule='constant', augment='none')
  updated, _ = jax.jit(jax.vmap(member_no_augment.train_step, in_axes=(0, None, None)))(states, images, labels)
  loss = lambda p: steps.cross_entropy(
      member_no_augment.model.apply({'params': p}, member_no_augment.prepare(images)), labels).mean()
  grad = jax.jit(jax.grad(loss))(jax.tree.map(lambda x: x[0], same))
  bias = lambda tree: tree['Dense_1']['bias']
  moved = np.asarray(bias(updated.params) - bias(same))
  np.testing.assert_allclose(moved, -rates[:, None] * np.asarray(bias(grad))[None], rtol=1e-4, atol=1e-7)


def test_snapshot_schedule_restarts_every_cycle(make_config):
  config = make_config(method='snapshot', schedule='cosine', snapshot_cycles=2, num_epochs=4, learning_rate=0.1)
  rate = optim.schedule(config, steps_per_epoch=5)
  assert float(rate(0)) == pytest.approx(0.1) and float(rate(10)) == pytest.approx(0.1)
  assert float(rate(9)) < 0.01 and float(rate(19)) < 0.01
  assert float(rate(5)) == pytest.approx(0.05) and float(rate(15)) == pytest.approx(0.05)


def test_snapshots_are_kept_at_each_cycles_end_and_averaged(trained):
  config, _, state, _ = trained('snapshot')
  kept = state.snapshots
  np.testing.assert_array_equal(np.asarray(kept['count']), 2)
  _tree_equal(jax.tree.map(lambda x: x[:, 1], kept['params']), state.params)  # the last cycle ends the run
  first = jax.tree.map(lambda x: np.asarray(x[:, 0]), kept['params'])
  assert not np.allclose(first['Dense_1']['kernel'], np.asarray(state.params['Dense_1']['kernel']))
  # A member predicts the mean probability of its two snapshots; the ensemble averages all K x 2.
  member = make_member(config, snapshot_cycles=2)
  one = jax.tree.map(lambda x: x[0], state)
  images = jnp.asarray(data.load(data_dir=config.data_dir).test['image'][:20])
  slot = lambda c: one.replace(params=jax.tree.map(lambda x: x[c], one.snapshots['params']))
  logits, predict = jax.jit(member.logits), jax.jit(member.predict)
  probs = [jax.nn.softmax(logits(slot(c), images)) for c in range(2)]
  np.testing.assert_allclose(np.exp(jax.nn.log_softmax(predict(one, images))), (probs[0] + probs[1]) / 2,
                             rtol=1e-5, atol=1e-6)
  # Before the first cycle ends, a member predicts with its current parameters.
  fresh = member.init(jax.random.key(0))
  np.testing.assert_allclose(predict(fresh, images), logits(fresh, images))


def test_a_snapshot_run_resumes_exactly(trained, tmp_path):
  config, workdir, straight, _ = trained('snapshot')
  # As if interrupted after the first of its two cycles: the resume restores the kept snapshot and goes on.
  shutil.copytree(workdir, tmp_path / 'b')
  shutil.rmtree(os.path.join(tmp_path, 'b', 'checkpoints', '2'))
  resumed, _ = trainer.train_and_evaluate(config, str(tmp_path / 'b'))
  np.testing.assert_array_equal(np.asarray(resumed.snapshots['count']), 2)
  _tree_equal(resumed.snapshots, straight.snapshots)
  _tree_equal(resumed.params, straight.params)


def test_batchensemble_members_share_their_weights_and_differ_in_their_factors(trained):
  config, _, state, _ = trained('batchensemble')
  shared = batchensemble.is_shared(jax.tree.map(lambda x: x[0], state.params))
  kernels = [np.asarray(leaf) for leaf, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(shared)) if s]
  factors = [np.asarray(leaf) for leaf, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(shared)) if not s]
  assert len(kernels) == 4 and len(factors) == 12  # per layer: a shared kernel; fast_in, fast_out, bias
  for kernel in kernels:
    np.testing.assert_array_equal(kernel, np.broadcast_to(kernel[0], kernel.shape))
  start = jax.jit(jax.vmap(make_member(config).init))(steps.member_keys(config.seed, K))
  for leaf, before in zip(kernels, [k for k, s in zip(jax.tree.leaves(start.params), jax.tree.leaves(shared)) if s]):
    assert not np.allclose(leaf[0], np.asarray(before[0]))  # they trained
  for factor in factors:
    assert all(not np.array_equal(factor[0], factor[i]) for i in range(1, K))
  # The K members cost one set of kernels plus K sets of factors.
  one = jax.tree.map(lambda x: x[0], state.params)
  sizes = [leaf.size for leaf in jax.tree.leaves(one)]
  assert make_member(config).method.num_params(one, K) == sum(k[0].size for k in kernels) + K * (
      sum(sizes) - sum(k[0].size for k in kernels))


@pytest.mark.parametrize('backend', ['pmap', 'jit'])
def test_batchensemble_s_fast_path_matches_its_plain_path(trained, tmp_path, backend):
  """The fast path loops over whole-device steps when members share weights: the same steps as the plain path."""
  config, _, plain, _ = trained('batchensemble')
  config = config.copy_and_resolve_references()
  config.backend, config.steps_per_dispatch = backend, 3
  fast, _ = trainer.train_and_evaluate(config, str(tmp_path / 'fast'))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5),
               jax.tree.map(np.asarray, fast.params), jax.tree.map(np.asarray, plain.params))


# independent: test_backends and test_trainer compare the backends for the plain deep ensemble.
@pytest.mark.parametrize('method', [name for name in METHODS if name != 'independent'])
def test_pmap_and_jit_train_every_method_alike(trained, method):
  """The same members, batches and steps on either backend: the same ensemble, to round-off."""
  (*_, pmap_state, pmap_summary), (*_, jit_state, jit_summary) = trained(method, 'pmap'), trained(method, 'jit')
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5),
               jax.tree.map(np.asarray, pmap_state.params), jax.tree.map(np.asarray, jit_state.params))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5),
               jax.tree.map(np.asarray, pmap_state.snapshots), jax.tree.map(np.asarray, jit_state.snapshots))
  np.testing.assert_allclose(pmap_summary['test_loss'], jit_summary['test_loss'], rtol=1e-4)


def test_evaluate_scores_a_batchensemble_workdir_like_any_ensemble(trained):
  config, workdir, _, summary = trained('batchensemble')
  run_config = evaluation.load_run_config(workdir)
  devices = devices_lib.evaluation_devices(K)
  member, state, _ = evaluation.restore(workdir, run_config, None, devices)
  log_probs = predictor.Predictor(member, state, devices, 64).log_probs(data.load(data_dir=config.data_dir).test)
  test = data.load(data_dir=config.data_dir).test
  np.testing.assert_allclose(calibration.ensemble_nll(log_probs, test['label']), summary['test_loss'], rtol=1e-4)


@pytest.mark.parametrize('override, message', [
    ({'method': 'boosting'}, "unknown method 'boosting': set --config.method to one of"),
    ({'method': 'snapshot', 'num_epochs': 3, 'snapshot_cycles': 2, 'schedule': 'cosine'},
     'snapshot_cycles=2 must be a positive divisor of num_epochs=3'),
    ({'method': 'snapshot', 'num_epochs': 2, 'snapshot_cycles': 2, 'schedule': 'constant'},
     'set --config.schedule=cosine'),
    ({'method': 'hyper', 'hyper_learning_rate': (0.2, 0.1)}, 'hyper_learning_rate=(0.2, 0.1) must be a range'),
    ({'method': 'hyper', 'hyper_weight_decay': (0.0, 0.1)}, 'hyper_weight_decay=(0.0, 0.1) must be a range'),
    ({'method': 'hyper', 'optimizer': 'adamw', 'learning_rate': 0.01},
     "hyper_learning_rate=(0.04, 0.12) in place of learning_rate=0.01, which that range leaves out: set one around "
     "it, e.g. --config.hyper_learning_rate='(0.004, 0.012)'"),
    ({'method': 'batchensemble', 'model': 'classifier'}, 'method batchensemble needs a model with rank-1 layers'),
    ({'member_data': 'bootstrap'}, 'run with --config.method=bagging'),
])
def test_bad_method_options_are_refused_in_one_line(make_config, override, message):
  with pytest.raises(UsageError, match=re.escape(message)) as raised:
    recipe_lib.resolve(make_config(**override), jax.devices())
  assert '\n' not in str(raised.value)


def test_a_bad_method_ends_the_cli_in_one_line(mnist_dir, tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'ensemble.train', f'--workdir={tmp_path / "run"}', '--config=configs/default.py',
       f'--config.data_dir={mnist_dir}', '--config.method=snapshot', '--config.num_epochs=3'],
      capture_output=True, text=True, check=False)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].startswith('error: snapshot_cycles=5 must be a positive divisor')
  assert not (tmp_path / 'run').exists()


def test_a_mesh_backend_refuses_an_ensembling_method():
  from configs import dp  # pylint: disable=g-import-not-at-top
  config = dp.get_config()
  config.method = 'bagging'
  with pytest.raises(UsageError, match="backend 'dp' trains one model, not an ensemble: leave --config.method"):
    recipe_lib.resolve(config, jax.devices())


def test_batchensemble_takes_the_plain_mlp_with_rank1_layers(make_config):
  """Feature vectors' built-in member has rank-1 layers too, so --config.model=mlp is not refused."""
  config, _ = recipe_lib.resolve(make_config(method='batchensemble', model='mlp'), jax.devices())
  model = models.create(config, 10, (4,))
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4)))['params']
  assert batchensemble.is_shared(params)['_Rank1_0']['shared']['kernel']


def test_every_method_has_a_name_and_the_default_is_independent():
  assert methods.NAMES == ('independent', 'bagging', 'hyper', 'snapshot', 'batchensemble', 'mc_dropout', 'packed',
                           'mimo', 'multiswag')
  assert isinstance(make_member().method, methods.Independent)
  assert make_member(data_info=MNIST_INFO).method.num_params({'w': np.zeros(3)}, 4) == 12


@pytest.mark.parametrize('backend', ['pmap', 'jit'])
def test_batchensemble_keeps_its_shared_weights_once_per_device_and_checkpoints_a_copy_per_member(backend):
  """K=4 on 2 devices: each device holds one copy of a shared kernel (and of its momentum), not one per member;
  the canonical (K, ...) layout repeats it for every member and converts back."""
  created = backends.create(backend, member=make_member(method='batchensemble'), devices=jax.devices()[:2],
                            ensemble_size=K, member_data='shared')
  state = created.init(0)
  layout = jax.tree_util.tree_flatten_with_path(state)[0]
  shared = [x for path, x in layout if batchensemble.is_shared_path(path)]
  assert len(shared) == 8  # 4 kernels, 4 momentum traces
  members = lambda x: x.addressable_shards[0].data.shape[:1 if backend == 'jit' else 2]  # a device's, (D, M) on pmap
  assert {members(x) for x in shared} == {(1,) if backend == 'jit' else (1, 1)}
  assert members(state.params['_Rank1_0']['fast_in']) == ((2,) if backend == 'jit' else (1, 2))
  canonical = created.to_canonical(state)
  for path, x in jax.tree_util.tree_flatten_with_path(canonical)[0]:
    assert x.shape[0] == K
    if batchensemble.is_shared_path(path):
      np.testing.assert_array_equal(np.asarray(x), np.broadcast_to(np.asarray(x)[0], x.shape))
  _tree_equal(created.to_canonical(created.from_canonical(canonical)), canonical)


@pytest.mark.parametrize('method', ['mimo', 'batchensemble', 'mc_dropout'])
def test_members_that_share_weights_predict_in_one_pass_as_each_would_alone(method):
  """Prediction leaves the shared weights unmapped (`backends.predict_members`): the members' outputs are each
  member's own forward pass, and MIMO's M heads cost one pass of its network, not M."""
  from conftest import toy_features  # pylint: disable=g-import-not-at-top
  import ensemble  # pylint: disable=g-import-not-at-top
  x, y = toy_features()
  ens = ensemble.fit('mlp', (x, y), ensemble_size=4, epochs=1, batch_size=16, method=method, progress=False)
  member, state = ens.member, ens.state
  each = lambda state, images: member.task.member_output(member.predict(state, images))
  one_by_one = np.stack([np.asarray(each(jax.tree.map(lambda leaf, i=i: leaf[i], state), x)) for i in range(4)])
  np.testing.assert_allclose(ens.member_outputs(x), one_by_one, rtol=1e-5, atol=1e-6)
  together = jax.jit(backends.predict_members(each, member, jax.devices()[:1]))
  np.testing.assert_allclose(np.asarray(together(state, x)), one_by_one, rtol=1e-5, atol=1e-6)
  if method == 'mimo':  # one pass: the matmuls of one member's, none with a member axis (XLA's cost analysis
    # counts a batched matmul once, so the shapes tell)
    matmuls = lambda fn, *args: sorted(re.findall(r':(\S+\[[\d,]*\]) = dot_general', str(jax.make_jaxpr(fn)(*args))))
    alone = matmuls(each, jax.tree.map(lambda leaf: leaf[0], state), x)
    assert alone and matmuls(backends.predict_members(each, member, jax.devices()[:1]), state, x) == alone
