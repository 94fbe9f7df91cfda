"""What cf_ray sets in Ray Train so that a failure costs less time: every dependence on Ray Train's
internals (environment variable names, their meaning in the pinned Ray) is in this module.

Ray Train's controller finds a dead rank by polling its workers every
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` seconds (Ray Train's default: 2 s): the poll of a killed
worker's actor fails at the first poll after its death, so detection waits half an interval on
average and a whole one at worst. A poll is one small actor call per rank; cf_ray makes it shorter.
The controller reads the variable from the driver's environment when ``fit()`` starts it (Ray
Train passes it from the driver to the controller), so cf_ray sets it in the driver's process when
``cf_ray`` is imported there, where a user's ``TorchTrainer`` script imports it.

Only a variable the user did not set is set; ``CF_RAY_RAY_TRAIN_DEFAULTS=0`` (before
``import cf_ray``, or before :func:`apply_driver_defaults` runs again) leaves Ray Train's own
defaults, and takes back what cf_ray set before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from cf_ray._engine import env as _env

logger = logging.getLogger("cf_ray")

#: ``0`` keeps Ray Train's own defaults for the variables below.
ENABLE = _env.RAY_TRAIN_DEFAULTS

#: Ray Train's variables and the values cf_ray gives them when the user has not.
DEFAULTS: dict[str, str] = {
    # Ray Train 2.60 (ray/train/v2/_internal/constants.py): seconds between two polls of the
    # workers' status by the controller; a dead rank is seen at the first poll after its death.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
}

_set_by_cf_ray: dict[str, str] = {}
"""The variables this process's cf_ray set, with the value it set (taken back when turned off)."""


def enabled(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether cf_ray's Ray Train settings apply (``CF_RAY_RAY_TRAIN_DEFAULTS`` is not ``0``)."""
    env = os.environ if environ is None else environ
    return env.get(ENABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def apply_driver_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`DEFAULTS` the user did not set; returns what is now set by cf_ray.

    Turned off (``CF_RAY_RAY_TRAIN_DEFAULTS=0``), it removes the variables it set before whose
    value is still the one it set, so Ray Train's defaults apply to the next ``fit()``.
    """
    env = os.environ if environ is None else environ
    if not enabled(env):
        for name, value in list(_set_by_cf_ray.items()):
            if env.get(name) == value:
                del env[name]
            del _set_by_cf_ray[name]
        return {}
    for name, value in DEFAULTS.items():
        if name not in env:
            env[name] = value
            _set_by_cf_ray[name] = value
    return {k: v for k, v in _set_by_cf_ray.items() if env.get(k) == v}


#: Ray Train 2.60's own default of ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``.
RAY_HEALTH_CHECK_S = 2.0

_said = False


def health_check_s(environ: MutableMapping[str, str] | None = None) -> float:
    """In a Ray Train worker: the interval at which Ray Train's controller polls the workers (Ray
    Train passes the variable on from the controller to its workers). When cf_ray's shorter value
    did not reach it (``cf_ray`` not imported in the driver before ``fit()``, or turned off), says
    so once in the log: a failure is then seen up to Ray Train's default interval later."""
    global _said
    env = os.environ if environ is None else environ
    raw = env.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    try:
        value = float(raw) if raw else RAY_HEALTH_CHECK_S
    except ValueError:
        value = RAY_HEALTH_CHECK_S
    if not raw and not _said:
        _said = True
        logger.info(
            "cf_ray: Ray Train polls its workers every %.0f s (its default): a failed worker is seen up to "
            "that late. `import cf_ray` in the driver before fit() sets %s (unless %s=0)",
            value,
            ", ".join(f"{k}={v}" for k, v in DEFAULTS.items()),
            ENABLE,
        )
    return value


__all__ = ["DEFAULTS", "ENABLE", "apply_driver_defaults", "enabled", "health_check_s"]
