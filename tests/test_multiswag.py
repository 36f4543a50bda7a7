"""MultiSWAG (`method='multiswag'`, methods/multiswag.py): the SWAG moments against a direct computation from the
collected parameters, the samples' mean and covariance against the Gaussian they are drawn from, the schedule, and
fits with the CNN, a user's linen and NNX models, classification and regression, on both backends; a workdir that
resumes exactly, restores, evaluates, predicts and exports; bad fields refused in one line."""

import functools
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ensemble
import user_models
from conftest import assert_same_training, fitted_once, small_config, toy_features, write_mnist
from ensemble import data, export, methods, optim, recipe as recipe_lib, steps, trainer
from ensemble.errors import UsageError
from ensemble.methods import multiswag

K, S, RANK = 2, 3, 3
# Two epochs of four steps: the rate is constant for the last four, and each of them collects (4 // RANK = 1).
SETTINGS = {'ensemble_size': K, 'epochs': 2, 'batch_size': 16, 'method': 'multiswag', 'swag_samples': S,
            'swag_rank': RANK, 'swag_start': 0.5, 'progress': False}


def _images(n: int = 64, seed: int = 0):
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 3, n).astype(np.int32)
  images = rng.integers(0, 60, (n, 8, 8, 1))
  for i, label in enumerate(labels):  # each class lights its own rows
    images[i, 2 * label:2 * label + 2] += 150
  return images.astype(np.uint8), labels


TRAIN, TEST = toy_features(), toy_features(16, 1)
MODELS = {
    'linen': user_models.TinyNet(width=16, num_classes=2),  # Dense, BatchNorm, ReLU, Dropout
    'nnx': functools.partial(user_models.NNXNet, din=5, num_classes=2, width=16),
}


@pytest.fixture(scope='module')
def fits():
  """`fits(model, backend)`: a MultiSWAG ensemble on the features, fitted once per module."""
  return fitted_once(lambda model, backend='pmap': ensemble.fit(MODELS[model], TRAIN, TEST, backend=backend,
                                                                **SETTINGS))


def _one(tree, i=0):
  return jax.tree.map(lambda leaf: leaf[i], tree)


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(tree)])


def test_the_moments_are_the_collected_parameters_mean_variance_and_last_deviations():
  """Real optimizer steps on a tiny parameter tree; the collections (every 2 steps after step 2, five of them for
  three rows, so that D wraps) against numpy on the parameters at those steps."""
  method = multiswag.MultiSWAG(rank=3, collection_start=2, collection_every=2)
  params = {'w': jnp.arange(6.0).reshape(2, 3), 'b': jnp.ones(3)}
  state = steps.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1, momentum=0.9), batch_stats={},
                                  key=jnp.zeros(2, jnp.uint32))
  state = method.init(None, state.replace(step=jnp.zeros((), jnp.int32)), None)
  step = jax.jit(lambda state, grads: method.after_update(state.apply_gradients(grads=grads)))
  rng, collected = np.random.default_rng(0), []
  for t in range(1, 13):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), state.params)
    state = step(state, grads)
    if t > 2 and (t - 2) % 2 == 0:
      collected.append(_flat(state.params))
  moments, thetas = state.snapshots, np.stack(collected).astype(np.float64)
  assert int(moments['count']) == len(thetas) == 5
  np.testing.assert_allclose(_flat(moments['mean']), thetas.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_flat(moments['variance']), thetas.var(0), rtol=1e-4, atol=1e-6)
  deviations = [thetas[i] - thetas[:i + 1].mean(0) for i in range(5)]  # from the running mean after collection i
  rows = [_flat(_one(moments['deviations'], r)) for r in range(3)]
  for i in (2, 3, 4):  # the last three, each in row i % 3
    np.testing.assert_allclose(rows[i % 3], deviations[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('count', [2, 5])
def test_samples_have_the_swag_mean_and_covariance(count):
  """20000 draws from a fixed moment set of three parameters: their mean and covariance within sampling error of
  mean and var / 2 + D^T D / (2 (R - 1)), R the filled rows (two of three after two collections)."""
  rng = np.random.default_rng(1)
  mean, var = rng.normal(size=3), rng.uniform(0.5, 1.5, size=3)
  filled = min(count, 3)
  d = np.zeros((3, 3))
  d[:filled] = rng.normal(size=(filled, 3))
  split = lambda v: {'a': jnp.asarray(v[..., :2], jnp.float32), 'b': jnp.asarray(v[..., 2:], jnp.float32)}
  moments = {'count': jnp.asarray(count, jnp.int32), 'mean': split(mean), 'variance': split(var),
             'deviations': split(d)}
  draws = jax.vmap(multiswag.sample, in_axes=(None, 0))(moments, jax.random.split(jax.random.key(0), 20000))
  draws = np.concatenate([np.asarray(draws['a']), np.asarray(draws['b'])], axis=1).astype(np.float64)
  expected = np.diag(var) / 2 + d.T @ d / (2 * (filled - 1))
  scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)))  # the standard error of a covariance scales so
  np.testing.assert_allclose(draws.mean(0), mean, atol=5 * np.sqrt(np.diag(expected).max() / 20000))
  assert np.abs(np.cov(draws.T) - expected).max() < 5 * np.sqrt(2 / 20000) * scale.max()
  assert np.abs(np.cov(draws.T) - (np.diag(var) / 2)).max() > 0.1  # the low-rank part is there


