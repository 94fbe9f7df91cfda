"""When to checkpoint: the frequency policies."""

from cf_ray.policy.adaptive import (Adaptive, AnyOf, EpochEnd, FixedInterval, FrequencyPolicy, PolicyWarning,
                                    Sample, SaveContext)

__all__ = ["Adaptive", "AnyOf", "EpochEnd", "FixedInterval", "FrequencyPolicy", "PolicyWarning", "Sample",
           "SaveContext"]
