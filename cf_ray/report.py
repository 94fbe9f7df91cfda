"""The profile of a run, as users see it: one row per checkpoint (pandas), kept as Parquet next to
the checkpoints, plotted in one call, and exported as Ray metrics.

The controller owns the rows: it builds them as plain dicts (see :func:`profile_frame` for the
columns), writes them with :func:`save_profile` through the run's storage, and feeds each
finished row to a :class:`CheckpointMetrics` (defined with the controller, in
``cf_ray._engine.observe.metrics``; re-exported here). Users read them back after the run with
:func:`read_run_profile` and draw them with :func:`plot_profile`::

    from cf_ray import report

    df = report.read_run_profile("/mnt/runs", "my-run")
    report.plot_profile(
        df,
        report.read_run_iterations("/mnt/runs", "my-run"),
        budget_pct=5,
        restarts_df=report.read_run_restarts("/mnt/runs", "my-run"),
    )
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa

from cf_ray._engine.lazy import lazy_module
from cf_ray._engine.observe.goodput_report import (
    GOODPUT_FILE,
    badput_frame,
    load_goodput,
    plot_badput,
    save_goodput,
)
from cf_ray._engine.observe.metrics import CheckpointMetrics, GoodputMetrics
from cf_ray._engine.observe.profile_plot import plot_profile
from cf_ray._engine.storage.fs import FileInfo, FsStorage, Storage
from cf_ray.errors import CorruptCheckpointError

# pandas and parquet load on first use: the controller actor imports this module to write profile
# parts and the profile, and needs pandas only then (its Ray metrics live in _engine/observe/metrics.py).
# Type checkers see the real modules, for the annotations. pandas ships no type information (no
# pandas-stubs here), so the casts below only state what the checker cannot infer from its source.
if TYPE_CHECKING:
    import pandas as pd
    import pyarrow.parquet as pq
else:
    pd = lazy_module("pandas")
    pq = lazy_module("pyarrow.parquet")

logger = logging.getLogger(__name__)

#: Where the profile lives under the run's cf_ray root (``<storage_path>/<run_name>/cf_ray``).
PROFILE_FILE = "profile.parquet"
#: The per-sample iteration times, next to it.
ITERATIONS_FILE = "iterations.parquet"
#: The restarts of the run and what each cost (goodput), next to it.
RESTARTS_FILE = "restarts.parquet"
#: Where the controller appends the rows that left its memory (``profile/<lineage>/part-<n>.parquet``).
PROFILE_PARTS_DIR = "profile"
#: The folder of a run's cf_ray files under ``<storage_path>/<run_name>``.
RUN_SUBDIR = "cf_ray"
#: What ``kind`` a checkpoint row can have.
KINDS = ("scheduled", "epoch", "manual", "preempt", "final")

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
}
# How a per-rank value (a sequence, or a mapping rank -> value) becomes the row's value.
_PER_RANK = {"stall_s": max, "copy_s": max, "persist_s": max, "bytes": sum}


# -- frames -------------------------------------------------------------------------------------


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
    to the end of the first resumed iteration).
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
        vals = [v for v in value if not _missing(v)]
        return reduce(vals) if vals else None
    return value


def _missing(v) -> bool:
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
    return _coerce(df, schema)


def _coerce(df: pd.DataFrame, schema: Mapping[str, Any]) -> pd.DataFrame:
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
    vals = [None if _missing(v) else v for v in s.tolist()]
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
    vals = [None if _missing(v) else v for v in s.tolist()]
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


# -- Parquet through a Storage ------------------------------------------------------------------


def save_profile(
    storage: Storage,
    rows: Iterable[Mapping] | pd.DataFrame,
    iter_rows: Iterable[Mapping] | pd.DataFrame | None = None,
    *,
    restarts: Iterable[Mapping] | pd.DataFrame | None = None,
    goodput: Mapping | None = None,
) -> dict[str, FileInfo]:
    """Write the profile (and the iteration times) as Parquet at the storage's root.

    Each file is written whole through :meth:`Storage.write_file`, so a reader sees the previous
    version or the new one, never a torn file.

    Args:
        storage: the run's cf_ray root (e.g. an :class:`~cf_ray._engine.storage.fs.FsStorage`).
        rows: checkpoint rows (see :func:`profile_frame`).
        iter_rows: iteration samples (see :func:`iterations_frame`); ``None`` writes an empty table.
        restarts: the restarts (see :func:`restarts_frame`), written as ``restarts.parquet`` when given.
        goodput: where the wall time went (:func:`badput_frame`), written as ``goodput.json`` when given.

    Returns:
        ``{path: FileInfo}`` of the files written.
    """
    out = {PROFILE_FILE: storage.write_file(PROFILE_FILE, [_parquet_bytes(profile_frame(rows))])}
    out[ITERATIONS_FILE] = storage.write_file(ITERATIONS_FILE, [_parquet_bytes(iterations_frame(iter_rows or []))])
    if restarts is not None:
        out[RESTARTS_FILE] = storage.write_file(RESTARTS_FILE, [_parquet_bytes(restarts_frame(restarts))])
    if goodput is not None:
        out[GOODPUT_FILE] = save_goodput(storage, goodput)
    return out


def load_profile(storage: Storage) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read what :func:`save_profile` wrote, with the rows the controller had already moved out of
    memory into ``profile/<lineage>/part-*.parquet``.

    A run that ended cleanly has every row in ``profile.parquet`` (read as it is). One whose
    controller died for good before its end has only the parts for the rows that left its memory:
    they are merged in. Rows are keyed by ``(generation, step)``; the parts are merged in the order
    they were written (a later part's values win, as the controller merges them), and a row of
    ``profile.parquet`` — the whole table a controller wrote at its end, its parts included —
    replaces the parts' row of the same key (the newest). Unreadable parts are skipped (logged).

    Returns:
        ``(profile, iterations)``; ``iterations`` is empty when its file is missing.

    Raises:
        FileNotFoundError: there is neither a profile nor a profile part at ``storage`` (the message
            says where it looked).
        CorruptCheckpointError: ``profile.parquet`` exists but is not a readable Parquet table.
    """
    parts = _read_profile_parts(storage)
    if not storage.exists(PROFILE_FILE) and not parts:
        raise FileNotFoundError(
            f"no cf_ray profile at {storage.uri(PROFILE_FILE)}; it is written when a run "
            "finishes (and by Checkpointer.finish()) — check storage_path and run_name"
        )
    if storage.exists(PROFILE_FILE):
        profile = _coerce(_read_parquet(storage, PROFILE_FILE), PROFILE_COLUMNS)
    else:
        profile = profile_frame([])
    if parts:
        saved = {_row_key(r): r for r in profile.to_dict("records")}
        extra = [r for r in parts if _row_key(r) not in saved]
        if extra:
            rows = sorted(
                [*saved.values(), *extra], key=lambda r: (_sort_key(r.get("step")), _sort_key(r.get("generation")))
            )
            profile = profile_frame(rows)
    if storage.exists(ITERATIONS_FILE):
        iterations = _coerce(_read_parquet(storage, ITERATIONS_FILE), ITERATION_COLUMNS)
    else:
        iterations = iterations_frame([])
    return profile, iterations