def test_the_schedule_runs_its_shape_down_to_the_swag_rate_then_holds_it(make_config):
  config = make_config(method='multiswag', schedule='cosine', num_epochs=4, learning_rate=0.1,
                       swag_learning_rate=0.01, swag_start=0.5, swag_rank=3)
  rate = lambda count, **changes: float(optim.schedule(_changed(config, changes), steps_per_epoch=5)(count))
  assert rate(0) == pytest.approx(0.1) and rate(5) == pytest.approx(0.01 + 0.09 * 0.5)  # cosine over 10 steps
  assert 0.01 < rate(9) < 0.013
  assert all(rate(c) == pytest.approx(0.01) for c in range(10, 20))
  assert rate(14, num_train_steps=30) > 0.01 and rate(15, num_train_steps=30) == pytest.approx(0.01)
  assert rate(7, schedule='constant') == pytest.approx(0.1) and rate(10, schedule='constant') == pytest.approx(0.01)
  # The method's collections: every (20 - 10) // 3 = 3 steps after step 10, three times.
  method = methods.create(config, steps_per_epoch=5)
  assert (method.collection_start, method.collection_every, method.rank) == (10, 3, 3)
  assert 'multiswag' in methods.NAMES


def _changed(config, changes):
  config = config.copy_and_resolve_references()
  config.update(changes)
  return config


@pytest.mark.parametrize('model', list(MODELS))
def test_independent_members_collect_their_moments(fits, model):
  moments = fits(model).state.snapshots
  np.testing.assert_array_equal(np.asarray(moments['count']), 4)  # steps 5..8
  assert not np.allclose(_flat(_one(moments['mean'], 0)), _flat(_one(moments['mean'], 1)))
  assert np.isfinite(fits(model).summary['test_loss'])


def test_a_member_predicts_the_mean_probability_of_its_samples(fits):
  ens = fits('linen')
  x, member = TEST[0], ens.member

  @jax.jit
  def sample_probs(one):  # member i's S samples under its own keys, each a forward pass with BatchNorm's averages
    key = jax.random.fold_in(jax.random.wrap_key_data(one.key), multiswag.SAMPLE_KEY)
    return jnp.stack([jax.nn.softmax(member.logits(one.replace(params=multiswag.sample(one.snapshots, k)), x))
                      for k in jax.random.split(key, S)])
  member_probs = ens.predict(x, members=True)['member_probs']
  for i in range(K):
    probs = np.asarray(sample_probs(_one(ens.state, i)))
    np.testing.assert_allclose(member_probs[i], probs.mean(0), rtol=1e-3, atol=1e-5)
    assert np.abs(probs[0] - probs[1]).max() > 1e-4  # the samples differ
  np.testing.assert_array_equal(ens.predict(x, members=True)['member_probs'], member_probs)  # reproducible
  # Before two collections, a member predicts with its current parameters.
  fresh = member.init(jax.random.key(0))
  predicted, current = jax.jit(lambda state: (member.predict(state, x), member.logits(state, x)))(fresh)
  np.testing.assert_allclose(predicted, current, rtol=1e-6)


