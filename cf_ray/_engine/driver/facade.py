"""The controller's logic as one object: a thin RPC facade over its parts, each with one job and one
lock (the Ray actor class wraps it, :mod:`.controller`).

Its parts:

* :class:`~.ledger.Ledger` — generation, schedule, commits, profile, requests, control state
  (:mod:`.checkpoints.commits`, :mod:`cf_ray._engine.observe.profile_book`, :mod:`.schedule`).
  Lock: the controller's (an RLock).
* :class:`~.recovery.Roster` — the run's holders: resync at start and of a new holder, telling them
  what settled, drain and kill at the end. Lock: its own.
* :class:`~.watch.Watch` — asks holders about sections pending too long (a thread). Lock: none of its
  own.
* :class:`~.lifetime.Lifetime` — owner, finished ranks, the reaper (a thread), the linger. Lock: its
  own.
* :class:`~.checkpoints.quarantine.Quarantine` — what is taken out of use, on the controller's own
  evidence: re-read damaged checkpoints, distrusted snapshots. Lock: its own (the file's).
* :class:`~.maintenance.Maintenance` — keep-last, uploads, profile parts, re-reads (a thread).
  Lock: its own condition.

Every RPC is a few lines that call one part or two. Storage I/O and calls to other actors happen
outside the controller's lock; the cluster's facts (alive and draining nodes, GCS calls) are asked
before it is taken, through :class:`ClusterView` (in process: none known, every node alive).

In process — no actor, no Ray — a test builds ``Controller(key, storage, settings, holders=...,
cluster=...)`` with holders reached through any object that has :class:`~.recovery.HolderLink`'s
methods (``tests/controller_harness.py``), as Ray Train's own tests build their controller.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from cf_ray._engine import env as _env
from cf_ray._engine.driver.checkpoints.quarantine import Quarantine
from cf_ray._engine.driver.checkpoints.uploads import tier_steps
from cf_ray._engine.driver.facts import ClusterView, default_cluster
from cf_ray._engine.driver.ledger import Ledger
from cf_ray._engine.driver.lifetime import Lifetime
from cf_ray._engine.driver.maintenance import Maintenance
from cf_ray._engine.driver.recovery import HolderLink, Roster, in_ray_actor, was_reconstructed
from cf_ray._engine.driver.settings import ControllerSettings
from cf_ray._engine.driver.watch import Watch
from cf_ray._engine.observe.profile_files import delete_other_lineages, newest_lineage
from cf_ray._engine.protocol.cluster import Owner, run_name_of
from cf_ray._engine.protocol.doorbell import ring_all
from cf_ray._engine.protocol.events import Event, RestoreFallbackEvent, as_event
from cf_ray._engine.protocol.messages import (
    HOLDER_MESSAGES,
    CheckpointKind,
    CheckpointRequest,
    Distrusted,
    HolderState,
    PartDurable,
    PartFailed,
    PartReplicated,
    PartStaged,
    PartSuperseded,
    Restored,
    RestorePlan,
    SectionState,
    Settled,
    SyncReply,
    SyncRequest,
)
from cf_ray._engine.storage.base import Storage

logger = logging.getLogger("cf_ray")

_AUTO = object()
#: Seconds a restore plan waits for the holders to deliver the messages they queued (``Roster.flush``).
FLUSH_TIMEOUT_S = 5.0


class Controller:
    """The controller's logic (the Ray actor class is ``controller.ControllerActor``).

    Args:
        key: the run key.
        storage: the run's storage.
        settings: from the user's config.
        holders: how to reach the run's holders; by default a :class:`HolderLink` inside a Ray
            actor and none in process.
        cluster: the cluster's facts (alive and draining nodes); by default Ray's inside an actor
            and none in process.
    """

    def __init__(
        self,
        key: str,
        storage: Storage,
        settings: ControllerSettings,
        *,
        holders: Any = _AUTO,
        cluster: ClusterView | None = None,
    ):
        self.key = key
        self.storage = storage
        resumed = was_reconstructed() or settings.recreated
        link = (HolderLink(key, _env.namespace()) if in_ray_actor() else None) if holders is _AUTO else holders
        self._cluster = cluster or default_cluster()
        lineage = newest_lineage(storage) if resumed else None
        self._ledger = Ledger(
            key,
            storage,
            settings.policy,
            resumed=resumed,
            lineage=lineage,
            on_commit=self._after_commit,
            on_profile_batch=lambda: self._maintenance.profile_batch_ready(),
        )
        self._maintenance = Maintenance(
            storage,
            tiers=settings.tiers,
            keep_last=settings.keep_last,
            upload_milestones_only=settings.upload_milestones_only,
            lock=self._ledger.lock,
            commits=self._ledger.commits,
            book=self._ledger.book,
            periodic=[
                (_env.POLICY_SAVE_INTERVAL_S, self._ledger.save_policy_state),
                (_env.WINDOW_SAVE_INTERVAL_S, self._ledger.save_window),
            ],
        )
        if lineage is None:
            keep = self._ledger.book.parts.lineage
            self._maintenance.run_soon(lambda: delete_other_lineages(storage, keep))
        self._lifetime = Lifetime(
            key,
            settings.owner,
            release_after_fit_s=settings.release_after_fit_s,
            replaced_dead_run=settings.replaces_dead_run,
        )
        # A checkpoint that did not commit is saved with the controller's state, off the thread that
        # learnt of it (storage may be what failed): one that starts again still reports it.
        self._ledger.book.log.on_failure = lambda: self._maintenance.run_soon(self._ledger.write_control_state)
        # An event (a restore, a fallback, a quarantine) is saved with the profile's window: one
        # that starts again still lists it.
        self._ledger.book.log.on_event = self._maintenance.changed
        self._roster = Roster(
            key, link, apply=self.apply_holder_state, owner=lambda: self._lifetime.owner, restarted=resumed
        )
        self._watch = Watch(self._ledger, self._roster)
        self._quarantine = Quarantine(
            storage,
            lock=self._ledger.lock,
            commits=self._ledger.commits,
            book=self._ledger.book,
            run_soon=self._maintenance.run_soon,
        )
        self._stopping = threading.Event()
        self._shutdown_lock = threading.Lock()
        if settings.replaces_dead_run:
            newest = self._ledger.commits.newest_step()
            logger.warning(
                "cf_ray: %s; the previous driver is gone",
                f"resuming run {run_name_of(key)} from storage (step {newest})"
                if newest is not None
                else f"starting run {run_name_of(key)} clean (nothing committed on storage)",
            )
        self._roster.start()
        if link is not None and in_ray_actor():  # in process, tests call watch_once() themselves
            threading.Thread(target=self._watch.loop, args=(self._stopping,), name="cf_ray-watch", daemon=True).start()
        if in_ray_actor() and settings.owner is not None and settings.owner.job_id:
            threading.Thread(
                target=self._lifetime.reaper, args=(self._stopping, self.shutdown), name="cf_ray-reaper", daemon=True
            ).start()

    @property
    def generation(self) -> int:
        return self._ledger.generation

    @generation.setter
    def generation(self, value: int) -> None:
        with self._ledger.lock:
            self._ledger.generation = value

    # -- attempts and restores ---------------------------------------------------------------------------
    def prepare_restore(self, world_size: int) -> RestorePlan:
        """Called by rank 0 at the start of every attempt: a new generation and a restore plan.
        A controller that just started waits (at most ``env.RESYNC_TIMEOUT_S``) until the holders
        have said what they hold, so that a memory restore is not missed. Until this attempt has
        restored, keep-last deletes nothing: the plan names checkpoints that a late commit of the
        previous attempt would otherwise push out (``keep_last=1``)."""
        self._roster.resynced.wait(timeout=_env.RESYNC_TIMEOUT_S)
        self._roster.flush(FLUSH_TIMEOUT_S)  # snapshots handed off just before the failure are known
        alive = self._cluster.alive_node_ids()
        self._maintenance.defer_deletions()
        self._lifetime.new_attempt(world_size)
        generation, memory, storage_steps, schedules = self._ledger.new_attempt(world_size, alive)
        tiers = tier_steps(self._maintenance.tiers)
        return RestorePlan(
            generation=generation, memory=memory, storage=storage_steps, tiers=tiers, schedules=schedules
        )

    def restored(self, info: Restored) -> None:
        """Rank 0 reports where the attempt resumed from. Snapshots of earlier generations past the
        restored step belong to a timeline that this attempt replays; they are not committed (one
        lost with its node is reported as a failure). Keep-last runs again from here."""
        alive = self._cluster.alive_node_ids()
        self._maintenance.resume_deletions()  # what was deferred during the restore
        self._roster.tell(self._ledger.restored(info, alive))

    def distrust(self, generation: int, step: int, reason: str) -> Distrusted:
        """A worker says the snapshot ``(generation, step)`` is not to be trusted (the run went
        non-finite after restoring it): it is never offered to a restore plan again, and when it was
        committed its checkpoint is quarantined with ``reason`` (kept on storage for inspection)."""
        out = self._quarantine.distrust(generation, step, reason)
        self._ledger.write_control_state()
        return out

    # -- worker polls ------------------------------------------------------------------------------------
    def sync(self, req: SyncRequest) -> SyncReply:
        """Non-blocking exchange with a worker: its samples in, the schedule and commit state out."""
        reply = self._ledger.sync(req)
        self._ring_doorbells()
        return reply

    def request_checkpoint(self, deadline_unix: float | None, detail: str = "") -> CheckpointRequest:
        """A preemption (or resize) notice from outside the workers, for every rank of this attempt
        (``cf_ray.preemption.notify_preemption``): each rank's doorbell is rung, so that its next
        step polls at once and reads it (a rank whose bell is not known hears of it at its next poll)."""
        req = self._ledger.request(deadline_unix, detail)
        self._ring_doorbells()
        return req

    def settled(self, generation: int, steps: list[int]) -> Settled:
        """Which of ``steps`` (of ``generation``) are settled — nothing more will happen to them — and
        how (:class:`Settled`); ``resynced`` is false while a controller that just started is still
        asking the holders what they hold."""
        out = self._ledger.settled(generation, steps)
        return out if self._roster.resynced.is_set() else _replace(out, resynced=False)

    def reopen_final(self, generation: int, step: int, rank: int, attempt: int) -> bool:
        """``finish()`` on ``rank`` is about to take ``step`` again, persisted (its ``attempt``-th try):
        the step is pending until that snapshot commits or fails, whatever the snapshot before it said
        (held in memory only, a rank's skip, a failed write), so that ``settled`` never answers for it
        from the old one (:meth:`.checkpoints.pending.PendingTable.reopen_final`). False: it is committed."""
        with self._ledger.lock:
            return self._ledger.commits.table.reopen_final(int(generation), int(step), int(rank), int(attempt))

    def keep_resume_point(self, step: int) -> int | None:
        """The final model names ``step`` as the run's resume point: never deleted by keep-last
        (:meth:`.checkpoints.committed.CommittedIndex.keep_resume_point`). Returns the step kept."""
        with self._ledger.lock:
            return self._ledger.commits.index.keep_resume_point(int(step))

    def keep_registered(self, step: int) -> int | None:
        """A rank is about to register ``step`` with Ray Train: keep-last spares it while Ray lists it
        (:meth:`.checkpoints.committed.CommittedIndex.keep_registered`). Returns the step kept: ``step``,
        or the newest committed one when keep-last took ``step`` out already (``None``: none)."""
        with self._ledger.lock:
            return self._ledger.commits.index.keep_registered(int(step))

    def ping(self) -> dict:
        """A cheap liveness check: ``{"generation": int, "resynced": bool}``."""
        return {"generation": self.generation, "resynced": self._roster.resynced.is_set()}

    def owner(self) -> Owner | None:
        """The run this controller belongs to (:mod:`cf_ray._engine.protocol.cluster`)."""
        return self._lifetime.owner

    def attach(self, owner: Owner, train_handle=None) -> None:
        """A ``fit()`` of this run's driver uses this controller (:meth:`.lifetime.Lifetime.attach`)."""
        self._lifetime.attach(owner, train_handle)

    def lifetime(self) -> dict:
        """``{"owner_job": str, "train_run": str | None, "replaced_dead_run": bool}``."""
        return self._lifetime.info()

    def run_over(self, now: float | None = None) -> str | None:
        """Why the run is over, or ``None`` (:meth:`.lifetime.Lifetime.run_over`)."""
        return self._lifetime.run_over(now)

    # -- holders -----------------------------------------------------------------------------------------
    # Each returns the step's state after the message (a SectionState, or None when this controller
    # knows nothing of it); every one is idempotent (a holder re-sends what it is unsure arrived).
    def part_staged(self, msg: PartStaged) -> SectionState | None:
        # A just-in-time checkpoint's safety depends on which nodes are draining: a GCS call, made
        # before the lock is taken (commits and polls never wait for it).
        preempt = CheckpointKind(msg.meta.kind) is CheckpointKind.PREEMPT and msg.meta.deadline_unix is not None
        draining = self._cluster.draining_nodes() if preempt else None
        new = self._roster.note(msg.holder)
        state, settled = self._ledger.staged(msg, draining)
        return self._told(state, settled, msg.holder, new)

    def part_superseded(self, msg: PartSuperseded) -> SectionState | None:
        new = self._roster.note(msg.holder)
        return self._told(*self._ledger.superseded(msg), msg.holder, new)

    def part_replicated(self, msg: PartReplicated) -> SectionState | None:
        """A peer replica of a section is held by a holder of another node (or was skipped or failed)."""
        new = self._roster.note(msg.origin)
        return self._told(self._ledger.replicated(msg), [], msg.origin, new)

    def part_durable(self, msg: PartDurable) -> SectionState | None:
        new = self._roster.note(msg.holder)
        out = self._told(*self._ledger.durable(msg), msg.holder, new)
        self._ring_doorbells()
        return out

    def _ring_doorbells(self) -> None:
        """A checkpoint request came, or a new schedule version was published (from a poll's samples
        or a persist time): every rank's doorbell is rung on a thread, so each polls at its next step."""
        bells = self._ledger.take_rings()
        if not bells:
            return

        def ring() -> None:
            rang = ring_all(bells)
            logger.info("cf_ray: rang %d of %d ranks' doorbells", rang, len(bells))

        threading.Thread(target=ring, name="cf_ray-bells", daemon=True).start()

    def part_failed(self, msg: PartFailed) -> SectionState | None:
        new = self._roster.note(msg.holder)
        return self._told(*self._ledger.failed(msg), msg.holder, new)

    def deliver(self, batch: tuple[tuple[str, Any], ...]) -> list[str]:
        """Messages of one holder in the order it queued them (its sender hands over what is queued in
        one call: at a checkpoint every iteration, one Ray call instead of one per section), each
        applied as if it came alone. Returns one line per message refused (the others are applied)."""
        refused = []
        for method, msg in batch:
            if method not in HOLDER_MESSAGES:
                refused.append(f"{method}: not a message a holder sends")
                continue
            try:
                getattr(self, method)(msg)
            except Exception as e:  # noqa: BLE001 - one bad message must not drop the ones after it
                refused.append(f"{method} (step {getattr(msg, 'step', '?')}): {e!r}")
        return refused

    def apply_holder_state(self, state: HolderState) -> None:
        """What a holder holds and did (``Holder.resync``), applied as if each message came again."""
        self._roster.note(state.holder)
        self._roster.tell(self._ledger.apply_state(state))

    def _after_commit(self, step: int, m: Any) -> None:
        """Under the lock, after each commit: clean-up and uploads, and a quarantine of an earlier
        checkpoint of this step lifted (a later attempt committed the step again, intact)."""
        self._maintenance.after_commit(step, m)
        self._quarantine.recommitted(step, int(m.generation))

    def _told(self, state: SectionState | None, settled: list, holder: str, new: bool) -> SectionState | None:
        self._roster.tell(settled)
        self._roster.resync_if_new(holder, new)
        return state

    def watch_once(self, min_age_s: float | None = None) -> None:
        """Ask the holders about sections pending for at least ``min_age_s`` (:mod:`.watch`)."""
        self._watch.once(min_age_s)

    # -- maintenance --------------------------------------------------------------------------------------
    def uploads_pending(self) -> list[int]:
        """Steps whose upload to the tiers is queued or running, oldest first (``Checkpointer.finish``
        waits until this is empty, or reports what is left)."""
        return self._maintenance.uploads_pending()

    # -- what users read ----------------------------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        """Every row of this run's profile so far: the parts on storage and the rows in memory."""
        return self._ledger.profile_rows()

    def iteration_rows(self) -> list[dict]:
        return self._ledger.iteration_rows()

    def events(self) -> list[dict]:
        return self._ledger.events()

    def explain(self) -> Any:
        """Why the interval is what it is (the policy's ``explain()``), for users and notebooks."""
        return self._ledger.explain()

    def record_event(self, event: Event | dict) -> None:
        """An event from a worker (typed, or its plain form: :class:`EventError` for one that names
        no known kind or lacks a field). A ``restore_fallback`` from this run's storage that found
        damage makes the controller re-read that checkpoint (quarantined only if it is damaged); one
        from memory whose bytes failed verification takes that snapshot out of every later plan."""
        event = as_event(event)
        self._ledger.record_event(event)
        if not isinstance(event, RestoreFallbackEvent):
            return
        step, generation = event.step, event.generation
        if not event.damaged or not isinstance(step, int):
            return
        error = str(event.error if event.error is not None else "damaged")[:500]
        if event.source == "memory":
            if isinstance(generation, int):
                self._quarantine.distrust(
                    generation, step, f"failed verification in a restore: {error}", source="memory"
                )
                self._ledger.write_control_state()
        elif event.source == "storage":
            self._quarantine.suspect(step, error)

    def summary(self) -> dict:
        return self._ledger.summary()

    # -- the end of a run ----------------------------------------------------------------------------------
    def finish(self, rank: int, world_size: int) -> None:
        self._ledger.forget_bell(rank)  # a handle held here would keep a user's own actor alive
        if self._lifetime.finish(rank, world_size):
            self.save_profile()
            threading.Thread(
                target=self._lifetime.linger_then, args=(self.shutdown,), name="cf_ray-linger", daemon=True
            ).start()

    def save_profile(self) -> None:
        """Write the profile table and the policy's state to storage (never raises)."""
        self._ledger.save_profile()

    def shutdown(self) -> None:
        """Ask this run's holders to finish what they are writing (at most ``CF_RAY_DRAIN_TIMEOUT_S``,
        logged when they do not), let the queued uploads finish (as long again), write the profile,
        then kill the holders and exit (used at the end of a run, by the reaper, and by tests).
        A second call while one runs waits for it."""
        with self._shutdown_lock:
            self._stopping.set()
            timeout_s = _env.get_float(_env.DRAIN_TIMEOUT_S)
            names = self._roster.drain(timeout_s)
            if not self._maintenance.wait_idle(timeout_s):
                logger.warning(
                    "cf_ray: uploads of steps %s not finished within %s=%.0f s at the end of the run",
                    self._maintenance.uploads_pending(),
                    _env.DRAIN_TIMEOUT_S,
                    timeout_s,
                )
            self.save_profile()
            self._roster.kill(names)
            self._maintenance.stop()
            if in_ray_actor():
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def _replace(settled: Settled, **kw) -> Settled:
    import dataclasses

    return dataclasses.replace(settled, **kw)


__all__ = ["Controller"]
