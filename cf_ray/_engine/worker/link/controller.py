"""This rank's one link to the run's controller actor: one handle and one poll, without blocking
the training thread. Split by the state each part owns:

* :class:`ControllerLine`: the controller's handle and its liveness. On a Ray actor error the
  controller is re-resolved (the ``resolve`` callable: the run's controller, made again when it is
  gone): a blocking call waits for it and retries once; a poll starts it on a thread of its own (the
  next poll goes to the new handle). Each incident (calls failing until one is answered) is logged
  once, with the rank and the step, and once more when the controller answers again; how long it
  lasts and how many polls failed in a row feed the durability watchdog (``watchdog.py``).
* :class:`ControllerNews`: what the replies told: failed checkpoints (this attempt's, and an earlier
  attempt's that never committed), each reported once by ``wait()``/``finish()``, and checkpoint
  requests from outside the workers (``cf_ray.preemption.notify_preemption``), each handed on once.
  The sequence numbers seen go back with the next poll, so the controller sends each only once.
* :class:`SyncExchange`: the poll. A step sends a :class:`SyncRequest` (the timing samples since the
  last one, the schedule version received, the failures and requests seen) every
  ``env.BELL_POLL_INTERVAL_S`` once the controller has the rank's doorbell, every
  ``env.POLL_INTERVAL_S`` until then or without one, and picks the previous :class:`SyncReply` up
  only once it has arrived; one poll is in flight at a time. What cannot wait for the next poll (a
  checkpoint request from outside the workers, a new schedule version) rings the rank's
  :class:`~cf_ray._engine.protocol.doorbell.Doorbell` and the next step polls at once. Inside a Ray
  actor a poll carries the bell's address until a reply says that the controller (a new one too)
  has it for this attempt. The request itself still comes in the poll's reply, so a bell that is
  lost, or a rank without one, waits at most one poll interval.
* :class:`ControllerLink`: the facade the step path holds, and the durability state: the steps this
  rank took in this attempt that are not known settled, the newest committed step it knows of.

Blocking calls are for the ends of a run: :meth:`ControllerLink.wait_durable` and the RPCs the user
asks for (the profile, the events).

Durability at the ends (``wait()``/``finish()``): :meth:`ControllerLink.wait_durable` waits until
each step taken is committed, failed, superseded or abandoned (the controller's ``settled``), or the
deadline passed: then each one left is reported as a failure of its own (section ``timeout``).
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
from cf_ray._engine.format.layout import rank_section
from cf_ray._engine.protocol.doorbell import Doorbell
from cf_ray._engine.protocol.events import Event
from cf_ray._engine.protocol.messages import CheckpointRequest, PartFailed, Settled, SyncReply, SyncRequest
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.timing import Timing
from cf_ray.errors import PersistError

logger = logging.getLogger("cf_ray")

#: ``ControllerLink.taken`` is pruned of settled steps when it grows past this (between two waits).
_PRUNE_AT = 64


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


class ControllerNews:
    """Failures and requests this rank heard of, and which failures it reported.

    Args:
        rank: this rank.
        on_request: called with each checkpoint request from the driver, on the training thread.
    """

    def __init__(self, rank: int, on_request: Callable[[CheckpointRequest], None]):
        self.rank = rank
        self.failures: list[dict] = []
        """Failed checkpoints of this attempt, oldest first (``step``, ``section``, ``rank``, ``error``,
        ``generation``), and those of earlier attempts of the run as the controller tells of them
        (marked ``earlier_attempt: True``)."""
        self.seen_failures = -1
        """The newest failure's sequence number heard of (sent with each poll)."""
        self.seen_requests = -1
        """The newest request's sequence number heard of (sent with each poll)."""
        self._on_request = on_request
        self._reported = 0

    def take(self, reply: SyncReply, generation: int) -> None:
        """The failures and requests of a reply (``generation``: this attempt's)."""
        for f in reply.failures:
            self.seen_failures = max(self.seen_failures, f.seq)
            if f.generation == generation:
                self.failures.append(f.as_dict())
                logger.warning(
                    "cf_ray: rank %d: checkpoint of step %d failed (%s): %s; the previous committed "
                    "checkpoint stays the latest",
                    self.rank,
                    f.step,
                    f.section,
                    f.error,
                )
            elif 0 < f.generation < generation:
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
            self.seen_requests = max(self.seen_requests, r.seq)
            self._on_request(r)

    def add(self, step: int, section: str, error: str, generation: int) -> None:
        """A failure this rank found itself."""
        self.failures.append(
            {"step": step, "section": section, "rank": self.rank, "error": error, "generation": generation}
        )

    def add_local(self, errors: list[tuple[int, BaseException]], generation: int) -> None:
        """Snapshots of this rank that never reached its holder (``Snapshotter.take_errors``)."""
        for step, err in errors:
            self.add(step, rank_section(self.rank), f"{type(err).__name__}: {err}", generation)

    def new(self, raise_on_error: bool) -> list[dict]:
        """The failures not yet reported (each is reported once), an earlier attempt's included.

        Raises:
            PersistError: when ``raise_on_error`` and one of this attempt's is among them (an earlier
                attempt's is reported, never raised: every new attempt would raise it again).
        """
        new = self.failures[self._reported :]
        self._reported = len(self.failures)
        own = [f for f in new if not f.get("earlier_attempt")]
        if own and raise_on_error:
            raise PersistError("; ".join(f"step {f['step']} ({f['section']}): {f['error']}" for f in own))
        return new

    @contextlib.contextmanager
    def kept_unreported(self) -> Iterator[None]:
        """Failures reported inside stay unreported for the user's next ``wait()``."""
        reported = self._reported
        try:
            yield
        finally:
            self._reported = reported


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
        if force or now - self._last >= interval:
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


