"""The controller's record of the run: one profile row per checkpoint, the iteration rows, the
events (restores, interval changes, uploads, notices) and the failures the workers learn of; the
rows are exported to Ray metrics and written to storage (``cf_ray.report``).

A row is a plain dict keyed by ``(generation, step)``; its columns and values are the profile
table's (``cf_ray.report.profile_frame``). Keys starting with ``_`` are per-rank inputs folded
into the public columns by :meth:`ProfileBook.profile_rows`.

Bounded (issue #16): memory and per-commit work stay constant however many checkpoints a run takes.

* Rows: the newest ``CF_RAY_PROFILE_WINDOW_ROWS`` (1,000) are kept in memory. When the window is
  full, its oldest quarter leaves memory as one batch of public rows, which the maintenance thread
  appends to storage as a Parquet part, ``profile/<lineage>/part-<n>.parquet`` (:class:`ProfileParts`),
  never rewriting an earlier one. :meth:`ProfileBook.profile_rows` returns the parts and the window
  together; :meth:`ProfileBook.save` (the end of a run) writes the whole table to
  ``profile.parquet`` as before, so ``cf_ray.report.read_run_profile`` reads it unchanged. A row
  mentioned again after it left memory (a rank's late timings) is merged with its part on read.
  The *lineage* is one controller and the controllers Ray restarts in its place; a new controller
  (a new ``fit()``) starts a new one, as a new controller started a new table before.
* Events and failures: the newest ``CF_RAY_EVENTS_WINDOW`` (1,000) each; a failure's ``seq``
  keeps counting (workers ask for the failures after the last one they saw).
* Iterations: the newest 20,000 (as before).
* The metrics export builds the one row it exports, not the table.
* Goodput (issue #15): each restart's cost (work lost, recovery time, restore source and time) and
  the run's effective training time ratio, kept by :class:`Goodput` from the samples and restore
  events the book already sees, exported as Ray metrics and saved as ``restarts.parquet``.

Not thread-safe on its own: the controller calls it under its lock (the maintenance thread only
appends events, one ``deque.append`` at a time, and writes the parts without the lock).
"""

from __future__ import annotations

import collections
import itertools
import logging
import posixpath
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from cf_ray._engine import env as _env
from cf_ray._engine.driver.jit_tier import JitPlan, JitTier
from cf_ray._engine.driver.schedule import ScheduleBook, checkpoint_stats
from cf_ray._engine.protocol.messages import CheckpointKind, Failure, PartReplicated, SectionState, SnapshotMeta
from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")

#: Per-rank timings a worker reports of its checkpoints (``SyncRequest.ckpt_stats``).
_RANK_TIMINGS = ("stall_s", "sync_s", "guard_s", "copy_s", "handoff_s")

#: Where the profile's parts live, relative to the run's storage.
PROFILE_PARTS = "profile"
_PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
_LINEAGE_RE = re.compile(r"^\d{20}$")
#: How often (at most) the iteration samples refresh the effective-training-ratio gauge.
_RATIO_EXPORT_PERIOD_S = 5.0


def new_lineage() -> str:
    """The name of a new lineage of profile parts (sorts by creation time)."""
    return f"{time.time_ns():020d}"


class ProfileParts:
    """The parts of one lineage on storage: append-only Parquet files of evicted rows.

    Storage I/O only: called without the controller's lock (the maintenance thread writes, an RPC
    thread reads).

    Args:
        storage: the run's storage.
        lineage: this controller's lineage (:func:`new_lineage`, or :func:`newest_lineage`).
    """

    def __init__(self, storage: Storage, lineage: str):
        self.storage = storage
        self.lineage = lineage
        self.directory = f"{PROFILE_PARTS}/{lineage}"
        self._next = 1 + max((int(m.group(1)) for m in map(_PART_RE.match, self._names()) if m), default=0)

    def _names(self) -> list[str]:
        try:
            return [n for n in self.storage.list_dir(self.directory) if _PART_RE.match(n)]
        except Exception as e:  # noqa: BLE001 - the profile is a report, never a reason to fail
            logger.warning("cf_ray: cannot list the profile parts at %s: %s", self.storage.uri(self.directory), e)
            return []

    def write(self, rows: list[dict]) -> str:
        """Append ``rows`` as the next part; returns its path."""
        from cf_ray import report

        path = f"{self.directory}/part-{self._next:06d}.parquet"
        self.storage.write_file(path, [report._parquet_bytes(report.profile_frame(rows))])
        self._next += 1
        return path

    def read_all(self) -> list[dict]:
        """Every row of every part, oldest part first (an unreadable part is skipped, logged)."""
        from cf_ray import report

        out: list[dict] = []
        for name in sorted(self._names()):
            path = f"{self.directory}/{name}"
            try:
                out.extend(report._read_parquet(self.storage, path).to_dict("records"))
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: skipping the profile part %s: %s", self.storage.uri(path), e)
        return out


