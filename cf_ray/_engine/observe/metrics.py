"""The Ray metrics a run exports (``ray.util.metrics``; Prometheus shows them with Ray's ``ray_``
prefix): :class:`CheckpointMetrics` (the newest checkpoint's interval, stall, persist, overhead,
committed step), :class:`GoodputMetrics` (restarts, work lost, recovery, the effective training
ratio, durability episodes, and the restores that failed verification and what was taken out of use),
and :class:`MetricsExport`, the controller's one holder of both. ``cf_ray.report`` re-exports the two
metric classes (users build them for their own rows).

Metrics are a report, never a reason to fail: every call here swallows and logs its errors. Ray is
imported when the first value is recorded, and only if it is initialised in this process.
No torch, no pandas.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

logger = logging.getLogger("cf_ray")

#: How often (at most) the iteration samples refresh the effective-training-ratio gauge.
RATIO_EXPORT_PERIOD_S = 5.0


def _missing(v) -> bool:
    """None, NaN, or pandas' NA / NaT (recognised by name: no pandas here)."""
    if v is None or type(v).__name__ in ("NAType", "NaTType"):
        return True
    try:
        return isinstance(v, float) and math.isnan(v)
    except TypeError:
        return False


def _reduce(value, reduce):
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple, np.ndarray)):
        vals = [v for v in value if not _missing(v)]
        return reduce(vals) if vals else None
    return value


class CheckpointMetrics:
    """Ray metrics (``ray.util.metrics`` gauges) for the latest checkpoint of a run.

    Gauges: ``cf_ray_checkpoint_interval`` (steps), ``cf_ray_checkpoint_stall_s``,
    ``cf_ray_checkpoint_persist_s``, ``cf_ray_checkpoint_overhead_pct`` and
    ``cf_ray_last_committed_step``, tagged with ``run`` (and any ``tags`` given). Ray is imported
    when the first row is recorded, and only if it is initialised in this process; anywhere else
    (no Ray, a plain script, a unit test) :meth:`record` does nothing. It never raises.

    Args:
        run: the run's name, as the ``run`` tag.
        tags: more constant tags.
    """

    GAUGES = {
        "interval": ("cf_ray_checkpoint_interval", "Checkpoint interval in force (steps)"),
        "stall_s": ("cf_ray_checkpoint_stall_s", "Training stall of the latest checkpoint (s, slowest rank)"),
        "persist_s": ("cf_ray_checkpoint_persist_s", "Persist time of the latest checkpoint (s, slowest rank)"),
        "overhead_pct": ("cf_ray_checkpoint_overhead_pct", "Measured checkpoint overhead (% of training time)"),
        "last_committed_step": ("cf_ray_last_committed_step", "Step of the newest committed checkpoint"),
    }

    def __init__(self, run: str | None = None, tags: Mapping[str, str] | None = None):
        self._tags = {str(k): str(v) for k, v in (tags or {}).items()}
        if run is not None:
            self._tags["run"] = str(run)
        self._gauges: dict | None = None
        self.enabled: bool | None = None
        """``None`` until the first :meth:`record`, then whether the gauges exist."""
        self.recorded = 0
        """How many rows were exported."""

    def __reduce__(self):  # the gauges are rebuilt where the object lands
        tags = dict(self._tags)
        run = tags.pop("run", None)
        return (CheckpointMetrics, (run, tags))

    def _ensure(self) -> bool:
        if self._gauges is not None:
            return True
        if self.enabled is False:
            return False
        try:
            import ray

            if not ray.is_initialized():
                return False  # try again later: Ray may be started after this object
            from ray.util.metrics import Gauge

            gauges = {}
            for key, (name, description) in self.GAUGES.items():
                g = Gauge(name, description=description, tag_keys=tuple(sorted(self._tags)))
                if self._tags:
                    g.set_default_tags(self._tags)
                gauges[key] = g
            self._gauges = gauges
            self.enabled = True
        except Exception as e:  # noqa: BLE001 - metrics are best effort, never a reason to fail
            logger.warning("cf_ray: Ray metrics disabled: %s", e)
            self.enabled = False
        return bool(self.enabled)

    def record(self, row: Mapping) -> None:
        """Export one profile row (a dict as in :func:`profile_frame`). Missing values are skipped."""
        if not self._ensure():
            return
        gauges = self._gauges
        assert gauges is not None  # _ensure() returned True: it built them
        values = {
            "interval": row.get("interval"),
            "stall_s": _reduce(row.get("stall_s"), max),
            "persist_s": _reduce(row.get("persist_s"), max),
            "overhead_pct": row.get("overhead_pct"),
        }
        if row.get("committed") is True and row.get("step") is not None:
            values["last_committed_step"] = row.get("step")
        try:
            for key, v in values.items():
                if v is None or isinstance(v, bool) or _missing(v):
                    continue
                gauges[key].set(float(v))
            self.recorded += 1
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not export checkpoint metrics: %s", e)