class ControllerLink:
    """One rank's link to the controller, the one object the rank's parts hold: the poll, the
    blocking calls, and what this rank knows of its checkpoints (the steps taken and not known
    settled, the newest committed step, the safe ones). Invariant: a step leaves ``taken`` only once
    it is known committed, failed, superseded or abandoned, or reported as a ``timeout`` failure.

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
        safe in the tier it chose for it (a peer's memory), as this rank last heard."""
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
        warn_at = t0 + _env.WARN_INTERVAL_S
        unsettled: list[int] = []
        while True:
            self.poll(step, copy_timings)  # the failures and the committed step as they come
            try:
                unsettled = self._unsettled(list(self.taken), step, safe_ok=safe_ok)
            except Exception as e:  # noqa: BLE001 - an unreachable controller: what is known locally
                logger.warning(
                    "cf_ray: rank %d: cannot ask the controller which checkpoints are settled: %r", self.rank, e
                )
                unsettled = self._unsettled_locally(list(self.taken))
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
                warn_at = time.monotonic() + _env.WARN_INTERVAL_S
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

    def _unsettled_locally(self, steps: list[int]) -> list[int]:
        """What this rank judges alone when the controller cannot be asked: a step is not settled when
        it is newer than the newest committed step known and than every failed one (one superseded
        by a newer failed one is settled)."""
        failed = self._failed_steps()
        newest_failed = max(failed, default=-1)
        return [s for s in steps if s not in failed and s > self.known_committed and s > newest_failed]

    # -- the final checkpoint (``finish()``) -------------------------------------------------------------
    def reopen_final(self, step: int, attempt: int) -> None:
        """Before ``finish()`` takes ``step`` again, persisted (its ``attempt``-th try): the controller
        answers for it from this snapshot only (never the one before: held in memory only, skipped,
        failed), and so does this rank."""
        self._final = (step, len(self.failures))
        if step not in self.taken:
            self.taken.append(step)
        try:
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
            if step <= 0:
                return step
            kept = self.call("keep_resume_point", step, step=step)
        except Exception as e:  # noqa: BLE001 - the final model names it all the same, unprotected
            logger.warning("cf_ray: rank %d: could not have step %d kept as the resume point: %r", self.rank, step, e)
            return step
        return 0 if kept is None else int(kept)

    def keep_registered(self, step: int) -> int | None:
        """Rank 0 is about to register committed ``step`` with Ray Train: keep-last spares it while
        Ray lists it. Returns the step kept and to be registered (the newest committed one when
        ``step`` is gone already); ``None`` when none is, or the controller could not say (a warning):
        nothing is registered, since Ray would then list a checkpoint that may not load."""
        try:
            kept = self.call("keep_registered", step, step=step)
        except Exception as e:  # noqa: BLE001 - registration is bookkeeping: this one is left out
            logger.warning("cf_ray: rank %d: step %d not registered with Ray Train: %r", self.rank, step, e)
            return None
        return None if kept is None else int(kept)

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
        while time.monotonic() < deadline:
            left = cast(list, self.call("uploads_pending", step=step))
            if not left:
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

    def record_event(self, event: Event, *, wait: bool = False) -> None:
        """An event for the controller's event list (and profile): fire-and-forget, or (``wait``) once
        the controller has recorded it (what another process must see next: a distrusted snapshot)."""
        try:
            if wait:
                self.call("record_event", event)
            else:
                self.controller.record_event.remote(event)
        except Exception as e:  # noqa: BLE001 - bookkeeping never fails training
            logger.warning("cf_ray: rank %d: could not record event %s: %r", self.rank, event.kind, e)

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
