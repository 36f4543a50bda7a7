"""Deep ensembles of Flax models, trained across devices with JAX.

  import ensemble
  ens = ensemble.fit(model, (x_train, y_train), test=(x_test, y_test), ensemble_size=8, epochs=10)
  ens.predict(x); ens.evaluate(x_test, y_test); ensemble.load(workdir)
  ensemble.active_learning(model, (x_seed, y_seed), pool=x_pool, label=ask); ensemble.bayesian_optimization(...)

Importing the package is cheap on purpose: it does not import jax, so that
`ensemble.cpu_devices(8)` can still choose the number of simulated CPU
devices. The API (`ensemble.api`) is imported on first use.
"""

from ensemble.errors import UsageError

__all__ = ['Ensemble', 'UsageError', 'active_learning', 'bayesian_optimization', 'cpu_devices', 'distill', 'fit',
           'load']
# Each name of the API and the module that holds it, imported on first use (they import jax). `distill` lives in
# ensemble/distillation.py: a module named distill would shadow the function once imported (the loops' modules are
# in ensemble/loops/ for the same reason).
_API = {'Ensemble': 'trained', 'fit': 'api', 'load': 'api', 'distill': 'distillation',
        'active_learning': 'loops.active_learning', 'bayesian_optimization': 'loops.bayesian_optimization'}


def __getattr__(name: str):
  if name == 'cpu_devices':
    from ensemble.devices import cpu_devices  # pylint: disable=g-import-not-at-top
    return cpu_devices
  if name == 'acquire':  # a module of pure functions (the acquisition functions), imported on first use
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module('ensemble.acquire')
  if name in _API:
    import importlib  # pylint: disable=g-import-not-at-top
    from ensemble import console  # pylint: disable=g-import-not-at-top
    with console.root_logging_kept():  # orbax's import would configure the caller's root logger
      module = importlib.import_module(f'ensemble.{_API[name]}')
    return getattr(module, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + ['acquire', 'cpu_devices', *_API])