class GoodputMetrics:
    """Ray metrics (``ray.util.metrics``) of a run's goodput, tagged with ``run`` (and any ``tags``).

    * ``cf_ray_restarts_total`` (counter, tag ``source``): restarts;
    * ``cf_ray_lost_steps_total`` (counter, steps) and ``cf_ray_lost_seconds_total`` (counter, s):
      work lost to restarts (redone; a counter only moves by more than 0);
    * ``cf_ray_restart_lost_steps`` (gauge, steps) and ``cf_ray_restart_lost_seconds`` (gauge, s):
      the same for the newest restart (0 included);
    * ``cf_ray_recovery_seconds`` (gauge, s): the newest restart's time from the failure to the
      first resumed iteration;
    * ``cf_ray_restore_seconds`` (gauge, s, tag ``source``): the newest restore's duration, by source;
    * ``cf_ray_effective_training_ratio`` (gauge, 0..1): useful training time / wall time;
    * ``cf_ray_durability_lost`` (gauge, 0 or 1) and ``cf_ray_durability_lost_episodes_total``
      (counter): the durability watchdog's state and its episodes (nothing committed for much
      longer than the schedule implies, or the controller unreachable);
    * ``cf_ray_restore_fallbacks_total`` (counter, tags ``source`` and ``cause``: ``verification``
      for bytes that failed their checksums or fingerprints, ``refused`` for anything else): restore
      candidates an attempt could not use and fell back from;
    * ``cf_ray_taken_out_total`` (counter, tag ``what``: ``memory`` for an in-memory snapshot never
      offered again, ``quarantined`` for a committed checkpoint quarantined on storage);
    * ``cf_ray_productive_seconds`` (gauge, s) and ``cf_ray_badput_seconds`` (gauge, s, tag
      ``category``: ``checkpoint_save``, ``checkpoint_restore``, ``wasted_progress``, ``recovery``,
      ``startup``, ``other``): where the wall time went (``cf_ray.report.badput_frame``);
    * ``cf_ray_failure_mtbf_seconds`` (gauge, s): the estimated mean time up between the run's
      failures (the policy's, or the controller's own without a prior), after each failure counted.

    As :class:`CheckpointMetrics`: built on first use, only where Ray is initialised; never raises.
    Prometheus shows them with Ray's ``ray_`` prefix (``ray_cf_ray_lost_steps_total``).
    """

    COUNTERS = {
        "restarts": ("cf_ray_restarts_total", "Restarts of the run (count)", ("source",)),
        "lost_steps": ("cf_ray_lost_steps_total", "Training steps lost to restarts and redone (steps)", ()),
        "lost_s": ("cf_ray_lost_seconds_total", "Training time lost to restarts and redone (s)", ()),
        "durability_episodes": (
            "cf_ray_durability_lost_episodes_total",
            "Episodes in which nothing became durable for much longer than the schedule implies (count)",
            (),
        ),
        "fallbacks": (
            "cf_ray_restore_fallbacks_total",
            "Restore candidates refused, by source and cause (verification: checksums or fingerprints)",
            ("source", "cause"),
        ),
        "taken_out": (
            "cf_ray_taken_out_total",
            "Snapshots never offered again (memory) and checkpoints quarantined (quarantined)",
            ("what",),
        ),
    }
    GAUGES = {
        "last_lost_steps": ("cf_ray_restart_lost_steps", "Newest restart: steps lost and redone (steps)", ()),
        "last_lost_s": ("cf_ray_restart_lost_seconds", "Newest restart: training time lost and redone (s)", ()),
        "recovery_s": ("cf_ray_recovery_seconds", "Newest restart: failure to first resumed iteration (s)", ()),
        "restore_s": ("cf_ray_restore_seconds", "Newest restore's duration (s), by source", ("source",)),
        "ratio": ("cf_ray_effective_training_ratio", "Useful training time / wall time since the first iteration", ()),
        "durability_lost": ("cf_ray_durability_lost", "1 while checkpoints are not becoming durable, else 0", ()),
        "productive_s": ("cf_ray_productive_seconds", "Productive training time since the run started (s)", ()),
        "badput_s": (
            "cf_ray_badput_seconds",
            "Wall time not spent on productive training (s), by category",
            ("category",),
        ),
        "mtbf_s": ("cf_ray_failure_mtbf_seconds", "Estimated mean time up between the run's failures (s)", ()),
    }

    def __init__(self, run: str | None = None, tags: Mapping[str, str] | None = None):
        self._tags = {str(k): str(v) for k, v in (tags or {}).items()}
        if run is not None:
            self._tags["run"] = str(run)
        self._metrics: dict | None = None
        self.enabled: bool | None = None
        """``None`` until first used, then whether the metrics exist."""

    def __reduce__(self):
        tags = dict(self._tags)
        run = tags.pop("run", None)
        return (GoodputMetrics, (run, tags))

    def _ensure(self) -> bool:
        if self._metrics is not None:
            return True
        if self.enabled is False:
            return False
        try:
            import ray

            if not ray.is_initialized():
                return False
            from ray.util.metrics import Counter, Gauge

            metrics = {}
            for kinds, cls in ((self.COUNTERS, Counter), (self.GAUGES, Gauge)):
                for key, (name, description, extra) in kinds.items():
                    m = cls(name, description=description, tag_keys=tuple(sorted({*self._tags, *extra})))
                    if self._tags:
                        m.set_default_tags(self._tags)
                    metrics[key] = m
            self._metrics = metrics
            self.enabled = True
        except Exception as e:  # noqa: BLE001 - metrics are best effort, never a reason to fail
            logger.warning("cf_ray: Ray goodput metrics disabled: %s", e)
            self.enabled = False
        return bool(self.enabled)

    def _apply(self, updates: list[tuple[str, str, Any, dict | None]]) -> None:
        if not self._ensure():
            return
        metrics = self._metrics
        assert metrics is not None
        try:
            for key, op, v, tags in updates:
                if v is None or isinstance(v, bool) or _missing(v):
                    continue
                getattr(metrics[key], op)(float(v), tags=tags)
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not export goodput metrics: %s", e)

    def record_restart(self, source: str, lost_steps: int, lost_s: float | None, restore_s: float | None) -> None:
        """A restart: its source, the work lost and the restore's duration."""
        src = {"source": str(source)}
        self._apply(
            [
                ("restarts", "inc", 1, src),
                ("lost_steps", "inc", lost_steps if lost_steps else None, None),
                ("lost_s", "inc", lost_s if lost_s else None, None),
                ("restore_s", "set", restore_s, src),
                ("last_lost_steps", "set", lost_steps, None),
                ("last_lost_s", "set", lost_s, None),
            ]
        )

    def record_recovery(self, recovery_s: float | None) -> None:
        """The newest restart's time from the failure to its first resumed iteration."""
        self._apply([("recovery_s", "set", recovery_s, None)])

    def record_ratio(self, ratio: float | None) -> None:
        """The run's effective training time ratio."""
        self._apply([("ratio", "set", ratio, None)])

    def record_badput(self, breakdown: Mapping) -> None:
        """Where the wall time went: productive seconds and the badput seconds by category."""
        updates: list[tuple[str, str, Any, dict | None]] = [
            ("productive_s", "set", breakdown.get("productive_s"), None)
        ]
        for category, seconds in (breakdown.get("badput_s") or {}).items():
            updates.append(("badput_s", "set", seconds, {"category": str(category)}))
        self._apply(updates)

    def record_mtbf(self, mtbf_s: float | None) -> None:
        """The estimated mean time between the run's failures (after each failure it counted)."""
        self._apply([("mtbf_s", "set", mtbf_s, None)])

    def record_fallback(self, source: str, cause: str) -> None:
        """A restore fell back from a candidate of ``source`` (``verification`` or ``refused``)."""
        self._apply([("fallbacks", "inc", 1, {"source": str(source), "cause": str(cause)})])

    def record_taken_out(self, what: str) -> None:
        """A snapshot (``memory``) or a committed checkpoint (``quarantined``) was taken out of use."""
        self._apply([("taken_out", "inc", 1, {"what": str(what)})])

    def record_durability(self, lost: bool) -> None:
        """The durability watchdog's state: an episode starts (``True``) or ends (``False``)."""
        updates: list[tuple[str, str, Any, dict | None]] = [("durability_lost", "set", 1 if lost else 0, None)]
        if lost:
            updates.append(("durability_episodes", "inc", 1, None))
        self._apply(updates)


