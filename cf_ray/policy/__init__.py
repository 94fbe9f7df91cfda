"""When to checkpoint: the frequency policies.

:mod:`cf_ray.policy.base` holds the protocol (:class:`FrequencyPolicy`, :class:`SaveContext`,
:class:`Sample`) and the fixed policies (:class:`FixedInterval`, :class:`EpochEnd`,
:class:`AnyOf`); :mod:`cf_ray.policy.adaptive` holds :class:`Adaptive`.
"""

from cf_ray.policy.adaptive import Adaptive
from cf_ray.policy.base import AnyOf, EpochEnd, FixedInterval, FrequencyPolicy, PolicyWarning, Sample, SaveContext

__all__ = [
    "Adaptive",
    "AnyOf",
    "EpochEnd",
    "FixedInterval",
    "FrequencyPolicy",
    "PolicyWarning",
    "Sample",
    "SaveContext",
]
