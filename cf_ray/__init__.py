"""cf_ray: CheckFreq-style frequent, two-phase, automatically tuned checkpoints for Ray Train.

The front door is small: a :class:`Checkpointer` per rank inside ``train_loop_per_worker``, its
:class:`CheckpointConfig`, the frequency policies, and functions to read checkpoints and profiles
afterwards. Everything else is internal.
"""

from cf_ray.checkpointer import CheckpointConfig, Checkpointer, FinishSummary, Resume
from cf_ray.errors import (CfRayError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                           ElasticResumeError, PersistError, UnsafePathError)
from cf_ray.load import CheckpointInfo, list_checkpoints, load_into, load_state
from cf_ray.policy import Adaptive, AnyOf, EpochEnd, FixedInterval
from cf_ray.preemption import PreemptionConfig, notify_preemption

__version__ = "0.1.0"

__all__ = [
    "Adaptive",
    "AnyOf",
    "CfRayError",
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpointError",
    "ElasticResumeError",
    "EpochEnd",
    "FinishSummary",
    "FixedInterval",
    "PersistError",
    "PreemptionConfig",
    "Resume",
    "UnsafePathError",
    "list_checkpoints",
    "load_into",
    "load_state",
    "notify_preemption",
]
