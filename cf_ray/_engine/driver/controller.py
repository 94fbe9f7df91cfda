"""The driver-side controller: one Ray actor per run that schedules, commits and remembers.

How a run finds its controller: it is a *named, detached* actor,
``cf_ray.controller.<run key>`` in the ``cf_ray`` namespace (``CF_RAY_NAMESPACE``), where the run
key is derived from the run's storage location and name. Every worker's :class:`Checkpointer`
gets it with ``get_if_exists=True``, so the first worker of a run creates it and workers restarted
by Ray Train (same run) find the same one, with its schedule, its profile and its index of
in-memory snapshots intact. It uses ``num_cpus=0`` and never blocks a worker: workers poll it
with non-blocking calls and read the answers when they are ready.

When the driver restarts (a new ``trainer.fit()`` with the same ``RunConfig(name, storage_path)``),
a new controller is created and rebuilds what matters from storage: the committed checkpoints, the
generation counter and the saved profile (so the interval does not have to be profiled again from
scratch). It exits on its own ``CF_RAY_CONTROLLER_LINGER_S`` seconds after every rank has called
``Checkpointer.finish()``, after asking every holder to finish what it is writing and writing the
profile table to storage.

Lifetime (issue #16, :mod:`cf_ray._engine.protocol.cluster`): the controller records its owner — the driver's Ray job and
the Ray Train run (``fit()``) — and its reaper thread ends the run's actors (holders drained first)
when the job is dead, or when the Ray Train run ended while no rank had called ``finish()``. A
controller of the same run key whose owner is gone is never reused: :func:`get_or_create_controller`
shuts it down (its holders drained and killed) and creates a new one, with the new config, that
starts from storage only and says so. A controller of the same run (Ray Train restarting workers)
is reused. It is placed on the head node with a *hard* affinity (``num_cpus=0`` fits a 0-CPU head):
the design (docs/ARCHITECTURE.md) draws it on the driver side, and a soft affinity requested from a
worker lands it on the worker's node, which may be lost.

Liveness and recovery (issue #16): the controller is created detached (the creating worker does
not own it) with ``max_restarts=-1``: when its process dies (OOM, a bug), Ray runs the constructor
again, which rebuilds the state from storage (committed manifests, ``policy_state.json``,
``control_state.json`` — the generation and recent restores, :mod:`.recovery`) and from the holders
of this run on every alive node (``Holder.resync``: what each holds and has done lately; also asked
of any holder that first contacts it later). Its generation is then at least the newest any holder
or worker reports, and it numbers schedule versions, failures and requests above its predecessor's
(:mod:`.schedule`). A controller that is gone for good (killed) is created again by whoever needs it:
the workers call :func:`resolve_controller` when a call to it fails; the holders look it up by name
again for every message they could not deliver (:mod:`cf_ray._engine.node.sender`). Every holder
message is idempotent here. A watch thread asks the holders about sections pending too long
(``Holder.lookup``): a lost message is recovered, and a section whose holder died or came back empty
fails, so the steps after it commit and nobody waits for ever.

What it does:
* keeps the schedule: the policy's interval, published as numbered versions that the ranks adopt
  together (see ``worker/control.py``) — :mod:`.schedule`;
* tracks every section of every snapshot: staged in a holder (memory), durable (storage),
  failed or superseded; commits a checkpoint — writes its manifest — only when every section of
  that step and generation is durable (:mod:`.commits`); then applies keep-last clean-up and
  copies it to the upload tiers, on its maintenance thread (no clean-up between a restore plan and
  the restore) — :mod:`.maintenance`;
* answers restore plans: the newest complete in-memory snapshot and the committed checkpoints;
  and which steps of an attempt are settled (:meth:`Controller.settled`);
* keeps the profile table (one row per checkpoint) and the events (restores, failures) —
  :mod:`.profile_book`.

:class:`Controller` is the RPC facade over these parts. Every RPC takes the one controller lock
(an ``RLock``: the parts call back into each other under it) for its bookkeeping only: storage I/O
(a manifest, the profile, the control state) and calls to other actors happen after it is released
(a commit is decided under the lock, written without it, and recorded under it again). The
maintenance thread takes the lock for its reads of the committed index and the pending table, never
while it deletes or uploads. The messages it exchanges are the typed, versioned ones of :mod:`.messages`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.driver.commits import CommitBook, CommitJob, load_committed
from cf_ray._engine.driver.maintenance import Maintenance, tier_steps
from cf_ray._engine.driver.profile_book import ProfileBook, delete_other_lineages, newest_lineage
from cf_ray._engine.driver.recovery import ControlState, HolderBusy, HolderLink, in_ray_actor, was_reconstructed
from cf_ray._engine.driver.schedule import ScheduleBook
from cf_ray._engine.driver.schedule import explain as explain_policy
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.format.manifest import QUARANTINE, load_quarantine, write_quarantine
from cf_ray._engine.protocol import cluster
from cf_ray._engine.protocol.actors import resolve_live
from cf_ray._engine.protocol.cluster import (
    Owner,
    current_owner,
    fit_over,
    head_node_id,
    owner_gone,
    run_name_of,
    train_controller,
)
from cf_ray._engine.protocol.messages import (
    CheckpointKind,
    CheckpointRequest,
    HolderState,
    Message,
    PartDurable,
    PartFailed,
    PartReplicated,
    PartStaged,
    PartSuperseded,
    Restored,
    RestorePlan,
    RestoreSource,
    SectionState,
    SyncReply,
    SyncRequest,
)
from cf_ray._engine.protocol.naming import controller_name, run_key
from cf_ray._engine.storage.fs import Storage
from cf_ray.policy import FrequencyPolicy, Sample

logger = logging.getLogger("cf_ray")

_AUTO = object()

#: What ``Holder.lookup`` says of a section it does not have.
_UNKNOWN = "unknown"


@dataclass(kw_only=True, slots=True)
class ControllerSettings:
    """What the controller needs from the user's CheckpointConfig (picklable, no live objects)."""

    policy: FrequencyPolicy
    """The checkpoint-frequency policy (the controller's copy plans the schedule)."""
    keep_last: int | None
    """How many committed checkpoints to keep (milestones aside); ``None``: all."""
    tiers: list  # list[Storage]
    """Upload destinations, fastest first."""
    upload_milestones_only: bool
    """Copy only milestones to the upload tiers."""
    recreated: bool = False
    """This controller replaces one that died while workers ran (set by :func:`resolve_controller`):
    it numbers schedule versions, failures and requests above anything the earlier one handed out,
    and continues its profile."""
    owner: Owner | None = None
    """The run this controller belongs to: its driver's job and Ray Train run (set by
    :func:`get_or_create_controller`; ``None``: unknown, no reaper)."""
    replaces_dead_run: bool = False
    """An earlier controller of this run key belonged to a driver that is gone: it was shut down,
    and this one starts from storage only (never from that run's holders) and says so."""
    release_after_fit_s: float = 120.0
    """How long the actors outlive a ``fit()`` that ended without ``finish()`` while its driver lives
    (``CheckpointConfig.release_after_fit_s``)."""


