"""Distillation (`ensemble.distill`, ensemble/distillation.py): the student's loss against the teacher's averaged
probabilities (at T = 1 and 2) and the regression loss against its closed form, computed here; a student of a tiny
ensemble that predicts closer to the ensemble than its members do; a quantile student that learns each level's own
quantile at uneven levels; the report against direct computations; a user's linen student in a workdir that loads,
predicts, evaluates and exports, an NNX student saved and loaded; refusals in one line."""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ensemble
import user_models
from ensemble import defaults, distillation, export, tasks
from ensemble.errors import UsageError
from ensemble.tasks import mixture, regression

K = 4
TEACHER = {'ensemble_size': K, 'epochs': 2, 'batch_size': 32, 'progress': False}
# The student trains longer than a member: it fits the teacher's outputs, which a member of 2 epochs never sees.
STUDENT = {'epochs': 8, 'batch_size': 32, 'progress': False}


def _classes(n: int, seed: int):
  """4 features, 2 noisy classes: a problem where 4 members of 2 epochs disagree, and their average gains."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 4)).astype(np.float32)
  logits = 2 * x[:, 0] + np.sin(3 * x[:, 1]) + x[:, 2] * x[:, 3]
  return x, (logits + rng.logistic(size=n) > 0).astype(np.int32)


def _targets(n: int, seed: int):
  """4 features, 1 target with a noise that grows with |x_2|."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 4)).astype(np.float32)
  return x, (np.sin(2 * x[:, 0]) + x[:, 1] + 0.3 * rng.normal(size=n) * (1 + np.abs(x[:, 2]))).astype(np.float32)


TRAIN, TEST = _classes(256, 0), _classes(512, 1)
REGRESSION_TRAIN, REGRESSION_TEST = _targets(256, 0), _targets(512, 1)


@pytest.fixture(scope='module')
def teachers():
  """Two tiny ensembles, trained once: a classifier and a regressor of 4 MLP members."""
  return {'classification': ensemble.fit('mlp', TRAIN, **TEACHER),
          'regression': ensemble.fit('mlp', REGRESSION_TRAIN, task='regression', **TEACHER)}


@pytest.fixture(scope='module')
def students(teachers):
  """The built-in MLP distilled from each teacher, with the report on the held-out sets."""
  return {'classification': ensemble.distill(teachers['classification'], 'mlp', TRAIN, test=TEST, **STUDENT),
          'regression': ensemble.distill(teachers['regression'], 'mlp', REGRESSION_TRAIN, test=REGRESSION_TEST,
                                         **STUDENT)}


@pytest.mark.parametrize('temperature', [1.0, 2.0])
def test_student_loss_is_hintons_against_the_members_mean_probabilities(teachers, temperature):
  teacher = teachers['classification']
  x = TRAIN[0][:32]
  # The teacher's averaged probabilities, from its members' log-probabilities through the pure-JAX `apply`.
  mean_probs = np.exp(np.asarray(teacher.apply(teacher.params, x), np.float64)).mean(0)
  _, targets = teacher.task.student_labels(teacher, x)
  np.testing.assert_allclose(targets, mean_probs, rtol=1e-5, atol=1e-7)
  logits = jax.random.normal(jax.random.key(1), (32, targets.shape[1])) * 3
  tempered = mean_probs ** (1 / temperature)
  tempered /= tempered.sum(-1, keepdims=True)
  student_log_probs = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64) / temperature))
  direct = temperature ** 2 * -(tempered * student_log_probs).sum(-1).mean()
  task = tasks.create(_config(distill_temperature=temperature))
  assert task.temperature == temperature
  loss, metrics = task.loss(logits, jnp.asarray(targets))
  np.testing.assert_allclose(loss, direct, rtol=1e-5)
  np.testing.assert_allclose(metrics['accuracy'], np.mean(np.argmax(logits, -1) == np.argmax(mean_probs, -1)))
  # A student with more outputs than the teacher's classes (as fit allows) learns probability 0 for the others.
  wider = jnp.concatenate([logits, jnp.full((32, 1), 0.5)], -1)
  wider_log_probs = np.asarray(jax.nn.log_softmax(np.asarray(wider, np.float64) / temperature))[:, :-1]
  np.testing.assert_allclose(task.loss(wider, jnp.asarray(targets))[0],
                             temperature ** 2 * -(tempered * wider_log_probs).sum(-1).mean(), rtol=1e-5)
  # Integer labels keep the plain cross-entropy, whatever the temperature.
  labels = jnp.asarray(TRAIN[1][:32])
  np.testing.assert_allclose(task.loss(logits, labels)[0],
                             optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), rtol=1e-6)


def _config(**fields):
  config = defaults.get_config()
  config.update(fields)
  return config