class MetricsExport:
    """The controller's metrics, made on first use (the actor imports Ray's metrics only once it has
    something to export). Never raises.

    Args:
        run: the run key (the ``run`` tag).
    """

    def __init__(self, run: str):
        self.run = run
        self._checkpoints: CheckpointMetrics | None = None
        self._goodput: GoodputMetrics | None = None
        self._ratio_unix = 0.0

    @property
    def goodput(self) -> GoodputMetrics:
        if self._goodput is None:
            self._goodput = GoodputMetrics(run=self.run)
        return self._goodput

    def checkpoint(self, row: Mapping) -> None:
        try:
            if self._checkpoints is None:
                self._checkpoints = CheckpointMetrics(run=self.run)
            self._checkpoints.record(row)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: metrics export failed", exc_info=True)

    def ratio_due(self, now_unix: float) -> bool:
        """Whether the ratio gauge is due again (at most every :data:`RATIO_EXPORT_PERIOD_S`)."""
        return now_unix - self._ratio_unix >= RATIO_EXPORT_PERIOD_S

    def restart(
        self, restart: Any, ratio: float | None, *, resumed: bool = False, badput: Mapping | None = None
    ) -> None:
        """A restart (when it happens; its recovery time once resumed), the ratio and (``badput``)
        where the wall time went; ``restart`` ``None``: the ratio and the split only."""
        try:
            self._ratio_unix = time.time()
            if restart is not None:
                if resumed:
                    self.goodput.record_recovery(restart.recovery_s)
                else:
                    self.goodput.record_restart(restart.source, restart.lost_steps, restart.lost_s, restart.restore_s)
            self.goodput.record_ratio(ratio)
            if badput is not None:
                self.goodput.record_badput(badput)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: goodput metrics export failed", exc_info=True)

    def mtbf(self, mtbf_s: float | None) -> None:
        """The failure rate's estimate after a failure was counted."""
        try:
            self.goodput.record_mtbf(mtbf_s)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: failure-rate metric export failed", exc_info=True)

    def durability(self, lost: bool) -> None:
        try:
            self.goodput.record_durability(lost)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: durability metric export failed", exc_info=True)

    def fallback(self, source: str, cause: str) -> None:
        try:
            self.goodput.record_fallback(source, cause)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: restore metric export failed", exc_info=True)

    def taken_out(self, what: str) -> None:
        try:
            self.goodput.record_taken_out(what)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: restore metric export failed", exc_info=True)


__all__ = ["CheckpointMetrics", "GoodputMetrics", "MetricsExport"]