def test_pmap_and_jit_train_the_same_members(fits):
  assert_same_training(fits('linen', 'pmap'), fits('linen', 'jit'), 'snapshots')


def test_the_cnn_trains_on_images_and_regression_gives_a_component_per_sample():
  images, labels = _images()
  ens = ensemble.fit('cnn', (images, labels), _images(32, 1), **SETTINGS)
  assert np.isfinite(ens.summary['test_loss']) and int(ens.state.snapshots['count'][0]) == 4
  x, _ = TRAIN
  regression = ensemble.fit('mlp', (x, (x[:, 0] - x[:, 2]).astype(np.float32)), task='regression', **SETTINGS)
  means, _ = regression.components(x[:8])
  assert means.shape == (K * S, 8, 1)  # K members x S samples, each a mixture component
  assert regression.predict(x[:8])['epistemic'].min() > 0


@pytest.fixture(scope='module')
def workdir_run(tmp_path_factory):
  """Three epochs of eight steps: the rate constant after step 12, collections at steps 15, 18, 21 and 24, so the
  checkpoint of epoch 2 (step 16) holds one."""
  root = tmp_path_factory.mktemp('multiswag')
  config = small_config(write_mnist(str(root / 'mnist')), model='mlp', method='multiswag', ensemble_size=2,
                        num_devices=2, num_epochs=3, swag_rank=4, swag_samples=2, swag_start=0.5)
  workdir = str(root / 'run')
  state, summary = trainer.train_and_evaluate(config, workdir)
  return config, workdir, state, summary


def test_a_run_resumes_exactly_with_its_moments(workdir_run, tmp_path):
  config, workdir, straight, _ = workdir_run
  np.testing.assert_array_equal(np.asarray(straight.snapshots['count']), 4)
  shutil.copytree(workdir, tmp_path / 'b')
  shutil.rmtree(os.path.join(tmp_path, 'b', 'checkpoints', '3'))  # as if interrupted in the collection phase
  resumed, _ = trainer.train_and_evaluate(config, str(tmp_path / 'b'))
  same = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  jax.tree.map(same, resumed.snapshots, straight.snapshots)
  jax.tree.map(same, resumed.params, straight.params)


def test_a_workdir_restores_evaluates_predicts_and_exports(workdir_run):
  config, workdir, _, summary = workdir_run
  loaded = ensemble.load(workdir)
  assert loaded.member.method.samples == 2
  test = data.load(data_dir=config.data_dir).test
  np.testing.assert_allclose(loaded.evaluate(test['image'], test['label'])['ensemble']['nll'], summary['test_loss'],
                             rtol=1e-4)
  images = test['image'][:8].astype(np.float32) / 255  # the artifact takes pixels in [0, 1]
  exported = jax.export.deserialize(export.export(loaded).serialize())
  np.testing.assert_allclose(exported.call(images)['probs'], loaded.predict(images)['probs'], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('changes, message', [
    ({'swag_samples': 0}, 'swag_samples=0 must be a whole number >= 1'),
    ({'swag_rank': 1}, 'swag_rank=1 must be a whole number >= 2'),
    ({'swag_start': 1.0}, 'swag_start=1.0 must be in (0, 1)'),
    ({'swag_start': 0.0}, 'swag_start=0.0 must be in (0, 1)'),
    ({'swag_learning_rate': 0.5}, 'swag_learning_rate=0.5 must be in (0, learning_rate=0.05]'),
    ({'swag_learning_rate': float('nan')}, 'swag_learning_rate=nan must be 0 (a tenth of learning_rate) or positive'),
    ({'schedule': 'warmup_cosine', 'warmup_epochs': 3, 'num_epochs': 4},
     'warmup_epochs=3 must end before the collection phase starts (epoch 3 of 4)'),
])
def test_bad_fields_are_refused_in_one_line(make_config, changes, message):
  with pytest.raises(UsageError, match=re.escape(message)) as raised:
    recipe_lib.resolve(make_config(method='multiswag', **changes), jax.devices())
  assert '\n' not in str(raised.value)
