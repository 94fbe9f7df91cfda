"""The driver-side controller: one Ray actor per run that schedules, commits and remembers.

How a run finds its controller: it is a *named, detached* actor,
``cf_ray.controller.<run key>`` in the ``cf_ray`` namespace (``CF_RAY_NAMESPACE``), where the run
key is derived from the run's storage location and name. Every worker's :class:`Checkpointer`
gets it with ``get_if_exists=True``, so the first worker of a run creates it and workers restarted
by Ray Train (same run) find the same one, with its schedule, its profile and its index of
in-memory snapshots intact. It uses ``num_cpus=0`` and never blocks a worker: workers poll it
with fire-and-forget calls and read the answers when they are ready.

When the driver restarts (a new ``trainer.fit()`` with the same ``RunConfig(name, storage_path)``),
a controller that is still alive (a long-lived cluster) is reused; otherwise a new one is created
and rebuilds what matters from storage: the committed checkpoints, the generation counter and the
saved profile (so the interval does not have to be profiled again from scratch). It exits on its
own ``CF_RAY_CONTROLLER_LINGER_S`` seconds after every rank has called ``Checkpointer.finish()``,
after writing the profile table to storage.

What it does:
* keeps the schedule: the policy's interval, published as numbered versions that the ranks adopt
  together (see ``worker/control.py``) — :mod:`.schedule`;
* tracks every section of every snapshot: staged in a holder (memory), durable (storage),
  failed or superseded; commits a checkpoint — writes its manifest — only when every section of
  that step and generation is durable (:mod:`.commits`); then applies keep-last clean-up and
  copies it to the upload tiers, on its maintenance thread (no clean-up between a restore plan and
  the restore) — :mod:`.maintenance`;
* answers restore plans: the newest complete in-memory snapshot and the committed checkpoints;
* keeps the profile table (one row per checkpoint) and the events (restores, failures) —
  :mod:`.profile_book`.

:class:`Controller` is the RPC facade over these parts. Every RPC takes the one controller lock
(an ``RLock``: the parts call back into each other under it); the maintenance thread takes it for
its reads of the committed index and the pending table, never while it deletes or uploads.
The messages it exchanges are the typed, versioned ones of :mod:`.messages`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from cf_ray._engine import env as _env
from cf_ray._engine.driver.commits import CommitBook, load_committed
from cf_ray._engine.driver.maintenance import Maintenance, tier_steps
from cf_ray._engine.driver.messages import (
    CheckpointRequest,
    PartDurable,
    PartFailed,
    PartStaged,
    PartSuperseded,
    Restored,
    RestorePlan,
    RestoreSource,
    SyncReply,
    SyncRequest,
)
from cf_ray._engine.driver.naming import controller_name, run_key
from cf_ray._engine.driver.profile_book import ProfileBook
from cf_ray._engine.driver.schedule import ScheduleBook
from cf_ray._engine.driver.schedule import explain as explain_policy
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.storage.fs import Storage
from cf_ray.policy import FrequencyPolicy, Sample

logger = logging.getLogger("cf_ray")


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


class Controller:
    """The controller's logic (the Ray actor class is :data:`ControllerActor`): the RPC facade
    over the schedule, the commit bookkeeping, the maintenance thread and the profile."""

    def __init__(self, key: str, storage: Storage, settings: ControllerSettings):
        self.key = key
        self.storage = storage
        self._lock = threading.RLock()
        committed, self.generation = load_committed(storage)
        self._schedule = ScheduleBook(settings.policy, storage)
        self._book = ProfileBook(key, storage, self._schedule)
        self._commits = CommitBook(storage, committed, book=self._book, schedule=self._schedule,
                                   on_commit=self._after_commit)
        self._maintenance = Maintenance(storage, tiers=settings.tiers, keep_last=settings.keep_last,
                                        upload_milestones_only=settings.upload_milestones_only, lock=self._lock,
                                        commits=self._commits, book=self._book)
        self._world_size: int | None = None
        self._finished: set[int] = set()
        self._holders: set[str] = set()
        self._requests: list[CheckpointRequest] = []  # from cf_ray.preemption.notify_preemption
        self._request_seq = 0

    # -- generations and restore --------------------------------------------------------------
    def prepare_restore(self, world_size: int) -> RestorePlan:
        """Called by rank 0 at the start of every attempt: a new generation and a restore plan."""
        with self._lock:
            self.generation += 1
            # Until this attempt has restored, keep-last deletes nothing: the plan names checkpoints
            # that a late commit of the previous attempt would otherwise push out (keep_last=1).
            self._maintenance.defer_deletions()
            self._event(self._schedule.reprofile_if_resized(self._world_size, world_size))
            self._world_size = world_size
            self._finished.clear()
            self._requests.clear()  # a notice for the previous attempt is moot
            memory = self._commits.newest_in_memory()
            storage_steps = tuple(self._commits.committed_steps(newest_first=True))
            generation, schedules = self.generation, self._schedule.all()
        return RestorePlan(generation=generation, memory=memory, storage=storage_steps,
                           tiers=tier_steps(self._maintenance.tiers), schedules=schedules)

    def restored(self, info: Restored) -> None:
        """Rank 0 reports where the attempt resumed from.

        Snapshots of earlier generations past the restored step belong to a timeline that this
        attempt replays; they are not committed. Those at or before it are valid and may still
        commit (the holders keep writing them), which keeps a memory restore durable. Keep-last
        clean-up, held back since :meth:`prepare_restore`, runs again from here.
        """
        with self._lock:
            self._maintenance.resume_deletions()  # what was deferred during the restore
            self._book.add_event({"source": RestoreSource(info.source).value, "step": info.step, "epoch": info.epoch,
                                  "seconds": info.seconds, "world_size": info.world_size,
                                  "saved_world_size": info.saved_world_size, **info.extra,
                                  "event": "restore", "generation": self.generation, "time": time.time()})
            for gen, step in self._commits.abandon_after(self.generation, info.step):
                self._book.note_abandoned(gen, step)

    # -- worker polls ----------------------------------------------------------------------------
    def sync(self, req: SyncRequest) -> SyncReply:
        """Non-blocking exchange with a worker: its samples in, the schedule and commit state out."""
        with self._lock:
            for s in req.samples:
                sample = Sample(**s)
                self._schedule.add_sample(sample)
                self._book.add_iteration(req.rank, sample.step, sample.iter_s, sample.iters)
            for stats in req.ckpt_stats:
                self._book.add_rank_timings(req.generation, req.rank, stats)
            self._event(self._schedule.replan())
            return SyncReply(schedules=self._schedule.since(req.adopted_version),
                             committed_step=self._commits.newest_step() or 0,
                             failures=self._book.failures_since(req.seen_failures),
                             requests=tuple(r for r in self._requests if r.seq > req.seen_requests))

    def request_checkpoint(self, deadline_unix: float | None, detail: str = "") -> CheckpointRequest:
        """A preemption (or resize) notice from outside the workers, for every rank of this attempt
        (``cf_ray.preemption.notify_preemption``)."""
        with self._lock:
            self._request_seq += 1
            req = CheckpointRequest(seq=self._request_seq, deadline_unix=deadline_unix, detail=str(detail),
                                    time_unix=time.time(), generation=self.generation)
            self._requests.append(req)
            self._book.add_event({"seq": req.seq, "deadline_unix": req.deadline_unix, "detail": req.detail,
                                  "time": req.time_unix, "generation": req.generation, "event": "notice"})
            return req

    # -- holders -----------------------------------------------------------------------------------
    def part_staged(self, msg: PartStaged) -> None:
        with self._lock:
            self._holders.add(msg.holder)
            self._commits.staged(msg)
            self._book.note_staged(msg.generation, msg.step, msg.meta)

    def part_superseded(self, msg: PartSuperseded) -> None:
        with self._lock:
            self._commits.superseded(msg.generation, msg.step, msg.section)

    def part_durable(self, msg: PartDurable) -> None:
        with self._lock:
            self._commits.durable(msg.generation, msg.step, msg.section, msg.files, msg.persist_s)

    def part_failed(self, msg: PartFailed) -> None:
        with self._lock:
            self._commits.failed(msg.generation, msg.step, msg.section, msg.error)

    def _after_commit(self, step: int, m: mf.Manifest) -> None:
        self._maintenance.after_commit(step, m)

    # -- the profile ---------------------------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        with self._lock:
            return self._book.profile_rows()

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
        with self._lock:
            self._book.add_event(dict(event, time=event.get("time", time.time())))

    def _event(self, event: dict | None) -> None:
        if event is not None:
            self._book.add_event(event)

    def summary(self) -> dict:
        with self._lock:
            return {"generation": self.generation, "committed_steps": self._commits.committed_steps(),
                    "interval": self._schedule.current_interval, "schedules": self._schedule.as_dicts(),
                    "failures": self._book.failure_dicts(), "events": list(self._book.events),
                    "pending": self._commits.pending_steps()}

    def maintenance_idle(self) -> bool:
        """True when no upload or clean-up is queued or running."""
        return self._maintenance.idle()

    def pending_steps(self, generation: int) -> list[int]:
        with self._lock:
            return self._commits.awaited_steps(generation)

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
        self._schedule.save_state()

    def _linger_then_exit(self) -> None:
        time.sleep(_env.get_float(_env.LINGER_S))
        with self._lock:
            if self._finished and len(self._finished) >= (self._world_size or 1):
                self.shutdown()

    def shutdown(self) -> None:
        """Kill this run's holders and exit (used at the end of a run and by tests)."""
        for name in list(self._holders):
            try:
                ray.kill(ray.get_actor(name, namespace=_env.namespace()))
            except Exception:  # noqa: BLE001
                pass
        self._maintenance.stop()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


ControllerActor = ray.remote(num_cpus=0, max_concurrency=32, max_restarts=0)(Controller)


def get_or_create_controller(key: str, storage: Storage, settings: ControllerSettings):
    # On the head node when there is one: the worker that creates it may be on a spot node that is
    # about to go, and the controller must outlive it (soft: anywhere if the head cannot take it).
    head = _head_node_id()
    extra = {}
    if head is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        extra["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=head, soft=True)
    return ControllerActor.options(
        name=controller_name(key), namespace=_env.namespace(), lifetime="detached", get_if_exists=True, **extra,
    ).remote(key, storage, settings)


def _head_node_id() -> str | None:
    try:
        for n in ray.nodes():
            if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}):
                return n["NodeID"]
    except Exception:  # noqa: BLE001 - placement is a preference only
        pass
    return None


def get_controller(key: str):
    """The live controller of a run, or ``None``."""
    try:
        return ray.get_actor(controller_name(key), namespace=_env.namespace())
    except ValueError:
        return None


__all__ = ["Controller", "ControllerActor", "ControllerSettings", "controller_name", "get_controller",
           "get_or_create_controller", "run_key"]
