"""cf_ray inside the trainers Ray Train users already run in ``train_loop_per_worker``.

One object added to the trainer gives it cf_ray's snapshots, interval policy, memory restore and
exact data position, the way Ray's own ``RayTrainReportCallback`` is added:

* :mod:`cf_ray.integrations.huggingface`: ``transformers.Trainer`` (``trainer.add_callback(CfRayCallback())``);
* :mod:`cf_ray.integrations.lightning`: Lightning (``pl.Trainer(callbacks=[CfRayCallback()], ...)``).

Each module imports its framework when it is imported, never before: ``import cf_ray`` (and this
package) pays for neither. Install them with ``pip install 'cf-ray[hf]'`` / ``'cf-ray[lightning]'``.
"""

import importlib as _importlib

_FRAMEWORKS = ("huggingface", "lightning")


def __getattr__(name: str):
    """``cf_ray.integrations.huggingface`` / ``.lightning`` after ``import cf_ray`` alone: the
    module (and its framework) is imported on first access."""
    if name in _FRAMEWORKS:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FRAMEWORKS))
