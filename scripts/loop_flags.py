"""What the loop benchmarks (active_mnist.py, bo_hartmann.py) share: their flags for what runs, how often, and
where each run keeps its resumable record."""

from absl import flags


def define_flags(acquisitions: list[str], seeds: int, epochs: int, workdir: str):
  flags.DEFINE_list('acquisitions', acquisitions, 'Acquisitions, a row each (random: the baseline).')
  flags.DEFINE_list('seeds', [str(s) for s in range(seeds)], 'Seeds; each row is the mean over them.')
  flags.DEFINE_integer('ensemble_size', 4, 'Members K.')
  flags.DEFINE_integer('epochs', epochs, 'Epochs of every fit.')
  flags.DEFINE_string('workdir', workdir, 'Where each run keeps its record, ACQUISITION-SEED (and resumes from).')
