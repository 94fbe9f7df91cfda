"""Where a run's wall time went (issue #26): productive training and the badput categories of
Google's ML Goodput Measurement (checkpoint save, checkpoint restore, wasted progress from
disruptions, infrastructure recovery from disruptions, program start-up), from what the controller
already sees; and the feed of the run's failures to the frequency policy.

* :class:`Badput` keeps the sums the profile book does not (the training-thread stall of every
  checkpoint, the first attempt's restore) and computes :meth:`Badput.breakdown` from them and the
  book's :class:`~cf_ray._engine.driver.profile_book.Goodput` (restarts, lost work, progress). The
  controller exports it as Ray metrics (``cf_ray_productive_seconds``, ``cf_ray_badput_seconds``
  by ``category``), returns it in its summary and saves it as ``goodput.json`` with the profile.
* :class:`FailureFeed` turns the run's start, restarts, recoveries and preemption notices into
  :class:`~cf_ray.policy.RunEvent` objects for the policy (:meth:`ScheduleBook.observe`), which
  estimates the failure rate from them.

The categories (seconds; they add up to the wall time since the controller started):

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
* ``other``: the rest (iteration-time noise, data stalls, the time since the newest report).

No Ray, no torch: the controller calls it under its lock.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

from cf_ray.policy import RunEvent, RunEventKind

if TYPE_CHECKING:
    from cf_ray._engine.driver.profile_book import Goodput, Restart
    from cf_ray._engine.driver.schedule import ScheduleBook

#: The badput categories, in the order users see them.
CATEGORIES = ("checkpoint_save", "checkpoint_restore", "wasted_progress", "recovery", "startup", "other")

_STALLS_KEPT = 256
"""Checkpoints whose per-rank stalls are kept (a rank's late report of an older one is still added)."""


class Badput:
    """The badput sums of one run (see the module docstring).

    Args:
        started_unix: when the controller started (the start of the run's wall time).
    """

    def __init__(self, started_unix: float | None = None):
        self.started_unix = time.time() if started_unix is None else started_unix
        self.start_restore_s = 0.0
        """The first attempt's restore (a resume from another run's or an earlier run's checkpoint)."""
        self.stall_s = 0.0
        """Sum over checkpoints of the slowest rank's training-thread stall."""
        self._stalls: collections.OrderedDict[tuple[int, int], dict[int, float]] = collections.OrderedDict()

    def note_stall(self, generation: int, step: int, rank: int, seconds: float) -> None:
        """A rank's stall for one checkpoint (its synchronous part plus its guard wait)."""
        if not isinstance(seconds, (int, float)) or seconds < 0:
            return
        per_rank = self._stalls.setdefault((int(generation), int(step)), {})
        before = max(per_rank.values(), default=0.0)
        per_rank[int(rank)] = float(seconds)
        self.stall_s += max(per_rank.values()) - before
        while len(self._stalls) > _STALLS_KEPT:
            self._stalls.popitem(last=False)

    def breakdown(self, goodput: Goodput, now_unix: float | None = None) -> dict:
        """``{"wall_s", "productive_s", "effective_training_ratio", "badput_s": {category: s},
        "shares": {category or "productive": share of wall}, "restarts"}``."""
        end = goodput.last_unix if goodput.last_unix is not None else (now_unix or time.time())
        wall = max(0.0, end - self.started_unix)
        restarts = list(goodput.restarts)
        productive = goodput.useful_s() or 0.0
        first = goodput.first_unix
        bad = {
            "checkpoint_save": self.stall_s,
            "checkpoint_restore": self.start_restore_s + sum(r.restore_s or 0.0 for r in restarts),
            "wasted_progress": goodput.lost_s_total,
            "recovery": sum(_infra(r, goodput.mean_iter_s() or 0.0) for r in restarts),
            "startup": max(0.0, first - self.started_unix - self.start_restore_s) if first is not None else 0.0,
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
        }


def _infra(r: Restart, iter_s: float) -> float:
    """A restart's recovery less its restore and its first resumed iteration (productive), 0 until
    it has resumed."""
    if r.recovery_s is None:
        return 0.0
    return max(0.0, r.recovery_s - (r.restore_s or 0.0) - iter_s)


class FailureFeed:
    """The run's failures, as :class:`~cf_ray.policy.RunEvent` objects, to the policy.

    Args:
        schedule: where the policy lives (:meth:`ScheduleBook.observe`).
    """

    def __init__(self, schedule: ScheduleBook):
        self.schedule = schedule
        self._generation: int | None = None
        self._failures = 0  # as of the last failure_rate event

    def restore(self, event: dict, restart: Restart | None) -> dict | None:
        """An attempt restored (the controller's ``restore`` event): the run's start, or a restart.
        Returns the ``failure_rate`` event to record after a restart."""
        gen = int(event.get("generation") or 0)
        now = float(event.get("time") or time.time())
        self._generation = gen
        if restart is None:
            self.schedule.observe(RunEvent(kind=RunEventKind.START, time_unix=now, generation=gen))
            return None
        self.schedule.observe(
            RunEvent(
                kind=RunEventKind.FAILURE,
                time_unix=restart.failure_unix if restart.failure_unix is not None else now,
                generation=gen,
                source=restart.source,
                lost_s=restart.lost_s,
            )
        )
        return self._rate_event("restart", now)

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

    def notice(self, time_unix: float, generation: int | None, source: str | None) -> dict | None:
        """A preemption notice reached the run (the driver's, or a ``preempt`` checkpoint's).
        Returns the ``failure_rate`` event to record."""
        gen = generation if generation is not None else self._generation
        self.schedule.observe(RunEvent(kind=RunEventKind.NOTICE, time_unix=time_unix, generation=gen, pool=source))
        return self._rate_event("notice", time_unix)

    def _rate_event(self, why: str, now: float) -> dict | None:
        """The policy's failure-rate estimate, once per failure it counted (``None``: no news)."""
        hazard = self.schedule.hazard()
        if hazard.get("failures", 0) == self._failures:
            return None
        self._failures = hazard.get("failures", 0)
        return {"event": "failure_rate", "why": why, "time": now, **hazard}


__all__ = ["CATEGORIES", "Badput", "FailureFeed"]