def newest_lineage(storage: Storage) -> str | None:
    """The newest lineage on storage (what a controller that Ray restarted continues), or ``None``."""
    try:
        names = [n for n in storage.list_dir(PROFILE_PARTS) if _LINEAGE_RE.match(n)]
    except Exception:  # noqa: BLE001
        return None
    return max(names, default=None)


def delete_other_lineages(storage: Storage, keep: str) -> None:
    """Delete the parts of earlier controllers (their table is in ``profile.parquet`` when they
    finished, which this controller's save replaces, as before parts existed). Storage I/O."""
    try:
        names = [n for n in storage.list_dir(PROFILE_PARTS) if _LINEAGE_RE.match(n) and n != keep]
    except Exception:  # noqa: BLE001
        return
    for name in names:
        try:
            storage.delete_dir(posixpath.join(PROFILE_PARTS, name))
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not delete old profile parts %s: %s", name, e)


def merge_rows(*sources: Iterable[dict]) -> list[dict]:
    """Rows of several sources as one table in step order: rows of the same ``(generation,
    step)`` are merged, a later source's non-missing values winning."""
    merged: dict[tuple, dict] = {}
    for rows in sources:
        for r in rows:
            key = (r.get("generation"), r.get("step"))
            old = merged.get(key)
            if old is None:
                merged[key] = dict(r)
            else:
                old.update({k: v for k, v in r.items() if v is not None})
    return sorted(merged.values(), key=lambda r: (_sort_key(r.get("step")), _sort_key(r.get("generation"))))


def _sort_key(v) -> tuple:
    return (v is None, v if v is not None else 0)


@dataclass
class Restart:
    """One restart of the run (after a failure, a preemption or a resize) and what it cost."""

    generation: int
    """The attempt that resumed."""
    source: str
    """Where it resumed from (``RestoreSource`` value: ``memory``, ``storage``, ``fresh``)."""
    restored_step: int
    """The step it resumed from."""
    restore_s: float
    """Seconds the restore took (rank 0's measure)."""
    lost_steps: int
    """Steps of the previous timeline redone: the newest step the controller saw reached since the
    previous restore (a rank's sample or a staged snapshot), minus ``restored_step`` (at least 0)."""
    lost_s: float | None
    """``lost_steps`` times the run's mean iteration time (``None`` before any iteration time)."""
    failure_unix: float | None
    """The best estimate of the failure time the controller has: the newest sign of life of the
    previous attempt before the restore — a sample or a staged snapshot reaching it, else that
    attempt's own restore (the failure happened after it)."""
    restored_unix: float
    """When the restore was reported."""
    resumed_unix: float | None = None
    """When the first iteration past ``restored_step`` ended (estimated from the first such sample:
    its arrival less the iterations it covers after the first); ``None`` until then."""
    recovery_s: float | None = None
    """``resumed_unix - failure_unix``: from the failure to the first resumed iteration."""


