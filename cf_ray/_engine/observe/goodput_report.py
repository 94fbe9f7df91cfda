"""Where a run's wall time went, as users read it: the goodput/badput breakdown the
controller keeps (:mod:`cf_ray._engine.observe.goodput`), as a table and a plot, and its file on
storage; its Ray metrics are :class:`cf_ray.report.GoodputMetrics`. :mod:`cf_ray.report`
re-exports the public names; read a run's with ``cf_ray.Run(storage_path, name).goodput()``.

The categories follow Google's ML Goodput Measurement: productive training, then the badput —
checkpoint save, checkpoint restore, wasted progress (work lost and redone), recovery (failure
detection and restart, less the restore), start-up, other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cf_ray._engine.lazy import lazy_module
from cf_ray._engine.observe.goodput import CATEGORIES
from cf_ray._engine.observe.profile_frames import restarts_frame
from cf_ray._engine.observe.profile_plot import new_axes, place_legend, restart_label, say_not_enough
from cf_ray._engine.storage.base import FileInfo, Storage
from cf_ray.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

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


def plot_badput(breakdowns: Mapping[str, Mapping | None] | Mapping, ax=None, *, restarts=None):
    """Draw where the wall time went: one horizontal bar per run, split by category; under it, when
    its restarts are given, what each restart cost (work lost, then failure to the first resumed
    iteration), shaded and numbered, named in the legend.

    Args:
        breakdowns: one breakdown (``Run.goodput()``), or ``{label: breakdown}`` for several runs; a
            run with no breakdown (``None``) or no wall time yet says so on its row.
        ax: a matplotlib ``Axes``; a new figure when ``None``.
        restarts: the restarts table of the run (:func:`cf_ray.report.read_run_restarts`), or
            ``{label: table}`` (labels of ``breakdowns``; runs left out have no restart row).

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    one = breakdowns is None or "badput_s" in breakdowns or "wall_s" in breakdowns
    runs: dict[str, Mapping | None] = {"run": breakdowns} if one else dict(breakdowns)
    per_run = {"run": restarts} if restarts is not None and not isinstance(restarts, Mapping) else dict(restarts or {})
    rows: list[tuple[str, str | None]] = [(label, None) for label in runs]
    for label in runs:
        if per_run.get(label) is not None and len(per_run[label]):
            rows.insert(rows.index((label, None)) + 1, (label, "restarts"))
    fig, ax, own = new_axes(ax, (10, 1.4 + 0.5 * len(rows)))
    handles, number = [], 0
    for y, (label, what) in enumerate(rows):
        breakdown = runs[label]
        wall = float((breakdown or {}).get("wall_s") or 0.0)
        if what is None and wall <= 0:
            say_not_enough(ax, "no breakdown yet" if breakdown is None else "no wall time measured yet", y=y,
                           transform=ax.get_yaxis_transform())  # fmt: skip
        elif what is None:
            df = badput_frame(breakdown or {})
            left = 0.0
            for category, share in zip(df["category"].tolist(), df["share"].tolist()):
                share = 0.0 if share != share else float(share)  # NaN: no wall time yet
                bar = ax.barh(y, share * 100, left=left, color=_COLOURS[category], label=category)
                if category not in [h.get_label() for h in handles]:
                    handles.append(bar)
                left += share * 100
        else:
            number = _restart_bars(ax, y, per_run[label], wall, number, handles)
    ax.set_yticks(range(len(rows)), [label if what is None else f"{label}: restarts" for label, what in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first run on top, its restarts under it; rows with no bar too
    ax.set_xlabel("share of wall time (%)")
    ax.set_xlim(0, 100)
    ax.set_title("where the wall time went (goodput and badput)")
    place_legend(fig, ax, handles, own=own, ncol=2 if number else 4)
    return fig


def _restart_bars(ax, y: float, restarts, wall: float, number: int, handles: list) -> int:
    """Each restart of a run as a segment of its row: work lost plus failure to the first resumed
    iteration, as a share of the run's wall time, numbered; returns the last restart number."""
    left = 0.0
    for r in restarts_frame(restarts).to_dict("records"):
        number += 1
        cost = sum(float(r[k]) for k in ("lost_s", "recovery_s") if r.get(k) is not None and r[k] == r[k])
        width = 100.0 * cost / wall if wall > 0 else 0.0
        shade = "tab:red" if number % 2 else "salmon"
        bar = ax.barh(y, width, left=left, height=0.5, color=shade, hatch="//", edgecolor="white")
        ax.text(left + width / 2, y, str(number), ha="center", va="center", fontsize="small", color="black")
        handles.append(bar)
        bar.set_label(f"{restart_label(number, r)}: {cost:.1f} s (work lost + recovery)")
        left += width
    return number


def save_goodput(storage: Storage, breakdown: Mapping) -> FileInfo:
    """Write the breakdown as ``goodput.json`` (whole, through :meth:`Storage.write_file`)."""
    return storage.write_file(GOODPUT_FILE, [json.dumps(dict(breakdown), sort_keys=True, default=float).encode()])


def load_goodput(storage: Storage) -> dict[str, Any] | None:
    """What :func:`save_goodput` wrote, or ``None`` (the run saved no breakdown).

    Raises:
        CorruptCheckpointError: the file is not JSON.
    """
    if not storage.exists(GOODPUT_FILE):
        return None
    try:
        return json.loads(bytes(storage.read_file(GOODPUT_FILE)))
    except ValueError as e:
        raise CorruptCheckpointError(f"{storage.uri(GOODPUT_FILE)} is not JSON ({e})") from e


__all__ = ["GOODPUT_FILE", "badput_frame", "load_goodput", "plot_badput", "save_goodput"]