def test_regression_student_trains_on_the_expected_nll_under_the_mixtures_gaussian(teachers):
  teacher = teachers['regression']
  x = REGRESSION_TRAIN[0][:32]
  inputs, targets = teacher.task.student_labels(teacher, x)
  np.testing.assert_array_equal(inputs, np.concatenate([x, x]))
  means, variances = (np.asarray(part, np.float64) for part in teacher.apply(teacher.params, x))  # (K, N, 1)
  mixture_mean = means.mean(0)
  mixture_variance = variances.mean(0) + ((means - mixture_mean) ** 2).mean(0)
  upper, lower = targets[:32], targets[32:]
  np.testing.assert_allclose((upper + lower) / 2, mixture_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(((upper - lower) / 2) ** 2, mixture_variance, rtol=1e-4)
  # The task's own NLL, averaged over the two targets, is the closed form of the expected NLL (two targets here).
  m = np.random.default_rng(2).normal(size=(32, 2))
  v = np.random.default_rng(3).uniform(0.1, 2.0, size=(32, 2))
  outputs = jax.random.normal(jax.random.key(4), (32, 4))
  task = regression.Regression(target_mean=(0.0, 0.0), target_std=(1.0, 1.0))
  pair = [jnp.asarray(m + sign * np.sqrt(v), jnp.float32) for sign in (1, -1)]
  average = (task.loss(outputs, pair[0])[0] + task.loss(outputs, pair[1])[0]) / 2
  mu, s2 = (np.asarray(part[0], np.float64) for part in regression.split_outputs(outputs, 2))
  closed_form = (0.5 * np.log(2 * np.pi * s2) + ((mu - m) ** 2 + v) / (2 * s2)).sum(-1).mean()
  np.testing.assert_allclose(average, closed_form, rtol=1e-5)


UNEVEN_LEVELS = (0.025, 0.05, 0.5, 0.95, 0.975)


def _line(n: int, seed: int):
  """1 feature, 1 target whose noise grows with |x|."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(-2, 2, size=(n, 1)).astype(np.float32)
  return x, (np.sin(x[:, 0]) + 0.3 * (1 + np.abs(x[:, 0])) * rng.normal(size=n)).astype(np.float32)


def test_a_quantile_student_learns_each_level_s_own_quantile_at_uneven_levels():
  """Issue 98: each head fitted by its level's pinball loss to all the teacher's quantiles learned their quantile
  at its level, the teacher's 0.025 at 0.05 and its 0.975 at 0.95."""
  x, y = _line(256, 0)
  teacher = ensemble.fit('mlp', (x, y), task='quantile', quantiles=UNEVEN_LEVELS, **{**TEACHER, 'ensemble_size': 2})
  # Each input once an epoch, its Q targets in one row: more epochs than STUDENT's.
  student = ensemble.distill(teacher, 'mlp', x, **{**STUDENT, 'epochs': 40})
  assert student.task.levels == UNEVEN_LEVELS
  grid = np.linspace(-2, 2, 64, dtype=np.float32)[:, None]
  want, got = teacher.predict(grid)['quantiles'], student.predict(grid)['quantiles']  # (64, Q)
  error = np.abs(got - want).mean(0)
  gap = np.abs(want[:, 1] - want[:, 0]).mean()  # what the 0.05 head was off by: the teacher's 0.025 to its 0.05
  assert error[1] < gap / 4, (error, gap)
  assert (error < 0.02 * (want[:, -1] - want[:, 0]).mean()).all(), error  # within 2% of the teacher's 95% interval


def _kl(p, q):
  return (p * (np.log(p) - np.log(q))).sum(-1).mean()


def test_student_predicts_closer_to_the_ensemble_than_its_members(teachers, students):
  teacher, student = teachers['classification'], students['classification']
  assert student.size == 1 and student.task.name == 'classification' and student.config.method == 'independent'
  members = teacher.member_probs(TEST[0])
  ensemble_probs = members.mean(0)
  student_probs = student.predict(TEST[0])['probs']
  assert _kl(ensemble_probs, student_probs) < min(_kl(ensemble_probs, member) for member in members)
  # Regression: the KL divergence from the mixture's moment-matched Gaussian.
  teacher, student = teachers['regression'], students['regression']
  means, variances = teacher.components(REGRESSION_TEST[0])
  moments = mixture.mixture_moments(means, variances)
  gaussian_kl = lambda mean, variance: (0.5 * (np.log(variance / moments['variance']) - 1 + (
      moments['variance'] + (moments['mean'] - mean) ** 2) / variance)).mean()
  predicted = student.predict(REGRESSION_TEST[0], levels=())
  assert gaussian_kl(predicted['mean'][:, None], predicted['variance'][:, None]) < min(
      gaussian_kl(means[k], variances[k]) for k in range(K))


def test_report_is_the_direct_nll_of_ensemble_members_and_student(teachers, students):
  x, y = TEST
  members = teachers['classification'].member_outputs(x)[:, np.arange(len(y)), y]  # (K, N) log-probabilities
  student = students['classification'].member_outputs(x)[0, np.arange(len(y)), y]
  member_nll = -members.mean(1)
  report = students['classification'].distillation
  np.testing.assert_allclose(report.ensemble_nll, -np.log(np.exp(members).mean(0)).mean(), rtol=1e-6)
  np.testing.assert_allclose(report.mean_member_nll, member_nll.mean(), rtol=1e-6)
  np.testing.assert_allclose(report.best_member_nll, member_nll.min(), rtol=1e-6)
  np.testing.assert_allclose(report.student_nll, -student.mean(), rtol=1e-6)
  np.testing.assert_allclose(report.retained, (member_nll.mean() + student.mean()) /
                             (member_nll.mean() + np.log(np.exp(members).mean(0)).mean()), rtol=1e-6)
  assert report.student_nll < report.mean_member_nll and report.retained > 0
  assert report.examples == len(y) and set(report.as_dict()) >= {'retained', 'retained_over_best'}
  # Regression: the mixture's exact density.
  x, y = REGRESSION_TEST
  means, variances = teachers['regression'].components(x)
  report = students['regression'].distillation
  np.testing.assert_allclose(report.ensemble_nll, -mixture.mixture_log_density(means, variances, y[:, None]).mean(),
                             rtol=1e-6)
  member_nll = [-mixture.mixture_log_density(means[k:k + 1], variances[k:k + 1], y[:, None]).mean()
                for k in range(K)]
  np.testing.assert_allclose([report.mean_member_nll, report.best_member_nll], [np.mean(member_nll),
                                                                                 np.min(member_nll)], rtol=1e-6)
  student_means, student_variances = students['regression'].components(x)
  np.testing.assert_allclose(report.student_nll, -mixture.mixture_log_density(
      student_means, student_variances, y[:, None]).mean(), rtol=1e-6)


def test_report_shares():
  report = distillation.DistillationReport(ensemble_nll=0.4, mean_member_nll=0.6, best_member_nll=0.5,
                                           student_nll=0.45, examples=10)
  assert report.retained == pytest.approx(0.75) and report.retained_over_best == pytest.approx(0.5)
  no_gain = distillation.DistillationReport(0.6, 0.6, 0.5, 0.45, 10)
  assert np.isnan(no_gain.retained) and np.isnan(no_gain.retained_over_best)


def test_user_students_in_a_workdir_and_saved_load_predict_evaluate_and_export(teachers, tmp_path):
  teacher = teachers['classification']
  workdir = str(tmp_path / 'linen')
  linen = ensemble.distill(teacher, user_models.TinyNet(width=16, num_classes=2), TRAIN, temperature=2.0,
                           workdir=workdir, epochs=1, batch_size=32, progress=False)
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  assert config['distill_temperature'] == 2.0 and config['ensemble_size'] == 1 and config['task'] == 'classification'
  loaded = ensemble.load(workdir, model=user_models.TinyNet(width=16, num_classes=2))
  np.testing.assert_allclose(loaded.predict(TEST[0])['probs'], linen.predict(TEST[0])['probs'], rtol=1e-5)
  assert set(loaded.evaluate(*TEST)['ensemble']) >= {'accuracy', 'nll', 'brier', 'ece'}
  exported = jax.export.deserialize(export.export(loaded).serialize())
  np.testing.assert_allclose(exported.call(TEST[0])['probs'], loaded.predict(TEST[0])['probs'], rtol=1e-5, atol=1e-6)
  nnx = ensemble.distill(teacher, functools.partial(user_models.NNXNet, din=4, num_classes=2, width=16), TRAIN,
                         epochs=1, batch_size=32, progress=False)
  assert nnx.distillation is None  # no test=
  probs = nnx.predict(TEST[0])['probs']
  nnx.save(str(tmp_path / 'nnx'))
  restored = ensemble.load(str(tmp_path / 'nnx'))
  np.testing.assert_allclose(restored.predict(TEST[0])['probs'], probs, rtol=1e-5)
  np.testing.assert_allclose(restored.evaluate(*TEST)['ensemble']['nll'], nnx.evaluate(*TEST)['ensemble']['nll'],
                             rtol=1e-6)


@pytest.mark.parametrize('call, message', [
    (lambda t: ensemble.distill('ens', 'mlp', TRAIN), 'teacher of type str'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN, temperature=0), 'temperature=0 must be a positive'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN, temperature=True), 'must be a positive number'),
    (lambda t: ensemble.distill(t['regression'], 'mlp', REGRESSION_TRAIN, temperature=2.0), 'regression ensemble'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN, ensemble_size=2), 'leave ensemble_size= out'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN, task='regression'), 'leave task= out'),
    (lambda t: ensemble.distill(t['regression'], 'mlp', REGRESSION_TRAIN, loss='mse'), 'leave loss= out'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN[0][:, :3]), 'trained on 4 features'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN[0][:0]), 'distill got 0 inputs'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN, test=TEST[0]), 'give a pair (inputs, labels)'),
    (lambda t: ensemble.distill(t['classification'], 'mlp', TRAIN, learning_rat=0.1), "unknown field 'learning_rat'"),
])
def test_refusals_are_one_line(teachers, call, message):
  with pytest.raises(UsageError, match=re.escape(message)) as raised:
    call(teachers)
  assert '\n' not in str(raised.value)
