"""Every setting of a run, with its default and what it means: the fields of `Recipe`.

The defaults are the default deep ensemble: one CNN per device (8 on a single
device), trained with pmap on MNIST. `ensemble.fit` starts from them (but
`api.FIT_DEFAULTS`, and a task's own, `REGRESSION` for targets), and so does
`python -m ensemble.train` with configs/default.py, whose `get_config()` is
these fields as an ml_collections ConfigDict; the other configs start from
that one. The recipe (cosine schedule, 2-pixel shifts, weight decay 5e-4,
each member its own data order) was chosen by measurement on the full MNIST:
docs/data-and-models.md. configs/classic.py keeps the Flax guide's recipe for
comparison.

A `Recipe` is immutable and always complete: ensemble/recipe.py makes one from
a config, `fit`'s keywords or a run's config.json, checking every field and
every rule between fields there and nowhere else (docs/layout.md, "How a
setting travels").
"""

import dataclasses
from typing import Any


class Kwargs(tuple):
  """A model's constructor arguments as (name, value) pairs sorted by name, every value made hashable (lists as
  tuples, dicts as Kwargs): a recipe that holds them can key the programs it compiles (ensemble/loop.py).
  `to_dict()` gives them back as keyword arguments."""

  @classmethod
  def of(cls, mapping: Any) -> 'Kwargs':
    return cls(sorted((str(key), frozen(value)) for key, value in dict(mapping).items()))

  def to_dict(self) -> dict[str, Any]:
    return {key: value.to_dict() if isinstance(value, Kwargs) else value for key, value in self}


