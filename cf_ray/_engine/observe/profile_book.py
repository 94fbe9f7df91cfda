"""The controller's record of the run: one profile row per checkpoint and the iteration rows,
exported to Ray metrics and written to storage (:mod:`.profile_files`); the events and failures
(:mod:`.events`), the goodput and badput (:mod:`.goodput`) it feeds, and the run's failures it
passes on to the schedule's failure feed (:class:`ScheduleView`).

A row is a plain dict keyed by ``(generation, step)``; its columns and values are the profile
table's (:func:`.profile_frames.profile_frame`). Keys starting with ``_`` are inputs folded into the
public columns by :meth:`ProfileBook.profile_rows`. The book records; what a column means for a
decision (whether a just-in-time checkpoint was safe in time) is the driver's, which reads and
writes the rows through :meth:`ProfileBook.row` and :meth:`ProfileBook.find_row`.

Bounded: memory and per-commit work stay constant however many checkpoints a run takes.

* Rows: the newest ``env.PROFILE_WINDOW_ROWS`` are kept in memory; when the window is full, its
  oldest quarter leaves memory as one batch of public rows, which the maintenance thread appends to
  storage as a Parquet part (:mod:`.profile_files`). :meth:`ProfileBook.all_rows` returns the parts
  and the window together; :meth:`ProfileBook.save` (the end of a run) writes the whole table to
  ``profile.parquet``, which ``cf_ray.report.read_run_profile`` reads. A row mentioned again after
  it left memory (a rank's late timings) is merged with its part on read.
* Events and failures: windows (:class:`~.events.EventLog`).
* Iterations: the newest 20,000.
* The metrics export builds the one row it exports, not the table (:mod:`.metrics`).

Not thread-safe on its own: the controller calls it under its lock (the maintenance thread only
appends events, one ``deque.append`` at a time, and writes the parts without the lock).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from cf_ray._engine import env as _env
from cf_ray._engine.observe.events import EventLog, fallback_cause
from cf_ray._engine.observe.goodput import Badput, Goodput, Restart, restore_args
from cf_ray._engine.observe.metrics import MetricsExport
from cf_ray._engine.observe.profile_files import ProfileParts, merge_rows, new_lineage, save_profile
from cf_ray._engine.protocol.events import (
    DistrustedEvent,
    DurabilityLostEvent,
    DurabilityRestoredEvent,
    Event,
    NoticeEvent,
    QuarantinedEvent,
    RestoreEvent,
    RestoreFallbackEvent,
    as_event,
)
from cf_ray._engine.protocol.messages import CheckpointKind, PartReplicated, SectionState, SnapshotMeta
from cf_ray._engine.storage.base import Storage
from cf_ray.policy import Sample

logger = logging.getLogger("cf_ray")

#: Per-rank timings a worker reports of its checkpoints (``SyncRequest.ckpt_stats``).
_RANK_TIMINGS = ("stall_s", "sync_s", "guard_s", "copy_s", "handoff_s")


class FailureSink(Protocol):
    """Where the book passes the run's failures on (the driver's ``FailureFeed``): the restores, the
    first resumed iteration of each restart, the preemption notices and the staged snapshots that
    answer one. ``attach`` gives it the book's event log and metrics export for its own records."""

    def attach(self, log: Any, export: Any) -> None: ...
    def restore(self, event: RestoreEvent, restart: Restart | None) -> None: ...
    def resumed(self, restart: Restart) -> None: ...
    def notice(self, event: NoticeEvent) -> None: ...
    def staged(self, generation: int, meta: SnapshotMeta) -> None: ...


class ScheduleView(Protocol):
    """What the book reads of the controller's schedule (the driver's ``ScheduleBook``): the
    interval a new row starts with, the timing samples (a row's overhead when the policy measured
    none), the policy's own measure of a checkpoint, and the failure feed."""

    @property
    def interval_in_force(self) -> int | None: ...
    @property
    def samples(self) -> Iterable[Sample]: ...
    @property
    def failures(self) -> FailureSink: ...
    def checkpoint_stats(self, step: int) -> dict | None: ...


