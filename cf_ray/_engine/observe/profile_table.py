"""``cf-ray profile``: the profile table as a terminal, a spreadsheet or a program reads it.

By default the columns of the metrics guide (:data:`DEFAULT_COLUMNS`, and ``error`` when a row has
one) so that the table fits a terminal; ``--all`` every column. One way to write each kind of
value in every column: seconds as milliseconds (``stall_s`` becomes ``stall_ms``), Unix times as
ISO 8601 UTC (``notice_unix`` becomes ``notice_utc``), and a missing value as ``-`` in the table,
an empty field in CSV and ``null`` in JSON. The table shortens long text (a storage URI, an
error) and writes byte counts as kB/MB/GB; CSV and JSON keep both whole.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
from collections.abc import Sequence
from typing import Any

#: The columns ``cf-ray profile`` prints by default: those of the metrics guide's example.
DEFAULT_COLUMNS = ("step", "kind", "generation", "interval", "stall_s", "committed")
#: Text longer than this is shortened in the table (``--csv`` and ``--json`` keep it whole).
TEXT_WIDTH = 40
#: How the table writes a missing value.
MISSING = "-"


def columns(frame, *, all_columns: bool) -> list[str]:
    """The columns to show: every one, or :data:`DEFAULT_COLUMNS` and ``error`` when a row has one."""
    if all_columns:
        return [str(c) for c in frame.columns]
    chosen = [c for c in DEFAULT_COLUMNS if c in frame.columns]
    if "error" in frame.columns and any(not _missing(v) for v in frame["error"]):
        chosen.append("error")  # a failure is never left out of what a user reads
    return chosen


def header(column: str) -> str:
    """A column's name as shown: ``*_s`` in milliseconds (``*_ms``), ``*_unix`` as ``*_utc``."""
    if column.endswith("_s"):
        return column[:-2] + "_ms"
    if column.endswith("_unix"):
        return column[:-5] + "_utc"
    return column


def render(frame, *, all_columns: bool = False, fmt: str = "table") -> str:
    """The profile ``frame`` (``cf_ray.report.profile_frame``) as ``table``, ``csv`` or ``json`` text."""
    cols = columns(frame, all_columns=all_columns)
    records = frame.to_dict("records")
    cells = [[_value(c, r.get(c), fmt) for c in cols] for r in records]
    names = [header(c) for c in cols]
    if fmt == "json":
        return json.dumps([dict(zip(names, row)) for row in cells], indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(names)
        writer.writerows(cells)
        return out.getvalue().rstrip("\n")
    if fmt != "table":
        raise ValueError(f"fmt={fmt!r}: use table, csv or json")
    return _table(names, cells)


def _table(names: Sequence[str], cells: list[list[Any]]) -> str:
    if not cells:
        return "  ".join(names) + "\n(no checkpoints)"
    widths = [max(len(n), *(len(row[i]) for row in cells)) for i, n in enumerate(names)]
    numeric = [all(_numeric(row[i]) for row in cells) for i in range(len(names))]
    lines = []
    for row in [list(names), *cells]:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    if text == MISSING:
        return True
    try:
        float(text.split()[0])
    except (ValueError, IndexError):
        return False
    return True


def _missing(v: Any) -> bool:
    if v is None:
        return True
    try:
        import pandas as pd

        return bool(pd.isna(v)) if not isinstance(v, (list, tuple, dict)) else False
    except (TypeError, ValueError):
        return False


def _value(column: str, v: Any, fmt: str) -> Any:
    """One cell, as ``fmt`` writes it (a string for the table, JSON-able for JSON)."""
    if _missing(v):
        return {"table": MISSING, "csv": ""}.get(fmt)
    if hasattr(v, "item") and not isinstance(v, (list, tuple, dict, str)):
        v = v.item()  # a numpy scalar
    if isinstance(v, bool):
        return {"table": "yes" if v else "no", "csv": "true" if v else "false"}.get(fmt, v)
    if isinstance(v, (int, float)) and column.endswith("_unix"):
        when = datetime.datetime.fromtimestamp(float(v), tz=datetime.timezone.utc)
        return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    if isinstance(v, (int, float)) and column.endswith("_s"):
        ms = 1000.0 * float(v)
        return f"{ms:.1f}" if fmt == "table" else round(ms, 3)
    if isinstance(v, int) and (column == "bytes" or column.endswith("_bytes")) and fmt == "table":
        return human_size(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v) if fmt != "json" else None
        return f"{v:.2f}" if fmt == "table" else v
    if isinstance(v, int):
        return str(v) if fmt != "json" else v
    if isinstance(v, (list, tuple, dict)):
        if fmt == "json":
            return json.loads(json.dumps(v, default=str))
        v = json.dumps(v, default=str, separators=(",", ":"))
    text = str(v)
    if fmt == "table" and len(text) > TEXT_WIDTH:  # a path's end names the checkpoint: keep that
        text = "..." + text[3 - TEXT_WIDTH :] if column == "where" else text[: TEXT_WIDTH - 3] + "..."
    return text


def human_size(n: int) -> str:
    value, unit = float(n), "B"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
