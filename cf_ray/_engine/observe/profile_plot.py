"""The plots of :mod:`cf_ray.report`: a run's profile over its steps (:func:`plot_profile`) and
where its wall time went (:func:`plot_badput`), and what they share: how a restart is marked and
labelled, where the legend goes, and what a plot says when there is not enough data to draw.

A restart is what a user reads a profile for: each one is shaded where its attempt redid work
(from the restored step, as many steps as were lost), with a line at the generation boundary and
its number; its legend entry says the generation, the step restored, the source and the seconds
from the failure to the first resumed iteration. The legend goes below the axes (outside the
data and every label) when cf_ray made the figure; on an ``Axes`` the caller made, where the
layout is theirs, in the axes where it hides the least data (``loc="best"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cf_ray._engine.lazy import lazy_module
from cf_ray._engine.observe.profile_frames import badput_frame, iterations_frame, profile_frame, restarts_frame

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

_KIND_STYLE = {"scheduled": "-", "epoch": "--", "manual": ":", "preempt": "-.", "final": "-"}
_RESTART_COLOUR = "tab:red"
#: Fewer points than this and each one is marked: a line through one point draws nothing.
_MARK_BELOW = 50

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


def plot_profile(
    df: pd.DataFrame,
    iterations_df: pd.DataFrame | None = None,
    ax=None,
    *,
    budget_pct: float | None = None,
    restarts_df: pd.DataFrame | None = None,
):
    """Draw a run's profile: iteration time over steps, checkpoints as vertical lines (green:
    committed, grey: in memory only / pending, red: failed; line style by kind), the measured
    overhead on a second axis, and each restart shaded over the steps its attempt redid.

    Args:
        df: the profile table (:func:`~cf_ray.report.profile_frame` /
            :func:`~cf_ray.report.read_run_profile`).
        iterations_df: the iteration-time table; the slowest rank's time is drawn per step.
        ax: a matplotlib ``Axes`` to draw on; a new figure is made when ``None``.
        budget_pct: draw the overhead budget as a horizontal line.
        restarts_df: the restarts table (:func:`~cf_ray.report.read_run_restarts`); each restart is
            shaded from its restored step over the steps redone, numbered, and named in the legend
            (generation, restored step, source, seconds to recover).

    Returns:
        The ``matplotlib.figure.Figure``. With no iteration time, no checkpoint and no restart it
        says "not enough data yet" instead of drawing empty axes.

    Raises:
        ImportError: matplotlib is not installed (``pip install cf-ray[plot]``).
    """
    try:
        import matplotlib.lines as mlines
    except ImportError as e:
        raise ImportError("cf_ray.report.plot_profile needs matplotlib: pip install cf-ray[plot]") from e
    fig, ax, own = new_axes(ax, (10, 4.5))
    df = profile_frame(df)
    handles = []
    it = iterations_frame(iterations_df if iterations_df is not None else []).dropna(subset=["step", "iter_s"])
    it = it[it["iter_s"] > 0]
    if len(it):
        slowest = cast("pd.Series", it.groupby("step")["iter_s"].max()).sort_index()
        handles += ax.plot(
            slowest.index.astype(float),
            slowest.to_numpy(dtype=float),
            color="tab:blue",
            linewidth=1.0,
            marker="." if len(slowest) < _MARK_BELOW else None,
            label="iteration time (slowest rank)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("iteration time (s)")
    ckpts = df.dropna(subset=["step"])
    for state, color in (("committed", "tab:green"), ("memory-only / pending", "0.6"), ("failed", "tab:red")):
        sel = ckpts.loc[np.array([_state(r) == state for r in ckpts.itertuples(index=False)], dtype=bool)]
        for kind, group in sel.groupby(sel["kind"].fillna("scheduled"), sort=False):
            for step in group["step"].astype(float):
                ax.axvline(step, color=color, linestyle=_KIND_STYLE.get(kind, "-"), linewidth=0.8, alpha=0.7)
        if len(sel):
            handles.append(mlines.Line2D([], [], color=color, linewidth=0.8, label=f"checkpoint ({state})"))
    restarts = restarts_frame(restarts_df if restarts_df is not None else []).dropna(subset=["restored_step"])
    handles += _shade_restarts(ax, restarts)
    over = ckpts.dropna(subset=["overhead_pct"])
    if len(over) or budget_pct is not None:
        ax2 = ax.twinx()
        if len(over):
            handles += ax2.plot(
                over["step"].astype(float),
                over["overhead_pct"].astype(float),
                color="tab:orange",
                marker="o",
                markersize=3,
                linewidth=1.0,
                label="overhead (%)",
            )
        if budget_pct is not None:
            handles.append(
                ax2.axhline(
                    budget_pct, color="tab:orange", linestyle="--", linewidth=0.8, label=f"budget ({budget_pct:g} %)"
                )
            )
        ax2.set_ylabel("checkpoint overhead (%)")
        ax2.set_ylim(bottom=0)
    if not len(it) and not len(ckpts) and not len(restarts):
        say_not_enough(ax, "not enough data yet: no iteration time, checkpoint or restart recorded")
        ax.set_xticks([])
        ax.set_yticks([])
    elif not len(it):
        say_not_enough(ax, "no iteration time recorded yet")
    ax.set_title("cf_ray checkpoint profile")
    place_legend(fig, ax, handles, own=own, ncol=2 if len(restarts) else 3)
    return fig


def _shade_restarts(ax, restarts: pd.DataFrame) -> list:
    """Each restart shaded over the steps its attempt redid (at least one step wide), a line at the
    generation boundary (the restored step) and its number at the top; returns the legend entries."""
    import matplotlib.patches as mpatches
    import matplotlib.transforms as mtransforms

    top = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    handles = []
    for n, row in enumerate(restarts.to_dict("records"), start=1):
        start, lost = _num(row.get("restored_step")) or 0.0, _num(row.get("lost_steps")) or 0.0
        ax.axvspan(start, start + max(lost, 1.0), color=_RESTART_COLOUR, alpha=0.15, linewidth=0, label="_restart")
        ax.axvline(start, color=_RESTART_COLOUR, linewidth=1.2)
        ax.text(start, 0.98, f" {n}", transform=top, color=_RESTART_COLOUR, va="top", ha="left", fontsize="small")
        label = ", ".join(t for t in (restart_label(n, row), recovery_text(row)) if t)
        handles.append(mpatches.Patch(color=_RESTART_COLOUR, alpha=0.3, label=label))
    return handles


def restart_label(n: int, r: Mapping[str, Any]) -> str:
    """One restart as a legend entry: its number, the generation it began, the step and the source
    it restored from (the seconds are the caller's: what its plot draws)."""
    gen, step, source = _num(r.get("generation")), _num(r.get("restored_step")), r.get("source")
    text = f"restart {n}: gen {'?' if gen is None else int(gen)} from step {'?' if step is None else int(step)}"
    return text + ("" if _missing(source) else f" ({source})")


def recovery_text(r: Mapping[str, Any]) -> str:
    """The seconds a restart took: from the failure to its first resumed iteration, else its restore."""
    recovery, restore = _num(r.get("recovery_s")), _num(r.get("restore_s"))
    if recovery is not None:
        return f"{recovery:.1f} s to recover"
    return "" if restore is None else f"{restore:.1f} s to restore"


def new_axes(ax, size: tuple[float, float]):
    """``(figure, axes, made here)``: a new constrained-layout figure when ``ax`` is ``None``."""
    if ax is not None:
        return ax.figure, ax, False
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size, layout="constrained")
    return fig, ax, True


def place_legend(fig, ax, handles: list, *, own: bool, ncol: int) -> None:
    """The legend outside the data and every label: below the axes, in the room the figure's
    layout makes for it (a figure cf_ray made); on the caller's ``Axes``, where it hides the least."""
    if not handles:
        return
    if own:
        fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize="small", frameon=False)
    else:
        ax.legend(handles=handles, loc="best", fontsize="small")


def say_not_enough(ax, text: str, *, y: float = 0.5, transform=None) -> None:
    """Say what is missing where the data would be, instead of leaving the axes empty."""
    ax.text(
        0.5,
        y,
        text,
        transform=transform if transform is not None else ax.transAxes,
        ha="center",
        va="center",
        color="0.35",
        fontsize="small",
    )


def _state(row) -> str:
    error, committed = getattr(row, "error", None), getattr(row, "committed", None)
    if getattr(row, "where", None) == "failed" or not _missing(error):
        return "failed"
    return "committed" if not _missing(committed) and bool(committed) else "memory-only / pending"


def _num(v: Any) -> float | None:
    return None if _missing(v) else float(v)


def _missing(v) -> bool:
    if v is None:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


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
