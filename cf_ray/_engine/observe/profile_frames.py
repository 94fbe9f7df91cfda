"""The profile's tables: the profile (one row per checkpoint), the iteration times, the
restarts and where the wall time went (:func:`badput_frame`), as pandas frames with one schema each (:data:`PROFILE_COLUMNS`, :data:`ITERATION_COLUMNS`,
:data:`RESTART_COLUMNS`), and as Parquet bytes. Every writer and reader of the tables (the
controller's parts and saved profile, ``cf_ray.report``, the plots, ``cf-ray profile``) goes through
these frames, so a column has the same name, dtype and place wherever a user meets it.

Known columns come first, in schema order, with nullable dtypes; any other key of the rows follows
in order of first appearance, with a dtype inferred from its values. A missing value is ``None``,
``NaN`` or pandas' ``NA`` alike.

pandas and Parquet load on first use: the controller actor imports this module to write its parts
and needs them only then. pandas ships no type information here, so the casts below only state what
the checker cannot infer.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cf_ray._engine.lazy import lazy_module
from cf_ray._engine.observe.goodput import CATEGORIES
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
else:
    pd = lazy_module("pandas")
    pa = lazy_module("pyarrow")
    pq = lazy_module("pyarrow.parquet")

logger = logging.getLogger("cf_ray.report")

# Column -> dtype, in the order users see them. Extra keys follow, in order of first appearance.
PROFILE_COLUMNS: dict[str, Any] = {
    "step": "Int64",
    "epoch": "Int64",
    "kind": object,
    "generation": "Int64",
    "stall_s": "float64",
    "copy_s": "float64",
    "persist_s": "float64",
    "bytes": "Int64",
    "interval": "Int64",
    "overhead_pct": "float64",
    "committed": "boolean",
    "where": object,
    "error": object,
    "durability_lost": "boolean",
}
ITERATION_COLUMNS: dict[str, Any] = {
    "step": "Int64",
    "rank": "Int64",
    "iter_s": "float64",
    "iters": "Int64",
    "time": "float64",
}
RESTART_COLUMNS: dict[str, Any] = {
    "generation": "Int64",
    "source": object,
    "restored_step": "Int64",
    "restore_s": "float64",
    "lost_steps": "Int64",
    "lost_s": "float64",
    "failure_unix": "float64",
    "restored_unix": "float64",
    "resumed_unix": "float64",
    "recovery_s": "float64",
    "fallbacks": "Int64",
    "memory_failed": "Int64",
    "rebuild_s": "float64",
    "setup_s": "float64",
    "first_step_s": "float64",
    "spare": object,
}
# How a per-rank value (a sequence, or a mapping rank -> value) becomes the row's value.
_PER_RANK = {"stall_s": max, "copy_s": max, "persist_s": max, "bytes": sum}


def profile_frame(rows: Iterable[Mapping] | pd.DataFrame) -> pd.DataFrame:
    """The profile table: one row per checkpoint, in the order given.

    Columns, always present and in this order: ``step``, ``epoch``, ``kind``
    (scheduled/epoch/manual/preempt/final), ``generation``, ``stall_s`` (max over ranks),
    ``copy_s`` (max), ``persist_s`` (max), ``bytes`` (sum over ranks), ``interval`` (in force),
    ``overhead_pct`` (measured), ``committed`` (bool), ``where`` (storage URI, ``memory-only`` or
    ``failed``), ``error`` (str or None); then any other key found in the rows.

    Args:
        rows: plain dicts from the controller (or a frame). Missing keys become NA / ``None``.
            ``stall_s``, ``copy_s``, ``persist_s`` and ``bytes`` may also be given per rank (a
            sequence, or a mapping rank -> value); they are reduced as said above.

    Returns:
        A :class:`pandas.DataFrame` with nullable integer/boolean columns and ``object`` strings.
    """
    if isinstance(rows, pd.DataFrame):
        records = rows.to_dict("records")
    else:
        records = [dict(r) for r in rows]
    for r in records:
        for key, reduce in _PER_RANK.items():
            if key in r:
                r[key] = _reduce(r[key], reduce)
    return _frame(records, PROFILE_COLUMNS)


def iterations_frame(rows: Iterable[Mapping | Any] | pd.DataFrame) -> pd.DataFrame:
    """The iteration-time table: one row per sample (``step``, ``rank``, ``iter_s``, ``iters``,
    ``time``, then extra keys). Accepts dicts, :class:`cf_ray.policy.Sample` objects or a frame."""
    if isinstance(rows, pd.DataFrame):
        records = rows.to_dict("records")
    else:
        records = [r if isinstance(r, Mapping) else _fields(r) for r in rows]
    return _frame(records, ITERATION_COLUMNS)


def restarts_frame(rows: Iterable[Mapping] | pd.DataFrame) -> pd.DataFrame:
    """The restarts table (goodput): one row per restart of the run, in order.

    Columns: ``generation`` (the attempt that resumed), ``source`` (memory/storage/fresh),
    ``restored_step``, ``restore_s``, ``lost_steps`` (steps redone), ``lost_s`` (``lost_steps``
    times the mean iteration time), ``failure_unix`` (the newest sample before the restart: the
    controller's best estimate of the failure time), ``restored_unix``, ``resumed_unix`` (the end of
    the first iteration past ``restored_step``), ``recovery_s`` (``resumed_unix - failure_unix``),
    ``fallbacks`` (restore candidates the attempt fell back from before the one it restored),
    ``memory_failed`` (of those, in-memory snapshots whose bytes failed verification), and the
    parts of ``recovery_s``: ``rebuild_s`` (to the start of rank 0's new process: Ray Train seeing
    the failure and rebuilding the worker group), ``setup_s`` (from there to ``restore()``: imports,
    ``init_process_group``, the user's set-up), ``restore_s`` and ``first_step_s`` (from the restore
    to the end of the first resumed iteration); ``spare``: ``taken`` when rank 0's new process was
    the spare its predecessor made ready, else why not.
    """
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else [dict(r) for r in rows]
    return _frame(records, RESTART_COLUMNS)


def _fields(obj) -> dict:
    names = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "__slots__", ())
    return {n: getattr(obj, n) for n in names if not n.startswith("_")}


def _reduce(value, reduce):
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple, np.ndarray, pd.Series)):
        vals = [v for v in value if not missing(v)]
        return reduce(vals) if vals else None
    return value


def missing(v) -> bool:
    if v is None or v is pd.NA or v is pd.NaT:
        return True
    try:
        return isinstance(v, float) and math.isnan(v)
    except TypeError:
        return False


def _frame(records: Sequence[Mapping], schema: Mapping[str, Any]) -> pd.DataFrame:
    extras: list[str] = []
    seen = set(schema)
    for r in records:
        for k in r:
            if k not in seen:
                seen.add(k)
                extras.append(k)
    data = {col: [r.get(col) for r in records] for col in list(schema) + extras}
    df = pd.DataFrame({col: pd.Series(vals, dtype=object) for col, vals in data.items()}, columns=list(schema) + extras)
    return coerce(df, schema)


def coerce(df: pd.DataFrame, schema: Mapping[str, Any]) -> pd.DataFrame:
    """Give the known columns their dtypes (adding missing ones) and put them first."""
    df = df.copy()
    for col, dtype in schema.items():
        if col not in df.columns:
            df[col] = pd.Series([None] * len(df), dtype=object, index=df.index)
        df[col] = _as_dtype(_column(df, col), dtype, col)
    extras = [c for c in df.columns if c not in schema]
    for col in extras:
        df[col] = _infer(_column(df, col))
    return cast("pd.DataFrame", df[list(schema) + extras].reset_index(drop=True))


def _column(df: pd.DataFrame, col: Any) -> pd.Series:
    """``df[col]``: a Series, as column names are unique in these frames."""
    return cast("pd.Series", df[col])


def _as_dtype(s: pd.Series, dtype, col: str) -> pd.Series:
    vals = [None if missing(v) else v for v in s.tolist()]
    if dtype is object:
        return pd.Series([None if v is None else str(v) for v in vals], dtype=object, index=s.index)
    if dtype == "boolean":
        return pd.Series([None if v is None else bool(v) for v in vals], dtype="boolean", index=s.index)
    if dtype == "Int64":
        try:
            return pd.Series(pd.array([None if v is None else _as_int(v) for v in vals], dtype="Int64"), index=s.index)
        except (TypeError, ValueError):
            logger.warning("cf_ray profile: column %r has non-integer values; keeping them as numbers", col)
            dtype = "float64"
    try:
        return pd.Series([np.nan if v is None else float(v) for v in vals], dtype="float64", index=s.index)
    except (TypeError, ValueError):
        return pd.Series(vals, dtype=object, index=s.index)


def _as_int(v) -> int:
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    f = float(v)
    if not f.is_integer():
        raise ValueError(v)
    return int(f)


def _infer(s: pd.Series) -> pd.Series:
    """An extra column: numbers and booleans get a (nullable) numeric dtype, the rest stays as is."""
    vals = [None if missing(v) else v for v in s.tolist()]
    present = [v for v in vals if v is not None]
    if present and all(isinstance(v, (bool, np.bool_)) for v in present):
        return pd.Series(vals, dtype="boolean", index=s.index)
    if present and all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in present):
        return pd.Series(pd.array(vals, dtype="Int64"), index=s.index)
    if present and all(
        isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) for v in present
    ):
        return pd.Series([np.nan if v is None else float(v) for v in vals], dtype="float64", index=s.index)
    return pd.Series(vals, dtype=object, index=s.index)


def parquet_bytes(df: pd.DataFrame) -> pa.Buffer:
    """``df`` as a Parquet file's bytes (extra columns of structures or mixed types as JSON text)."""
    table = pa.Table.from_pandas(_arrow_ready(df), preserve_index=False)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue()


