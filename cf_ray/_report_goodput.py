"""Where a run's wall time went, as users read it (issue #26): the goodput/badput breakdown the
controller keeps (:mod:`cf_ray._engine.driver.badput`), as a table and a plot, and its file on
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

from cf_ray._engine.driver.badput import CATEGORIES
from cf_ray._engine.lazy import lazy_module
from cf_ray._engine.storage.fs import FileInfo, Storage
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


__all__ = ["GOODPUT_FILE", "badput_frame", "load_goodput", "plot_badput", "save_goodput"]
