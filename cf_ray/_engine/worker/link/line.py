"""The handle of the run's controller as one rank holds it, and its liveness.

When a call fails with a Ray actor error (``RayActorError``, ``ActorDiedError``,
``ActorUnavailableError``) the line re-resolves the controller (the ``resolve`` callable: the run's
controller, created again when it is gone) and goes on: a blocking call waits for it and retries
once; a poll starts it on a thread of its own (the next poll goes to the new handle). Each incident
(calls failing until one is answered) is logged once, with the rank and the step, and once more when
the controller answers again; how long it lasts and how many polls failed in a row feed the
durability watchdog (``watchdog.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from cf_ray._engine import env as _env

logger = logging.getLogger("cf_ray")


class ControllerLine:
    """One rank's handle of the run's controller: blocking calls, re-resolving, incidents.

    Args:
        controller: the run's controller actor.
        rank: this rank.
        resolve: returns a live handle of the run's controller, creating it when it is gone (may
            block); ``None``: never re-resolved.
    """

    def __init__(self, controller, rank: int, resolve: Callable[[], Any] | None = None):
        self.controller = controller
        """The handle calls go to (a new one once re-resolved)."""
        self.rank = rank
        self.poll_failures = 0
        """Calls in a row that failed (0 once one is answered)."""
        self.incident_since: float | None = None
        """Monotonic time of the first failure of the incident going on (``None``: none)."""
        self._resolve = resolve
        self._resolving: threading.Thread | None = None

    def call(self, method: str, *args, step: int | None = None, timeout_s: float | None = None) -> Any:
        """A blocking RPC; on a Ray actor error the controller is re-resolved and the call made once more."""
        timeout = _env.get_float(_env.ACTOR_TIMEOUT_S) if timeout_s is None else timeout_s
        for attempt in (0, 1):
            handle = self.controller
            try:
                out = ray.get(getattr(handle, method).remote(*args), timeout=timeout)
            except ray.exceptions.RayActorError as e:
                if attempt or self._resolve is None:
                    raise
                self.failed(step, e, reresolve=False)
                self.join_resolving(timeout)
                if self.controller is handle:
                    self.controller = self._resolve()
                continue
            self.answered(step)
            return out
        raise AssertionError("unreachable")  # pragma: no cover

    def failed(self, step: int | None, error: BaseException, *, reresolve: bool) -> None:
        """A call failed (logged once per incident); ``reresolve``: re-resolve on a thread of its own."""
        self.poll_failures += 1
        if self.incident_since is None:
            self.incident_since = time.monotonic()
            what = (
                "re-resolving it"
                if (reresolve or self._resolve is not None) and isinstance(error, ray.exceptions.RayActorError)
                else "training goes on"
            )
            logger.warning(
                "cf_ray: rank %d: a call to the controller failed at step %s (%s: %s); %s",
                self.rank,
                step if step is not None else "-",
                type(error).__name__,
                error,
                what,
            )
        if reresolve:
            self._resolve_async()

    def answered(self, step: int | None) -> None:
        """A call was answered: the incident (if any) ends, and is said to."""
        self.poll_failures = 0
        if self.incident_since is not None:
            self.incident_since = None
            logger.warning(
                "cf_ray: rank %d: the controller answers again (step %s)", self.rank, step if step is not None else "-"
            )

    def resolving(self) -> bool:
        """Whether the controller is being re-resolved now (the old handle is dead)."""
        return self._resolving is not None and self._resolving.is_alive()

    def _resolve_async(self) -> None:
        """Re-resolve the controller on a thread of its own (a poll never blocks the training thread)."""
        if self._resolve is None or self.resolving():
            return
        resolve = self._resolve

        def run() -> None:
            try:
                self.controller = resolve()
            except Exception as e:  # noqa: BLE001 - the next failed poll tries again
                logger.warning("cf_ray: rank %d: could not re-resolve the controller: %r", self.rank, e)

        self._resolving = threading.Thread(target=run, name=f"cf_ray-resolve-r{self.rank}", daemon=True)
        self._resolving.start()

    def join_resolving(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for a re-resolve going on."""
        if self._resolving is not None:
            self._resolving.join(timeout)
            self._resolving = None

    def has(self, method: str) -> bool:
        """Whether the controller has ``method`` (one of older code may not)."""
        try:
            getattr(self.controller, method)
        except AttributeError:
            return False
        return True