def _read_profile_parts(storage: Storage) -> list[dict]:
    """Every row of every lineage's parts (oldest lineage, oldest part first), merged by key."""
    try:
        if not storage.exists(PROFILE_PARTS_DIR):
            return []
        lineages = sorted(n for n in storage.list_dir(PROFILE_PARTS_DIR) if n.isdigit())
    except Exception as e:  # noqa: BLE001 - missing parts only mean fewer rows
        logger.warning("cf_ray: cannot list the profile parts at %s: %s", storage.uri(PROFILE_PARTS_DIR), e)
        return []
    merged: dict[tuple, dict] = {}
    for lineage in lineages:
        directory = f"{PROFILE_PARTS_DIR}/{lineage}"
        try:
            names = sorted(n for n in storage.list_dir(directory) if n.startswith("part-") and n.endswith(".parquet"))
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: cannot list the profile parts at %s: %s", storage.uri(directory), e)
            continue
        for name in names:
            path = f"{directory}/{name}"
            try:
                rows = _read_parquet(storage, path).to_dict("records")
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: skipping the profile part %s: %s", storage.uri(path), e)
                continue
            for r in rows:
                old = merged.get(_row_key(r))
                if old is None:
                    merged[_row_key(r)] = dict(r)
                else:
                    old.update({k: v for k, v in r.items() if not _missing(v)})
    return list(merged.values())


