"""The controller's record of the run: one profile row per checkpoint, the iteration rows, the
events (restores, interval changes, uploads, notices) and the failures the workers learn of; the
rows are exported to Ray metrics and written to storage (``cf_ray.report``).

A row is a plain dict keyed by ``(generation, step)``; its columns and values are the profile
table's (``cf_ray.report.profile_frame``). Keys starting with ``_`` are per-rank inputs folded
into the public columns by :meth:`ProfileBook.profile_rows`.

Not thread-safe on its own: the controller calls it under its lock (the maintenance thread only
appends events, one ``list.append`` at a time).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from cf_ray._engine.driver.messages import CheckpointKind, Failure, SectionState, SnapshotMeta
from cf_ray._engine.driver.schedule import ScheduleBook, checkpoint_stats
from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")

#: Per-rank timings a worker reports of its checkpoints (``SyncRequest.ckpt_stats``).
_RANK_TIMINGS = ("stall_s", "sync_s", "guard_s", "copy_s", "handoff_s")


class ProfileBook:
    """Profile rows, iteration rows, events, failures and the metrics export of one run.

    Args:
        key: the run key (the metrics' ``run`` tag).
        storage: the run's storage (where the profile table is saved).
        schedule: the schedule (the interval a new row starts with; the policy and samples the
            overhead column comes from).
    """

    def __init__(self, key: str, storage: Storage, schedule: ScheduleBook):
        self.key = key
        self.storage = storage
        self.schedule = schedule
        self._rows: dict[tuple[int, int], dict] = {}
        self.events: list[dict] = []
        """Restores, fallbacks, notices, interval changes, uploads, in order."""
        self._iters: collections.deque = collections.deque(maxlen=20000)
        self._failures: list[Failure] = []
        self._metrics = None  # cf_ray.report.CheckpointMetrics, made on first use

    # -- rows ---------------------------------------------------------------------------------------------
    def row(self, generation: int, step: int) -> dict:
        """The row of a checkpoint, made on first mention."""
        row = self._rows.get((generation, step))
        if row is None:
            row = self._rows[(generation, step)] = {"step": step, "generation": generation, "committed": False,
                                                    "where": SectionState.PENDING.value, "error": None,
                                                    "interval": self.schedule.current_interval}
        return row

    def add_rank_timings(self, generation: int, rank: int, stats: dict) -> None:
        """A rank's timings of one of its checkpoints (one entry of ``SyncRequest.ckpt_stats``)."""
        row = self.row(generation, stats["step"])
        for k in _RANK_TIMINGS:
            if k in stats:
                row.setdefault(f"_{k}", {})[rank] = stats[k]
        if "nbytes" in stats:
            row.setdefault("_rank_bytes", {})[rank] = stats["nbytes"]

    def note_staged(self, generation: int, step: int, meta: SnapshotMeta) -> None:
        row = self.row(generation, step)
        row.update(epoch=meta.epoch, kind=CheckpointKind(meta.kind).value, milestone=meta.milestone,
                   interval=meta.interval, world_size=meta.world_size)
        d = meta.deadline_unix  # a just-in-time checkpoint: the earliest deadline any rank knows
        if d is not None and (row.get("deadline_unix") is None or d < row["deadline_unix"]):
            row.update(deadline_unix=d, notice_unix=meta.notice_unix, notice_source=meta.notice_source)

    def note_superseded(self, generation: int, step: int) -> None:
        self.row(generation, step).update(committed=False, where="memory-only",
                                          error="superseded by a newer snapshot before it was persisted")

    def note_failed(self, generation: int, step: int, section: str, error: str) -> None:
        row = self.row(generation, step)
        row.update(committed=False, where=SectionState.FAILED.value, error=f"{section}: {error}")
        if row.get("deadline_unix") is not None:
            row["made_deadline"] = False

    def note_abandoned(self, generation: int, step: int) -> None:
        """A just-in-time checkpoint of an attempt that ended before it was durable."""
        row = self._rows.get((generation, step))
        if row is not None and row.get("deadline_unix") is not None:
            row.update(made_deadline=False, where=SectionState.ABANDONED.value,
                       error="not durable when its attempt ended")

    def note_committed(self, generation: int, step: int, *, where: str, commit_s: float, persist_s: float,
                       total_bytes: int, epoch: int, kind: str, milestone: bool) -> dict:
        row = self.row(generation, step)
        row.update(committed=True, where=where, error=None, commit_s=commit_s, persist_s=persist_s, bytes=total_bytes,
                   epoch=epoch, kind=kind, milestone=milestone)
        row["durable_unix"] = time.time()
        if row.get("deadline_unix") is not None:
            row["made_deadline"] = row["durable_unix"] <= row["deadline_unix"]
        return row

    def profile_rows(self) -> list[dict]:
        """One dict per checkpoint (the profile table's columns), in step order."""
        iter_s = _recent_iter_s(self.schedule.samples)
        out = []
        for (_gen, step), row in sorted(self._rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            r = {k: v for k, v in row.items() if not k.startswith("_")}
            stalls = row.get("_stall_s") or {}
            guards = row.get("_guard_s") or {}
            # Training-thread stall per rank: the synchronous part plus the guard's wait for the copy.
            stall = max((v + guards.get(r, 0.0) for r, v in stalls.items()), default=None)
            r["stall_s"] = stall
            r["copy_s"] = _max(row.get("_copy_s"))
            r["sync_s"] = _max(row.get("_sync_s"))
            r["guard_s"] = _max(row.get("_guard_s"))
            if "bytes" not in r and row.get("_rank_bytes"):
                r["bytes"] = sum(row["_rank_bytes"].values())
            interval = r.get("interval")
            stats = checkpoint_stats(self.schedule.policy, step)
            if stats and stats.get("overhead_pct") is not None:
                r["overhead_pct"] = stats["overhead_pct"]
            elif stall is not None and interval and iter_s:
                r["overhead_pct"] = 100.0 * stall / (interval * iter_s)
            out.append(r)
        return out

    # -- iterations, events, failures --------------------------------------------------------------------
    def add_iteration(self, rank: int, step: int, iter_s: float, iters: int) -> None:
        self._iters.append({"time": time.time(), "rank": rank, "step": step, "iter_s": iter_s, "iters": iters})

    def iteration_rows(self) -> list[dict]:
        return list(self._iters)

    def add_event(self, event: dict) -> None:
        self.events.append(event)

    def add_failure(self, *, generation: int, step: int, section: str, rank: int, error: str) -> Failure:
        failure = Failure(seq=len(self._failures), step=step, section=section, rank=rank, error=error,
                          generation=generation)
        self._failures.append(failure)
        return failure

    def failures_since(self, seen_seq: int) -> tuple[Failure, ...]:
        return tuple(f for f in self._failures if f.seq > seen_seq)

    def failure_dicts(self) -> list[dict]:
        """The failures as the controller's summary has them."""
        return [{"seq": f.seq, "step": f.step, "section": f.section, "rank": f.rank, "error": f.error,
                 "generation": f.generation} for f in self._failures]

    # -- export -------------------------------------------------------------------------------------------
    def record_metrics(self, generation: int, step: int) -> None:
        """Export the row to Ray metrics (dashboard, Prometheus); never fails the caller."""
        try:
            if self._metrics is None:
                from cf_ray.report import CheckpointMetrics

                self._metrics = CheckpointMetrics(run=self.key)
            row = next((r for r in self.profile_rows() if r["step"] == step and r["generation"] == generation), None)
            if row is not None:
                self._metrics.record(row)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: metrics export failed", exc_info=True)

    def save(self, lock: threading.RLock) -> None:
        """Write the profile table and the iteration rows to storage; never fails the caller.
        The rows are read under ``lock`` (the controller's), the writing is done without it."""
        try:
            from cf_ray import report

            with lock:
                rows, iterations = self.profile_rows(), self.iteration_rows()
            report.save_profile(self.storage, rows, iterations)
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
