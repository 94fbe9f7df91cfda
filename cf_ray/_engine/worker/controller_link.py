"""This rank's line to the run's controller actor, without blocking the training thread.

Every ``CF_RAY_POLL_INTERVAL_S`` a step sends a :class:`SyncRequest` (the timing samples since the
last one) and picks the previous :class:`SyncReply` up only once it has arrived: new schedule
versions, the newest committed step, failed checkpoints, and checkpoint requests from outside
the workers (``cf_ray.preemption.notify_preemption``). Blocking calls are for the ends of a run:
:meth:`ControllerLink.wait_durable` and the RPCs the user asks for (the profile, the events).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import ray

from cf_ray._engine import env as _env
from cf_ray._engine.driver.messages import CheckpointRequest, Failure, SyncReply, SyncRequest
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.timing import Timing
from cf_ray.errors import PersistError

logger = logging.getLogger("cf_ray")


class ControllerLink:
    """One rank's polls of the controller, and what it learnt from them.

    Args:
        controller: the run's controller actor.
        rank: this rank.
        timing: whose samples each poll sends.
        scheduler: where new schedule versions go (and which version this rank has received).
        on_request: called with each checkpoint request from the driver, on the training thread.
    """

    def __init__(self, controller, rank: int, timing: Timing, scheduler: Scheduler,
                 on_request: Callable[[CheckpointRequest], None]):
        self.controller = controller
        self.rank = rank
        self.generation = 0
        """This attempt's generation (set at restore)."""
        self.known_committed = 0
        """The newest committed step this rank knows of."""
        self.failures: list[dict] = []
        """Failed checkpoints of this attempt, oldest first (``step``, ``section``, ``rank``, ``error``, ...)."""
        self._timing = timing
        self._scheduler = scheduler
        self._on_request = on_request
        self._poll_ref = None
        self._last_poll = 0.0
        self._seen_failures = -1
        self._seen_requests = -1
        self._reported_failures = 0

    def start_attempt(self, generation: int, committed_step: int) -> None:
        """At restore: this attempt's generation and the newest step committed before it."""
        self.generation = generation
        self.known_committed = committed_step

    def committed(self, step: int) -> bool:
        """Whether ``step`` (or a newer one) is committed, as this rank knows it."""
        return self.known_committed >= step

    # -- the controller, without blocking -------------------------------------------------------
    def poll(self, step: int, copy_timings: dict[str, float], force: bool = False) -> None:
        """Pick up the reply to the last poll if it has arrived; send the next one when due.

        Args:
            step: this rank's step count (with the samples).
            copy_timings: the snapshotter's timings of its last finished job.
            force: send now, however recent the last poll.
        """
        if self._poll_ref is not None:
            ready, _ = ray.wait([self._poll_ref], timeout=0)
            if not ready:
                return
            try:
                self._on_reply(cast(SyncReply, ray.get(self._poll_ref)))
            except Exception as e:  # noqa: BLE001 - a lost controller must not stop training
                logger.warning("cf_ray: rank %d: controller poll failed: %r", self.rank, e)
            self._poll_ref = None
        now = time.monotonic()
        if force or now - self._last_poll >= _env.get_float(_env.POLL_INTERVAL_S):
            samples, stats = self._timing.drain(self.rank, step, copy_timings)
            req = SyncRequest(rank=self.rank, generation=self.generation, samples=tuple(samples),
                              ckpt_stats=tuple(stats), adopted_version=self._scheduler.received,
                              seen_failures=self._seen_failures, seen_requests=self._seen_requests)
            self._poll_ref = self.controller.sync.remote(req)
            self._last_poll = now

    def poll_blocking(self, step: int, copy_timings: dict[str, float]) -> None:
        """Wait for the poll in flight, then poll once more and wait for that too."""
        if self._poll_ref is not None:
            try:
                self._on_reply(cast(SyncReply, ray.get(self._poll_ref, timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))))
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: rank %d: controller poll failed: %r", self.rank, e)
            self._poll_ref = None
        self.poll(step, copy_timings, force=True)
        if self._poll_ref is not None:
            self._on_reply(cast(SyncReply, ray.get(self._poll_ref, timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))))
            self._poll_ref = None

    def _on_reply(self, reply: SyncReply) -> None:
        self._scheduler.receive(reply.schedules)
        self.known_committed = max(self.known_committed, reply.committed_step)
        for f in reply.failures:
            self._seen_failures = max(self._seen_failures, f.seq)
            if f.generation == self.generation:
                self.failures.append(_failure_dict(f))
                logger.warning("cf_ray: rank %d: checkpoint of step %d failed (%s): %s; the previous committed "
                               "checkpoint stays the latest", self.rank, f.step, f.section, f.error)
        for r in reply.requests:  # cf_ray.preemption.notify_preemption() from the driver
            self._seen_requests = max(self._seen_requests, r.seq)
            self._on_request(r)

    # -- durability ---------------------------------------------------------------------------------
    def add_local_failures(self, errors: list[tuple[int, BaseException]]) -> None:
        """Snapshots of this rank that never reached its holder (``Snapshotter.take_errors``)."""
        for step, err in errors:
            self.failures.append({"step": step, "section": mf.rank_section(self.rank), "rank": self.rank,
                                  "error": f"{type(err).__name__}: {err}", "generation": self.generation})

    def wait_durable(self, deadline: float, step: int, copy_timings: dict[str, float]) -> None:
        """Block until the controller has no pending checkpoint of this attempt (or ``deadline``,
        ``time.monotonic()``), then poll once (the failures and the newest committed step)."""
        warn_at = time.monotonic() + _env.get_float(_env.WARN_INTERVAL_S)
        while time.monotonic() < deadline:
            pending = ray.get(self.controller.pending_steps.remote(self.generation),
                              timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
            if not pending:
                break
            if time.monotonic() > warn_at:
                logger.warning("cf_ray: rank %d still waiting for steps %s to become durable; raise "
                               "CF_RAY_ACTOR_TIMEOUT_S to wait longer", self.rank, pending)
                warn_at = time.monotonic() + _env.get_float(_env.WARN_INTERVAL_S)
            time.sleep(0.05)
        self.poll_blocking(step, copy_timings)

    def new_failures(self, raise_on_error: bool) -> list[dict]:
        """The failures not yet reported (each is reported once).

        Raises:
            PersistError: when ``raise_on_error`` and there is one.
        """
        new = self.failures[self._reported_failures:]
        self._reported_failures = len(self.failures)
        if new and raise_on_error:
            raise PersistError("; ".join(f"step {f['step']} ({f['section']}): {f['error']}" for f in new))
        return new

    @contextlib.contextmanager
    def failures_kept_unreported(self) -> Iterator[None]:
        """Failures reported inside stay unreported for the user's next ``wait()``."""
        reported = self._reported_failures
        try:
            yield
        finally:
            self._reported_failures = reported

    def wait_maintenance(self) -> None:
        """Block until the controller's uploads and clean-up are done (at most the actor timeout)."""
        deadline = time.monotonic() + _env.get_float(_env.ACTOR_TIMEOUT_S)
        while time.monotonic() < deadline and not ray.get(self.controller.maintenance_idle.remote()):
            time.sleep(0.1)

    # -- what happened, and the end -----------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        return ray.get(self.controller.profile_rows.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))

    def explain(self) -> Any:
        return ray.get(self.controller.explain.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))

    def events(self) -> list[dict]:
        return ray.get(self.controller.events.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))

    def finish(self, rank: int, world_size: int) -> dict:
        """The controller's summary, then tell it this rank is done. Returns the summary."""
        summary = cast(dict, ray.get(self.controller.summary.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)))
        self.controller.finish.remote(rank, world_size)
        return summary


def _failure_dict(f: Failure) -> dict:
    """A failure as users see it (``FinishSummary.failures``, ``Checkpointer.wait()``)."""
    return {"seq": f.seq, "step": f.step, "section": f.section, "rank": f.rank, "error": f.error,
            "generation": f.generation}
