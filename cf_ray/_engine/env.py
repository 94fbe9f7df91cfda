"""Every tunable environment variable of cf_ray, with its default, in one place.

Tests change them with ``monkeypatch.setenv``; code reads them through the helpers below at the
moment it needs them (never cached at import), so a change takes effect in the next object built.
"""

from __future__ import annotations

import os

#: Seconds between two non-blocking polls of the controller by a worker.
POLL_INTERVAL_S = "CF_RAY_POLL_INTERVAL_S"
#: Minimum seconds between two registrations of a committed checkpoint with Ray Train
#: (``ray.train.report`` is a barrier and, on Ray 2.60, throttled to one per health-check period).
REGISTER_INTERVAL_S = "CF_RAY_REGISTER_INTERVAL_S"
#: Seconds a worker waits for the controller or a holder in a blocking call (restore, close).
ACTOR_TIMEOUT_S = "CF_RAY_ACTOR_TIMEOUT_S"
#: Seconds between warnings while a blocking wait goes on (names the lagging ranks).
WARN_INTERVAL_S = "CF_RAY_WARN_INTERVAL_S"
#: Seconds the controller stays alive after every rank has finished, so the driver can read it.
LINGER_S = "CF_RAY_CONTROLLER_LINGER_S"
#: Bytes per write call when streaming a checkpoint file to storage.
WRITE_CHUNK_BYTES = "CF_RAY_WRITE_CHUNK_BYTES"
#: "0" turns off direct I/O (O_DIRECT) for large local writes; they then go through the page cache.
DIRECT_IO = "CF_RAY_DIRECT_IO"
#: Namespace of cf_ray's named actors.
NAMESPACE = "CF_RAY_NAMESPACE"

_DEFAULTS = {
    POLL_INTERVAL_S: 0.25,
    REGISTER_INTERVAL_S: 10.0,
    ACTOR_TIMEOUT_S: 120.0,
    WARN_INTERVAL_S: 15.0,
    LINGER_S: 120.0,
    WRITE_CHUNK_BYTES: 16 * 1024 * 1024,
    DIRECT_IO: 1,
}


def get_float(name: str) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return float(_DEFAULTS[name])
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number; unset it or give a number") from None


def get_int(name: str) -> int:
    return int(get_float(name))


def namespace() -> str:
    return os.environ.get(NAMESPACE, "cf_ray")
