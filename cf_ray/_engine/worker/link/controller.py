"""This rank's line to the run's controller actor, without blocking the training thread; a facade
over its parts:

* the poll exchange (``controller_sync.py``): every ``env.POLL_INTERVAL_S`` a step sends a
  :class:`SyncRequest` and picks the previous :class:`SyncReply` up only once it has arrived: new
  schedule versions, the newest committed step, failed checkpoints, and checkpoint requests from
  outside the workers (``cf_ray.preemption.notify_preemption``);
* what the replies told (``controller_news.py``): the failures, each reported once, and the requests;
* the controller's handle and its liveness (``controller_line.py``): on a Ray actor error the
  controller is re-resolved, each incident logged once. What the link knows of the controller's
  health (polls failed in a row, the age of the poll in flight, how fresh the last reply is) feeds
  the durability watchdog (``watchdog.py``).

Blocking calls are for the ends of a run: :meth:`ControllerLink.wait_durable` and the RPCs the user
asks for (the profile, the events).

Durability at the ends (``wait()``/``finish()``): the link keeps the steps this rank took in this
attempt that are not known settled, and :meth:`ControllerLink.wait_durable` waits until each one is
committed, failed, superseded or abandoned, or the deadline passed: then each one left is reported
as a failure of its own (section ``timeout``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.messages import CheckpointRequest, PartFailed, Settled, SyncReply
from cf_ray._engine.worker.link.line import ControllerLine
from cf_ray._engine.worker.link.news import ControllerNews
from cf_ray._engine.worker.link.sync import SyncExchange
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.timing import Timing

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
        self.rank = rank
        self.generation = 0
        """This attempt's generation (set at restore)."""
        self.known_committed = 0
        """The newest committed step this rank knows of."""
        self.taken: list[int] = []
        """Steps of the checkpoints this rank took in this attempt, not yet known settled (oldest first)."""
        self.safe_steps: set[int] = set()
        """Just-in-time checkpoints the controller said are safe in a peer's memory (storage goes on)."""
        self._final: tuple[int, int] | None = None
        """``finish()`` takes this step again: (the step, how many failures this rank knew of then);
        the failures of that step known before are the snapshot's before it, not this one's."""
        self._scheduler = scheduler
        self._line = ControllerLine(controller, rank, resolve)
        self._news = ControllerNews(rank, on_request)
        self._sync = SyncExchange(self._line, timing, scheduler, self._news, self._on_reply)

    @property
    def controller(self):
        """The run's controller actor (a new handle once re-resolved)."""
        return self._line.controller

    @property
    def failures(self) -> list[dict]:
        """Failed checkpoints of this attempt, oldest first (``step``, ``section``, ``rank``, ``error``,
        ``generation``), and those of earlier attempts of the run as the controller tells of them
        (marked ``earlier_attempt: True``)."""
        return self._news.failures

    @property
    def poll_failures(self) -> int:
        """Polls in a row that failed (0 once one is answered)."""
        return self._line.poll_failures

    @property
    def info_time(self) -> float | None:
        """When the request of the newest reply read was sent (``time.monotonic()``; ``None``: none yet)."""
        return self._sync.info_time

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
        failed = self._failed_steps()
        self.taken = [s for s in self.taken if s > self.known_committed and s not in failed]

    def _failed_steps(self, *, local_only: bool = False) -> set[int]:
        """The steps of this attempt's failures (``local_only``: those this rank found itself, which
        the controller may never hear of), less those of the final step from before ``finish()``
        took it again."""
        final_step, known = self._final if self._final is not None else (None, 0)
        return {
            f["step"]
            for i, f in enumerate(self.failures)
            if not f.get("earlier_attempt")
            and not (local_only and "seq" in f)
            and not (f["step"] == final_step and i < known)
        }

    def in_flight_s(self, now: float) -> float:
        """Seconds this rank has been waiting for the controller: the poll in flight's age, or the
        time since a call first failed while the controller is being re-resolved (0: neither)."""
        return self._sync.in_flight_s(now)

    # -- the controller, without blocking -------------------------------------------------------
    def poll(self, step: int, copy_timings: dict[str, float], force: bool = False) -> None:
        """Pick up the reply to the last poll if it has arrived; send the next one when due.

        Args:
            step: this rank's step count (with the samples).
            copy_timings: the snapshotter's timings of its last finished job.
            force: send now, however recent the last poll.
        """
        self._sync.poll(step, copy_timings, self.generation, force)

    def poll_blocking(self, step: int, copy_timings: dict[str, float]) -> None:
        """Wait for the poll in flight, then poll once more and wait for that too."""
        self._sync.poll_blocking(step, copy_timings, self.generation)

    def _on_reply(self, reply: SyncReply) -> None:
        self._scheduler.receive(reply.schedules)
        self.known_committed = max(self.known_committed, reply.committed_step)
        self._news.take(reply, self.generation)

    def call(self, method: str, *args, step: int | None = None, timeout_s: float | None = None) -> Any:
        """A blocking RPC; on a Ray actor error the controller is re-resolved and the call made once more."""
        return self._line.call(method, *args, step=step, timeout_s=timeout_s)

    # -- durability ---------------------------------------------------------------------------------
    def add_local_failures(self, errors: list[tuple[int, BaseException]]) -> None:
        """Snapshots of this rank that never reached its holder (``Snapshotter.take_errors``)."""
        self._news.add_local(errors, self.generation)

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
        failed = self._failed_steps()
        unsettled = [s for s in unsettled if s not in failed and s > self.known_committed]
        if unsettled and report_timeout:
            waited = time.monotonic() - t0
            for s in unsettled:
                self._news.add(s, "timeout", f"not durable after {waited:.0f} s", self.generation)
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
        # SEAM (#16, driver side): the controller's settled(generation, steps) says it exactly. A
        # controller without it (older code) is asked for its pending steps, and this rank judges
        # the steps it has not heard of yet itself (_unsettled_locally).
        if self.has("settled"):
            report = cast(Settled, self.call("settled", self.generation, steps, step=step))
            if report.newest_committed is not None:
                self.known_committed = max(self.known_committed, report.newest_committed)
            # A step this rank heard failed is waited for while the controller has it pending: the
            # failures of its other sections are due (one step's failures are reported together).
            # What this rank found itself, the controller may never hear of.
            waiting = set(report.pending) | (set(report.unknown) - self._failed_steps())
            safe = set(report.safe)
            self.safe_steps |= safe
            if safe_ok and safe:  # older checkpoints are moot once a newer one is safe
                waiting = {s for s in waiting if s > max(safe)}
            failed = self._failed_steps(local_only=True)
            return [s for s in steps if s in waiting and s not in failed]
        pending = set(cast(list, self.call("pending_steps", self.generation, step=step)))
        return self._unsettled_locally(steps, pending)

    def _unsettled_locally(self, steps: list[int], pending: set[int]) -> list[int]:
        """Without ``settled``: a step is not settled while the controller lists it pending, or when it
        is newer than the newest committed step known and than every failed one (the controller may
        not have heard of it yet; one superseded by a newer failed one is settled)."""
        failed = self._failed_steps()
        newest_failed = max(failed, default=-1)
        return [
            s for s in steps if s not in failed and (s in pending or (s > self.known_committed and s > newest_failed))
        ]

    # -- the final checkpoint (``finish()``) -------------------------------------------------------------
    def reopen_final(self, step: int, attempt: int) -> None:
        """Before ``finish()`` takes ``step`` again, persisted (its ``attempt``-th try): the controller
        answers for it from this snapshot only (never the one before: held in memory only, skipped,
        failed), and so does this rank."""
        self._final = (step, len(self.failures))
        if step not in self.taken:
            self.taken.append(step)
        try:
            if self.has("reopen_final"):  # SEAM (#16): an older controller opens it on the persisted staging
                self.call("reopen_final", self.generation, step, self.rank, attempt, step=step)
        except Exception as e:  # noqa: BLE001 - the wait then asks what the controller knows, as before
            logger.warning("cf_ray: rank %d: could not tell the controller of the final checkpoint: %r", self.rank, e)

    def final_failed(self, step: int) -> bool:
        """Whether the controller says the checkpoint of ``step`` failed (``finish()`` tries again)."""
        try:
            report = cast(Settled, self.call("settled", self.generation, [step], step=step))
        except Exception as e:  # noqa: BLE001 - not taken again; the wait said what it knows
            logger.warning("cf_ray: rank %d: cannot ask the controller how step %d settled: %r", self.rank, step, e)
            return False
        return step in report.failed

    def keep_resume_point(self, step: int) -> int:
        """The final model is about to name ``step`` (committed) for ``resume_from``: keep-last never
        deletes it. Returns the step kept, which the final model names (the newest committed step
        when keep-last took ``step`` out first; 0: none)."""
        try:
            if step <= 0 or not self.has("keep_resume_point"):
                return step
            kept = self.call("keep_resume_point", step, step=step)
        except Exception as e:  # noqa: BLE001 - the final model names it all the same, unprotected
            logger.warning("cf_ray: rank %d: could not have step %d kept as the resume point: %r", self.rank, step, e)
            return step
        return 0 if kept is None else int(kept)

    def new_failures(self, raise_on_error: bool) -> list[dict]:
        """The failures not yet reported (each is reported once), an earlier attempt's included.

        Raises:
            PersistError: when ``raise_on_error`` and one of this attempt's is among them (an earlier
                attempt's is reported, never raised: every new attempt would raise it again).
        """
        return self._news.new(raise_on_error)

    def failures_kept_unreported(self) -> contextlib.AbstractContextManager[None]:
        """Failures reported inside stay unreported for the user's next ``wait()``."""
        return self._news.kept_unreported()

    def wait_maintenance(self, step: int | None = None) -> list[int]:
        """Block until the controller's uploads (and clean-up) are done, at most the actor timeout.

        Returns:
            The steps whose upload is still queued or running at the timeout (logged).
        """
        deadline = time.monotonic() + _env.get_float(_env.ACTOR_TIMEOUT_S)
        left: list[int] = []
        # SEAM (#16, driver side): uploads_pending() names what is left; older controllers only
        # say whether their maintenance thread is idle.
        uploads = self.has("uploads_pending")
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
            for sec in sections:
                self._news.add(step, sec, error, self.generation)

    def has(self, method: str) -> bool:
        """Whether the controller has ``method`` (one of older code may not)."""
        return self._line.has(method)

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