class ProfileBook:
    """Profile rows and iteration rows of one run, the events, failures and goodput they feed, and
    the metrics export.

    Args:
        key: the run key (the metrics' ``run`` tag).
        storage: the run's storage (where the profile table is saved).
        schedule: the schedule (:class:`ScheduleView`).
        lineage: where this controller's evicted rows go (:class:`ProfileParts`); a new lineage
            when ``None``.
        seq_base: the first failure's ``seq`` (a controller that starts again during a run counts
            above its predecessor).
        on_batch: called (under the controller's lock) when a batch of rows left memory and waits
            to be written (:meth:`write_parts`, by the maintenance thread).
    """

    def __init__(
        self,
        key: str,
        storage: Storage,
        schedule: ScheduleView,
        *,
        lineage: str | None = None,
        seq_base: int = 0,
        on_batch: Callable[[], None] | None = None,
    ):
        self.key = key
        self.storage = storage
        self.schedule = schedule
        self.parts = ProfileParts(storage, lineage or new_lineage(), continued=lineage is not None)
        self._window = max(4, _env.PROFILE_WINDOW_ROWS)
        self._rows: dict[tuple[int, int], dict] = {}
        """(generation, step) -> row, oldest first mention first; at most the window."""
        self._unwritten: list[list[dict]] = []
        """Batches of public rows that left memory, until their part is written."""
        self._evicted: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        """Keys of the rows that left memory most recently (at most the window): a later mention
        makes a fragment (no defaults), merged with the part on read."""
        self._on_batch = on_batch
        events_window = max(1, _env.EVENTS_WINDOW)
        self.log = EventLog(events_window, seq_base)
        """The events, the failures and the restore fallbacks."""
        self.log.restore_events(self.parts.predecessor_events)
        self._iters: collections.deque = collections.deque(maxlen=20000)
        self.goodput = Goodput(events_window)
        """The run's timeline: restarts, progress, the effective training ratio."""
        self.badput = Badput()
        """The stalls and the controller's start: where the wall time went, with :attr:`goodput`."""
        self._export = MetricsExport(key)
        schedule.failures.attach(self.log, self._export)
        self._lost_since: tuple[int, int] | None = None
        """``(generation, step)`` from which checkpoints were taken while the watchdog's episode was
        open (``None``: no episode): their rows say ``durability_lost``."""

    # -- rows ---------------------------------------------------------------------------------------------
    def row(self, generation: int, step: int) -> dict:
        """The row of a checkpoint, made on first mention."""
        row = self._rows.get((generation, step))
        if row is None:
            if (generation, step) in self._evicted:  # late news of a row already on its way to storage
                row = self._rows[(generation, step)] = {"step": step, "generation": generation}
            else:
                row = self._rows[(generation, step)] = {
                    "step": step,
                    "generation": generation,
                    "committed": False,
                    "where": SectionState.PENDING.value,
                    "error": None,
                    "interval": self.schedule.interval_in_force,
                    "durability_lost": self._lost_since is not None,
                }
            if len(self._rows) > self._window:
                self._evict()
        return row

    def _evict(self) -> None:
        """The oldest quarter of the window leaves memory, as a batch for the next part."""
        n = max(1, self._window // 4)
        keys = list(itertools.islice(self._rows, n))
        for k in keys:
            self._evicted[k] = None
        while len(self._evicted) > self._window:
            self._evicted.popitem(last=False)
        iter_s = _recent_iter_s(self.schedule.samples)
        self._unwritten.append([self._public(self._rows.pop(k), iter_s) for k in keys])
        if self._on_batch is not None:
            self._on_batch()

    def add_rank_timings(self, generation: int, rank: int, stats: dict) -> None:
        """A rank's timings of one of its checkpoints (one entry of ``SyncRequest.ckpt_stats``)."""
        row = self.row(generation, stats["step"])
        for k in _RANK_TIMINGS:
            if k in stats:
                row.setdefault(f"_{k}", {})[rank] = stats[k]
        if "nbytes" in stats:
            row.setdefault("_rank_bytes", {})[rank] = stats["nbytes"]
        self.badput.note_stall(generation, rank, stats)

    def note_staged(self, generation: int, step: int, meta: SnapshotMeta) -> None:
        try:
            self.goodput.on_progress(generation, step, time.time())
        except Exception:  # noqa: BLE001 - goodput is a report, never a reason to fail
            logger.debug("cf_ray: goodput bookkeeping failed", exc_info=True)
        self.schedule.failures.staged(generation, meta)
        row = self.row(generation, step)
        row.update(
            epoch=meta.epoch,
            kind=CheckpointKind(meta.kind).value,
            milestone=meta.milestone,
            # A FixedInterval's ranks decide alone and send no interval: the schedule says its ``every``.
            interval=meta.interval if meta.interval is not None else self.schedule.interval_in_force,
            world_size=meta.world_size,
        )
        # Host passes: what each rank copied and read again for its snapshot, and its wait for a slot.
        row.setdefault("_copies", {})[("rank", meta.rank)] = (meta.copied_bytes, meta.crc_read_bytes)
        if meta.slot_wait_s is not None:
            row.setdefault("_slot_wait_s", {})[meta.rank] = meta.slot_wait_s
        d = meta.deadline_unix  # a just-in-time checkpoint: the earliest deadline any rank knows
        if d is not None and (row.get("deadline_unix") is None or d < row["deadline_unix"]):
            row.update(deadline_unix=d, notice_unix=meta.notice_unix, notice_source=meta.notice_source)

    def note_host_copies(self, generation: int, step: int, key: tuple, copied: int, crc_read: int) -> None:
        """Bytes a holder copied (``copied``) and read again to checksum (``crc_read``) for one
        section of a checkpoint, as it took it (``("staged", section)``) or wrote it (``("durable",
        section)``)."""
        if (generation, step) not in self._rows and (generation, step) in self._evicted:
            return
        row = self.row(generation, step)
        row.setdefault("_copies", {})[key] = (copied, crc_read)

    def note_replicated(self, msg: PartReplicated) -> None:
        """A peer replica of a section: its bytes and seconds (the slowest section's), or a
        copy skipped for a newer snapshot or failed, in the checkpoint's row."""
        if (msg.generation, msg.step) not in self._rows and (msg.generation, msg.step) in self._evicted:
            return  # the row already left for storage
        row = self.row(msg.generation, msg.step)
        if msg.skipped:
            row["replicas_skipped"] = row.get("replicas_skipped", 0) + 1
        elif msg.error:
            row["replica_error"] = f"{msg.section}: {msg.error}"
        else:
            row["replica_bytes"] = row.get("replica_bytes", 0) + msg.nbytes
            row["replica_s"] = max(row.get("replica_s") or 0.0, msg.seconds)

    def find_row(self, generation: int, step: int) -> dict | None:
        """The row of a checkpoint if it is in memory (``None``: never mentioned, or already left for
        storage), without making one."""
        return self._rows.get((generation, step))

    def note_superseded(self, generation: int, step: int, *, held: bool = False) -> None:
        """Not written: superseded by a newer snapshot, or ``held`` in memory only by the schedule (no error)."""
        error = None if held else "superseded by a newer snapshot before it was persisted"
        self.row(generation, step).update(committed=False, where="memory-only", error=error)

    def note_failed(self, generation: int, step: int, section: str, error: str) -> None:
        row = self.row(generation, step)
        row.update(committed=False, where=SectionState.FAILED.value, error=f"{section}: {error}")

    def note_committed(
        self,
        generation: int,
        step: int,
        *,
        where: str,
        commit_s: float,
        persist_s: float,
        total_bytes: int,
        epoch: int,
        kind: str,
        milestone: bool,
    ) -> dict:
        row = self.row(generation, step)
        row.update(
            committed=True,
            where=where,
            error=None,
            commit_s=commit_s,
            persist_s=persist_s,
            bytes=total_bytes,
            epoch=epoch,
            kind=kind,
            milestone=milestone,
        )
        row["durable_unix"] = time.time()
        return row

    def memory_rows(self) -> list[dict]:
        """The rows still in memory (the window, and batches not yet in a part), in step order."""
        iter_s = _recent_iter_s(self.schedule.samples)
        window = [
            self._public(row, iter_s) for _, row in sorted(self._rows.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ]
        return merge_rows(*self._unwritten, window) if self._unwritten else window

    def profile_rows(self) -> list[dict]:
        """One dict per checkpoint in memory (and a dead predecessor's last window save: what the
        window file saves), in step order. The whole table is :meth:`all_rows` (storage I/O)."""
        return merge_rows(self.parts.predecessor, self.memory_rows())

    def all_rows(self, lock: threading.RLock) -> list[dict]:
        """Every row of this lineage: the parts on storage and the rows in memory, in step order.
        The rows in memory are read under ``lock``, the parts without it."""
        with lock:
            memory = self.memory_rows()
        parts = self.parts.read_all()  # after: a batch written meanwhile is in one of the two
        return merge_rows(self.parts.predecessor, parts, memory)  # older than any part: first

    def _public(self, row: dict, iter_s: float | None) -> dict:
        """A row as the profile table has it: the per-rank inputs folded into its columns."""
        step = row["step"]
        r = {k: v for k, v in row.items() if not k.startswith("_")}
        stalls = row.get("_stall_s") or {}
        guards = row.get("_guard_s") or {}
        # Training-thread stall per rank: the synchronous part plus the guard's wait for the copy.
        stall = max((v + guards.get(r, 0.0) for r, v in stalls.items()), default=None)
        r["stall_s"] = stall
        r["copy_s"] = _max(row.get("_copy_s"))
        r["sync_s"] = _max(row.get("_sync_s"))
        r["guard_s"] = _max(row.get("_guard_s"))
        copies = row.get("_copies") or {}
        if copies:
            # Bytes copied on the host for this checkpoint (workers and holders; peer copies are
            # replica_bytes), and bytes read a second time to checksum them.
            r["copied_bytes"] = sum(c for c, _ in copies.values())
            r["crc_read_bytes"] = sum(c for _, c in copies.values())
        r["slot_wait_s"] = _max(row.get("_slot_wait_s"))
        if "bytes" not in r and row.get("_rank_bytes"):
            r["bytes"] = sum(row["_rank_bytes"].values())
        interval = r.get("interval")
        stats = self.schedule.checkpoint_stats(step)
        if stats and stats.get("overhead_pct") is not None:
            r["overhead_pct"] = stats["overhead_pct"]
        elif stall is not None and interval and iter_s:
            r["overhead_pct"] = 100.0 * stall / (interval * iter_s)
        return r

    # -- parts (the maintenance thread) ----------------------------------------------------------------
    def write_parts(self, lock: threading.RLock) -> None:
        """Write the batches that left memory, one part each (storage I/O without ``lock``; the
        batches stay readable in memory until their part is written). Never raises."""
        with lock:
            batches = list(self._unwritten)
        for batch in batches:
            try:
                self.parts.write(batch)
            except Exception as e:  # noqa: BLE001 - the profile is a report, never a reason to fail
                logger.warning(
                    "cf_ray: could not write %d profile rows to %s (dropped): %s",
                    len(batch),
                    self.storage.uri(self.parts.directory),
                    e,
                )
            with lock:
                self._unwritten = [b for b in self._unwritten if b is not batch]

    def unwritten_batches(self) -> int:
        return len(self._unwritten)

    # -- iterations, events, failures --------------------------------------------------------------------
    def add_iteration(self, rank: int, step: int, iter_s: float, iters: int) -> None:
        now = time.time()
        self._iters.append({"time": now, "rank": rank, "step": step, "iter_s": iter_s, "iters": iters})
        try:
            resumed = self.goodput.on_sample(step, iter_s, iters, now)
            if resumed is not None:
                self.schedule.failures.resumed(resumed)
                self._export_goodput(resumed, resumed=True)
            elif self._export.ratio_due(now):
                self._export_goodput(None)
        except Exception:  # noqa: BLE001 - goodput is a report, never a reason to fail
            logger.debug("cf_ray: goodput bookkeeping failed", exc_info=True)

    def _mark_durability(self, event: DurabilityLostEvent | DurabilityRestoredEvent) -> None:
        """The profile's ``durability_lost`` column: the rows of the checkpoints that were taken and
        not committed while an episode was open (from the step since which nothing committed)."""
        if not isinstance(event, DurabilityLostEvent):
            self._lost_since = None
            return
        generation = int(event.generation or 0)
        since = event.since_step
        if since is None:
            since = (event.committed_step or 0) + 1
        self._lost_since = (generation, int(since))
        for (gen, step), row in self._rows.items():
            if gen == generation and step >= since and not row.get("committed"):
                row["durability_lost"] = True

    def iteration_rows(self) -> list[dict]:
        return list(self._iters)

    def add_event(self, event: Event | dict) -> None:
        """Record ``event`` (a plain form is typed first) and pass it on to what it concerns: the
        profile's ``durability_lost`` column, the goodput, the failure feed, the metrics."""
        event = as_event(event)
        self.log.add(event)
        if isinstance(event, (DurabilityLostEvent, DurabilityRestoredEvent)):  # the workers' watchdog
            lost = isinstance(event, DurabilityLostEvent)
            if lost:
                logger.warning("cf_ray: run %s: checkpoints are not becoming durable: %s", self.key, event.to_dict())
            self._mark_durability(event)
            self._export.durability(lost)
        elif isinstance(event, RestoreFallbackEvent):
            source, cause = event.source, fallback_cause(event)
            self.goodput.on_fallback(source, cause)
            self._export.fallback(source, cause)
        elif isinstance(event, (QuarantinedEvent, DistrustedEvent)):
            self._export.taken_out("quarantined" if isinstance(event, QuarantinedEvent) else "memory")
        elif isinstance(event, RestoreEvent):  # the controller's restored(): a restart's cost, or the run's start
            try:
                restart = self.goodput.on_restore(**restore_args(event))
                if restart is not None:
                    self._export_goodput(restart)
                self.schedule.failures.restore(event, restart)
            except Exception:  # noqa: BLE001
                logger.debug("cf_ray: goodput bookkeeping failed", exc_info=True)
        elif isinstance(event, NoticeEvent):  # the driver's notify_preemption: a failure, for the failure rate
            self.schedule.failures.notice(event)

    @property
    def events(self) -> collections.deque[Event]:
        """The events, oldest first (the newest window)."""
        return self.log.events

    def restart_rows(self) -> list[dict]:
        """One dict per restart (the ``restarts`` table, :func:`.profile_frames.restarts_frame`)."""
        return self.goodput.rows()

    def breakdown(self) -> dict:
        """Where the run's wall time went (:meth:`.goodput.Badput.breakdown`)."""
        return self.badput.breakdown(self.goodput)

    # -- export -------------------------------------------------------------------------------------------
    def record_metrics(self, generation: int, step: int) -> None:
        """Export the row to Ray metrics (dashboard, Prometheus); never fails the caller."""
        try:
            row = self._rows.get((generation, step))
            if row is None:
                return
            self._export.checkpoint(self._public(row, _recent_iter_s(self.schedule.samples)))
            self._export_goodput(None)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: metrics export failed", exc_info=True)

    def _export_goodput(self, restart: Restart | None, *, resumed: bool = False) -> None:
        """Export a restart (when it happens; its recovery time once resumed) and the ratio to Ray metrics."""
        self._export.restart(restart, self.goodput.effective_ratio(), resumed=resumed, badput=self.breakdown())

    def save(self, lock: threading.RLock) -> None:
        """Write the profile table (every row of this lineage) and the iteration rows to storage;
        never fails the caller. The rows in memory are read under ``lock`` (the controller's),
        the parts are read and the table written without it."""
        try:
            with lock:
                iterations = self.iteration_rows()
                restarts, goodput = self.restart_rows(), self.breakdown()
            rows = self.all_rows(lock)
            save_profile(self.storage, rows, iterations, restarts=restarts, goodput=goodput)
        except Exception as e:  # noqa: BLE001 - the profile is a report, never a reason to fail
            logger.warning("cf_ray: could not save the profile table: %s", e)


def _max(d: dict | None) -> float | None:
    return max(d.values()) if d else None


def _recent_iter_s(samples) -> float | None:
    per_rank: dict[int, list[float]] = {}
    for s in samples:
        if s.iters > 0 and s.iter_s > 0:
            per_rank.setdefault(s.rank, []).append(s.iter_s)
    if not per_rank:
        return None
    # The slowest rank governs.
    return max(sum(v[-8:]) / len(v[-8:]) for v in per_rank.values())
