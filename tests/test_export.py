"""`python -m ensemble.export`: the forward pass as a jax.export artifact that JAX alone runs, for any batch size."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import COMPILE_FLAGS, linked_workdir, run_main, small_config, write_mnist
from ensemble import api, data, export, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
export.define_flags()  # for the command line run in this process

# What a service runs: jax and numpy only, not this package or Flax.
SERVICE = """
import sys
import jax, numpy as np
exported = jax.export.deserialize(open(sys.argv[1], 'rb').read())
images = np.load(sys.argv[2])
out = exported.call(images)
np.savez(sys.argv[3], probs=out['probs'], member_log_probs=out['member_log_probs'])
assert not any(name.split('.')[0] in ('ensemble', 'flax', 'optax') for name in sys.modules), 'more than JAX'
"""


@pytest.fixture(scope='module')
def trained(tmp_path_factory) -> dict:
  """A 2-member ensemble trained on 2 devices, and its test images as float32 in [0, 1]."""
  root = tmp_path_factory.mktemp('export')
  mnist, workdir = write_mnist(str(root / 'mnist')), str(root / 'run')
  trainer.train_and_evaluate(small_config(mnist, ensemble_size=2, num_devices=2, heldout_fraction=0.1), workdir)
  return {'workdir': workdir, 'images': data.load(data_dir=mnist).test['image'].astype(np.float32) / 255}


def test_the_artifact_round_trips_for_any_batch_size(trained):
  model = api.load(trained['workdir'], temperature=2.0)
  exported = jax.export.deserialize(export.export(model).serialize())
  assert exported.platforms == export.DEFAULT_PLATFORMS and exported.nr_devices == 1
  for n in (1, 7, 100):
    images = trained['images'][:n]
    out = exported.call(images)
    expected = model.predict(images, members=True)
    assert out['member_log_probs'].shape == (2, n, 10) and out['probs'].shape == (n, 10)
    np.testing.assert_allclose(np.exp(out['member_log_probs']), expected['member_probs'], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out['probs'], expected['probs'], rtol=1e-5, atol=1e-7)  # temperature 2 baked in


def test_the_cli_writes_what_a_service_runs_with_jax_alone(trained, tmp_path):
  env = {**os.environ, 'XLA_FLAGS': COMPILE_FLAGS}
  output = tmp_path / 'model.jax'
  result = subprocess.run([sys.executable, '-m', 'ensemble.export', '--workdir', trained['workdir'], '--output',
                           str(output), '--platforms=cpu'], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'Wrote {output}' in result.stderr and 'images float32 (batch, 28, 28, 1)' in result.stderr
  np.save(tmp_path / 'images.npy', trained['images'][:9])
  service = subprocess.run([sys.executable, '-c', SERVICE, str(output), str(tmp_path / 'images.npy'),
                            str(tmp_path / 'out.npz')], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
  assert service.returncode == 0, service.stderr[-3000:]
  out = np.load(tmp_path / 'out.npz')
  expected = api.load(trained['workdir']).predict(trained['images'][:9], members=True)
  np.testing.assert_allclose(out['probs'], expected['probs'], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.exp(out['member_log_probs']), expected['member_probs'], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('args, message', [
    (['--output', '{tmp}/model.jax', '--platforms=gpu'], 'error: --platforms=gpu: choose from cpu, cuda, rocm, tpu'),
    (['--output', '{tmp}/missing/model.jax'], 'error: --output={tmp}/missing/model.jax: no folder {tmp}/missing'),
    (['--output', '{tmp}'], 'error: --output={tmp}: a folder; name a file in it'),
    ([], 'error: --output is required'),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(trained, tmp_path, capsys, args, message):
  assert run_main(export.main, 'export', '--workdir', trained['workdir'], *(a.format(tmp=tmp_path) for a in args)) == 2
  errors = capsys.readouterr().err.strip().splitlines()
  assert len(errors) == 1 and errors[0].startswith(message.format(tmp=tmp_path)), errors
  assert os.listdir(tmp_path) == []


def test_a_workdir_of_one_model_over_a_mesh_is_refused(trained, tmp_path, capsys):
  workdir = linked_workdir(trained['workdir'], str(tmp_path / 'run'), backend='dp', model='classifier',
                           ensemble_size=1)
  assert run_main(export.main, 'export', '--workdir', workdir, '--output', str(tmp_path / 'model.jax')) == 2
  (error,) = capsys.readouterr().err.strip().splitlines()
  assert error.startswith(f"error: {workdir} holds one classifier model trained with backend 'dp', not an ensemble")
  assert not os.path.exists(tmp_path / 'model.jax')
