"""README.md and docs/*.md against the code: a renamed flag, config field or file fails here, not a reader.

Every shell command that runs an `ensemble` module (`python -m ensemble.X`) or a script
(`python scripts/X.py`), in a fenced block or inline, is checked: each `--config.FIELD` must exist in
the config the command names (configs/default.py when it names none), each other flag must be one that
the program defines, and each repository path it names must exist. A program's flags come from the
program itself, run once with `--helpxml` (absl) or `--help` (argparse), so the check does not depend
on where or when the program defines them.
"""

import concurrent.futures
import dataclasses
import functools
import glob
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from conftest import COMPILE_FLAGS, USER_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ['README.md'] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, 'docs', '*.md')))
DEFAULT_CONFIG = 'configs/default.py'
REPO_DIRS = ('configs/', 'scripts/', 'docs/', 'ensemble/', 'tests/')
# Programs that hand every argument after a bare `--` to another program.
PASSES_ON = {'scripts/launch_local.py': 'ensemble.train'}
_PREFIXES = ('$', 'srun', 'mpirun', 'time', 'nohup')  # words that may come before `python` in a command
_FENCE = re.compile(r'^```([\w-]*)[^\n]*\n(.*?)^```', re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Command:
  where: str  # FILE:LINE
  program: str  # 'ensemble.train' or 'scripts/compare_methods.py'
  args: tuple[str, ...]


def _parse(line: str, where: str) -> Command | None:
  """The command `line` runs, if it runs an ensemble module or a script; None for any other line."""
  words = line.split()
  while words and (words[0] in _PREFIXES or re.fullmatch(r'\w+=\S*', words[0])):
    words = words[1:]  # a prompt, a launcher or an environment variable
  if len(words) < 2 or not re.fullmatch(r'python3?', words[0]):
    return None
  if not (words[1] == '-m' and words[2:3] and words[2].startswith('ensemble.')) and not words[1].startswith('scripts/'):
    return None
  try:
    tokens = shlex.split(' '.join(words), comments=True)
  except ValueError as e:
    raise AssertionError(f'{where}: cannot split {line!r} as a shell command ({e})') from None
  tokens = [token.strip('[]') for token in tokens]  # optional flags are written [--flag=VALUE]
  if tokens[1] == '-m':
    return Command(where, tokens[2], tuple(t for t in tokens[3:] if t))
  return Command(where, tokens[1], tuple(t for t in tokens[2:] if t))


def commands(text: str, name: str) -> list[Command]:
  """Every command in a Markdown text: lines of fenced blocks (not Python ones), joined at a trailing `\\`,
  and inline code spans."""
  found = []
  line_of = lambda offset: text.count('\n', 0, offset) + 1
  for block in _FENCE.finditer(text):
    if block.group(1) in ('python', 'py'):
      continue
    start = line_of(block.start(2))
    lines = block.group(2).split('\n')
    i = 0
    while i < len(lines):
      first, line = i, lines[i]
      while line.rstrip().endswith('\\') and i + 1 < len(lines):
        i += 1
        line = line.rstrip()[:-1] + ' ' + lines[i]
      command = _parse(line.strip(), f'{name}:{start + first}')
      if command:
        found.append(command)
      i += 1
  prose = _FENCE.sub(lambda block: '\n' * block.group(0).count('\n'), text)
  for span in re.finditer(r'`([^`]+)`', prose):
    command = _parse(' '.join(span.group(1).split()), f'{name}:{line_of(span.start())}')
    if command:
      found.append(command)
  return found


def documented_commands() -> list[Command]:
  return [c for name in DOCS for c in commands(open(os.path.join(REPO, name), encoding='utf-8').read(), name)]


def _program_path(program: str) -> str:
  return program if program.startswith('scripts/') else program.replace('.', '/') + '.py'


def _help_command(program: str) -> list[str]:
  """absl programs print every flag with --helpxml; argparse ones list theirs with --help."""
  path = _program_path(program)
  target = ['-m', program] if not program.startswith('scripts/') else [path]
  source = open(os.path.join(REPO, path), encoding='utf-8').read() if os.path.exists(os.path.join(REPO, path)) else ''
  # An argparse program would take --helpxml for an unknown flag (or, parse_known_args, pass it on to another).
  return [sys.executable, *target, '--help' if 'argparse' in source else '--helpxml']


def _flags_from_help(output: str) -> dict[str, str]:
  """{flag name: type} from absl's --helpxml, or {name: ''} from an argparse --help."""
  start = output.find('<?xml')
  if start >= 0:
    root = ElementTree.fromstring(output[start:output.rindex('</AllFlags>') + len('</AllFlags>')])
    flags = {}
    for flag in root.iter('flag'):
      kind = flag.findtext('type', '')
      for tag in ('name', 'short_name'):
        if flag.findtext(tag):
          flags[flag.findtext(tag)] = kind
    return flags
  # argparse lists each option at the start of a line of its options section: `  -h, --help`, `  --epochs EPOCHS`.
  return {name: '' for name in re.findall(r'^ {2}(?:-\w[^,\s]*, )?--([A-Za-z][\w-]*)', output, re.M)}


def program_flags(programs) -> dict[str, dict[str, str] | None]:
  """Runs each program's help once, all at the same time; None for a program that does not exist."""
  def run(program):
    if not os.path.exists(os.path.join(REPO, _program_path(program))):
      return program, None
    env = {**os.environ, 'XLA_FLAGS': COMPILE_FLAGS, 'JAX_PLATFORMS': 'cpu'}
    result = subprocess.run(_help_command(program), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    flags = _flags_from_help(result.stdout)
    assert flags, f'{program}: no flags in its help output (exit {result.returncode}): {result.stderr[-1000:]}'
    return program, flags
  with concurrent.futures.ThreadPoolExecutor(max_workers=len(set(programs)) or 1) as pool:
    return dict(pool.map(run, sorted(set(programs))))


@functools.cache
def _config(path: str):
  # By file, so that this repository's config is read whatever else is on sys.path.
  spec = importlib.util.spec_from_file_location(f'_docs_config_{len(path)}_{abs(hash(path))}', os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _has_field(config, field: str) -> bool:
  for part in field.split('.'):
    try:
      if part not in config:
        return False
    except TypeError:  # a leaf value, not a ConfigDict
      return False
    config = config[part]
  return True


def _segments(command: Command):
  """(program, args) pieces: one, or two where the program passes what follows `--` to another."""
  args = list(command.args)
  if command.program in PASSES_ON and '--' in args:
    cut = args.index('--')
    return [(command.program, args[:cut]), (PASSES_ON[command.program], args[cut + 1:])]
  return [(command.program, args)]


def problems(command: Command, flags_of: dict[str, dict[str, str] | None]) -> list[str]:
  """What in `command` does not exist: program, flags, config fields, repository paths. Empty when it all does."""
  found = []
  where = f'{command.where}: python {command.program}'
  for program, args in _segments(command):
    flags = flags_of.get(program)
    if flags is None:
      found.append(f'{where}: no such program {program} ({_program_path(program)} is missing)')
      continue
    named = [a.split('=', 1)[1] for a in args if a.startswith('--config=')]
    named += [args[i + 1] for i, a in enumerate(args[:-1]) if a == '--config']
    config_path = next((p.split(':')[0] for p in named if p.startswith('configs/')), DEFAULT_CONFIG)
    for arg in args:
      name, _, value = arg.partition('=')
      for text in (arg, value):
        if text.startswith(REPO_DIRS):
          path = text.split(':')[0].rstrip(').,;')
          if not os.path.exists(os.path.join(REPO, path)):
            found.append(f'{where}: {path} does not exist in the repository')
      for option in (arg, value):
        if option.startswith('--config.'):
          field = option[len('--config.'):].partition('=')[0]
          if os.path.exists(os.path.join(REPO, config_path)) and not _has_field(_config(config_path), field):
            found.append(f'{where}: --config.{field} is not a field of {config_path}')
      if not arg.startswith('--') or arg == '--' or arg.startswith('--config.'):
        continue
      flag = name[2:]
      boolean = flag.startswith('no') and flags.get(flag[2:]) == 'bool'
      if flag not in flags and not boolean:
        found.append(f'{where}: --{flag} is not a flag of {program}')
  return found


@pytest.fixture(scope='module')
def flags_of():
  programs = [program for c in documented_commands() for program, _ in _segments(c)]
  return program_flags([*programs, 'ensemble.train'])


def test_documented_commands_name_only_what_exists(flags_of):
  found = [problem for command in documented_commands() for problem in problems(command, flags_of)]
  assert not found, '\n'.join(found)


def test_the_reader_finds_the_commands():
  """The check above is only as good as the parsing: README's own commands and those of every page count."""
  found = documented_commands()
  readme = [c for c in found if c.where.startswith('README.md')]
  assert ('ensemble.train', ('--workdir=/tmp/mnist', '--config=configs/default.py', '--cpu_devices=8')) in [
      (c.program, c.args) for c in readme]
  assert {'ensemble.evaluate', 'ensemble.predict'} <= {c.program for c in readme}
  pages = {c.where.split(':')[0] for c in found}
  assert {'docs/data-and-models.md', 'docs/methods.md', 'docs/several-hosts.md', 'docs/speed.md'} <= pages
  # A command continued over three lines arrives whole.
  mesh = [c for c in found if c.program == 'ensemble.train' and '--config=configs/mlp.py' in c.args]
  assert mesh and '--config.logical=True' in mesh[0].args


MADE_UP = '''
Some prose with `python -m ensemble.evaluate --workdir=/tmp/x --angels=0,90` inline.

```bash
python -m ensemble.train --workdir=/tmp/x --config=configs/default.py \\
    --config.num_epoch=1 --cpu_devices=2   # a comment with --not_a_flag
python -m ensemble.train --workdir=/tmp/x --config=configs/mlp.py --config.mesh_shape='(4, 2)' --config.nesting.deep=1
python -m ensemble.train --workdir=/tmp/x --config=configs/nope.py --nocpu_devices --noalsologtostderr
python scripts/launch_local.py --num_processes=2 -- --workdir=/tmp/mp --config.sead=1 --num_procs=2
python scripts/compare_methods.py --epochs=1 --override=--config.ensemble_siz=8 --markdown=docs/nope.md
python scripts/no_such_script.py --x=1
python -m ensemble.train --workdir=/tmp/x --config=configs/default.py --config.num_epochs=1 --verbosity=-1
ls configs/                                  # not a command of ours
```
'''


def test_the_checker_fails_on_made_up_fields_flags_and_paths(flags_of):
  made_up = commands(MADE_UP, 'MADE_UP.md')
  programs = [program for c in made_up for program, _ in _segments(c)]
  flags_of = {**flags_of, **program_flags([p for p in programs if p not in flags_of])}
  found = {c.where: problems(c, flags_of) for c in made_up}
  assert len(made_up) == 8
  assert [p.split(': ', 2)[2] for p in found['MADE_UP.md:2']] == ['--angels is not a flag of ensemble.evaluate']
  assert [p.split(': ', 2)[2] for p in found['MADE_UP.md:5']] == [
      '--config.num_epoch is not a field of configs/default.py']  # the comment's --not_a_flag is not read
  assert [p.split(': ', 2)[2] for p in found['MADE_UP.md:7']] == [
      '--config.nesting.deep is not a field of configs/mlp.py']
  assert [p.split(': ', 2)[2] for p in found['MADE_UP.md:8']] == [
      'configs/nope.py does not exist in the repository', '--nocpu_devices is not a flag of ensemble.train']
  assert [p.split(': ', 2)[2] for p in found['MADE_UP.md:9']] == [  # what follows `--` is ensemble.train's
      '--config.sead is not a field of configs/default.py', '--num_procs is not a flag of ensemble.train']
  assert [p.split(': ', 2)[2] for p in found['MADE_UP.md:10']] == [
      '--config.ensemble_siz is not a field of configs/default.py', 'docs/nope.md does not exist in the repository']
  assert [p.split(': ', 2)[2] for p in found['MADE_UP.md:11']] == [
      'no such program scripts/no_such_script.py (scripts/no_such_script.py is missing)']
  assert found['MADE_UP.md:12'] == []


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def test_links_between_pages_resolve():
  broken = []
  for name in DOCS:
    text = open(os.path.join(REPO, name), encoding='utf-8').read()
    for target in re.findall(r'\]\(([^)\s]+)\)', _FENCE.sub('', text)):
      if re.match(r'\w+://|mailto:', target):
        continue
      path, _, anchor = target.partition('#')
      path = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
      if not os.path.exists(os.path.join(REPO, path)):
        broken.append(f'{name}: {target} (no {path})')
      elif anchor and path.endswith('.md'):
        headings = re.findall(r'^#+ (.*)$', _FENCE.sub('', open(os.path.join(REPO, path), encoding='utf-8').read()),
                              re.M)
        if anchor not in {_slug(h) for h in headings}:
          broken.append(f'{name}: {target} (no heading #{anchor} in {path})')
  assert not broken, '\n'.join(broken)


# Run as `python -c _OFFLINE MODULE ARGS...`: the module runs as `python -m MODULE ARGS...` would, on a machine
# whose network is unreachable (loopback aside): connections and name lookups fail as they do offline.
_OFFLINE = '''
import runpy, socket, sys

LOOPBACK = ('127.0.0.1', '::1', 'localhost')


def unreachable():
  raise OSError(101, 'Network is unreachable (tests/test_docs.py)')


def guard(original):
  def call(self, address, *args):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
      unreachable()
    return original(self, address, *args)
  return call


lookup = socket.getaddrinfo
socket.getaddrinfo = lambda host, *a, **k: lookup(host, *a, **k) if host in LOOPBACK else unreachable()
socket.socket.connect, socket.socket.connect_ex = guard(socket.socket.connect), guard(socket.socket.connect_ex)
for address in (('storage.googleapis.com', 443), ('8.8.8.8', 53)):
  try:
    socket.create_connection(address, timeout=5).close()
    raise SystemExit(f'{address} is reachable: the network is not cut')
  except OSError:
    pass
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name='__main__', alter_sys=True)
'''


@pytest.mark.compute_bound
def test_readme_train_command_runs_offline(tmp_path):
  """README's train command on the bundled MNIST, with no network, compiled as users compile: 2 members on 2
  devices, the first 120 steps of an epoch (15,360 of the 54,000 images, batch 128), tested on the 10,000 test
  images: 22 s on 2 cores (35 s of CPU; compiled quickly, 93 s for 250 steps), ensemble accuracy 0.976."""
  train = next(c for c in documented_commands() if c.where.startswith('README.md') and c.program == 'ensemble.train')
  workdir = tmp_path / 'mnist'
  args = [f'--workdir={workdir}' if arg.startswith('--workdir=') else arg for arg in train.args]
  args += ['--cpu_devices=2', '--config.num_train_steps=120', '--config.ensemble_size=2']
  env = {**os.environ, 'XLA_FLAGS': USER_XLA_FLAGS, 'JAX_PLATFORMS': 'cpu'}
  for proxy in ('HTTP_PROXY', 'HTTPS_PROXY', 'http_proxy', 'https_proxy', 'ALL_PROXY', 'all_proxy'):
    env.pop(proxy, None)
  result = subprocess.run([sys.executable, '-c', _OFFLINE, train.program, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'data: mnist (bundled copy' in result.stderr
  lines = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [line['epoch'] for line in lines] == [1] and len(lines[0]['member_test_accuracy']) == 2
  assert lines[0]['test_accuracy'] > 0.95  # the real digits, learnt
