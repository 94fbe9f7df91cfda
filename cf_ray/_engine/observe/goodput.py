"""Goodput and badput of a run, from what the controller already sees: the iteration samples, the
staged snapshots, the restore events and each checkpoint's training-thread stall.

* :class:`Goodput` owns the run's timeline: each restart's cost (work lost, recovery time and its
  parts, restore source and time), the progress and the mean iteration time, and the effective
  training time ratio. The restarts are the ``restarts`` table (``cf_ray.report.read_run_restarts``).
* :class:`Badput` owns what the timeline does not: when the controller started and the checkpoint
  stalls; :meth:`Badput.breakdown` splits the wall time into productive time and the badput
  categories of Google's ML Goodput Measurement (:data:`CATEGORIES`), from both. The controller
  exports it as Ray metrics (``cf_ray_productive_seconds``, ``cf_ray_badput_seconds`` by
  ``category``), returns it in its summary and saves it as ``goodput.json`` with the profile.

The categories (seconds; they add up to the wall time since the controller started, up to the
overlap said under ``other``):

* ``productive``: progress on the current timeline x the mean iteration time (as the effective
  training ratio counts it; the slowdown of iterations that overlap a background copy is in it);
* ``checkpoint_save``: the training-thread stall of every checkpoint (slowest rank's);
* ``checkpoint_restore``: every restore's own duration (the first attempt's included);
* ``wasted_progress``: training redone after restarts (the work lost);
* ``recovery``: for each restart, failure to first resumed iteration less its restore and that
  iteration (failure detection, Ray Train restarting the worker group, processes and models built
  again);
* ``startup``: the controller's start (the first rank's ``Checkpointer``) to the first iteration,
  less the first attempt's restore;
* ``other``: the rest (iteration-time noise, data stalls, the time since the newest report); never
  below 0: the categories are estimates from when the workers' reports arrive, and two of them (a
  recovery, the work lost before it) can overlap by a report's lag.

No Ray, no storage, no lock: the profile (:class:`~.profile_book.ProfileBook`) calls it under the
controller's lock.
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass

from cf_ray._engine.protocol.events import RestoreEvent

#: The badput categories, in the order users see them.
CATEGORIES = ("checkpoint_save", "checkpoint_restore", "wasted_progress", "recovery", "startup", "other")

_STALLS_KEPT = 256
"""Checkpoints whose per-rank stalls are kept (a rank's late report of an older one is still added)."""


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
    fallbacks: int = 0
    """Restore candidates this attempt tried and fell back from before the one it restored."""
    memory_failed: int = 0
    """Of those, in-memory snapshots whose bytes failed verification (block checksums, fingerprints)."""
    rebuild_s: float | None = None
    """Of ``recovery_s``, from ``failure_unix`` to the start of rank 0's new process: Ray Train
    seeing the failure, tearing the old worker group down, placing and starting the new one.
    ``None`` when unknown (rank 0's process is older than the failure: it was not replaced)."""
    setup_s: float | None = None
    """From the start of rank 0's new process to its call of ``restore()``: the process's imports,
    ``init_process_group`` and the user's set-up (model, optimizer, ``Checkpointer``)."""
    first_step_s: float | None = None
    """From the restore reaching the controller to the end of the first resumed iteration."""
    spare: str | None = None
    """Whether rank 0's new process was the spare one its predecessor made ready (``taken``), or why
    not (``not taken: ...``); ``None`` when spares are off."""


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
        """The step the run started from; set by the run's start (its first restore, or a sample
        before any), so ``None`` until the start was seen."""
        self._reached_step: int | None = None
        """The newest step reported on the current timeline (since the newest restore)."""
        self._first_unix: float | None = None
        """When the run's first iteration started (estimated)."""
        self._last_unix: float | None = None
        """When the newest sample or staged snapshot arrived."""
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
        self._fallbacks: list[tuple[str, str]] = []
        """(source, cause) of the restore fallbacks since the newest restore (the next restart's)."""
        self.start_restore_s = 0.0
        """The first attempt's restore (a resume from another run's or an earlier run's checkpoint):
        not a restart, but badput all the same."""

    def mean_iter_s(self) -> float | None:
        return self._iter_total_s / self._iters if self._iters else None

    @property
    def first_unix(self) -> float | None:
        """When the run's first iteration started (estimated; ``None`` before any)."""
        return self._first_unix

    @property
    def last_unix(self) -> float | None:
        """When the newest sample or staged snapshot arrived."""
        return self._last_unix

    def on_sample(self, step: int, iter_s: float, iters: int, now_unix: float) -> Restart | None:
        """A rank's sample; returns the pending restart when this sample is its first resumed iteration."""
        step, iters = int(step), int(iters)
        timed = iters > 0 and iter_s > 0
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
        resumed.first_step_s = max(0.0, resumed.resumed_unix - resumed.restored_unix)
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

    def on_fallback(self, source: str, cause: str) -> None:
        """The attempt now restoring fell back from a candidate (counted in its restart's row)."""
        self._fallbacks.append((str(source), str(cause)))

    def on_restore(
        self,
        *,
        generation: int,
        source: str,
        step: int,
        restore_s: float,
        now_unix: float,
        process_start_unix: float | None = None,
        restore_begin_unix: float | None = None,
        code_start_unix: float | None = None,
        spare: str | None = None,
    ) -> Restart | None:
        """An attempt restored ``step``; returns the restart it makes (``None`` for the run's start:
        the first restore, unless samples came before it). ``process_start_unix`` and
        ``restore_begin_unix`` (rank 0's, when it sent them) split the recovery into its parts;
        ``code_start_unix`` (when rank 0 loaded cf_ray) stands for the process start when that
        predates the failure."""
        step, previous_attempt_unix = int(step), self._attempt_unix
        self._generation = max(int(generation), self._generation or 0)
        self._attempt_unix = now_unix
        if self._start_step is None:  # where the run starts
            self._fallbacks = []
            self._start_step = self._reached_step = step
            self._start_unix = now_unix
            self.start_restore_s += float(restore_s or 0.0)
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
            fallbacks=len(self._fallbacks),
            memory_failed=sum(1 for src, cause in self._fallbacks if src == "memory" and cause == "verification"),
            spare=spare,
        )
        _split(restart, process_start_unix, restore_begin_unix, code_start_unix)
        self._fallbacks = []
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