class Controller:
    """The controller's logic (the Ray actor class is :data:`ControllerActor`): the RPC facade
    over the schedule, the commit bookkeeping, the maintenance thread and the profile.

    Args:
        key: the run key.
        storage: the run's storage.
        settings: from the user's config.
        holders: how to reach the run's holders; by default a :class:`HolderLink` inside a Ray
            actor and none in process (tests drive the controller directly, holders are names).
    """

    def __init__(self, key: str, storage: Storage, settings: ControllerSettings, *, holders: Any = _AUTO):
        self.key = key
        self.storage = storage
        self._lock = threading.RLock()
        resumed = was_reconstructed() or settings.recreated
        self._link: HolderLink | None = (
            (HolderLink(key, _env.namespace()) if in_ray_actor() else None) if holders is _AUTO else holders
        )
        committed, newest_generation = load_committed(storage)
        self._quarantine: dict[int, str] = load_quarantine(storage)
        self._control = ControlState(storage)
        saved_generation, restores = self._control.load()
        self.generation = max(newest_generation, saved_generation)
        self._state_seq = 0
        base = int(time.time() * 1000) if resumed else 0  # numbers above a predecessor's (see .schedule)
        self._schedule = ScheduleBook(settings.policy, storage, version_base=base)
        lineage = newest_lineage(storage) if resumed else None
        self._book = ProfileBook(
            key, storage, self._schedule, lineage=lineage, seq_base=base, on_batch=self._on_profile_batch
        )
        self._commits = CommitBook(
            storage,
            committed,
            book=self._book,
            schedule=self._schedule,
            on_commit=self._after_commit,
            restores=restores,
            draining=cluster.draining_nodes if in_ray_actor() else None,
        )
        self._maintenance = Maintenance(
            storage,
            tiers=settings.tiers,
            keep_last=settings.keep_last,
            upload_milestones_only=settings.upload_milestones_only,
            lock=self._lock,
            commits=self._commits,
            book=self._book,
            periodic=(_env.get_float(_env.POLICY_SAVE_INTERVAL_S), self._save_policy_state),
        )
        if lineage is None:
            keep = self._book.parts.lineage
            self._maintenance.run_soon(lambda: delete_other_lineages(storage, keep))
        self._world_size: int | None = None
        self._finished: set[int] = set()
        self._holders: set[str] = set()
        self._resyncing: set[str] = set()
        self._requests: collections.deque[CheckpointRequest] = collections.deque(maxlen=64)  # notify_preemption
        self._request_seq = base
        self._resynced = threading.Event()
        """Set once the holders alive at the start were asked what they hold."""
        self._stopping = threading.Event()
        self._shutdown_lock = threading.Lock()
        self._owner = settings.owner
        self._release_after_fit_s = settings.release_after_fit_s
        self._fit_over_since: float | None = None
        self._train_handle = None
        """The ``TrainController`` of the owner's ``fit()`` (set by :meth:`attach`)."""
        """Monotonic time the reaper first saw the owner's ``fit()`` over (``None``: not over)."""
        self._replaced_dead_run = settings.replaces_dead_run
        if settings.replaces_dead_run:
            newest = self._commits.newest_step()
            logger.warning(
                "cf_ray: %s; the previous driver is gone",
                f"resuming run {run_name_of(key)} from storage (step {newest})"
                if newest is not None
                else f"starting run {run_name_of(key)} clean (nothing committed on storage)",
            )
        if self._link is not None:
            threading.Thread(target=self._rebuild_from_holders, name="cf_ray-resync", daemon=True).start()
        else:
            self._resynced.set()
        if self._link is not None and in_ray_actor():  # in process, tests call watch_once() themselves
            threading.Thread(target=self._watch_loop, name="cf_ray-watch", daemon=True).start()
        if in_ray_actor() and self._owner is not None and self._owner.job_id:
            threading.Thread(target=self._reaper_loop, name="cf_ray-reaper", daemon=True).start()

    # -- generations and restore --------------------------------------------------------------
    def prepare_restore(self, world_size: int) -> RestorePlan:
        """Called by rank 0 at the start of every attempt: a new generation and a restore plan.
        A controller that just started waits (at most ``CF_RAY_RESYNC_TIMEOUT_S``) until the holders
        have said what they hold, so that a memory restore is not missed."""
        self._resynced.wait(timeout=_env.get_float(_env.RESYNC_TIMEOUT_S))
        alive = cluster.alive_node_ids()
        with self._lock:
            self.generation += 1
            # Until this attempt has restored, keep-last deletes nothing: the plan names checkpoints
            # that a late commit of the previous attempt would otherwise push out (keep_last=1).
            self._maintenance.defer_deletions()
            self._event(self._schedule.reprofile_if_resized(self._world_size, world_size))
            self._world_size = world_size
            self._finished.clear()
            self._requests.clear()  # a notice for the previous attempt is moot
            memory = self._commits.newest_in_memory(alive)  # copies on lost nodes do not count
            storage_steps = tuple(self._commits.committed_steps(newest_first=True))
            generation, schedules = self.generation, self._schedule.all()
            state = self._control_state()
        self._control.write(*state)
        return RestorePlan(
            generation=generation,
            memory=memory,
            storage=storage_steps,
            tiers=tier_steps(self._maintenance.tiers),
            schedules=schedules,
        )

    def restored(self, info: Restored) -> None:
        """Rank 0 reports where the attempt resumed from.

        Snapshots of earlier generations past the restored step belong to a timeline that this
        attempt replays; they are not committed (nor are their late messages, see
        :meth:`CommitBook.abandon_after`). Those at or before it are valid and may still commit
        (the holders keep writing them), which keeps a memory restore durable. Keep-last clean-up,
        held back since :meth:`prepare_restore`, runs again from here.
        """
        with self._lock:
            self._maintenance.resume_deletions()  # what was deferred during the restore
            self._book.add_event(
                {
                    "source": RestoreSource(info.source).value,
                    "step": info.step,
                    "epoch": info.epoch,
                    "seconds": info.seconds,
                    "world_size": info.world_size,
                    "saved_world_size": info.saved_world_size,
                    **info.extra,
                    "event": "restore",
                    "generation": self.generation,
                    "time": time.time(),
                }
            )
            for gen, step in self._commits.abandon_after(self.generation, info.step):
                self._book.note_abandoned(gen, step)
            state = self._control_state()
            settled = self._commits.take_settled()
        self._control.write(*state)
        self._tell_holders(settled)

    def _control_state(self) -> tuple[int, int, dict[int, int]]:
        self._state_seq += 1
        return self._state_seq, self.generation, dict(self._commits.restores)

    # -- worker polls ----------------------------------------------------------------------------
    def sync(self, req: SyncRequest) -> SyncReply:
        """Non-blocking exchange with a worker: its samples in, the schedule and commit state out."""
        with self._lock:
            # A controller that started again continues above what the workers have seen.
            self.generation = max(self.generation, req.generation)
            self._event(self._schedule.continue_above(req.adopted_version))
            self._book.continue_failures_above(req.seen_failures)
            self._request_seq = max(self._request_seq, req.seen_requests)
            for s in req.samples:
                sample = Sample(**s)
                self._schedule.add_sample(sample)
                self._book.add_iteration(req.rank, sample.step, sample.iter_s, sample.iters)
            for stats in req.ckpt_stats:
                self._book.add_rank_timings(req.generation, req.rank, stats)
            self._event(self._schedule.replan())
            return SyncReply(
                schedules=self._schedule.since(req.adopted_version),
                committed_step=self._commits.newest_step() or 0,
                failures=self._book.failures_since(req.seen_failures),
                requests=tuple(r for r in self._requests if r.seq > req.seen_requests),
            )

    def request_checkpoint(self, deadline_unix: float | None, detail: str = "") -> CheckpointRequest:
        """A preemption (or resize) notice from outside the workers, for every rank of this attempt
        (``cf_ray.preemption.notify_preemption``)."""
        with self._lock:
            self._request_seq += 1
            req = CheckpointRequest(
                seq=self._request_seq,
                deadline_unix=deadline_unix,
                detail=str(detail),
                time_unix=time.time(),
                generation=self.generation,
            )
            self._requests.append(req)
            self._book.add_event(
                {
                    "seq": req.seq,
                    "deadline_unix": req.deadline_unix,
                    "detail": req.detail,
                    "time": req.time_unix,
                    "generation": req.generation,
                    "event": "notice",
                }
            )
            return req

    def settled(self, generation: int, steps: list[int]) -> dict:
        """Which of ``steps`` (of ``generation``) are settled — nothing more will happen to them —
        and how. Returns::

            {"generation": int,
             "committed": [step, ...],          # manifest written (or on storage)
             "failed": {step: "section: error"}, # a section or the manifest could not be written
             "superseded": [step, ...],         # replaced by a newer snapshot before it was written
             "abandoned": [step, ...],          # past a later attempt's restore point, or its files
                                                #   were gone when a restarted controller re-learnt it
             "pending": [step, ...],            # known, some section not durable yet (not settled)
             "unknown": [step, ...],            # never heard of (not settled: its part_staged may
                                                #   not have arrived yet, or the controller restarted)
             "safe": [step, ...],               # just-in-time checkpoints pending on storage but safe
                                                #   in the tier chosen for them: a peer's memory (#12)
             "newest_committed": int | None,    # the newest committed step of any generation
             "resynced": bool}                  # False while a controller that just started is
                                                #   still asking the holders what they hold

        A step is settled when it is in ``committed``, ``failed``, ``superseded`` or ``abandoned``.
        """
        with self._lock:
            out = self._commits.settled_report(int(generation), list(steps))
            out["safe"] = self._commits.safe_steps(int(generation), list(out["pending"]))
        out["resynced"] = self._resynced.is_set()
        return out

    def ping(self) -> dict:
        """A cheap liveness check: ``{"generation": int, "resynced": bool}``."""
        return {"generation": self.generation, "resynced": self._resynced.is_set()}

    def owner(self) -> Owner | None:
        """The run this controller belongs to (:mod:`cf_ray._engine.protocol.cluster`)."""
        return self._owner

    def attach(self, owner: Owner, train_handle=None) -> None:
        """A ``fit()`` of this run's driver uses this controller (the first, or a later one: the
        notebook's re-run cell, the next segment of an elastic schedule): it is the run's ``fit()``
        from now on, and the reaper's clock for the previous one stops. ``train_handle``: that
        ``fit()``'s ``TrainController``, asked by the reaper whether the ``fit()`` is over."""
        with self._lock:
            if self._owner is not None and owner.train_run and owner.same_run(self._owner):
                if owner.train_run != self._owner.train_run:
                    self._owner = dataclasses.replace(self._owner, train_run=owner.train_run)
                if train_handle is not None:
                    self._train_handle = train_handle
                self._fit_over_since = None

    def lifetime(self) -> dict:
        """``{"owner_job": str, "train_run": str | None, "replaced_dead_run": bool}``: whose run this
        is, and whether it replaced the controller of a run whose driver was gone."""
        return {
            "owner_job": self._owner.job_id if self._owner is not None else "",
            "train_run": self._owner.train_run if self._owner is not None else None,
            "replaced_dead_run": self._replaced_dead_run,
        }

    # -- holders -----------------------------------------------------------------------------------
    # Each returns the step's state after the message (a SectionState, or None when this controller
    # knows nothing of it); every one is idempotent (a holder re-sends what it is unsure arrived).
    def part_staged(self, msg: PartStaged) -> SectionState | None:
        # A just-in-time checkpoint's tier depends on which nodes are draining: a GCS call, made
        # before the lock is taken (commits and polls never wait for it).
        draining = (
            self._commits.draining_nodes()
            if CheckpointKind(msg.meta.kind) is CheckpointKind.PREEMPT and msg.meta.deadline_unix is not None
            else None
        )
        with self._lock:
            new = self._note_holder(msg.holder)
            self.generation = max(self.generation, msg.generation)
            job = self._staged(msg, resync=False, draining=draining)
            state, settled = self._commits.state_of(msg.generation, msg.step), self._commits.take_settled()
        self._complete([job], settled)
        self._resync_if_new(msg.holder, new)
        return state

    def part_superseded(self, msg: PartSuperseded) -> SectionState | None:
        with self._lock:
            new = self._note_holder(msg.holder)
            self._commits.superseded(msg.generation, msg.step, msg.section)
            state, settled = self._commits.state_of(msg.generation, msg.step), self._commits.take_settled()
        self._tell_holders(settled)
        self._resync_if_new(msg.holder, new)
        return state

    def part_replicated(self, msg: PartReplicated) -> SectionState | None:
        """A peer replica of a section is held by a holder of another node (or was skipped or failed)."""
        with self._lock:
            new = self._note_holder(msg.origin)
            self._commits.replicated(msg)
            state = self._commits.state_of(msg.generation, msg.step)
        self._resync_if_new(msg.origin, new)
        return state

    def part_durable(self, msg: PartDurable) -> SectionState | None:
        with self._lock:
            new = self._note_holder(msg.holder)
            job = self._commits.durable(
                msg.generation, msg.step, msg.section, msg.files, msg.persist_s, holder=msg.holder
            )
            self._book.note_host_copies(
                msg.generation, msg.step, ("durable", msg.section), msg.copied_bytes, msg.crc_read_bytes
            )
            state, settled = self._commits.state_of(msg.generation, msg.step), self._commits.take_settled()
        state = self._complete([job], settled, msg.generation, msg.step) or state
        self._resync_if_new(msg.holder, new)
        return state

    def part_failed(self, msg: PartFailed) -> SectionState | None:
        with self._lock:
            new = self._note_holder(msg.holder)
            self._commits.failed(msg.generation, msg.step, msg.section, msg.error, holder=msg.holder)
            state, settled = self._commits.state_of(msg.generation, msg.step), self._commits.take_settled()
        self._tell_holders(settled)
        self._resync_if_new(msg.holder, new)
        return state

    def apply_holder_state(self, state: HolderState) -> None:
        """What a holder holds and did (``Holder.resync``), applied as if each message came again."""
        with self._lock:
            self.generation = max(self.generation, state.generation)
            self._note_holder(state.holder)
            # The origins of the copies first (one whose node is lost can no longer say it staged them).
            jobs = self._apply_locked((*state.staged, *state.replica_origins), state.outcomes)
            for msg in state.replicas:
                if self._commits.accepts(msg.generation, msg.step):
                    self._commits.replicated(msg, resync=True)
            settled = self._commits.take_settled()
        self._complete(jobs, settled)

    def _staged(self, msg: PartStaged, *, resync: bool, draining: set[str] | None = None) -> CommitJob | None:
        if not self._commits.accepts(msg.generation, msg.step):
            return None
        job = self._commits.staged(msg, resync=resync, draining=draining)
        self._book.note_staged(msg.generation, msg.step, msg.meta)
        self._book.note_host_copies(msg.generation, msg.step, ("staged", msg.section), msg.holder_copied_bytes, 0)
        return job

    def _apply_locked(self, staged: tuple | list, outcomes: tuple | list) -> list[CommitJob | None]:
        jobs = [self._staged(m, resync=True) for m in staged]
        for o in outcomes:
            if isinstance(o, PartDurable):
                jobs.append(
                    self._commits.durable(
                        o.generation, o.step, o.section, o.files, o.persist_s, holder=o.holder, resync=True
                    )
                )
            elif isinstance(o, PartFailed):
                self._commits.failed(o.generation, o.step, o.section, o.error, holder=o.holder, resync=True)
            elif isinstance(o, PartSuperseded):
                self._commits.superseded(o.generation, o.step, o.section, resync=True)
        return jobs

    def _complete(
        self, jobs: list[CommitJob | None], settled: list, generation: int | None = None, step: int | None = None
    ) -> SectionState | None:
        """Write the manifests of the steps that became complete (outside the lock), record the
        results (under it), then tell the holders which steps settled. Returns the state of
        ``(generation, step)`` afterwards when given."""
        state = None
        for job in jobs:
            if job is None:
                continue
            result = self._commits.write(job)
            with self._lock:
                self._commits.finish(job, result)
                settled = settled + self._commits.take_settled()
        if generation is not None and step is not None and any(j is not None for j in jobs):
            with self._lock:
                state = self._commits.state_of(generation, step)
        self._tell_holders(settled)
        return state

    def _tell_holders(self, settled: list[tuple[int, int, SectionState, tuple[str, ...]]]) -> None:
        """The steps that settled: their holders drop their record (fire-and-forget). When one
        committed, every holder of the run hears of it too: the peers' copies older than it can no
        longer be restored (storage has newer), those of a lost node's holder included."""
        if self._link is None or not settled:
            return
        by_holder: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        for gen, step, _state, holders in settled:
            for h in holders:
                by_holder[h].append((gen, step))
        committed = max(((g, s) for g, s, state, _ in settled if state == SectionState.COMMITTED), default=None)
        if committed is not None:
            with self._lock:
                for h in self._holders:
                    by_holder.setdefault(h, [])
        for h, keys in by_holder.items():
            self._link.forget(h, keys, committed)

    def _note_holder(self, name: str) -> bool:
        """Remember a holder; True when it is new to this controller."""
        if not name or name in self._holders:
            return False
        self._holders.add(name)
        return True

    def _resync_if_new(self, name: str, new: bool) -> None:
        """A holder first heard of after this controller started: ask it what it holds (once, in
        the background: never from an RPC thread that holds the lock)."""
        if not new or self._link is None or not self._resynced.is_set():
            return  # the start-up resync asks every holder anyway
        with self._lock:
            if name in self._resyncing:
                return
            self._resyncing.add(name)
        threading.Thread(target=self._resync_one, args=(name,), name="cf_ray-resync", daemon=True).start()

    def _resync_one(self, name: str) -> bool:
        link = self._link
        if link is None:
            return False
        try:
            state = link.resync(name, timeout_s=_env.get_float(_env.ACTOR_TIMEOUT_S))
            if state is not None:
                self.apply_holder_state(state)
            return state is not None
        except HolderBusy:
            logger.warning("cf_ray: holder %s did not answer a resync in time", name)
            return False
        except Exception:  # noqa: BLE001
            logger.exception("cf_ray: resync of holder %s failed", name)
            return False
        finally:
            with self._lock:
                self._resyncing.discard(name)

    def _rebuild_from_holders(self) -> None:
        """At start: ask the run's holder on every alive node what it holds and has done lately."""
        link = self._link
        try:
            names = link.names_on_alive_nodes() if link is not None else []
            found = [n for n in names if link is not None and link.exists(n) and self._holder_of_this_run(n)]
            for name in found:
                self._resync_one(name)
            if found:
                logger.info(
                    "cf_ray: controller %s re-learnt the state of %d holder(s); generation %d",
                    self.key,
                    len(found),
                    self.generation,
                )
        except Exception:  # noqa: BLE001
            logger.exception("cf_ray: could not resync the holders")
        finally:
            self._resynced.set()

    def _holder_of_this_run(self, name: str) -> bool:
        """Whether holder ``name`` belongs to this run. One left by a run whose driver is gone is
        drained and killed: its snapshots are that run's, never this one's (storage is the truth)."""
        if self._link is None or self._owner is None:
            return True
        theirs = self._link.owner(name, timeout_s=_env.get_float(_env.ACTOR_TIMEOUT_S))
        if self._owner.same_run(theirs):
            return True
        if owner_gone(theirs) is not None:
            logger.warning(
                "cf_ray: holder %s belongs to a run whose driver is gone (job %s); draining and "
                "killing it, its snapshots are not used",
                name,
                theirs.job_id if theirs else "?",
            )
            self._link.drain_all([name], _env.get_float(_env.DRAIN_TIMEOUT_S))
            self._link.kill(name)
        return False

    # -- the reaper ------------------------------------------------------------------------------------
    def _reaper_loop(self) -> None:
        """End the run's actors when the run is over without ``finish()`` (see :mod:`cf_ray._engine.protocol.cluster`)."""
        while not self._stopping.wait(max(0.1, _env.get_float(_env.REAPER_INTERVAL_S))):
            try:
                why = self.run_over()
                if why is None:
                    continue
                logger.warning(
                    "cf_ray: run %s is over (%s) and its ranks did not all call finish(): draining "
                    "the holders, saving the profile and ending the run's actors; storage is the truth",
                    run_name_of(self.key),
                    "its driver's Ray job ended"
                    if why == "job"
                    else f"its fit() ended and no fit() of the run came back within "
                    f"release_after_fit_s={self._release_after_fit_s:g} s",
                )
                self.shutdown()
                return
            except Exception:  # noqa: BLE001 - the reaper never dies
                logger.exception("cf_ray: the controller's reaper failed")

    def run_over(self, now: float | None = None) -> str | None:
        """Why the run is over (``"job"``: its driver's Ray job ended; ``"fit"``: its ``fit()`` ended
        without ``finish()`` at least ``release_after_fit_s`` ago and no later ``fit()`` attached), or
        ``None``. A run whose ranks all called ``finish()`` is left to the linger."""
        if owner_gone(self._owner) == "job":
            return "job"
        with self._lock:
            owner = self._owner
            finished = bool(self._finished) and len(self._finished) >= (self._world_size or 1)
        if finished or owner is None or not owner.train_run:
            return None
        if not fit_over(self._train_handle, owner.train_run):  # running, or cannot tell: never on a guess
            with self._lock:
                self._fit_over_since = None
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            if owner != self._owner:  # a new fit() attached meanwhile
                return None
            if self._fit_over_since is None:
                self._fit_over_since = now
                logger.info(
                    "cf_ray: the fit() of run %s ended without finish(); its actors and in-memory "
                    "snapshots wait %g s for the next fit() of the run",
                    run_name_of(self.key),
                    self._release_after_fit_s,
                )
            over = now - self._fit_over_since >= self._release_after_fit_s
        return "fit" if over else None

    # -- the watch -------------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        while not self._stopping.wait(max(0.2, _env.get_float(_env.WATCH_INTERVAL_S))):
            try:
                self.watch_once()
            except Exception:  # noqa: BLE001 - the watch never dies
                logger.exception("cf_ray: the controller's watch failed")

    def watch_once(self, min_age_s: float | None = None) -> None:
        """Ask the holders about sections pending for at least ``min_age_s`` (default
        ``CF_RAY_WATCH_INTERVAL_S``): an outcome this controller missed is applied; a section its
        holder does not have (it died, or Ray restarted it empty) fails; a section of an earlier
        attempt that no holder was ever heard to have is abandoned."""
        if self._link is None:
            return
        interval = _env.get_float(_env.WATCH_INTERVAL_S)
        min_age_s = interval if min_age_s is None else min_age_s
        with self._lock:
            by_holder, orphans = self._commits.watch_targets(min_age_s)
            known = sorted(self._holders)
        staged: list[PartStaged] = []
        outcomes: list[Message] = []
        lost: list[tuple[tuple[int, int, str], str]] = []
        gone: set[str] = set()
        timeout_s = max(1.0, interval)
        for name, keys in by_holder.items():
            try:
                answer = self._link.lookup(name, keys, timeout_s=timeout_s)
            except HolderBusy:
                continue
            if answer is None:
                gone.add(name)
                lost += [(k, name) for k in keys]
                continue
            for key, (status, st, out) in zip(keys, answer):
                staged += [st] if st is not None else []
                outcomes += [out] if out is not None else []
                if status == _UNKNOWN:
                    lost.append((key, name))
        unfound = set(orphans)
        for name in known if orphans else ():
            try:
                answer = self._link.lookup(name, orphans, timeout_s=timeout_s)
            except HolderBusy:
                unfound.clear()  # cannot tell: ask again next time
                continue
            if answer is None:
                gone.add(name)
                continue
            for key, (status, st, out) in zip(orphans, answer):
                if status != _UNKNOWN:
                    unfound.discard(key)
                    staged += [st] if st is not None else []
                    outcomes += [out] if out is not None else []
        with self._lock:
            jobs = self._apply_locked(staged, outcomes)
            for (gen, step, sec), name in lost:
                self._commits.failed(
                    gen,
                    step,
                    sec,
                    f"lost: holder {name} died or was restarted before it had written this section",
                    holder=name,
                    lost=True,
                )
            for gen, step in sorted({(g, s) for g, s, _ in unfound}):
                if gen < self.generation and self._commits.abandon(gen, step):
                    self._book.note_abandoned(gen, step)
                    logger.info(
                        "cf_ray: step %d of generation %d abandoned: a section was never handed to a "
                        "holder and its attempt is over",
                        step,
                        gen,
                    )
            self._holders -= gone
            settled = self._commits.take_settled()
        self._complete(jobs, settled)

    # -- commits and maintenance -------------------------------------------------------------------
    def _after_commit(self, step: int, m: mf.Manifest) -> None:
        self._maintenance.after_commit(step, m)

    def _on_profile_batch(self) -> None:
        self._maintenance.profile_batch_ready()

    def maintenance_idle(self) -> bool:
        """True when no upload, clean-up or profile write is queued or running."""
        return self._maintenance.idle()

    def uploads_pending(self) -> list[int]:
        """Steps whose upload to the tiers is queued or running, oldest first (``Checkpointer.finish``
        waits until this is empty, or reports what is left)."""
        return self._maintenance.uploads_pending()

    def pending_steps(self, generation: int) -> list[int]:
        with self._lock:
            return self._commits.awaited_steps(generation)

    # -- the profile ---------------------------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        """Every row of this run's profile so far: the parts on storage and the rows in memory."""
        return self._book.all_rows(self._lock)

    def iteration_rows(self) -> list[dict]:
        with self._lock:
            return self._book.iteration_rows()

    def events(self) -> list[dict]:
        with self._lock:
            return list(self._book.events)

    def explain(self) -> Any:
        """Why the interval is what it is (the policy's ``explain()``), for users and notebooks."""
        with self._lock:
            return explain_policy(self._schedule.policy)

    def record_event(self, event: dict) -> None:
        quarantined, why = None, ""
        with self._lock:
            self._book.add_event(dict(event, time=event.get("time", time.time())))
            step = event.get("step")
            if event.get("event") == "restore_fallback" and event.get("corrupt") and isinstance(step, int):
                why = str(event.get("error", "corrupt"))[:500]
                if self._commits.quarantine(step, why):
                    self._quarantine[step] = why
                    quarantined = dict(self._quarantine)
                    self._book.add_event({"event": "quarantined", "step": step, "error": why, "time": time.time()})
        if quarantined is not None:  # storage I/O outside the lock
            try:
                write_quarantine(self.storage, quarantined)
                logger.warning(
                    "cf_ray: checkpoint step %s is corrupt: quarantined (kept on storage, never "
                    "restored from again, not counted by keep-last): %s",
                    step,
                    why,
                )
            except Exception as e:  # noqa: BLE001 - the index is already right; the file only outlives us
                logger.warning("cf_ray: could not write %s: %s", QUARANTINE, e)

    def _event(self, event: dict | None) -> None:
        if event is not None:
            self._book.add_event(event)

    def summary(self) -> dict:
        with self._lock:
            return {
                "generation": self.generation,
                "committed_steps": self._commits.committed_steps(),
                "interval": self._schedule.current_interval,
                "schedules": self._schedule.as_dicts(),
                "failures": self._book.failure_dicts(),
                "events": list(self._book.events),
                "pending": self._commits.pending_steps(),
            }

    # -- the end of a run ------------------------------------------------------------------------------
    def finish(self, rank: int, world_size: int) -> None:
        with self._lock:
            self._finished.add(rank)
            done = len(self._finished) >= world_size
        if done:
            self.save_profile()
            threading.Thread(target=self._linger_then_exit, name="cf_ray-linger", daemon=True).start()

    def save_profile(self) -> None:
        """Write the profile table and the policy's state to storage (never raises)."""
        self._book.save(self._lock)
        self._save_policy_state()

    def _save_policy_state(self) -> None:
        with self._lock:
            raw = self._schedule.state_bytes()
        self._schedule.write_state(raw)

    def _linger_then_exit(self) -> None:
        time.sleep(_env.get_float(_env.LINGER_S))
        with self._lock:
            done = bool(self._finished) and len(self._finished) >= (self._world_size or 1)
        if done:
            self.shutdown()

    def shutdown(self) -> None:
        """Ask this run's holders to finish what they are writing (at most ``CF_RAY_DRAIN_TIMEOUT_S``,
        logged when they do not), let the queued uploads finish (as long again), write the profile,
        then kill the holders and exit (used at the end of a run, by the reaper, and by tests).
        A second call while one runs waits for it."""
        with self._shutdown_lock:
            self._shutdown_locked()

    def _shutdown_locked(self) -> None:
        self._stopping.set()
        timeout_s = _env.get_float(_env.DRAIN_TIMEOUT_S)
        names: list[str] = []
        if self._link is not None:
            with self._lock:
                names = sorted(
                    self._holders
                    | set(
                        n for n in self._link.names_on_alive_nodes() if n not in self._holders and self._link.exists(n)
                    )
                )
            for name, answer in self._link.drain_all(names, timeout_s).items():
                if answer is not None and not answer.get("drained"):
                    logger.warning(
                        "cf_ray: holder %s had not finished within %s=%.0f s when the run ended "
                        "(writing %s, waiting %s, %s messages unsent); what it did not write is lost, "
                        "the committed checkpoints stand",
                        name,
                        _env.DRAIN_TIMEOUT_S,
                        timeout_s,
                        answer.get("writing"),
                        answer.get("waiting"),
                        answer.get("unsent"),
                    )
        if not self._maintenance.wait_idle(timeout_s):
            logger.warning(
                "cf_ray: uploads of steps %s not finished within %s=%.0f s at the end of the run",
                self._maintenance.uploads_pending(),
                _env.DRAIN_TIMEOUT_S,
                timeout_s,
            )
        self.save_profile()
        if self._link is not None:
            for name in names:
                self._link.kill(name)
        self._maintenance.stop()
        if in_ray_actor():
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


