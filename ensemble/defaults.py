"""The default deep ensemble: one CNN per device (8 on a single device), trained with pmap on MNIST.

Every field the trainer reads is here, with what it means. `ensemble.fit`
starts from these values, and so does `python -m ensemble.train` with
configs/default.py, which returns them; the other configs start from that one.
The recipe (cosine schedule, 2-pixel shifts, weight decay 5e-4, each member its
own data order) was chosen by measurement on the full MNIST: docs/data-and-models.md.
configs/classic.py keeps the Flax guide's recipe for comparison.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # 'cnn', 'resnet' (CIFAR ResNet, depth 6n+2, BatchNorm), 'mlp' (two hidden layers of 128 ReLUs; with the fields
  # of configs/mlp.py, the mesh MLP), the mesh model 'classifier', or a model of your own by import path,
  # 'package.module:Name': a flax.linen Module class, or an NNX Module class or function of nnx.Rngs, built with
  # model_kwargs (a dict; num_classes comes from the data when the model takes it and model_kwargs leaves it out),
  # e.g. --config.model=mypackage.nets:WideCNN --config.model_kwargs="{'width': 64}". On feature vectors (a .csv),
  # 'cnn' becomes 'mlp'; cnn and resnet take images only.
  config.model = 'cnn'
  config.model_kwargs = ml_collections.ConfigDict()
  config.resnet_depth = 20
  config.resnet_width = 1
  # 'pmap' (the classic recipe) or 'jit' (NamedSharding over an 'ensemble' mesh axis).
  config.backend = 'pmap'
  # Members; 0 means one per device, or 8 on a single device (an ensemble of one would be no ensemble). K must be a
  # multiple of the device count D, or with backend jit a divisor of it: then each member trains data-parallel on
  # D/K devices of its own (docs/backends-and-devices.md).
  config.ensemble_size = 0
  # With fewer members than devices (backend jit): 'replicated', each of a member's devices holds its whole state;
  # 'fsdp', each holds 1/(D/K) of every large parameter and its optimizer state, gathered for each step; or 'model',
  # the parameters the model annotates (Flax's nn.with_logical_partitioning, nn.with_partitioning) split along the
  # member's 'model' axis of D/K devices, as the mesh MLP's are, and its computation with them.
  config.member_sharding = 'replicated'
  # Which mesh axis ('data', 'model' or None) each logical axis name of a model's annotations is split over: the
  # mesh MLP's names ('hidden', ...) or a model's own.
  config.logical_axis_rules = (('batch', 'data'), ('hidden', 'model'))
  # Devices to use; 0 means all of them.
  config.num_devices = 0
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
  config.method = 'independent'
  # Method mc_dropout's dropout rate in the built-in models (cnn, resnet, mlp; the other methods train them without
  # dropout); a model of your own keeps its own dropout layers and rates. The dp/fsdp classifier's too.
  config.dropout_rate = 0.1
  # Adversarial training with any method, > 0: each step also trains on x + eps * range * sign(grad_x loss) (FGSM),
  # eps this fraction of each input dimension's range: of the pixel range for images (0.01: 2.55 of 255), of 4
  # standard deviations for standardised features (standardize_features=True). About 2x a step's cost. The paper
  # (Lakshminarayanan et al. 2017) used 0.01.
  config.adversarial_epsilon = 0.0
  # What the members predict (ensemble/tasks/): 'classification' (logits, one per class; integer labels) or
  # 'regression' (float targets (N,) or (N, D); the model's last layer gives 2 D numbers, a mean and a raw scale
  # per target, and the ensemble predicts the uniform mixture of the members' Gaussians). docs/python-api.md.
  config.task = 'classification'
  # Regression's loss: 'nll' (the Gaussian negative log-likelihood), 'beta_nll' (each target's NLL weighted by
  # its predicted variance to the power beta, Seitzer et al. 2022) or 'mse' (squared error of the mean only).
  config.loss = 'nll'
  config.beta = 0.5
  # A student distilled from an ensemble (ensemble.distill): the temperature T of Hinton et al.'s loss, T^2 times
  # the cross-entropy of softmax(logits / T) against the teacher's probabilities at T. Used only where the training
  # labels are a teacher's probabilities; 1: the plain cross-entropy against them.
  config.distill_temperature = 1.0
  # Regression from a .csv data_dir: the target column(s), comma-separated; every other column is a feature.
  config.target = ''
  config.hyper_learning_rate = (0.04, 0.12)
  config.hyper_weight_decay = (1e-4, 1e-3)
  config.snapshot_cycles = 5
  # Method packed (Packed-Ensembles, Laurent et al. 2023): the K members together are packed_alpha times as wide as
  # the model (each member alpha / K of each layer's width, rounded up to a multiple of packed_gamma), and each
  # member's inner layers are split into packed_gamma groups. The paper's alpha is 2; gamma 1 is torch-uncertainty's.
  config.packed_alpha = 2.0
  config.packed_gamma = 1
  # Method multiswag: the schedule spans the first swag_start of the run, shifted to end at swag_learning_rate, which
  # then holds while each member collects its SWAG moments swag_rank (or a few more) times at even steps; swag_rank
  # deviations make each member's low-rank covariance ((2 + swag_rank) x its parameters of extra state), and it
  # predicts with swag_samples draws from its Gaussian (K x swag_samples forward passes).
  config.swag_samples = 10
  config.swag_rank = 10
  config.swag_start = 0.75
  config.swag_learning_rate = 0.01
  # 'shared': every member sees the same batches (the classic recipe). 'shuffled': each
  # member its own order of the training set, for more diversity between members. Method bagging sets
  # 'bootstrap': each member its own resample.
  config.member_data = 'shuffled'
  # Used when data_dir is empty: 'mnist' with these splits is the copy bundled with the package (no download);
  # any other name ('fashion_mnist', 'cifar10', ...) or split is a tensorflow-datasets dataset and its splits.
  config.dataset = 'mnist'
  config.train_split = 'train'
  config.test_split = 'test'
  # A folder of IDX files (MNIST, Fashion-MNIST, KMNIST) or an .npz file with x_train, y_train, x_test, y_test.
  config.data_dir = ''
  # Read a folder of ArrayRecord files (python -m ensemble.data.convert) or a tfds dataset prepared as ArrayRecord a
  # batch at a time as training asks (grain threads, each process its own rows), never whole: 'auto' once its
  # training split would take more than a quarter of the host's memory, 'always', or 'never' (docs/data-and-models.md).
  config.streaming = 'auto'
  # What the model takes: 'images' (uint8, or float in [0, 1]; standardised per channel, augmented), 'features'
  # (float vectors or arrays, passed as they are), 'tokens' (integer ids), or 'auto': images for the data of
  # data_dir and tensorflow-datasets; for arrays given to ensemble.fit, integers are tokens, 4-D arrays and 3-D
  # uint8 arrays images, other floats features.
  config.inputs = 'auto'
  # Centre and scale float features per feature with the training split's mean and standard deviation.
  config.standardize_features = False
  # On-device augmentation, each member with its own random views: 'none', 'shift' (up to 2 pixels, for
  # digits) or 'crop_flip' (random crop of the 4-pixel-padded image and horizontal flip, for CIFAR). Images only:
  # other inputs train (and config.json records) 'none'.
  config.augment = 'shift'
  # 0: the plain path, a host batch per step. N > 0: the fast path, the training set kept
  # on the devices and N steps run per dispatch (same results). Meant for accelerators; on CPU
  # it pays with several members per device, at N=8 (docs/benchmarks.md). -1: a whole epoch per dispatch. -2: -1
  # for a training set under ensemble/loop.py's RESIDENT_LIMIT_BYTES whose steps run as a loop, else 0
  # (ensemble.fit's default).
  config.steps_per_dispatch = 0
  # The last fraction of the training split is never trained on: `ensemble.evaluate` fits the
  # ensemble's temperature there (a temperature fitted on training data would sharpen it).
  config.heldout_fraction = 0.1
  # The test pass runs after the last epoch and every eval_every epochs (0: after the last only).
  config.eval_every = 1
  # What ensemble.fit's arrays were (shapes, dtypes, a hash of their bytes): a workdir refuses to resume on others.
  config.data_fingerprint = ''
  config.num_epochs = 10
  # Train this many steps instead (0: num_epochs epochs), for a set whose epoch is too long to wait for: the last
  # epoch is cut short, and the learning-rate schedule spans the steps.
  config.num_train_steps = 0
  # Also save a checkpoint (and write the training metrics so far) every this many steps, and resume from one at
  # the same batch of its epoch (0: at each epoch's end only). Checkpoints are then numbered by step.
  config.checkpoint_every_steps = 0
  config.batch_size = 128
  config.eval_batch_size = 1000
  # 'sgd' (with momentum) or 'adamw'; schedule 'constant', 'cosine' or 'warmup_cosine' (warmup_epochs
  # of linear warm-up); weight_decay is decoupled and applies to kernels only.
  config.optimizer = 'sgd'
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.schedule = 'cosine'
  config.warmup_epochs = 0
  config.weight_decay = 5e-4
  config.seed = 0
  config.checkpoints_to_keep = 3
  # The forward pass's dtype: 'float32', or 'bfloat16' (activations and matmuls in bfloat16, for accelerators that
  # run it faster; the parameters, optimizer state and loss stay float32).
  config.dtype = 'float32'
  # JAX's persistent compilation cache, so that a second run with the same shapes skips its compiles: 'auto' (a
  # folder in the user's cache: $XDG_CACHE_HOME or ~/.cache, /ensemble/jax), a folder, or '' (off). A cache that
  # the program (or the caller of ensemble.fit) has set up already is left as it is.
  config.compilation_cache = 'auto'
  # On CPU, whether XLA may run the train steps' convolutions, dots and elementwise work with YNNPACK (JAX's default
  # since jaxlib 0.9). False: XLA's own kernels, which ran the CNN's train steps 1.04-1.06x faster; evaluation keeps the
  # default either way, as YNNPACK ran the test pass 2x faster (docs/speed.md).
  config.xla_cpu_ynnpack = False
  return config


# Where regression starts instead, `ensemble.fit(task='regression')` and configs/regression.py alike: the
# deep-ensemble paper's Adam, on standardised features (method hyper's rates drawn around its rate). The image
# recipe's SGD at 0.1 sends Gaussian-NLL members astray (the cubic toy, noise 3: RMSE 194 against 3.0 with this;
# docs/python-api.md, "Regression").
REGRESSION = {'optimizer': 'adamw', 'learning_rate': 0.01, 'weight_decay': 0.0, 'standardize_features': True,
              'hyper_learning_rate': (0.004, 0.012)}