class Goodput:
    """Goodput of one run from the iteration samples and restore events (no Ray, no storage).

    Definitions (also in docs/guides/metrics.md):

    * mean iteration time: the ``iters``-weighted mean of every sample's ``iter_s`` (checkpoint
      stalls excluded, as the workers measure it);
    * progress: the newest step reached on the current timeline (a sample's step, or a staged
      snapshot's) minus the step the run started from (the first attempt's restored step, or where
      the first sample's iterations began);
    * useful seconds: progress times the mean iteration time — each step that survives counts once,
      steps redone after a restart count once, the stalls, restores and lost work not at all;
    * wall seconds: from the start of the run's first iteration (the first sample's arrival less
      the iterations it covers; when the first attempt ended before any of its samples arrived,
      its restore) to the newest sample or staged snapshot;
    * effective training time ratio: useful seconds / wall seconds, clipped to [0, 1].

    The first restore this object sees is the run's start, whatever reached the controller before
    it; every later one is a restart (an attempt may fail before its first sample is sent: its
    restart still counts, with the work lost that the controller saw).

    Args:
        max_restarts: how many restarts are kept (the newest).
    """

    def __init__(self, max_restarts: int = 1000):
        self.restarts: collections.deque[Restart] = collections.deque(maxlen=max(1, max_restarts))
        self._start_step: int | None = None
        """The step the run started from."""
        self._reached_step: int | None = None
        """The newest step reported on the current timeline (since the newest restore)."""
        self._first_unix: float | None = None
        """When the run's first iteration started (estimated)."""
        self._last_unix: float | None = None
        """When the newest sample or staged snapshot arrived."""
        self._started = False
        """Whether the run's start (its first restore, or a sample before any) was seen."""
        self._start_unix: float | None = None
        """When the run's first attempt restored (its start)."""
        self._attempt_unix: float | None = None
        """When the current attempt restored: a sign of life when nothing newer came from it."""
        self._generation: int | None = None
        """The generation of the newest restore: staged snapshots of older ones are late news."""
        self._iter_total_s = 0.0
        self._iters = 0
        self._pending: Restart | None = None
        """The newest restart until its first resumed iteration."""
        self.lost_steps_total = 0
        self.lost_s_total = 0.0

    def mean_iter_s(self) -> float | None:
        return self._iter_total_s / self._iters if self._iters else None

    def on_sample(self, step: int, iter_s: float, iters: int, now_unix: float) -> Restart | None:
        """A rank's sample; returns the pending restart when this sample is its first resumed iteration."""
        step, iters = int(step), int(iters)
        timed = iters > 0 and iter_s > 0
        self._started = True
        if self._first_unix is None:
            self._first_unix = now_unix - (iters * iter_s if timed else 0.0)
            if self._start_step is None:
                self._start_step = max(0, step - max(iters, 0))
        self._seen(step, now_unix)
        if timed:
            self._iter_total_s += iters * iter_s
            self._iters += iters
        resumed = self._pending
        if resumed is None or step <= resumed.restored_step:
            return None
        self._pending = None
        covered = min(iters, step - resumed.restored_step) if timed else 1
        resumed.resumed_unix = max(resumed.restored_unix, now_unix - max(0, covered - 1) * (iter_s if timed else 0))
        if resumed.failure_unix is not None:
            resumed.recovery_s = max(0.0, resumed.resumed_unix - resumed.failure_unix)
        return resumed

    def on_progress(self, generation: int, step: int, now_unix: float) -> None:
        """A snapshot of ``step`` was staged: the run reached it (no timing; the samples may not
        have arrived yet, e.g. when an attempt fails before its first sync). Snapshots of an
        earlier generation than the newest restore's are late news of an ended timeline: ignored."""
        if self._generation is not None and int(generation) < self._generation:
            return
        self._seen(int(step), now_unix)

    def _seen(self, step: int, now_unix: float) -> None:
        self._last_unix = now_unix if self._last_unix is None else max(self._last_unix, now_unix)
        self._reached_step = step if self._reached_step is None else max(self._reached_step, step)

    def on_restore(
        self, *, generation: int, source: str, step: int, restore_s: float, now_unix: float
    ) -> Restart | None:
        """An attempt restored ``step``; returns the restart it makes (``None`` for the run's start:
        the first restore, unless samples came before it)."""
        step, previous_attempt_unix = int(step), self._attempt_unix
        self._generation = max(int(generation), self._generation or 0)
        self._attempt_unix = now_unix
        if not self._started:  # where the run starts
            self._started = True
            self._start_step = self._reached_step = step
            self._start_unix = now_unix
            return None
        if self._first_unix is None:  # the first attempt ended before its first sample came
            self._first_unix = self._start_unix if self._start_unix is not None else previous_attempt_unix
        lost = max(0, (self._reached_step if self._reached_step is not None else step) - step)
        mean = self.mean_iter_s()
        alive = [t for t in (self._last_unix, previous_attempt_unix) if t is not None]
        restart = Restart(
            generation=int(generation),
            source=str(source),
            restored_step=step,
            restore_s=float(restore_s or 0.0),
            lost_steps=lost,
            lost_s=None if mean is None else lost * mean,
            failure_unix=max(alive, default=None),
            restored_unix=now_unix,
        )
        self.lost_steps_total += lost
        self.lost_s_total += restart.lost_s or 0.0
        self._reached_step = step
        self.restarts.append(restart)
        self._pending = restart
        return restart

    def progress_steps(self) -> int | None:
        if self._start_step is None or self._reached_step is None:
            return None
        return max(0, self._reached_step - self._start_step)

    def useful_s(self) -> float | None:
        progress, mean = self.progress_steps(), self.mean_iter_s()
        return None if progress is None or mean is None else progress * mean

    def wall_s(self) -> float | None:
        if self._first_unix is None or self._last_unix is None:
            return None
        return max(0.0, self._last_unix - self._first_unix)

    def effective_ratio(self) -> float | None:
        """Useful seconds / wall seconds, in [0, 1]; ``None`` before there is wall time."""
        useful, wall = self.useful_s(), self.wall_s()
        if useful is None or not wall:
            return None
        return min(1.0, max(0.0, useful / wall))

    def rows(self) -> list[dict]:
        """The restarts as the ``restarts`` table has them (``cf_ray.report.restarts_frame``)."""
        return [asdict(r) for r in self.restarts]


