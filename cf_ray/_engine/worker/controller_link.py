"""This rank's line to the run's controller actor, without blocking the training thread.

Every ``env.POLL_INTERVAL_S`` a step sends a :class:`SyncRequest` (the timing samples since the
last one) and picks the previous :class:`SyncReply` up only once it has arrived: new schedule
versions, the newest committed step, failed checkpoints, and checkpoint requests from outside
the workers (``cf_ray.preemption.notify_preemption``). Blocking calls are for the ends of a run:
:meth:`ControllerLink.wait_durable` and the RPCs the user asks for (the profile, the events).

Liveness: when a call fails with a Ray actor error (``RayActorError``, ``ActorDiedError``,
``ActorUnavailableError``) the link re-resolves the controller (the ``resolve`` callable: the run's
controller, created again when it is gone) and goes on: a blocking call waits for it and retries
once; a poll starts it on a thread of its own and the next poll goes to the new handle. Each
incident is logged once, with the rank and the step, and once more when the controller answers again.
What the link knows of the controller's health (polls failed in a row, the age of the poll in
flight, how fresh the last reply is) feeds the durability watchdog (``watchdog.py``).

Durability at the ends (``wait()``/``finish()``): the link keeps the steps this rank took in this
attempt that are not known settled, and :meth:`ControllerLink.wait_durable` waits until each one is
committed, failed, superseded or abandoned, or the deadline passed: then each one left is reported
as a failure of its own (section ``timeout``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.protocol.messages import CheckpointRequest, PartFailed, Settled, SyncReply, SyncRequest
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.timing import Timing
from cf_ray.errors import PersistError

logger = logging.getLogger("cf_ray")

#: ``ControllerLink.taken`` is pruned of settled steps when it grows past this (between two waits).
_PRUNE_AT = 64


class ControllerLink:
    """One rank's polls of the controller, and what it learnt from them.

    Args:
        controller: the run's controller actor.
        rank: this rank.
        timing: whose samples each poll sends.
        scheduler: where new schedule versions go (and which version this rank has received).
        on_request: called with each checkpoint request from the driver, on the training thread.
        resolve: returns a live handle of the run's controller, creating it when it is gone (may
            block); ``None``: never re-resolved.
    """

    def __init__(
        self,
        controller,
        rank: int,
        timing: Timing,
        scheduler: Scheduler,
        on_request: Callable[[CheckpointRequest], None],
        resolve: Callable[[], Any] | None = None,
    ):
        self.controller = controller
        self.rank = rank
        self.generation = 0
        """This attempt's generation (set at restore)."""
        self.known_committed = 0
        """The newest committed step this rank knows of."""
        self.failures: list[dict] = []
        """Failed checkpoints of this attempt, oldest first (``step``, ``section``, ``rank``, ``error``,
        ``generation``), and those of earlier attempts of the run as the controller tells of them
        (marked ``earlier_attempt: True``)."""
        self.taken: list[int] = []
        self.safe_steps: set[int] = set()
        """Just-in-time checkpoints the controller said are safe in a peer's memory (storage goes on)."""
        """Steps of the checkpoints this rank took in this attempt, not yet known settled (oldest first)."""
        self.poll_failures = 0
        """Polls in a row that failed (0 once one is answered)."""
        self.info_time: float | None = None
        """When the request of the newest reply read was sent (``time.monotonic()``; ``None``: none yet)."""
        self._timing = timing
        self._scheduler = scheduler
        self._on_request = on_request
        self._resolve = resolve
        self._resolving: threading.Thread | None = None
        self._incident = False  # a failed call was logged; logged again once the controller answers
        self._incident_since: float | None = None  # monotonic time of the incident's first failure
        self._poll_ref = None
        self._poll_sent_at: float | None = None
        self._last_poll = 0.0
        self._seen_failures = -1
        self._seen_requests = -1
        self._reported_failures = 0

    def start_attempt(self, generation: int, committed_step: int) -> None:
        """At restore: this attempt's generation and the newest step committed before it."""
        self.generation = generation
        self.known_committed = committed_step
        self.taken.clear()

    def committed(self, step: int) -> bool:
        """Whether ``step`` (or a newer one) is committed, as this rank knows it."""
        return self.known_committed >= step

    def safe(self, step: int) -> bool:
        """Whether ``step`` is committed, or is a just-in-time checkpoint that the controller says is
        safe in the tier it chose for it (a peer's memory, #12), as this rank last heard."""
        return self.committed(step) or step in self.safe_steps

    def track(self, step: int) -> None:
        """This rank took a checkpoint of ``step`` (``wait()`` waits until it is settled)."""
        if not self.taken or self.taken[-1] != step:
            self.taken.append(step)
        if len(self.taken) > _PRUNE_AT:
            self._prune()

    def _prune(self) -> None:
        """Between two waits, forget the steps known settled from the replies: failed, or older than a
        commit (a long run that never calls ``wait()`` keeps a short list)."""
        failed = self._failed_steps(self.failures[-_PRUNE_AT:])
        self.taken = [s for s in self.taken if s > self.known_committed and s not in failed]

    def in_flight_s(self, now: float) -> float:
        """Seconds this rank has been waiting for the controller: the poll in flight's age, or the
        time since a call first failed while the controller is being re-resolved (0: neither)."""
        waiting = 0.0
        if self._poll_ref is not None and self._poll_sent_at is not None:
            waiting = now - self._poll_sent_at
        if self._incident_since is not None:
            waiting = max(waiting, now - self._incident_since)
        return max(waiting, 0.0)

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
            ref, self._poll_ref = self._poll_ref, None
            self._read_reply(ref, step, timeout=None)
        if self._resolving is not None and self._resolving.is_alive():
            return  # the old handle is dead; the next poll goes to the new one
        now = time.monotonic()
        if force or now - self._last_poll >= _env.get_float(_env.POLL_INTERVAL_S):
            samples, stats = self._timing.drain(self.rank, step, copy_timings)
            req = SyncRequest(
                rank=self.rank,
                generation=self.generation,
                samples=tuple(samples),
                ckpt_stats=tuple(stats),
                adopted_version=self._scheduler.received,
                seen_failures=self._seen_failures,
                seen_requests=self._seen_requests,
            )
            self._poll_ref = self.controller.sync.remote(req)
            self._poll_sent_at = now
            self._last_poll = now

    def poll_blocking(self, step: int, copy_timings: dict[str, float]) -> None:
        """Wait for the poll in flight, then poll once more and wait for that too."""
        timeout = _env.get_float(_env.ACTOR_TIMEOUT_S)
        if self._poll_ref is not None:
            ref, self._poll_ref = self._poll_ref, None
            self._read_reply(ref, step, timeout=timeout)
        self._join_resolving(timeout)
        self.poll(step, copy_timings, force=True)
        if self._poll_ref is not None:
            ref, self._poll_ref = self._poll_ref, None
            self._read_reply(ref, step, timeout=timeout)

    def _read_reply(self, ref, step: int, timeout: float | None) -> None:
        sent_at = self._poll_sent_at
        try:
            reply = cast(SyncReply, ray.get(ref, timeout=timeout))
        except ray.exceptions.RayActorError as e:
            self._failed(step, e, reresolve=True)
            return
        except Exception as e:  # noqa: BLE001 - a lost controller must not stop training
            self._failed(step, e, reresolve=False)
            return
        self._answered(step)
        self.info_time = sent_at
        self._on_reply(reply)

    def _on_reply(self, reply: SyncReply) -> None:
        self._scheduler.receive(reply.schedules)
        self.known_committed = max(self.known_committed, reply.committed_step)
        for f in reply.failures:
            self._seen_failures = max(self._seen_failures, f.seq)
            if f.generation == self.generation:
                self.failures.append(f.as_dict())
                logger.warning(
                    "cf_ray: rank %d: checkpoint of step %d failed (%s): %s; the previous committed "
                    "checkpoint stays the latest",
                    self.rank,
                    f.step,
                    f.section,
                    f.error,
                )
            elif 0 < f.generation < self.generation:
                # An earlier attempt's checkpoint that never committed (a step lost with its node, a
                # failed write its ranks did not live to report): reported once by wait() and in
                # FinishSummary.failures, marked, never counted as one of this attempt's steps.
                self.failures.append({**f.as_dict(), "earlier_attempt": True})
                if self.rank == 0:
                    logger.warning(
                        "cf_ray: checkpoint of step %d of an earlier attempt (generation %d) was never "
                        "committed (%s): %s",
                        f.step,
                        f.generation,
                        f.section,
                        f.error,
                    )
        for r in reply.requests:  # cf_ray.preemption.notify_preemption() from the driver
            self._seen_requests = max(self._seen_requests, r.seq)
            self._on_request(r)

    # -- liveness: re-resolve the controller on an actor error ------------------------------------
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
                self._failed(step, e, reresolve=False)
                self._join_resolving(timeout)
                if self.controller is handle:
                    self.controller = self._resolve()
                continue
            self._answered(step)
            return out
        raise AssertionError("unreachable")  # pragma: no cover

    def _failed(self, step: int | None, error: BaseException, *, reresolve: bool) -> None:
        self.poll_failures += 1
        if not self._incident:
            self._incident = True
            self._incident_since = time.monotonic()
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

    def _answered(self, step: int | None) -> None:
        self.poll_failures = 0
        self._incident_since = None
        if self._incident:
            self._incident = False
            logger.warning(
                "cf_ray: rank %d: the controller answers again (step %s)", self.rank, step if step is not None else "-"
            )

    def _resolve_async(self) -> None:
        """Re-resolve the controller on a thread of its own (a poll never blocks the training thread)."""
        if self._resolve is None or (self._resolving is not None and self._resolving.is_alive()):
            return
        resolve = self._resolve

        def run() -> None:
            try:
                self.controller = resolve()
            except Exception as e:  # noqa: BLE001 - the next failed poll tries again
                logger.warning("cf_ray: rank %d: could not re-resolve the controller: %r", self.rank, e)

        self._resolving = threading.Thread(target=run, name=f"cf_ray-resolve-r{self.rank}", daemon=True)
        self._resolving.start()

    def _join_resolving(self, timeout: float) -> None:
        if self._resolving is not None:
            self._resolving.join(timeout)
            self._resolving = None

    # -- durability ---------------------------------------------------------------------------------
    def add_local_failures(self, errors: list[tuple[int, BaseException]]) -> None:
        """Snapshots of this rank that never reached its holder (``Snapshotter.take_errors``)."""
        for step, err in errors:
            self.failures.append(
                {
                    "step": step,
                    "section": mf.rank_section(self.rank),
                    "rank": self.rank,
                    "error": f"{type(err).__name__}: {err}",
                    "generation": self.generation,
                }
            )

    def wait_durable(
        self,
        deadline: float,
        step: int,
        copy_timings: dict[str, float],
        *,
        report_timeout: bool = True,
        safe_ok: bool = False,
        hint: str = "wait(timeout=...) or CF_RAY_ACTOR_TIMEOUT_S",
    ) -> list[int]:
        """Block until every checkpoint this rank took in this attempt is settled (committed, failed,
        superseded or abandoned) or ``deadline`` (``time.monotonic()``) passed, then poll once (the
        failures and the newest committed step).

        Args:
            report_timeout: each step still not settled at the deadline becomes a failure of its own
                (section ``timeout``) and a warning; False: left for a later wait.
            safe_ok: a just-in-time checkpoint safe in a peer's memory counts as settled, and so
                do the older ones still pending (the preempted rank's wait; ``finish()`` waits for
                storage).
            hint: the setting that makes the wait longer (named in the warnings).

        Returns:
            The steps not settled at the deadline.
        """
        t0 = time.monotonic()
        warn_at = t0 + _env.get_float(_env.WARN_INTERVAL_S)
        unsettled: list[int] = []
        while True:
            self.poll(step, copy_timings)  # the failures and the committed step as they come
            try:
                unsettled = self._unsettled(list(self.taken), step, safe_ok=safe_ok)
            except Exception as e:  # noqa: BLE001 - an unreachable controller: what is known locally
                logger.warning(
                    "cf_ray: rank %d: cannot ask the controller which checkpoints are settled: %r", self.rank, e
                )
                unsettled = self._unsettled_locally(list(self.taken), set())
                break
            self.taken = [s for s in self.taken if s in unsettled]
            if not unsettled or time.monotonic() >= deadline:
                break
            if time.monotonic() > warn_at:
                logger.warning(
                    "cf_ray: rank %d still waiting for steps %s to become durable (%.0f s left; %s waits longer)",
                    self.rank,
                    unsettled,
                    max(0.0, deadline - time.monotonic()),
                    hint,
                )
                warn_at = time.monotonic() + _env.get_float(_env.WARN_INTERVAL_S)
            time.sleep(0.05)
        try:
            self.poll_blocking(step, copy_timings)
        except Exception as e:  # noqa: BLE001 - the failures known so far stand
            logger.warning("cf_ray: rank %d: controller poll failed: %r", self.rank, e)
        failed = self._failed_steps(self.failures)
        unsettled = [s for s in unsettled if s not in failed and s > self.known_committed]
        if unsettled and report_timeout:
            waited = time.monotonic() - t0
            for s in unsettled:
                self.failures.append(
                    {
                        "step": s,
                        "section": "timeout",
                        "rank": self.rank,
                        "error": f"not durable after {waited:.0f} s",
                        "generation": self.generation,
                    }
                )
            logger.warning(
                "cf_ray: rank %d: checkpoints of steps %s were neither committed nor failed after %.0f s; "
                "reported as failed (timeout); %s waits longer",
                self.rank,
                unsettled,
                waited,
                hint,
            )
            self.taken = [s for s in self.taken if s not in unsettled]
        return unsettled

    def _unsettled(self, steps: list[int], step: int, *, safe_ok: bool = False) -> list[int]:
        """Which of ``steps`` are not settled yet (committed, failed, superseded or abandoned)."""
        if not steps:
            return []
        failed = self._failed_steps(self.failures)
        # SEAM (#16, driver side): the controller's settled(generation, steps) says it exactly. A
        # controller without it (older code) is asked for its pending steps, and this rank judges
        # the steps it has not heard of yet itself (_unsettled_locally).
        if _has_method(self.controller, "settled"):
            report = cast(Settled, self.call("settled", self.generation, steps, step=step))
            if report.newest_committed is not None:
                self.known_committed = max(self.known_committed, report.newest_committed)
            waiting = set(report.pending) | set(report.unknown)
            safe = set(report.safe)
            self.safe_steps |= safe
            if safe_ok and safe:  # older checkpoints are moot once a newer one is safe
                waiting = {s for s in waiting if s > max(safe)}
            return [s for s in steps if s in waiting and s not in failed]
        pending = set(cast(list, self.call("pending_steps", self.generation, step=step)))
        return self._unsettled_locally(steps, pending)

    def _unsettled_locally(self, steps: list[int], pending: set[int]) -> list[int]:
        """Without ``settled``: a step is not settled while the controller lists it pending, or when it
        is newer than the newest committed step known and than every failed one (the controller may
        not have heard of it yet; one superseded by a newer failed one is settled)."""
        failed = self._failed_steps(self.failures)
        newest_failed = max(failed, default=-1)
        return [
            s for s in steps if s not in failed and (s in pending or (s > self.known_committed and s > newest_failed))
        ]

    @staticmethod
    def _failed_steps(failures: list[dict]) -> set[int]:
        """The steps of this attempt's failures (an earlier attempt's step of the same number is another checkpoint)."""
        return {f["step"] for f in failures if not f.get("earlier_attempt")}

    def new_failures(self, raise_on_error: bool) -> list[dict]:
        """The failures not yet reported (each is reported once), an earlier attempt's included.

        Raises:
            PersistError: when ``raise_on_error`` and one of this attempt's is among them (an earlier
                attempt's is reported, never raised: every new attempt would raise it again).
        """
        new = self.failures[self._reported_failures :]
        self._reported_failures = len(self.failures)
        own = [f for f in new if not f.get("earlier_attempt")]
        if own and raise_on_error:
            raise PersistError("; ".join(f"step {f['step']} ({f['section']}): {f['error']}" for f in own))
        return new

    @contextlib.contextmanager
    def failures_kept_unreported(self) -> Iterator[None]:
        """Failures reported inside stay unreported for the user's next ``wait()``."""
        reported = self._reported_failures
        try:
            yield
        finally:
            self._reported_failures = reported

    def wait_maintenance(self, step: int | None = None) -> list[int]:
        """Block until the controller's uploads (and clean-up) are done, at most the actor timeout.

        Returns:
            The steps whose upload is still queued or running at the timeout (logged).
        """
        deadline = time.monotonic() + _env.get_float(_env.ACTOR_TIMEOUT_S)
        left: list[int] = []
        # SEAM (#16, driver side): uploads_pending() names what is left; older controllers only
        # say whether their maintenance thread is idle.
        uploads = _has_method(self.controller, "uploads_pending")
        while time.monotonic() < deadline:
            if uploads:
                left = cast(list, self.call("uploads_pending", step=step))
                if not left:
                    return []
            elif self.call("maintenance_idle", step=step):
                return []
            time.sleep(0.1)
        logger.warning(
            "cf_ray: rank %d: uploads to the upload tiers not finished after %.0f s%s; they go on in "
            "the background while the controller lives",
            self.rank,
            _env.get_float(_env.ACTOR_TIMEOUT_S),
            f" (steps {left})" if left else "",
        )
        return left

    def record_event(self, event: dict, *, wait: bool = False) -> None:
        """An event for the controller's event list (and profile): fire-and-forget, or (``wait``) once
        the controller has recorded it (what another process must see next: a distrusted snapshot)."""
        try:
            if wait:
                self.call("record_event", event)
            else:
                self.controller.record_event.remote(event)
        except Exception as e:  # noqa: BLE001 - bookkeeping never fails training
            logger.warning("cf_ray: rank %d: could not record event %s: %r", self.rank, event.get("event"), e)

    def report_skipped(self, step: int, error: str, sections: list[str]) -> None:
        """A snapshot this rank did not take (no free slot in time): the controller fails its step, so
        that nobody waits for it and the failure reaches every rank (``wait()``, ``FinishSummary``)."""
        try:
            for section in sections:
                self.controller.part_failed.remote(
                    PartFailed(generation=self.generation, step=step, section=section, error=error)
                )
        except Exception as e:  # noqa: BLE001 - the warning said it; the local list keeps it
            logger.warning(
                "cf_ray: rank %d: could not report the skipped checkpoint of step %d: %r", self.rank, step, e
            )
            self.failures.extend(
                {"step": step, "section": sec, "rank": self.rank, "error": error, "generation": self.generation}
                for sec in sections
            )

    def has(self, method: str) -> bool:
        """Whether the controller has ``method`` (one of older code may not)."""
        return _has_method(self.controller, method)

    # -- what happened, and the end -----------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        return cast(list, self.call("profile_rows"))

    def explain(self) -> Any:
        return self.call("explain")

    def events(self) -> list[dict]:
        return cast(list, self.call("events"))

    def finish(self, rank: int, world_size: int) -> dict:
        """The controller's summary, then tell it this rank is done. Returns the summary."""
        summary = cast(dict, self.call("summary"))
        self.controller.finish.remote(rank, world_size)
        return summary


def _has_method(handle, name: str) -> bool:
    """Whether an actor handle has the method ``name`` (a controller of older code may not)."""
    try:
        getattr(handle, name)
    except AttributeError:
        return False
    return True
