"""What one rank says about durability: the watchdog's episodes (``watchdog.py`` judges, this
module speaks), the ``durability_lost`` / ``durability_restored`` events rank 0 records, the
:class:`~cf_ray.errors.DurabilityLostError` of ``on_durability_lost="raise"``, and how long the end
of the run waits for its checkpoints (``finish_timeout_s``, or derived from this run's persist times).

The watchdog is fed at the end of every step, and also while the training thread waits for a free
snapshot slot (:meth:`Durability.observe` from the slot wait): a storage that hangs is said while the
thread waits, not only once the wait ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn, cast

from cf_ray._engine.protocol.events import DurabilityLostEvent, DurabilityRestoredEvent, FinalNotDurableEvent
from cf_ray._engine.worker.link.controller import ControllerLink
from cf_ray._engine.worker.watchdog import DurabilitySettings, DurabilityWatchdog, Knowledge
from cf_ray.config import CheckpointConfig, DurabilityTimeout
from cf_ray.errors import DurabilityLostError

logger = logging.getLogger("cf_ray")


class Durability:
    """One rank's durability watchdog and its reports.

    Call order (training thread): :meth:`start_attempt` at restore; :meth:`taken` for each checkpoint;
    :meth:`observe` at the end of every step (and during a slot wait); :meth:`raise_lost` when the
    agreement says some rank lost durability with ``on_durability_lost="raise"``.

    Args:
        config: the run's settings (``durability_timeout``, ``on_durability_lost``, ``finish_timeout_s``).
        rank: this rank.
        link: the line to the controller (what it knows; rank 0 records the events through it).
        storage_uri: where checkpoints go (for the messages).
    """

    def __init__(self, config: CheckpointConfig, rank: int, link: ControllerLink, storage_uri: str):
        self.config = config
        self.rank = rank
        self.link = link
        self.storage_uri = storage_uri
        self.timeout = cast(DurabilityTimeout, config.durability_timeout)
        self.watchdog = DurabilityWatchdog(
            DurabilitySettings(timeout_s=self.timeout.seconds, factor=self.timeout.factor, floor_s=self.timeout.floor_s)
        )
        self._lost_reported = False  # rank 0 recorded the episode in progress with the controller

    def start_attempt(self, committed_step: int) -> None:
        self.watchdog.start_attempt(committed_step, time.monotonic())

    def taken(self, step: int) -> None:
        self.watchdog.taken(step, time.monotonic())

    @property
    def raising(self) -> bool:
        """This rank lost durability and the attempt is to fail (posted in the agreement)."""
        return self.watchdog.lost and self.config.on_durability_lost == "raise"

    def late_wait_s(self) -> float:
        """How long a snapshot's background thread waits for the next Checkpointer call."""
        iter_s = self.watchdog.iter_s
        return max(5.0, 4 * iter_s) if iter_s else 5.0

    def finish_limit_s(self) -> float:
        """How long ``finish()`` waits for durability: ``finish_timeout_s``, else derived from the
        persist times this rank saw (``DurabilityWatchdog.finish_limit_s``)."""
        if self.config.finish_timeout_s is not None:
            return float(self.config.finish_timeout_s)
        return self.watchdog.finish_limit_s()

    def not_durable_at_finish(self, step: int, committed: int, limit: float, waited: float) -> None:
        """Rank 0 says that the final checkpoint did not commit within ``finish()``'s wait (never
        silently): how long it waited (``waited`` seconds, of at most ``limit``), and what the final
        model names instead. A wait that ended before its limit ended because the final checkpoint
        failed (its tries are in ``FinishSummary.failures``)."""
        older = f"step {committed}, the newest committed one," if committed > 0 else "no checkpoint"
        why = (
            f"within finish()'s wait of {waited:.0f} s"
            if waited >= limit
            else f"(it failed; finish() waited {waited:.1f} s of at most {limit:.0f} s)"
        )
        logger.warning(
            "cf_ray: the final state (step %d) was not committed %s; the final model names %s for "
            "resume_from=result.checkpoint, %d step(s) before the end. The holder goes on writing it while its "
            "node lives; to wait longer set CheckpointConfig(finish_timeout_s=...)",
            step,
            why,
            older,
            step - committed,
        )
        self.link.record_event(
            FinalNotDurableEvent(
                step=step,
                resume_step=committed,
                waited_s=round(waited, 3),
                limit_s=limit,
                generation=self.link.generation,
            )
        )

    # -- the judgement, said --------------------------------------------------------------------------
    def observe(self, step: int, interval: int | None) -> None:
        """Feed the watchdog what this rank knows; say so when an episode starts or ends."""
        now = time.monotonic()
        link = self.link
        change = self.watchdog.observe(
            Knowledge(
                now=now,
                step=step,
                committed_step=link.known_committed,
                info_time=link.info_time,
                in_flight_s=link.in_flight_s(now),
                poll_failures=link.poll_failures,
                interval_steps=interval,
            )
        )
        if change is None:
            return
        if change.started:
            logger.warning("%s", self._lost_message(step, action=True))
            self._record_lost(step)
            return
        ep = change.episode
        logger.warning(
            "cf_ray: rank %d: durability restored at step %d: step %d committed, %.0f s after the alarm (%s)",
            self.rank,
            step,
            change.committed_step,
            change.lost_s,
            ep.reason.value,
        )
        if self.rank == 0 and self._lost_reported:
            link.record_event(
                DurabilityRestoredEvent(
                    rank=self.rank,
                    step=step,
                    committed_step=change.committed_step,
                    lost_s=change.lost_s,
                    reason=ep.reason.value,
                    generation=link.generation,
                )
            )
        self._lost_reported = False

    def raise_lost(self, step: int) -> NoReturn:
        self._record_lost(step)
        raise DurabilityLostError(
            self._lost_message(step, action=False) + ". The attempt fails because CheckpointConfig(on_durability_lost="
            "'raise'); to tolerate longer stalls set CheckpointConfig(durability_timeout=<seconds>), or "
            "on_durability_lost='warn' to train on without durable checkpoints"
        )

    def _record_lost(self, step: int) -> None:
        """Rank 0 tells the controller (its events, profile and metrics), once per episode."""
        if self.rank != 0 or self._lost_reported:
            return
        self._lost_reported = True
        ep = self.watchdog.episode
        episode: dict[str, Any] = (
            {"reason": ep.reason.value, "since_step": ep.since_step, "waited_s": ep.waited_s, "limit_s": ep.limit_s}
            if ep is not None
            else {"reason": "another_rank"}
        )
        self.link.record_event(
            DurabilityLostEvent(
                rank=self.rank,
                step=step,
                committed_step=self.link.known_committed,
                generation=self.link.generation,
                action=self.config.on_durability_lost,
                failures=tuple(f"step {f['step']} ({f['section']}): {f['error']}" for f in self.link.failures[-3:]),
                **episode,
            )
        )

    def _lost_message(self, step: int, *, action: bool) -> str:
        """What happened, as this rank knows it, and (``action``) what cf_ray does about it."""
        ep = self.watchdog.episode
        config = self.config
        if ep is not None:
            what = f"cf_ray: rank {self.rank}: durability lost at step {step}: {ep.describe()}"
            if self.timeout.seconds is None:
                what += (
                    f" ({self.timeout.factor:g} x the expected {ep.expected_s:.1f} s to a commit, "
                    f"at least DurabilityTimeout.floor_s={self.timeout.floor_s:g})"
                )
        else:
            what = (
                f"cf_ray: rank {self.rank}: durability lost on another rank at step {step} (this rank "
                f"knows of no commit since step {self.link.known_committed})"
            )
        failures = self.link.failures[-3:]
        what += ". Last failures: " + (
            "; ".join(f"step {f['step']} ({f['section']}): {f['error']}" for f in failures)
            if failures
            else "none reported (a storage that hangs, or the controller)"
        )
        what += (
            f". Checkpoints go to {self.storage_uri}: check that it is reachable and writable, and that the "
            "cf_ray controller actor is alive"
        )
        if not action:
            return what
        if config.on_durability_lost == "raise":
            return what + "; the attempt fails (CheckpointConfig(on_durability_lost='raise'))"
        return (
            what + "; training goes on, the newest committed checkpoint stays the one a restart would use "
            "(warned once per episode; on_durability_lost='raise' fails the attempt instead)"
        )


__all__ = ["Durability"]
