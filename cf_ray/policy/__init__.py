"""When to checkpoint: the frequency policies.

:mod:`cf_ray.policy.base` holds the base class every policy subclasses (:class:`FrequencyPolicy`:
each method the engine calls, with its default), what it is called with (:class:`SaveContext`,
:class:`Sample`) and the fixed policies (:class:`FixedInterval`, :class:`EpochEnd`,
:class:`AnyOf`); :mod:`cf_ray.policy.adaptive` holds :class:`Adaptive`, and
:mod:`cf_ray.policy._hazard` the failure side of it (:class:`RunEvent`, what the controller tells
it of the run's failures).
"""

from cf_ray.policy._hazard import RunEvent, RunEventKind
from cf_ray.policy.adaptive import Adaptive
from cf_ray.policy.base import AnyOf, EpochEnd, FixedInterval, FrequencyPolicy, PolicyWarning, Sample, SaveContext

__all__ = [
    "Adaptive",
    "AnyOf",
    "EpochEnd",
    "FixedInterval",
    "FrequencyPolicy",
    "PolicyWarning",
    "RunEvent",
    "RunEventKind",
    "Sample",
    "SaveContext",
]
