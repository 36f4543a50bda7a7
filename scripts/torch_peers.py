"""What a PyTorch user would run to train the same K members: the peers of `scripts/benchmark.py --peers`.

  python scripts/torch_peers.py --model=cnn --members=8 --batch=128 [--dtypes=float32,bfloat16] [--json=peers.json]
  pip install -e ".[peers]"    # PyTorch, where it is not installed

Two peers, each in its fastest form found: channels-last memory, fused SGD
(momentum 0.9), with `--dtypes=bfloat16` autocast (parameters and optimizer state
stay float32, as in `ensemble`), and the training step eager or under
`torch.compile` as `--peer_compile` says (on a CPU here the compiled step was the
slower, 5-10x: `--peer_compile=eager` there; on a GPU it is usually the faster):

- 'torch vmap': the K members' parameters stacked with `torch.func.stack_module_state`
  and one `vmap` of `functional_call` over them (PyTorch's model-ensembling
  recipe). BatchNorm under vmap cannot update running statistics in place, so
  `torch.func.replace_all_batch_norm_modules_` turns them off: slightly less
  work than a member with running averages.
- 'torch loop': a Python loop over K separate models, one optimizer over all.

The members are `ensemble`'s: the CNN of configs/default.py (MNIST 28x28x1) and
ResNet-20 of configs/cifar10.py (32x32x3, BatchNorm, a 1x1 projection where the
shape changes). Each member gets its own random batch, already on the device, as
`ensemble`'s fast path keeps the training set there: the figure is the training
step's speed, member-images/s = K x batch x steps / seconds, median of
`--repeats` timings after a warm-up that compiles. Only torch and numpy are
imported, so this runs beside a JAX install without either seeing the other.
"""

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn


