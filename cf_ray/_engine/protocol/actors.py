"""What the actor rooms share: getting a live handle of a named cf_ray actor (no torch)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from cf_ray._engine import env as _env


def resolve_live(get_or_create: Callable[[], Any], what: str, timeout_s: float | None = None) -> Any:
    """``get_or_create()`` until the handle it returns answers ``ping``, with backoff.

    A dead actor whose name Ray has not released yet, or one that Ray is restarting, is tried again
    (0.05 s, doubling up to 2 s) for at most ``timeout_s`` (``CF_RAY_ACTOR_TIMEOUT_S``).

    Raises:
        TimeoutError: no live actor within the timeout, naming ``what`` (the last error is chained).
    """
    deadline = time.monotonic() + (_env.get_float(_env.ACTOR_TIMEOUT_S) if timeout_s is None else timeout_s)
    delay, last = 0.05, None
    while True:
        try:
            handle = get_or_create()
            ray.get(handle.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return handle
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError) as e:
            last = e
        if time.monotonic() + delay > deadline:
            raise TimeoutError(f"no live {what} within the timeout") from last
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