def _arrow_ready(df: pd.DataFrame) -> pd.DataFrame:
    """Extra columns holding structures or mixed types become JSON text, so any row can be saved."""
    df = df.copy()
    for col in df.columns:
        if df[col].dtype != object:
            continue
        vals = df[col].tolist()
        if all(v is None or isinstance(v, str) for v in vals):
            continue
        try:
            if any(isinstance(v, (Mapping, list, tuple, set)) for v in vals):
                raise TypeError("structured")
            pa.array(vals, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            df[col] = pd.Series(
                [None if v is None else json.dumps(v, default=str, sort_keys=True) for v in vals],
                dtype=object,
                index=df.index,
            )
    return df


def read_parquet(storage: Storage, path: str) -> pd.DataFrame:
    """The Parquet table at ``path`` with ``None`` for its missing values (no schema applied: see
    :func:`coerce`).

    Raises:
        CorruptCheckpointError: the file is not a readable Parquet table.
    """
    data = storage.read_file(path)
    try:
        table = pq.read_table(pa.BufferReader(pa.py_buffer(data)))
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptCheckpointError(
            f"{storage.uri(path)} is not a readable Parquet table ({e}); "
            "delete it, the next save_profile() writes it again"
        ) from e
    df = table.to_pandas()
    return df.astype(object).where(df.notna(), None) if len(df) else df.astype(object)


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


__all__ = [
    "ITERATION_COLUMNS",
    "PROFILE_COLUMNS",
    "RESTART_COLUMNS",
    "badput_frame",
    "coerce",
    "iterations_frame",
    "missing",
    "parquet_bytes",
    "profile_frame",
    "read_parquet",
    "restarts_frame",
]