# max_restarts=-1: Ray runs the constructor again after the process died; it rebuilds from storage
# and from the holders (see the module doc). Calls in flight when it died fail; callers retry.
ControllerActor = ray.remote(num_cpus=0, max_concurrency=32, max_restarts=-1)(Controller)  # pyright: ignore[reportCallIssue] - ray.remote's overloads do not list max_concurrency with a class


def get_or_create_controller(key: str, storage: Storage, settings: ControllerSettings):
    """The run's controller, created (detached: the creating process does not own it) if there is
    none. The arguments are used only when it is created.

    An existing controller of this run key is reused when it belongs to this run (the same driver
    job and Ray Train run: workers restarted by Ray Train) or when its owner is still alive. One whose
    owner is gone (the previous driver died, or its ``fit()`` ended) is shut down — its holders
    drained and killed — and a new one is created with ``settings`` (the new config), starting from
    storage only (:mod:`cf_ray._engine.protocol.cluster`).
    """
    owner = settings.owner or current_owner()
    settings = dataclasses.replace(settings, owner=owner)
    existing = get_controller(key)
    if existing is not None:
        theirs, reachable = _owner_of(existing)
        if not reachable or owner.same_run(theirs):
            if reachable and theirs is not None:
                _attach(existing, owner)
            return existing
        if owner_gone(theirs) is None:
            logger.warning(
                "cf_ray: the controller of run %s belongs to another live run (job %s); reusing it",
                run_name_of(key),
                theirs.job_id if theirs else "?",
            )
            return existing
        _retire(key, existing, theirs)
        settings = dataclasses.replace(settings, replaces_dead_run=True, recreated=False)
    created = _create(key, storage, settings)
    _attach(created, owner)
    return created