def restore_args(event: RestoreEvent) -> dict:
    """:meth:`Goodput.on_restore`'s arguments from the controller's ``restore`` event."""
    return {
        "generation": event.generation or 0,
        "source": str(event.source),
        "step": event.step or 0,
        "restore_s": event.seconds or 0.0,
        "now_unix": event.time or time.time(),
        "process_start_unix": event.process_start_unix,
        "restore_begin_unix": event.restore_begin_unix,
        "code_start_unix": event.code_start_unix,
        "spare": event.spare,
    }


def _split(
    restart: Restart,
    process_start_unix: float | None,
    restore_begin_unix: float | None,
    code_start_unix: float | None = None,
) -> None:
    """The parts of a restart's recovery before its restore, from rank 0's process start (or, when
    that predates the failure, when rank 0 loaded cf_ray) and its call of ``restore()``; left ``None``
    where a time is missing or both predate the failure."""
    failed = restart.failure_unix
    if failed is None:
        return
    start = next((t for t in (process_start_unix, code_start_unix) if t is not None and t >= failed), None)
    if start is None:
        return
    restart.rebuild_s = start - failed
    if restore_begin_unix is not None and restore_begin_unix >= start:
        restart.setup_s = restore_begin_unix - start


class Badput:
    """Where the wall time went (the module docstring): the checkpoint stalls and the controller's
    start, which the timeline (:class:`Goodput`) does not hold, and the breakdown of both.

    Args:
        started_unix: when the controller started (the start of the run's wall time; now by default).
    """

    def __init__(self, started_unix: float | None = None):
        self.started_unix = time.time() if started_unix is None else started_unix
        self.stall_s = 0.0
        """Sum over checkpoints of the slowest rank's training-thread stall."""
        self._stalls: collections.OrderedDict[tuple[int, int], dict[int, float]] = collections.OrderedDict()
        """(generation, step) -> rank -> stall, the newest :data:`_STALLS_KEPT`: a rank's late report
        of a kept checkpoint raises its slowest stall instead of adding a second one."""

    def note_stall(self, generation: int, rank: int, stats: dict) -> None:
        """A rank's timings of one checkpoint (``SyncRequest.ckpt_stats``): its stall, the synchronous
        part plus its guard wait, counts for the slowest rank."""
        seconds = (stats.get("stall_s") or 0.0) + (stats.get("guard_s") or 0.0)
        if "stall_s" not in stats or not isinstance(seconds, (int, float)) or seconds < 0:
            return
        per_rank = self._stalls.setdefault((int(generation), int(stats["step"])), {})
        before = max(per_rank.values(), default=0.0)
        per_rank[int(rank)] = float(seconds)
        self.stall_s += max(per_rank.values()) - before
        while len(self._stalls) > _STALLS_KEPT:
            self._stalls.popitem(last=False)

    def breakdown(self, goodput: Goodput, now_unix: float | None = None) -> dict:
        """``{"wall_s", "productive_s", "effective_training_ratio", "badput_s": {category: s},
        "shares": {category or "productive": share of wall}, "restarts", "recovery_parts_s"}`` of the
        run whose timeline is ``goodput``; the wall time ends at its newest report (``now_unix``, or
        now, before any)."""
        end = goodput.last_unix if goodput.last_unix is not None else (now_unix or time.time())
        wall = max(0.0, end - self.started_unix)
        restarts = list(goodput.restarts)
        productive = goodput.useful_s() or 0.0
        first = goodput.first_unix
        start_restore = goodput.start_restore_s
        bad = {
            "checkpoint_save": self.stall_s,
            "checkpoint_restore": start_restore + sum(r.restore_s or 0.0 for r in restarts),
            "wasted_progress": goodput.lost_s_total,
            "recovery": sum(_infra(r, goodput.mean_iter_s() or 0.0) for r in restarts),
            "startup": max(0.0, first - self.started_unix - start_restore) if first is not None else 0.0,
        }
        bad["other"] = max(0.0, wall - productive - sum(bad.values()))
        shares = {"productive": productive / wall if wall else None}
        shares.update({k: (v / wall if wall else None) for k, v in bad.items()})
        return {
            "wall_s": wall,
            "productive_s": productive,
            "effective_training_ratio": goodput.effective_ratio(),
            "badput_s": bad,
            "shares": shares,
            "restarts": len(restarts),
            "recovery_parts_s": _parts(restarts),
        }


def _parts(restarts: list[Restart]) -> dict:
    """The recovery's parts summed over the restarts that have them (``Restart.rebuild_s``,
    ``setup_s``, ``restore_s``, ``first_step_s``): where the ``recovery`` and ``checkpoint_restore``
    badput went, with how many restarts each sum covers."""
    out: dict = {}
    for name in ("rebuild_s", "setup_s", "restore_s", "first_step_s"):
        vals = [getattr(r, name) for r in restarts if getattr(r, name) is not None]
        out[name] = sum(vals)
        out[name.removesuffix("_s") + "_count"] = len(vals)
    return out


def _infra(r: Restart, iter_s: float) -> float:
    """A restart's recovery less its restore and its first resumed iteration (productive), 0 until
    it has resumed."""
    if r.recovery_s is None:
        return 0.0
    return max(0.0, r.recovery_s - (r.restore_s or 0.0) - iter_s)


__all__ = ["CATEGORIES", "Badput", "Goodput", "Restart", "restore_args"]