def frozen(value: Any) -> Any:
  """`value` made hashable: dicts as `Kwargs`, lists and tuples as tuples, all the way down."""
  if isinstance(value, dict) or hasattr(value, 'to_dict') and not isinstance(value, Kwargs):
    return Kwargs.of(value.to_dict() if hasattr(value, 'to_dict') else value)
  if isinstance(value, (list, tuple)) and not isinstance(value, Kwargs):
    return tuple(frozen(item) for item in value)
  return value


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The settings of a run, resolved: read by the loop, the trainer, the backends, the tasks and the methods,
  never changed (`dataclasses.replace` makes another)."""
  # 'cnn', 'resnet' (CIFAR ResNet, depth 6n+2, BatchNorm), 'mlp' (two hidden layers of 128 ReLUs; with the fields
  # of configs/mlp.py, the mesh MLP), the mesh model 'classifier', or a model of your own by import path,
  # 'package.module:Name': a flax.linen Module class, or an NNX Module class or function of nnx.Rngs, built with
  # model_kwargs (a dict; num_classes comes from the data when the model takes it and model_kwargs leaves it out),
  # e.g. --config.model=mypackage.nets:WideCNN --config.model_kwargs="{'width': 64}". On feature vectors (a .csv),
  # 'cnn' becomes 'mlp'; cnn and resnet take images only.
  model: str = 'cnn'
  model_kwargs: Kwargs = Kwargs()
  resnet_depth: int = 20
  resnet_width: int = 1
  # 'pmap' (the classic recipe) or 'jit' (NamedSharding over an 'ensemble' mesh axis).
  backend: str = 'pmap'
  # Members; 0 means one per device, or 8 on a single device (an ensemble of one would be no ensemble). K must be a
  # multiple of the device count D, or with backend jit a divisor of it: then each member trains data-parallel on
  # D/K devices of its own (docs/backends-and-devices.md).
  ensemble_size: int = 0
  # With fewer members than devices (backend jit): 'replicated', each of a member's devices holds its whole state;
  # 'fsdp', each holds 1/(D/K) of every large parameter and its optimizer state, gathered for each step; or 'model',
  # the parameters the model annotates (Flax's nn.with_logical_partitioning, nn.with_partitioning) split along the
  # member's 'model' axis of D/K devices, as the mesh MLP's are, and its computation with them.
  member_sharding: str = 'replicated'
  # Which mesh axis ('data', 'model' or None) each logical axis name of a model's annotations is split over: the
  # mesh MLP's names ('hidden', ...) or a model's own.
  logical_axis_rules: tuple[tuple[str, str | None], ...] = (('batch', 'data'), ('hidden', 'model'))
  # Devices to use; 0 means all of them.
  num_devices: int = 0
  # The ensembling method (ensemble/methods/): 'independent' (a deep ensemble), 'bagging' (each member its own
  # bootstrap resample), 'hyper' (each member its own learning rate and weight decay, drawn log-uniformly from
  # hyper_learning_rate and hyper_weight_decay), 'snapshot' (C = snapshot_cycles restarts of the schedule, every
  # member keeping its parameters at the end of each; K x C snapshots averaged), 'batchensemble' (members share
  # their weights and differ in rank-1 factors; cnn or resnet) or 'mc_dropout' (one network trained with dropout,
  # each member a pass of it with dropout on; training costs what K members cost), 'multiswag' (independent members,
  # each a SWAG Gaussian over its weights; K x swag_samples samples averaged), 'packed' (Packed-Ensembles: members
  # at packed_alpha / K of the model's width, packed_gamma groups in their inner layers), 'mimo' (one network of K
  # inputs and K heads trained on K examples at once, member i predicting with head i; batch_size a multiple of K).
  # docs/methods.md.
  method: str = 'independent'
  # Method mc_dropout's dropout rate in the built-in models (cnn, resnet, mlp; the other methods train them without
  # dropout); a model of your own keeps its own dropout layers and rates. The dp/fsdp classifier's too.
  dropout_rate: float = 0.1
  # Adversarial training with any method, > 0: each step also trains on x + eps * range * sign(grad_x loss) (FGSM),
  # eps this fraction of each input dimension's range: of the pixel range for images (0.01: 2.55 of 255), of 4
  # standard deviations for standardised features (standardize_features=True). About 2x a step's cost. The paper
  # (Lakshminarayanan et al. 2017) used 0.01.
  adversarial_epsilon: float = 0.0
  # What the members predict (ensemble/tasks/): 'classification' (logits, one per class; integer labels),
  # 'regression' (float targets (N,) or (N, D); the model's last layer gives 2 D numbers, a mean and a raw scale
  # per target, and the ensemble predicts the uniform mixture of the members' Gaussians) or 'multilabel' (labels
  # (N, L) of 0 and 1; a logit per label, a sigmoid each, the ensemble the mean of the members' probabilities) or
  # 'dense' (a class per position: labels (N, *positions), logits (N, *positions, C), e.g. a segmentation's
  # (N, H, W) labels of (N, H, W, C) images) or 'quantile' (float targets, as regression's; the model gives a
  # quantile of each target at each of `quantiles`, and the ensemble their mean). docs/python-api.md.
  task: str = 'classification'
  # Dense: the label of a position that carries none (not a class: negative, or above every class); such positions
  # are left out of the loss and of every score.
  ignore_label: int = -1
  # Multi-label: per label, the weight of its positive examples in the binary cross-entropy (a rare label's
  # positives count more, e.g. negatives / positives); () weighs every example 1.
  pos_weight: tuple[float, ...] = ()
  # Regression's loss: 'nll' (the Gaussian negative log-likelihood), 'beta_nll' (each target's NLL weighted by
  # its predicted variance to the power beta, Seitzer et al. 2022) or 'mse' (squared error of the mean only).
  loss: str = 'nll'
  beta: float = 0.5
  # Quantile regression (task='quantile'): the levels, increasing in (0, 1), whose quantiles of each target every
  # member predicts (trained by the pinball loss); the outermost pair bounds the interval predict gives.
  quantiles: tuple[float, ...] = (0.05, 0.5, 0.95)
  # A student distilled from an ensemble (ensemble.distill): the temperature T of Hinton et al.'s loss, T^2 times
  # the cross-entropy of softmax(logits / T) against the teacher's probabilities at T. Used only where the training
  # labels are a teacher's probabilities; 1: the plain cross-entropy against them.
  distill_temperature: float = 1.0
  # Regression from a .csv data_dir: the target column(s), comma-separated; every other column is a feature.
  target: str = ''
  hyper_learning_rate: tuple[float, float] = (0.04, 0.12)
  hyper_weight_decay: tuple[float, float] = (1e-4, 1e-3)
  snapshot_cycles: int = 5
  # Method packed (Packed-Ensembles, Laurent et al. 2023): the K members together are packed_alpha times as wide as
  # the model (each member alpha / K of each layer's width, rounded up to a multiple of packed_gamma), and each
  # member's inner layers are split into packed_gamma groups. The paper's alpha is 2; gamma 1 is torch-uncertainty's.
  packed_alpha: float = 2.0
  packed_gamma: int = 1
  # Method multiswag: the schedule spans the first swag_start of the run, shifted to end at swag_learning_rate, which
  # then holds while each member collects its SWAG moments swag_rank (or a few more) times at even steps; swag_rank
  # deviations make each member's low-rank covariance ((2 + swag_rank) x its parameters of extra state), and it
  # predicts with swag_samples draws from its Gaussian (K x swag_samples forward passes). swag_learning_rate 0: a
  # tenth of learning_rate (0.01 for SGD at 0.1), so that the default follows a rate of the user's.
  swag_samples: int = 10
  swag_rank: int = 10
  swag_start: float = 0.75
  swag_learning_rate: float = 0.0
  # Module paths ('backbone', 'backbone/Dense_0', a tuple of them; ensemble/sharing.py) whose parameters all
  # members share, one copy trained by them together (methods independent and bagging: K heads on one backbone), and
  # whose parameters are not trained (no optimizer state, no backward pass through them); ensemble.fit's init_params
  # starts them from a pretrained model.
  shared: tuple[str, ...] = ()
  frozen: tuple[str, ...] = ()
  # r > 0: each member a rank-r adapter (LoRA) of the shared layers' kernels, which are then frozen (frozen defaults
  # to shared): K adapters on one model.
  adapter_rank: int = 0
  # Where the shared parameters lie (backend jit): 'replicated', a copy on every device; 'fsdp', each large one and
  # its optimizer state split over all the devices (weights of fewer than min_weight_size values stay whole),
  # gathered for each step, its gradient reduce-scattered: a backbone that one device cannot hold K heads beside.
  shared_sharding: str = 'replicated'
  # A workdir (a run's, or Ensemble.save's) whose first member's parameters start every member of a fresh run: those
  # of the layers `shared` names where it names any, else all of them (ensemble.fit's init_params, from the command
  # line). '' for none.
  init_from: str = ''
  # > 0: each member's copy of what init_params (init_from) gave, but the shared parameters, plus Gaussian noise of
  # this standard deviation, each member its own draw (from the seed): members that start from one model differ.
  init_noise: float = 0.0
  # 'shared': every member sees the same batches (the classic recipe). 'shuffled': each
  # member its own order of the training set, for more diversity between members. Method bagging sets
  # 'bootstrap': each member its own resample.
  member_data: str = 'shuffled'
  # Used when data_dir is empty: 'mnist' with these splits is the copy bundled with the package (no download);
  # any other name ('fashion_mnist', 'cifar10', ...) or split is a tensorflow-datasets dataset and its splits.
  dataset: str = 'mnist'
  train_split: str = 'train'
  test_split: str = 'test'
  # A folder of IDX files (MNIST, Fashion-MNIST, KMNIST) or an .npz file with x_train, y_train, x_test, y_test.
  data_dir: str = ''
  # Read a folder of ArrayRecord files (python -m ensemble.data.convert) or a tfds dataset prepared as ArrayRecord a
  # batch at a time as training asks (grain threads, each process its own rows), never whole: 'auto' once its
  # training split would take more than a quarter of the host's memory, 'always', or 'never' (docs/data-and-models.md).
  streaming: str = 'auto'
  # What the model takes: 'images' (uint8, or float in [0, 1]; standardised per channel, augmented), 'features'
  # (float vectors or arrays, passed as they are), 'tokens' (integer ids), or 'auto': images for the data of
  # data_dir and tensorflow-datasets; for arrays given to ensemble.fit, integers are tokens, 4-D arrays and 3-D
  # uint8 arrays images, other floats features.
  inputs: str = 'auto'
  # Centre and scale float features per feature with the training split's mean and standard deviation.
  standardize_features: bool = False
  # On-device augmentation, each member with its own random views: 'none', 'shift' (up to 2 pixels, for
  # digits) or 'crop_flip' (random crop of the 4-pixel-padded image and horizontal flip, for CIFAR). Images only:
  # other inputs train (and config.json records) 'none'.
  augment: str = 'shift'
  # 0: the plain path, a host batch per step. N > 0: the fast path, the training set kept
  # on the devices and N steps run per dispatch (same results). Meant for accelerators; on CPU
  # it pays with several members per device, at N=8 (docs/benchmarks.md). -1: a whole epoch per dispatch. -2: -1
  # for a training set under ensemble/loop.py's RESIDENT_LIMIT_BYTES whose steps run as a loop, else 0
  # (ensemble.fit's default).
  steps_per_dispatch: int = 0
  # The last fraction of the training split is never trained on: `ensemble.evaluate` fits the
  # ensemble's temperature there (a temperature fitted on training data would sharpen it).
  heldout_fraction: float = 0.1
  # N > 0: early stopping. The validation NLL (on the held-out slice; ensemble.fit's validation= where given) is
  # scored after every epoch, training stops once N epochs pass without a lower one, and the best epoch's members
  # are the run's result: in a workdir, the epochs that lower it are the ones checkpointed, so its last checkpoint is
  # the best. 0: every epoch trains.
  early_stopping: int = 0
  # The test pass runs after the last epoch and every eval_every epochs (0: after the last only).
  eval_every: int = 1
  # What ensemble.fit's arrays were (shapes, dtypes, a hash of their bytes): a workdir refuses to resume on others.
  data_fingerprint: str = ''
  num_epochs: int = 10
  # Train this many steps instead (0: num_epochs epochs), for a set whose epoch is too long to wait for: the last
  # epoch is cut short, and the learning-rate schedule spans the steps.
  num_train_steps: int = 0
  # Also save a checkpoint (and write the training metrics so far) every this many steps, and resume from one at
  # the same batch of its epoch (0: at each epoch's end only). Checkpoints are then numbered by step.
  checkpoint_every_steps: int = 0
  batch_size: int = 128
  eval_batch_size: int = 1000
  # 'sgd' (with momentum) or 'adamw'; schedule 'constant', 'cosine' or 'warmup_cosine' (warmup_epochs
  # of linear warm-up); weight_decay is decoupled and applies to kernels only.
  optimizer: str = 'sgd'
  learning_rate: float = 0.1
  momentum: float = 0.9
  schedule: str = 'cosine'
  warmup_epochs: int = 0
  weight_decay: float = 5e-4
  seed: int = 0
  checkpoints_to_keep: int = 3
  # The forward pass's dtype: 'float32', or 'bfloat16' (activations and matmuls in bfloat16, for accelerators that
  # run it faster; the parameters, optimizer state and loss stay float32).
  dtype: str = 'float32'
  # JAX's persistent compilation cache, so that a second run with the same shapes skips its compiles: 'auto' (a
  # folder in the user's cache: $XDG_CACHE_HOME or ~/.cache, /ensemble/jax), a folder, or '' (off). A cache that
  # the program (or the caller of ensemble.fit) has set up already is left as it is.
  compilation_cache: str = 'auto'
  # On CPU, whether XLA may run the train steps' convolutions, dots and elementwise work with YNNPACK (JAX's default
  # since jaxlib 0.9). False: XLA's own kernels, which ran the CNN's train steps 1.04-1.06x faster; evaluation keeps the
  # default either way, as YNNPACK ran the test pass 2x faster (docs/speed.md).
  xla_cpu_ynnpack: bool = False

  # The mesh backends' fields (backend sharded, dp or fsdp; configs/mlp.py, dp.py and fsdp.py set them): the (data,
  # model) devices, whose product is the device count, one of them may be -1; the mesh MLP's or the classifier's
  # DotReluDot blocks (num_layers of depth hidden units; 0 layers: the plain MLP, what every other backend trains),
  # stacked with nn.scan (use_scan), annotated with logical axis names mapped by logical_axis_rules (logical); each
  # device's slice of a batch processed in num_minibatches chunks; fsdp (and shared_sharding=fsdp) keeps weights of
  # fewer than min_weight_size values whole.
  mesh_shape: tuple[int, ...] = ()
  num_layers: int = 0
  depth: int = 0
  use_scan: bool = False
  logical: bool = False
  num_minibatches: int = 1
  min_weight_size: int = 2**14

  def replace(self, **changes) -> 'Recipe':
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """The fields as JSON takes them (what config.json records): model_kwargs a dict, tuples as they are."""
    fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
    fields['model_kwargs'] = self.model_kwargs.to_dict()
    return fields

  @property
  def checkpoint_unit(self) -> str:
    """What the run's checkpoints are numbered by: 'step' where they are saved every checkpoint_every_steps steps,
    else 'epoch' (what a log line names a checkpoint by)."""
    return 'step' if self.checkpoint_every_steps > 0 else 'epoch'

  @property
  def own_model(self) -> bool:
    """Whether `model` is a user's, named by its import path ('package.module:Name'), not a built-in one: what the
    methods' rules ask of a model before it is built (ensemble/methods/), with nothing of the models imported."""
    return is_import_path(self.model)


def is_import_path(model: str) -> bool:
  return ':' in model


FIELDS = tuple(field.name for field in dataclasses.fields(Recipe))


def get_config():
  """These fields as an ml_collections ConfigDict: what configs/default.py returns, for config files and
  `--config.FIELD=value` overrides."""
  import ml_collections  # pylint: disable=g-import-not-at-top  # only config files need it
  return ml_collections.ConfigDict(Recipe().to_dict())


# Where regression starts instead, `ensemble.fit(task='regression')` and configs/regression.py alike: the
# deep-ensemble paper's Adam, on standardised features (method hyper's rates drawn around its rate). The image
# recipe's SGD at 0.1 sends Gaussian-NLL members astray (the cubic toy, noise 3: RMSE 194 against 3.0 with this;
# docs/python-api.md, "Regression").
# Where a dense task's `fit` departs from them: its labels are per position, and a shifted image's labels would
# need shifting too, which augmentation does not do.
DENSE = {'augment': 'none'}
REGRESSION = {'optimizer': 'adamw', 'learning_rate': 0.01, 'weight_decay': 0.0, 'standardize_features': True,
              'hyper_learning_rate': (0.004, 0.012)}