def _create(key: str, storage: Storage, settings: ControllerSettings):
    # On the head node, hard: the worker that creates it may be on a spot node that is about to go,
    # and the controller must outlive it (the design draws it on the driver side). Ray does not honour
    # a soft affinity requested from a worker node; num_cpus=0 fits a head with no CPUs.
    head = head_node_id()
    extra = {}
    if head is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        extra["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=head, soft=False)
    else:
        logger.warning(
            "cf_ray: no head node found in ray.nodes(); the controller of run %s is placed anywhere "
            "(it may land on a node that is lost)",
            run_name_of(key),
        )
    return ControllerActor.options(
        name=controller_name(key),
        namespace=_env.namespace(),
        lifetime="detached",
        get_if_exists=True,
        **extra,
    ).remote(key, storage, settings)


def _attach(handle, owner: Owner) -> None:
    """Tell the controller which ``fit()`` uses it now (its reaper then watches that one). Not
    waited for: it only decides when the actors of a ``fit()`` that is over may end, and a controller
    that does not get it keeps them until the driver's job ends."""
    try:
        handle.attach.remote(owner, train_controller())
    except Exception as e:  # noqa: BLE001
        logger.debug("cf_ray: could not attach to the controller: %r", e)


def _owner_of(handle) -> tuple[Owner | None, bool]:
    """``(owner, reachable)`` of an existing controller; an unreachable one (dying, or restarting
    past the timeout) is left to Ray and to :func:`resolve_controller`."""
    try:
        return ray.get(handle.owner.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)), True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None, False
    except AttributeError:  # a controller from before owners were recorded
        return None, True


