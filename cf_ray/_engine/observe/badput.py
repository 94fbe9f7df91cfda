"""Where a run's wall time went (issue #26): productive training and the badput categories of
Google's ML Goodput Measurement (checkpoint save, checkpoint restore, wasted progress from
disruptions, infrastructure recovery from disruptions, program start-up), from what the controller
already sees; and the feed of the run's failures to the frequency policy.

* :class:`Badput` is the profile book's :class:`~.goodput.Goodput` (restarts, lost work, progress)
  with the sums it lacks (the training-thread stall of every checkpoint, the first attempt's
  restore), and computes :meth:`Badput.breakdown` from both. The controller exports it as Ray
  metrics (``cf_ray_productive_seconds``, ``cf_ray_badput_seconds`` by ``category``), returns it in
  its summary and saves it as ``goodput.json`` with the profile.
* :class:`FailureFeed` (the schedule's, :attr:`ScheduleBook.failures`) turns the run's start,
  restarts, recoveries and preemption notices into :class:`~cf_ray.policy.RunEvent` objects for the
  policy (:meth:`ScheduleBook.observe`), which estimates the failure rate from them, and records a
  ``failure_rate`` event (and its Ray metric) per failure counted.

The categories (seconds; they add up to the wall time since the controller started, up to the overlap
said under ``other``):

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
  below 0: the categories are estimates from when the workers' reports arrive, and on a busy
  machine two of them (a recovery, the work lost before it) can overlap by a report's lag.

No Ray, no torch: the controller's profile book (:mod:`.profile_book`) calls it under its lock.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from cf_ray._engine.observe.goodput import Goodput, Restart
from cf_ray._engine.protocol.messages import CheckpointKind, SnapshotMeta
from cf_ray.policy import RunEvent, RunEventKind

if TYPE_CHECKING:
    from cf_ray._engine.driver.schedule import ScheduleBook

logger = logging.getLogger("cf_ray")

#: The badput categories, in the order users see them.
CATEGORIES = ("checkpoint_save", "checkpoint_restore", "wasted_progress", "recovery", "startup", "other")

_STALLS_KEPT = 256
"""Checkpoints whose per-rank stalls are kept (a rank's late report of an older one is still added)."""


class Badput(Goodput):
    """A :class:`~.goodput.Goodput` that also says where the wall time went (the module docstring).

    Args:
        max_restarts: as :class:`~.goodput.Goodput`.
        started_unix: when the controller started (the start of the run's wall time; now by default).
    """

    def __init__(self, max_restarts: int = 1000, started_unix: float | None = None):
        super().__init__(max_restarts)
        self.started_unix = time.time() if started_unix is None else started_unix
        self.start_restore_s = 0.0
        """The first attempt's restore (a resume from another run's or an earlier run's checkpoint)."""
        self.stall_s = 0.0
        """Sum over checkpoints of the slowest rank's training-thread stall."""
        self._stalls: collections.OrderedDict[tuple[int, int], dict[int, float]] = collections.OrderedDict()

    def on_restore(self, *, restore_s: float, **kw) -> Restart | None:
        restart = super().on_restore(restore_s=restore_s, **kw)
        if restart is None:  # the run's start: its restore is badput too
            self.start_restore_s += float(restore_s or 0.0)
        return restart

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

    def breakdown(self, now_unix: float | None = None) -> dict:
        """``{"wall_s", "productive_s", "effective_training_ratio", "badput_s": {category: s},
        "shares": {category or "productive": share of wall}, "restarts"}``."""
        end = self.last_unix if self.last_unix is not None else (now_unix or time.time())
        wall = max(0.0, end - self.started_unix)
        restarts = list(self.restarts)
        productive = self.useful_s() or 0.0
        first = self.first_unix
        bad = {
            "checkpoint_save": self.stall_s,
            "checkpoint_restore": self.start_restore_s + sum(r.restore_s or 0.0 for r in restarts),
            "wasted_progress": self.lost_s_total,
            "recovery": sum(_infra(r, self.mean_iter_s() or 0.0) for r in restarts),
            "startup": max(0.0, first - self.started_unix - self.start_restore_s) if first is not None else 0.0,
        }
        bad["other"] = max(0.0, wall - productive - sum(bad.values()))
        shares = {"productive": productive / wall if wall else None}
        shares.update({k: (v / wall if wall else None) for k, v in bad.items()})
        return {
            "wall_s": wall,
            "productive_s": productive,
            "effective_training_ratio": self.effective_ratio(),
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


class FailureFeed:
    """The run's failures, as :class:`~cf_ray.policy.RunEvent` objects, to the policy; a
    ``failure_rate`` event and metric per failure counted. Never raises (a report).

    Args:
        schedule: where the policy lives (:meth:`ScheduleBook.observe`).
    """

    def __init__(self, schedule: ScheduleBook):
        self.schedule = schedule
        self._generation: int | None = None
        self._failures = 0  # as of the last failure_rate event
        self._log: Any = None  # the profile book's EventLog and MetricsExport (attach)
        self._export: Any = None

    def attach(self, log: Any, export: Any) -> None:
        """Where the ``failure_rate`` events go (an ``EventLog``) and their metric (a ``MetricsExport``)."""
        self._log, self._export = log, export

    def restore(self, event: dict, restart: Restart | None) -> None:
        """An attempt restored (the controller's ``restore`` event): the run's start, or a restart."""
        try:
            gen = int(event.get("generation") or 0)
            now = float(event.get("time") or time.time())
            self._generation = gen
            if restart is None:
                self.schedule.observe(RunEvent(kind=RunEventKind.START, time_unix=now, generation=gen))
                return
            failed = restart.failure_unix if restart.failure_unix is not None else now
            self.schedule.observe(
                RunEvent(
                    kind=RunEventKind.FAILURE,
                    time_unix=failed,
                    generation=gen,
                    source=restart.source,
                    lost_s=restart.lost_s,
                )
            )
            self._rate_event("restart", now)
        except Exception:  # noqa: BLE001 - a report, never a reason to fail
            logger.debug("cf_ray: failure-rate bookkeeping failed", exc_info=True)

    def resumed(self, restart: Restart) -> None:
        """The first iteration after a restart ended."""
        if restart.resumed_unix is None:
            return
        self.schedule.observe(
            RunEvent(
                kind=RunEventKind.RESUMED,
                time_unix=restart.resumed_unix,
                source=restart.source,
                recovery_s=restart.recovery_s,
            )
        )

    def notice(self, event: dict) -> None:
        """The driver's preemption notice (the controller's ``notice`` event)."""
        self._notice(event.get("time") or time.time(), event.get("generation"), "driver")

    def staged(self, generation: int, meta: SnapshotMeta) -> None:
        """A section of a checkpoint was staged: a ``preempt`` one carries the notice it answers."""
        if meta.notice_unix is not None and CheckpointKind(meta.kind) is CheckpointKind.PREEMPT:
            self._notice(meta.notice_unix, generation, meta.notice_source)

    def _notice(self, time_unix: float, generation: int | None, source: str | None) -> None:
        try:
            gen = generation if generation is not None else self._generation
            self.schedule.observe(RunEvent(kind=RunEventKind.NOTICE, time_unix=time_unix, generation=gen, pool=source))
            self._rate_event("notice", time_unix)
        except Exception:  # noqa: BLE001 - a report, never a reason to fail
            logger.debug("cf_ray: failure-rate bookkeeping failed", exc_info=True)

    def _rate_event(self, why: str, now: float) -> None:
        """Record the failure-rate estimate, once per failure counted."""
        hazard = self.schedule.hazard()
        if hazard.get("failures", 0) == self._failures:
            return
        self._failures = hazard.get("failures", 0)
        if self._log is not None:
            self._log.add({"event": "failure_rate", "why": why, "time": now, **hazard})
        if self._export is not None:
            self._export.mtbf(hazard.get("mtbf_s"))


__all__ = ["CATEGORIES", "Badput", "FailureFeed"]
