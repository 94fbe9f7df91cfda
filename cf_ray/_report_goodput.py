"""Where a run's wall time went, as users read it (issue #26): the goodput/badput breakdown the
controller keeps (:mod:`cf_ray._engine.driver.goodput`), as a table and a plot, and its file on
storage. :mod:`cf_ray.report` re-exports the public names; read a run's with
``cf_ray.Run(storage_path, name).goodput()``.

The categories follow Google's ML Goodput Measurement: productive training, then the badput —
checkpoint save, checkpoint restore, wasted progress (work lost and redone), recovery (failure
detection and restart, less the restore), start-up, other.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cf_ray._engine.driver.goodput import CATEGORIES
from cf_ray._engine.lazy import lazy_module
from cf_ray._engine.storage.fs import FileInfo, Storage
from cf_ray.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

logger = logging.getLogger("cf_ray.report")

#: Where the breakdown is saved with the profile (``<storage_path>/<run_name>/cf_ray/goodput.json``).
GOODPUT_FILE = "goodput.json"

#: Colours of the categories in :func:`plot_badput` (productive first).
_COLOURS = {
    "productive": "tab:green",
    "checkpoint_save": "tab:orange",
    "checkpoint_restore": "tab:purple",
    "wasted_progress": "tab:red",
    "recovery": "tab:brown",
    "startup": "tab:gray",
    "other": "0.8",
}


def badput_frame(breakdown: Mapping) -> pd.DataFrame:
    """The breakdown as a table: one row per category (``productive`` first), its seconds and its
    share of the wall time.

    Args:
        breakdown: ``Run.goodput()`` (what the controller's summary and ``goodput.json`` hold).
    """
    wall = breakdown.get("wall_s") or 0.0
    rows = [("productive", breakdown.get("productive_s") or 0.0)]
    rows += [(c, (breakdown.get("badput_s") or {}).get(c) or 0.0) for c in CATEGORIES]
    return pd.DataFrame(
        {
            "category": [c for c, _ in rows],
            "seconds": [float(s) for _, s in rows],
            "share": [float(s) / wall if wall else float("nan") for _, s in rows],
        }
    )


def plot_badput(breakdowns: Mapping[str, Mapping] | Mapping, ax=None):
    """Draw where the wall time went: one horizontal bar per run, split by category.

    Args:
        breakdowns: one breakdown (``Run.goodput()``), or ``{label: breakdown}`` for several runs.
        ax: a matplotlib ``Axes``; a new figure when ``None``.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * max(1, len(breakdowns))), layout="constrained")
    else:
        fig = ax.figure
    runs = {"run": breakdowns} if "badput_s" in breakdowns else dict(breakdowns)
    labels = list(runs)
    for i, label in enumerate(labels):
        df = badput_frame(runs[label])
        left = 0.0
        for category, share in zip(df["category"].tolist(), df["share"].tolist()):
            share = 0.0 if share != share else float(share)  # NaN: no wall time yet
            ax.barh(i, share * 100, left=left, color=_COLOURS[category], label=category if i == 0 else None)
            left += share * 100
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("share of wall time (%)")
    ax.set_xlim(0, 100)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize="small")
    ax.set_title("where the wall time went (goodput and badput)")
    return fig


def save_goodput(storage: Storage, breakdown: Mapping) -> FileInfo:
    """Write the breakdown as ``goodput.json`` (whole, through :meth:`Storage.write_file`)."""
    return storage.write_file(GOODPUT_FILE, [json.dumps(dict(breakdown), sort_keys=True, default=float).encode()])


def load_goodput(storage: Storage) -> dict[str, Any] | None:
    """What :func:`save_goodput` wrote, or ``None`` (a run saved before #26, or none).

    Raises:
        CorruptCheckpointError: the file is not JSON.
    """
    if not storage.exists(GOODPUT_FILE):
        return None
    try:
        return json.loads(bytes(storage.read_file(GOODPUT_FILE)))
    except ValueError as e:
        raise CorruptCheckpointError(f"{storage.uri(GOODPUT_FILE)} is not JSON ({e})") from e


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
    * ``cf_ray_productive_seconds`` (gauge, s) and ``cf_ray_badput_seconds`` (gauge, s, tag
      ``category``: ``checkpoint_save``, ``checkpoint_restore``, ``wasted_progress``, ``recovery``,
      ``startup``, ``other``): where the wall time went (:func:`badput_frame`);
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
    }
    GAUGES = {
        "last_lost_steps": ("cf_ray_restart_lost_steps", "Newest restart: steps lost and redone (steps)", ()),
        "last_lost_s": ("cf_ray_restart_lost_seconds", "Newest restart: training time lost and redone (s)", ()),
        "recovery_s": ("cf_ray_recovery_seconds", "Newest restart: failure to first resumed iteration (s)", ()),
        "restore_s": ("cf_ray_restore_seconds", "Newest restore's duration (s), by source", ("source",)),
        "ratio": ("cf_ray_effective_training_ratio", "Useful training time / wall time since the first iteration", ()),
        "durability_lost": ("cf_ray_durability_lost", "1 while checkpoints are not becoming durable, else 0", ()),
        "productive_s": ("cf_ray_productive_seconds", "Productive training time since the run started (s)", ()),
        "mtbf_s": ("cf_ray_failure_mtbf_seconds", "Estimated mean time up between the run's failures (s)", ()),
        "badput_s": (
            "cf_ray_badput_seconds",
            "Wall time not spent on productive training (s), by category",
            ("category",),
        ),
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

    def record_durability(self, lost: bool) -> None:
        """The durability watchdog's state: an episode starts (``True``) or ends (``False``)."""
        updates: list[tuple[str, str, Any, dict | None]] = [("durability_lost", "set", 1 if lost else 0, None)]
        if lost:
            updates.append(("durability_episodes", "inc", 1, None))
        self._apply(updates)


def _missing(v) -> bool:
    """``None`` or NaN (a value not measured)."""
    return v is None or (isinstance(v, float) and math.isnan(v))


__all__ = ["GOODPUT_FILE", "GoodputMetrics", "badput_frame", "load_goodput", "plot_badput", "save_goodput"]