def _row_key(r: Mapping) -> tuple:
    return tuple(None if _missing(r.get(k)) else int(r[k]) for k in ("generation", "step"))


def _sort_key(v) -> tuple:
    missing = _missing(v)
    return (missing, 0 if missing else v)


def read_run_profile(storage_path: str, run_name: str, filesystem=None) -> pd.DataFrame:
    """The profile table of a run: ``<storage_path>/<run_name>/cf_ray/profile.parquet``, with the
    rows of the controller's parts that it lacks (a run whose controller died, see :func:`load_profile`).

    Args:
        storage_path: what the run was given as ``storage_path`` (a local path, ``s3://...``,
            ``gs://...``; a path on ``filesystem`` when one is given).
        run_name: the run's name (a path under ``storage_path``; no ``..``).
        filesystem: an optional ``pyarrow.fs.FileSystem`` (as for ``RunConfig(storage_filesystem=)``).

    Raises:
        FileNotFoundError: no profile there.
    """
    return load_profile(_run_storage(storage_path, run_name, filesystem))[0]


def read_run_iterations(storage_path: str, run_name: str, filesystem=None) -> pd.DataFrame:
    """The iteration-time table of a run (see :func:`read_run_profile` for the arguments)."""
    return load_profile(_run_storage(storage_path, run_name, filesystem))[1]


def load_restarts(storage: Storage) -> pd.DataFrame:
    """The restarts table :func:`save_profile` wrote (:func:`restarts_frame`); empty when there is none."""
    if not storage.exists(RESTARTS_FILE):
        return restarts_frame([])
    return _coerce(_read_parquet(storage, RESTARTS_FILE), RESTART_COLUMNS)


def read_run_restarts(storage_path: str, run_name: str, filesystem=None) -> pd.DataFrame:
    """The restarts table of a run (goodput: work lost, recovery time, restore source and time per
    restart; see :func:`restarts_frame`), written at the run's end. Arguments as :func:`read_run_profile`."""
    return load_restarts(_run_storage(storage_path, run_name, filesystem))


def read_run_goodput(storage_path: str, run_name: str, filesystem=None) -> dict | None:
    """Where a run's wall time went (productive and badput seconds by category, see
    :func:`badput_frame`), as saved at its end; ``None`` when it saved none. Arguments as
    :func:`read_run_profile`."""
    return load_goodput(_run_storage(storage_path, run_name, filesystem))


def _run_storage(storage_path: str, run_name: str, filesystem) -> FsStorage:
    return FsStorage.from_uri(storage_path, filesystem).child(f"{run_name.strip('/')}/{RUN_SUBDIR}")


def _parquet_bytes(df: pd.DataFrame) -> pa.Buffer:
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


def _read_parquet(storage: Storage, path: str) -> pd.DataFrame:
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


__all__ = [
    "CheckpointMetrics",
    "GOODPUT_FILE",
    "GoodputMetrics",
    "ITERATIONS_FILE",
    "PROFILE_FILE",
    "RESTARTS_FILE",
    "iterations_frame",
    "badput_frame",
    "load_goodput",
    "load_profile",
    "load_restarts",
    "plot_badput",
    "plot_profile",
    "profile_frame",
    "read_run_goodput",
    "read_run_iterations",
    "read_run_profile",
    "read_run_restarts",
    "restarts_frame",
    "save_profile",
]