def _retire(key: str, handle, theirs: Owner | None) -> None:
    """Shut down a controller whose run is over (holders drained and killed), then wait until its
    name is free or taken by another actor (a rank of the new run may have been quicker)."""
    logger.warning(
        "cf_ray: the controller of run %s belongs to a run whose driver is gone (job %s); shutting it "
        "down and starting from storage",
        run_name_of(key),
        theirs.job_id if theirs else "?",
    )
    timeout_s = 2 * _env.get_float(_env.DRAIN_TIMEOUT_S) + 60
    try:
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass  # it killed itself at the end of its shutdown
    except Exception as e:  # noqa: BLE001 - stuck: killed; the new controller retires its holders
        logger.warning("cf_ray: the old controller of run %s did not shut down (%r); killing it", run_name_of(key), e)
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    old = handle._actor_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = get_controller(key)
        if now is None or now._actor_id != old:
            return
        time.sleep(0.1)


def resolve_controller(key: str, storage: Storage, settings: ControllerSettings, timeout_s: float | None = None):
    """A live handle of the run's controller, made again if it is gone: what a worker calls when a
    call to the controller failed (``RayActorError``, ``ActorDiedError``, ``ActorUnavailableError``,
    a timeout). A controller that Ray is restarting is waited for; one that is gone for good (killed,
    or its node lost before Ray could restart it) is created again by the first caller — several
    ranks may call at once, Ray's ``get_if_exists`` makes one — with ``recreated=True`` (it numbers
    above the dead one's versions and rebuilds from storage and the holders). Tries with backoff for
    at most ``timeout_s`` (``CF_RAY_ACTOR_TIMEOUT_S``).

    Raises:
        TimeoutError: no live controller within the timeout (the last error is chained).
    """
    settings = dataclasses.replace(settings, recreated=True)
    return resolve_live(
        lambda: get_or_create_controller(key, storage, settings), f"cf_ray controller for run {key}", timeout_s
    )


def get_controller(key: str):
    """The live controller of a run, or ``None``."""
    try:
        return ray.get_actor(controller_name(key), namespace=_env.namespace())
    except ValueError:
        return None


__all__ = [
    "Controller",
    "ControllerActor",
    "ControllerSettings",
    "controller_name",
    "get_controller",
    "get_or_create_controller",
    "resolve_controller",
    "run_key",
]
