"""cf_ray: CheckFreq-style frequent, two-phase, automatically tuned checkpoints for Ray Train.

The front door is small: a :class:`Checkpointer` per rank inside ``train_loop_per_worker``, its
:class:`CheckpointConfig`, the frequency policies, :class:`Run` (the driver-side handle of a run:
its profile, summary, checkpoints and preemption notices), functions to read checkpoints, and the
exceptions users catch. ``__all__`` below is the whole public surface of this module, pinned by
``tests/test_public_api.py``; the other public modules are ``cf_ray.policy``, ``cf_ray.data``,
``cf_ray.preemption`` (``CheckpointBeforeResize``), ``cf_ray.config`` (``Replication``,
``DurabilityTimeout``: the grouped parts of a ``CheckpointConfig``) and ``cf_ray.report``, each an attribute of the
package after ``import cf_ray`` alone (imported on first use). Everything under
``cf_ray._engine`` is internal.

Importing cf_ray checks that the installed Ray is one cf_ray was tested with (``ImportError``
otherwise, naming the supported range; ``CF_RAY_ALLOW_UNTESTED_RAY=1`` skips the check): see
:mod:`cf_ray._version`.
"""

import importlib
from typing import TYPE_CHECKING

from cf_ray._version import __version__ as __version__
from cf_ray._version import check_ray_version as _check_ray_version

_check_ray_version()

# Ray Train's settings that make a failure cost less (its health-check interval), set in the driver
# before fit() passes them on; a user's own values are kept, CF_RAY_RAY_TRAIN_DEFAULTS=0 keeps Ray's.
from cf_ray._engine.worker.link.ray_train_fast import apply_driver_defaults as _apply_driver_defaults  # noqa: E402

_apply_driver_defaults()

# Names are loaded on first use (PEP 562): cf_ray's actors (controller, holder) import
# ``cf_ray._engine.driver`` / ``cf_ray._engine.node``, which run this file first, and must not pay for
# torch and pandas they never use (seconds of CPU per actor process on a small machine).
_LAZY = {
    "CheckpointConfig": "config",
    "Checkpointer": "checkpointer",
    "FinishSummary": "checkpointer",
    "Resume": "checkpointer",
    "CfRayError": "errors",
    "CheckpointMismatchError": "errors",
    "CheckpointNotFoundError": "errors",
    "ConfigError": "errors",
    "CorruptCheckpointError": "errors",
    "DurabilityLostError": "errors",
    "ElasticResumeError": "errors",
    "PersistError": "errors",
    "RestoreError": "errors",
    "UnsafePathError": "errors",
    "CheckpointInfo": "load",
    "list_checkpoints": "load",
    "load_into": "load",
    "load_state": "load",
    "Adaptive": "policy",
    "AnyOf": "policy",
    "EpochEnd": "policy",
    "FixedInterval": "policy",
    "PreemptionConfig": "config",
    "notify_preemption": "preemption",
    "Run": "run",
    "RunUnavailableError": "run",
}

if TYPE_CHECKING:
    from cf_ray.checkpointer import Checkpointer, FinishSummary, Resume
    from cf_ray.config import CheckpointConfig, PreemptionConfig
    from cf_ray.errors import (
        CfRayError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        ConfigError,
        CorruptCheckpointError,
        DurabilityLostError,
        ElasticResumeError,
        PersistError,
        RestoreError,
        UnsafePathError,
    )
    from cf_ray.load import CheckpointInfo, list_checkpoints, load_into, load_state
    from cf_ray.policy import Adaptive, AnyOf, EpochEnd, FixedInterval
    from cf_ray.preemption import notify_preemption
    from cf_ray.run import Run, RunUnavailableError


#: The public submodules, reachable as attributes after ``import cf_ray`` alone (``cf_ray.data``,
#: ``cf_ray.preemption.CheckpointBeforeResize()``, ...) and imported on first use like the names above.
_SUBMODULES = ("config", "data", "integrations", "policy", "preemption", "report")


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"cf_ray.{name}")
    else:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'cf_ray' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"cf_ray.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


__all__ = [
    "Adaptive",
    "AnyOf",
    "CfRayError",
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpointError",
    "DurabilityLostError",
    "ElasticResumeError",
    "EpochEnd",
    "FinishSummary",
    "FixedInterval",
    "PersistError",
    "PreemptionConfig",
    "RestoreError",
    "Resume",
    "Run",
    "RunUnavailableError",
    "UnsafePathError",
    "list_checkpoints",
    "load_into",
    "load_state",
    "notify_preemption",
]
