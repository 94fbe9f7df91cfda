"""The poll exchange with the controller, without blocking the training thread: a step sends a
:class:`SyncRequest` (the timing samples since the last one, the schedule version received, the
failures and requests seen) every ``env.BELL_POLL_INTERVAL_S`` (1 s) once the controller has the
rank's doorbell, every ``env.POLL_INTERVAL_S`` (0.25 s) until then or without one, and picks the
previous :class:`SyncReply` up only once it has arrived. One poll is in flight at a time.

What cannot wait for the next poll, a checkpoint request from outside the workers
(``cf_ray.preemption.notify_preemption``) or a new schedule version, rings the rank's
:class:`~cf_ray._engine.protocol.doorbell.Doorbell` and the next step polls at once. Inside a Ray
actor (a Ray Train worker) a poll carries the bell's address until a reply says that the controller
(a new one too) has it for this attempt. The request itself still comes in the poll's reply, so a
bell that is lost, or a rank without one (outside an actor), waits at most one poll interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.doorbell import Doorbell
from cf_ray._engine.protocol.messages import SyncReply, SyncRequest
from cf_ray._engine.worker.link.line import ControllerLine
from cf_ray._engine.worker.link.news import ControllerNews
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.timing import Timing


class SyncExchange:
    """One rank's polls of the controller.

    Args:
        line: the controller's handle (a failed poll starts its re-resolve).
        timing: whose samples each poll sends.
        scheduler: which schedule version this rank has received.
        news: the failures and requests seen (their sequence numbers go with each poll).
        on_reply: called with each reply picked up, on the training thread.
    """

    def __init__(
        self,
        line: ControllerLine,
        timing: Timing,
        scheduler: Scheduler,
        news: ControllerNews,
        on_reply: Callable[[SyncReply], None],
    ):
        self.info_time: float | None = None
        """When the request of the newest reply read was sent (``time.monotonic()``; ``None``: none yet)."""
        self._line = line
        self._timing = timing
        self._scheduler = scheduler
        self._news = news
        self._on_reply = on_reply
        self._ref = None
        self._sent_at: float | None = None
        self._last = 0.0
        self._bell = Doorbell.here()
        self._bell_known = False
        """Whether the last reply said the controller has this rank's bell for this attempt."""

    def in_flight_s(self, now: float) -> float:
        """Seconds this rank has been waiting for the controller: the poll in flight's age, or the
        time since a call first failed while the controller is being re-resolved (0: neither)."""
        waiting = 0.0
        if self._ref is not None and self._sent_at is not None:
            waiting = now - self._sent_at
        if self._line.incident_since is not None:
            waiting = max(waiting, now - self._line.incident_since)
        return max(waiting, 0.0)

    def poll(self, step: int, copy_timings: dict[str, float], generation: int, force: bool = False) -> None:
        """Pick up the reply to the last poll if it has arrived; send the next one when due
        (``force``: now, however recent the last poll)."""
        if self._ref is not None:
            ready, _ = ray.wait([self._ref], timeout=0)
            if not ready:
                return
            ref, self._ref = self._ref, None
            self._read(ref, step, timeout=None)
        if self._line.resolving():
            return  # the old handle is dead; the next poll goes to the new one
        now = time.monotonic()
        if self._bell is not None and self._bell.take():
            force = True
        interval = _env.BELL_POLL_INTERVAL_S if self._bell_known else _env.POLL_INTERVAL_S
        if force or now - self._last >= _env.get_float(interval):
            rank = self._line.rank
            bell = None if self._bell is None or self._bell_known else self._bell.address
            samples, stats = self._timing.drain(rank, step, copy_timings)
            req = SyncRequest(
                rank=rank,
                generation=generation,
                samples=tuple(samples),
                ckpt_stats=tuple(stats),
                adopted_version=self._scheduler.received,
                seen_failures=self._news.seen_failures,
                seen_requests=self._news.seen_requests,
                bell=bell,
            )
            self._ref = self._line.controller.sync.remote(req)
            self._sent_at = now
            self._last = now

    def poll_blocking(self, step: int, copy_timings: dict[str, float], generation: int) -> None:
        """Wait for the poll in flight, then poll once more and wait for that too."""
        timeout = _env.get_float(_env.ACTOR_TIMEOUT_S)
        if self._ref is not None:
            ref, self._ref = self._ref, None
            self._read(ref, step, timeout=timeout)
        self._line.join_resolving(timeout)
        self.poll(step, copy_timings, generation, force=True)
        if self._ref is not None:
            ref, self._ref = self._ref, None
            self._read(ref, step, timeout=timeout)

    def _read(self, ref, step: int, timeout: float | None) -> None:
        sent_at = self._sent_at
        try:
            reply = cast(SyncReply, ray.get(ref, timeout=timeout))
        except ray.exceptions.RayActorError as e:
            self._line.failed(step, e, reresolve=True)
            return
        except Exception as e:  # noqa: BLE001 - a lost controller must not stop training
            self._line.failed(step, e, reresolve=False)
            return
        self._line.answered(step)
        self._bell_known = reply.bell_known
        self.info_time = sent_at
        self._on_reply(reply)