class ProfileBook:
    """Profile rows, iteration rows, events, failures and the metrics export of one run.

    Args:
        key: the run key (the metrics' ``run`` tag).
        storage: the run's storage (where the profile table is saved).
        schedule: the schedule (the interval a new row starts with; the policy and samples the
            overhead column comes from).
        lineage: where this controller's evicted rows go (:class:`ProfileParts`); a new lineage
            when ``None``.
        seq_base: the first failure's ``seq`` (a controller that starts again during a run counts
            above its predecessor, see :mod:`.schedule`).
        on_batch: called (under the controller's lock) when a batch of rows left memory and waits
            to be written (:meth:`write_parts`, by the maintenance thread).
    """

    def __init__(
        self,
        key: str,
        storage: Storage,
        schedule: ScheduleBook,
        *,
        lineage: str | None = None,
        seq_base: int = 0,
        on_batch: Callable[[], None] | None = None,
    ):
        self.key = key
        self.storage = storage
        self.schedule = schedule
        self.parts = ProfileParts(storage, lineage or new_lineage())
        self._window = max(4, _env.get_int(_env.PROFILE_WINDOW_ROWS))
        self._rows: dict[tuple[int, int], dict] = {}
        """(generation, step) -> row, oldest first mention first; at most the window."""
        self._unwritten: list[list[dict]] = []
        """Batches of public rows that left memory, until their part is written."""
        self._evicted: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        """Keys of the rows that left memory most recently (at most the window): a later mention
        makes a fragment (no defaults), merged with the part on read."""
        self._on_batch = on_batch
        events_window = max(1, _env.get_int(_env.EVENTS_WINDOW))
        self.events: collections.deque[dict] = collections.deque(maxlen=events_window)
        """Restores, fallbacks, notices, interval changes, uploads, in order (the newest)."""
        self._iters: collections.deque = collections.deque(maxlen=20000)
        self._failures: collections.deque[Failure] = collections.deque(maxlen=events_window)
        self._next_failure_seq = int(seq_base)
        self._metrics = None  # cf_ray.report.CheckpointMetrics, made on first use
        self.goodput = Goodput(events_window)
        self._goodput_metrics = None  # cf_ray.report.GoodputMetrics, made on first use
        self._ratio_exported_unix = 0.0
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
                    "interval": self.schedule.current_interval,
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

    def note_staged(self, generation: int, step: int, meta: SnapshotMeta) -> None:
        try:
            self.goodput.on_progress(generation, step, time.time())
        except Exception:  # noqa: BLE001 - goodput is a report, never a reason to fail
            logger.debug("cf_ray: goodput bookkeeping failed", exc_info=True)
        row = self.row(generation, step)
        row.update(
            epoch=meta.epoch,
            kind=CheckpointKind(meta.kind).value,
            milestone=meta.milestone,
            interval=meta.interval,
            world_size=meta.world_size,
        )
        # Host passes (#14): what each rank copied and read again for its snapshot, and its wait for a slot.
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
        self.row(generation, step).setdefault("_copies", {})[key] = (copied, crc_read)

    def note_replicated(self, msg: PartReplicated) -> None:
        """A peer replica of a section (#12): its bytes and seconds (the slowest section's), or a
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

    def note_jit_plan(self, generation: int, step: int, plan: JitPlan) -> None:
        """The tier chosen for a just-in-time checkpoint and each tier's predicted seconds (#12)."""
        row = self.row(generation, step)
        row.update(plan.row(), _jit_decided_unix=plan.decided_unix)
        self.add_event({**plan.event(), "step": step, "generation": generation})

    def note_jit_peer_safe(self, generation: int, step: int, plan: JitPlan) -> None:
        """Every section of a just-in-time checkpoint that needed one has a copy on another usable node."""
        t = plan.peer_safe_unix
        if t is None:
            return
        row = self.row(generation, step)
        row["actual_peer_s"] = round(t - plan.decided_unix, 3)
        if plan.tier is not JitTier.STORAGE:
            self._safe(row, t, JitTier.PEER)

    @staticmethod
    def _safe(row: dict, t: float, tier: JitTier) -> None:
        """A just-in-time checkpoint is safe in ``tier`` at ``t``: the first such time decides whether
        the deadline was met (a tier not chosen counts only when it is storage, which survives more)."""
        if row.get("safe_unix") is not None and row["safe_unix"] <= t:
            return
        row.update(safe_unix=t, safe_tier=tier.value)
        if row.get("deadline_unix") is not None:
            row["made_deadline"] = t <= row["deadline_unix"]

    def note_superseded(self, generation: int, step: int) -> None:
        self.row(generation, step).update(
            committed=False, where="memory-only", error="superseded by a newer snapshot before it was persisted"
        )

    def note_failed(self, generation: int, step: int, section: str, error: str) -> None:
        row = self.row(generation, step)
        row.update(committed=False, where=SectionState.FAILED.value, error=f"{section}: {error}")
        if row.get("deadline_unix") is not None and row.get("safe_unix") is None:
            row["made_deadline"] = False  # safe in a peer's memory before the deadline stays met

    def note_abandoned(self, generation: int, step: int) -> None:
        """A just-in-time checkpoint of an attempt that ended before it was durable."""
        row = self._rows.get((generation, step))
        if row is not None and row.get("deadline_unix") is not None:
            row.update(where=SectionState.ABANDONED.value, error="not durable when its attempt ended")
            if row.get("safe_unix") is None:
                row["made_deadline"] = False

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
        if row.get("_jit_decided_unix") is not None:
            row["actual_storage_s"] = round(row["durable_unix"] - row["_jit_decided_unix"], 3)
        if row.get("deadline_unix") is not None:
            self._safe(row, row["durable_unix"], JitTier.STORAGE)
        return row

    def memory_rows(self) -> list[dict]:
        """The rows still in memory (the window, and batches not yet in a part), in step order."""
        iter_s = _recent_iter_s(self.schedule.samples)
        window = [
            self._public(row, iter_s) for _, row in sorted(self._rows.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ]
        return merge_rows(*self._unwritten, window) if self._unwritten else window

    def profile_rows(self) -> list[dict]:
        """One dict per checkpoint still in memory (the profile table's columns), in step order.
        The whole table is :meth:`all_rows` (storage I/O: outside the controller's lock)."""
        return self.memory_rows()

    def all_rows(self, lock: threading.RLock) -> list[dict]:
        """Every row of this lineage: the parts on storage and the rows in memory, in step order.
        The rows in memory are read under ``lock``, the parts without it."""
        with lock:
            memory = self.memory_rows()
        parts = self.parts.read_all()  # after: a batch written meanwhile is in one of the two
        return merge_rows(parts, memory) if parts else memory

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
        stats = checkpoint_stats(self.schedule.policy, step)
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
                self._export_goodput(resumed, resumed=True)
            elif now - self._ratio_exported_unix >= _RATIO_EXPORT_PERIOD_S:
                self._export_goodput(None)
        except Exception:  # noqa: BLE001 - goodput is a report, never a reason to fail
            logger.debug("cf_ray: goodput bookkeeping failed", exc_info=True)

    def _mark_durability(self, event: dict, lost: bool) -> None:
        """The profile's ``durability_lost`` column: the rows of the checkpoints that were taken and
        not committed while an episode was open (from the step since which nothing committed)."""
        if not lost:
            self._lost_since = None
            return
        generation = int(event.get("generation") or 0)
        since = event.get("since_step")
        if since is None:
            since = (event.get("committed_step") or 0) + 1
        self._lost_since = (generation, int(since))
        for (gen, step), row in self._rows.items():
            if gen == generation and step >= since and not row.get("committed"):
                row["durability_lost"] = True

    def iteration_rows(self) -> list[dict]:
        return list(self._iters)

    def add_event(self, event: dict) -> None:
        self.events.append(event)
        if event.get("event") in ("durability_lost", "durability_restored"):  # the workers' watchdog
            lost = event["event"] == "durability_lost"
            if lost:
                logger.warning("cf_ray: run %s: checkpoints are not becoming durable: %s", self.key, event)
            self._mark_durability(event, lost)
            try:
                if self._goodput_metrics is None:
                    from cf_ray.report import GoodputMetrics

                    self._goodput_metrics = GoodputMetrics(run=self.key)
                self._goodput_metrics.record_durability(lost)
            except Exception:  # noqa: BLE001 - metrics are a report, never a reason to fail
                logger.debug("cf_ray: durability metric export failed", exc_info=True)
        if event.get("event") == "restore":  # the controller's restored(): a restart's cost, or the run's start
            try:
                restart = self.goodput.on_restore(
                    generation=event.get("generation") or 0,
                    source=str(event.get("source")),
                    step=event.get("step") or 0,
                    restore_s=event.get("seconds") or 0.0,
                    now_unix=event.get("time") or time.time(),
                )
                if restart is not None:
                    self._export_goodput(restart)
            except Exception:  # noqa: BLE001
                logger.debug("cf_ray: goodput bookkeeping failed", exc_info=True)

    def restart_rows(self) -> list[dict]:
        """One dict per restart (the ``restarts`` table, :func:`cf_ray.report.restarts_frame`)."""
        return self.goodput.rows()

    def add_failure(self, *, generation: int, step: int, section: str, rank: int, error: str) -> Failure:
        failure = Failure(
            seq=self._next_failure_seq, step=step, section=section, rank=rank, error=error, generation=generation
        )
        self._next_failure_seq += 1
        self._failures.append(failure)
        return failure

    def continue_failures_above(self, seen_seq: int) -> None:
        """A rank has seen failure ``seen_seq`` of an earlier controller: count above it."""
        self._next_failure_seq = max(self._next_failure_seq, int(seen_seq) + 1)

    def failures_since(self, seen_seq: int) -> tuple[Failure, ...]:
        return tuple(f for f in self._failures if f.seq > seen_seq)

    def failure_dicts(self) -> list[dict]:
        """The failures as the controller's summary has them."""
        return [f.as_dict() for f in self._failures]

    # -- export -------------------------------------------------------------------------------------------
    def record_metrics(self, generation: int, step: int) -> None:
        """Export the row to Ray metrics (dashboard, Prometheus); never fails the caller."""
        try:
            row = self._rows.get((generation, step))
            if row is None:
                return
            if self._metrics is None:
                from cf_ray.report import CheckpointMetrics

                self._metrics = CheckpointMetrics(run=self.key)
            self._metrics.record(self._public(row, _recent_iter_s(self.schedule.samples)))
            self._export_goodput(None)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: metrics export failed", exc_info=True)

    def _export_goodput(self, restart: Restart | None, *, resumed: bool = False) -> None:
        """Export a restart (when it happens; its recovery time once resumed) and the ratio to Ray metrics."""
        try:
            if self._goodput_metrics is None:
                from cf_ray.report import GoodputMetrics

                self._goodput_metrics = GoodputMetrics(run=self.key)
            self._ratio_exported_unix = time.time()
            if restart is not None:
                if resumed:
                    self._goodput_metrics.record_recovery(restart.recovery_s)
                else:
                    self._goodput_metrics.record_restart(
                        restart.source, restart.lost_steps, restart.lost_s, restart.restore_s
                    )
            self._goodput_metrics.record_ratio(self.goodput.effective_ratio())
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: goodput metrics export failed", exc_info=True)

    def save(self, lock: threading.RLock) -> None:
        """Write the profile table (every row of this lineage) and the iteration rows to storage;
        never fails the caller. The rows in memory are read under ``lock`` (the controller's),
        the parts are read and the table written without it."""
        try:
            from cf_ray import report

            with lock:
                iterations = self.iteration_rows()
                restarts = self.restart_rows()
            rows = self.all_rows(lock)
            report.save_profile(self.storage, rows, iterations, restarts=restarts)
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