class CNN(nn.Module):
  """ensemble/models/cnn.py: conv 32, avg-pool, conv 64, avg-pool, dense 256, dense 10 ('SAME' padding)."""

  def __init__(self, channels: int = 1, size: int = 28, classes: int = 10):
    super().__init__()
    self.features = nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten())
    self.head = nn.Sequential(nn.Linear(64 * (size // 4) ** 2, 256), nn.ReLU(), nn.Linear(256, classes))

  def forward(self, x):
    return self.head(self.features(x))


class BasicBlock(nn.Module):
  """ensemble/models/resnet.py's block: two 3x3 convolutions, BatchNorm, a projection where the shape changes."""

  def __init__(self, inputs: int, filters: int, stride: int):
    super().__init__()
    self.conv1 = nn.Conv2d(inputs, filters, 3, stride, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(filters, momentum=0.1)
    self.conv2 = nn.Conv2d(filters, filters, 3, 1, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(filters, momentum=0.1)
    nn.init.zeros_(self.bn2.weight)
    self.shortcut = (nn.Sequential() if stride == 1 and inputs == filters else
                     nn.Sequential(nn.Conv2d(inputs, filters, 1, stride, bias=False), nn.BatchNorm2d(filters)))

  def forward(self, x):
    y = torch.relu(self.bn1(self.conv1(x)))
    return torch.relu(self.shortcut(x) + self.bn2(self.conv2(y)))


class ResNet20(nn.Module):

  def __init__(self, classes: int = 10):
    super().__init__()
    layers, inputs = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()], 16
    for stage, filters in enumerate((16, 32, 64)):
      for block in range(3):
        layers.append(BasicBlock(inputs, filters, 2 if stage and not block else 1))
        inputs = filters
    self.body = nn.Sequential(*layers)
    self.head = nn.Linear(64, classes)

  def forward(self, x):
    return self.head(self.body(x).mean((2, 3)))


SHAPES = {'cnn': (1, 28, 28), 'resnet': (3, 32, 32)}


def make_models(model: str, members: int, device, memory_format=torch.channels_last) -> list[nn.Module]:
  torch.manual_seed(0)
  build = CNN if model == 'cnn' else ResNet20
  return [build().to(device, memory_format=memory_format) for _ in range(members)]


def memory_format(peer: str, model: str):
  """channels-last where it runs: `torch.vmap` over a channels-last BatchNorm raises "NYI: querying is_contiguous
  inside of vmap for memory_format other than torch.contiguous_format", so the vmap peer of ResNet runs contiguous
  (what a PyTorch user would do); the loop peer, and the CNN (no BatchNorm), keep channels-last."""
  return torch.contiguous_format if peer == 'torch vmap' and model == 'resnet' else torch.channels_last


def vmap_step(models: list[nn.Module], autocast):
  """One compiled step of all members as one vmapped program over their stacked parameters."""
  for m in models:
    torch.func.replace_all_batch_norm_modules_(m)
  params, buffers = torch.func.stack_module_state(models)
  base = copy.deepcopy(models[0]).to('meta')
  optimizer = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9, fused=True)

  def member_loss(p, b, x, y):
    return nn.functional.cross_entropy(torch.func.functional_call(base, (p, b), (x,)).float(), y)

  losses = torch.vmap(member_loss)

  def step(x, y):
    with autocast():
      loss = losses(params, buffers, x, y).sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss
  return step


def loop_step(models: list[nn.Module], autocast):
  """One compiled step of a Python loop over the K models."""
  optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1, momentum=0.9, fused=True)

  def step(x, y):
    with autocast():
      loss = sum(nn.functional.cross_entropy(m(x[k]).float(), y[k]) for k, m in enumerate(models))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss
  return step


PEERS = {'torch vmap': vmap_step, 'torch loop': loop_step}


def bench(peer: str, model: str, members: int, batch: int, dtype: str, steps: int, repeats: int,
          compile_step: bool, device) -> dict:
  """Member-images/s of `peer`'s training step, eager or (`compile_step`) compiled."""
  layout = memory_format(peer, model)
  models = make_models(model, members, device, layout)
  bf16 = dtype == 'bfloat16'
  autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
  step = PEERS[peer](models, autocast)
  if compile_step:
    step = torch.compile(step)
  x = torch.randn(members, batch, *SHAPES[model], device=device)
  if peer == 'torch loop':  # a batch per model, laid out as the model
    x = [xk.contiguous(memory_format=layout) for xk in x]
  y = torch.randint(0, 10, (members, batch), device=device)
  sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
  start = time.perf_counter()
  for _ in range(3):  # compiles (and recompiles once, as torch.compile does for the optimizer's first steps)
    step(x, y)
  sync()
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(steps):
      step(x, y)
    sync()
    times.append(time.perf_counter() - start)
  return {'path': peer, 'model': model, 'K': members, 'batch': batch, 'dtype': dtype, 'compiled': compile_step,
          'memory_format': 'channels_last' if layout == torch.channels_last else 'contiguous',
          'compile_s': compile_s, 'member_images_per_s': members * batch * steps / statistics.median(times)}


# --peer_compile: which forms of each peer's step to time. 'auto' compiles the vmap peer (one graph) and leaves
# the loop peer of ResNet eager (compiling its K graphs took 115 s on an H100, and the whole table must fit one
# device call); 'both' times every peer eager and compiled and reports the faster.
COMPILE_FORMS = {'eager': lambda peer, model: (False,), 'compiled': lambda peer, model: (True,),
                 'both': lambda peer, model: (False, True),
                 'auto': lambda peer, model: (False,) if peer == 'torch loop' and model == 'resnet' else (True,)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', choices=tuple(SHAPES), default='cnn')
  parser.add_argument('--members', type=int, default=8)
  parser.add_argument('--batch', type=int, default=128, help='per member')
  parser.add_argument('--dtypes', default='float32,bfloat16')
  parser.add_argument('--peers', default=','.join(PEERS))
  parser.add_argument('--steps', type=int, default=50)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--peer_compile', choices=tuple(COMPILE_FORMS), default='auto',
                      help="which forms of the steps to time: 'auto' (the vmap peer compiled; the loop peer too, but "
                      "of ResNet eager), 'eager', 'compiled' or 'both' (the faster reported)")
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
  name = torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'
  print(f'# torch {torch.__version__} on {name}', flush=True)
  results = []
  for dtype in args.dtypes.split(','):
    for peer in args.peers.split(','):
      forms = [bench(peer, args.model, args.members, args.batch, dtype, args.steps, args.repeats, compiled, device)
               for compiled in COMPILE_FORMS[args.peer_compile](peer, args.model)]
      for form in forms:
        print(json.dumps(form), flush=True)
      results.append(max(forms, key=lambda r: r['member_images_per_s']))
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump({'torch': torch.__version__, 'device': name, 'results': results}, f, indent=2)


if __name__ == '__main__':
  main()
