"""The trainer's train step under several configs, in alternating rounds in one process: which change is faster.

  python scripts/compare_steps.py --cpu_devices=8 --variants '' 'augment=none' 'model=mypackage.nets:CNN'

Each variant is the default config (configs/default.py: K = one member per device, batch 128, each member its
own batches; no held-out slice) with `key=value` overrides separated by '|', e.g. 'batch_size=64|augment=none';
'' is the default itself. Every variant's backend is built and compiled first, as `ensemble.train` builds it
(its train steps compiled as `backends.train_program` compiles them, freed host memory kept as the trainer keeps
it). Then rounds of --steps steps alternate over the variants, each step fetching its metrics as the trainer
does, and the table gives each variant's median milliseconds a step and the median of its per-round ratios to
the first variant. Alternating in one process is what makes a few percent visible here: the speed of these
machines drifts between processes by more than that.

Reads the bundled MNIST (`--data_dir=` a folder of IDX files instead).
"""

import argparse
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from ensemble import backends, data, defaults, host_memory, members, recipe as recipe_lib, standardise
from ensemble.data import bundled, idx
from ensemble.errors import exit_with_error


def parse_variant(text: str) -> dict[str, str]:
  """'a=1|b=x' -> {'a': '1', 'b': 'x'}; '' -> {}."""
  overrides = {}
  for item in filter(None, text.split('|')):
    key, sep, value = item.partition('=')
    if not sep:
      exit_with_error(f"{item!r} in --variants is not key=value: write it as, e.g., 'batch_size=64'")
    overrides[key.strip()] = value.strip()
  return overrides


def build(overrides: dict[str, str], dataset: data.Dataset):
  """(backend, fresh state, the epoch's batch indices) for the default config with `overrides`."""
  config = defaults.get_config()
  config.heldout_fraction = 0.0
  for key, value in overrides.items():
    if key not in config:
      exit_with_error(f'{key!r} in --variants is not a config field: use one of those ensemble/defaults.py lists')
    current = config[key]
    try:
      config[key] = value.lower() in ('1', 'true') if isinstance(current, bool) else type(current)(value)
    except (TypeError, ValueError):
      exit_with_error(f'{key}={value!r} in --variants: {key} takes {type(current).__name__} values, e.g. {current!r}')
  config, devices = recipe_lib.resolve(config, jax.devices())
  num_train = len(dataset.train['label'])
  info = members.data_info(dataset.image_shape, dataset.num_classes,
                           *standardise.input_stats(dataset.train['image'], dataset.inputs), inputs=dataset.inputs)
  member = members.member(config, info, data.steps_per_epoch(num_train, config.batch_size), None)
  backend = backends.create(config.backend, member=member, devices=devices, ensemble_size=config.ensemble_size,
                            member_data=config.member_data, config=config)
  indices = data.train_batch_indices(num_train, config.batch_size, config.seed, 1, config.ensemble_size,
                                     config.member_data)
  return backend, backend.init(config.seed), indices


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--variants', nargs='+', default=[''], help="'key=value|key=value' each; '' the default")
  parser.add_argument('--cpu_devices', type=int, default=None, help='simulate N CPU devices')
  parser.add_argument('--data_dir', default=None, help='a folder of IDX files (default: the bundled MNIST)')
  parser.add_argument('--steps', type=int, default=10, help='training steps per round')
  parser.add_argument('--rounds', type=int, default=6)
  args = parser.parse_args()

  if args.cpu_devices:  # before JAX picks its devices
    jax.config.update('jax_num_cpu_devices', args.cpu_devices)
  host_memory.keep_freed_memory_on_cpu()
  dataset = idx.load(args.data_dir) if args.data_dir else bundled.load('mnist')
  runs = []
  for text in args.variants:
    backend, state, indices = build(parse_variant(text), dataset)
    runs.append({'name': text or '(default)', 'backend': backend, 'state': state, 'indices': indices, 'ms': []})
  needed = 2 + args.rounds * args.steps
  for run in runs:  # after every variant is known to be valid: a mistake in the last is reported first
    if len(run['indices']) < needed:
      exit_with_error(f'{run["name"]} has {len(run["indices"])} steps an epoch, fewer than the {needed} that '
                      '--rounds and --steps ask for: lower them, or give more data')

  def train(run, first: int, steps: int) -> float:
    started = time.perf_counter()
    for step in range(first, first + steps):
      run['state'], metrics = backends.train_chunk(run['backend'], run['state'], dataset.train, None,
                                                   run['indices'][step:step + 1])
      run['backend'].to_host(metrics)  # waits for the step, as the trainer does
    return (time.perf_counter() - started) / steps * 1000

  for run in runs:
    train(run, 0, 2)  # compiles
  for round_ in range(args.rounds):
    for run in runs:
      run['ms'].append(train(run, 2 + round_ * args.steps, args.steps))
  print(f'{len(jax.devices())} {jax.devices()[0].platform} devices, {args.rounds} rounds of {args.steps} steps')
  print(f'{"variant":40s} {"ms a step":>10s} {"ratio":>7s}  rounds')
  for run in runs:
    ratio = statistics.median(a / b for a, b in zip(run['ms'], runs[0]['ms']))
    print(f'{run["name"]:40s} {statistics.median(run["ms"]):10.1f} {ratio:7.3f}  '
          + ' '.join(f'{ms:.0f}' for ms in run['ms']))


if __name__ == '__main__':
  main()
