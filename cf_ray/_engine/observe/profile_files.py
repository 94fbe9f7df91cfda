"""The profile on storage, under the run's cf_ray folder: the whole tables a controller writes at
its end (:data:`PROFILE_FILE`, :data:`ITERATIONS_FILE`, :data:`RESTARTS_FILE` and the goodput
breakdown, :func:`save_profile`), the parts it appends while the run goes on, and reading them
back as one table (:func:`load_profile`), and the run's events (:data:`EVENTS_FILE`,
:func:`save_events`) so that ``cf_ray.Run(...).events()`` reads them once the controller is gone.

While the run goes on, when the controller's window of rows is full, its oldest quarter leaves
memory as one batch, which the maintenance thread appends to storage as a Parquet part,
``profile/<lineage>/part-<n>.parquet`` (:class:`ProfileParts`), never rewriting an earlier one; the
rows still in memory, and the events window, are saved beside them as ``window.json``
(:data:`WINDOW`, replaced), so that a controller that Ray starts again lists them too. The
*lineage* is one controller and the controllers Ray restarts in its place; a new controller (a new
``fit()``) starts a new one. A profile row or an event is thus never lost with its controller.

Each file is written whole through :meth:`Storage.write_file`, so a reader sees the previous
version or the new one, never a torn file. Storage I/O only: called without the controller's lock.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from cf_ray._engine.observe.profile_frames import (
    ITERATION_COLUMNS,
    PROFILE_COLUMNS,
    RESTART_COLUMNS,
    coerce,
    iterations_frame,
    missing,
    parquet_bytes,
    profile_frame,
    read_parquet,
    restarts_frame,
)
from cf_ray._engine.protocol.events import Event
from cf_ray._engine.storage.base import FileInfo, Storage
from cf_ray.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger("cf_ray")

#: Where the profile lives under the run's cf_ray root (``<storage_path>/<run_name>/cf_ray``).
PROFILE_FILE = "profile.parquet"
#: The per-sample iteration times, next to it.
ITERATIONS_FILE = "iterations.parquet"
#: The restarts of the run and what each cost (goodput), next to it.
RESTARTS_FILE = "restarts.parquet"
#: Where the breakdown of the wall time is saved with the profile (``Badput.breakdown``).
GOODPUT_FILE = "goodput.json"
#: Where the controller's events are saved with the profile at the run's end.
EVENTS_FILE = "events.json"
#: Where the controller appends the rows that left its memory (``profile/<lineage>/part-<n>.parquet``).
PROFILE_PARTS = "profile"
#: In a lineage's directory: the rows a controller still held in memory and its events, as of its last
#: save (JSON ``{"rows": [...], "events": [...]}``, replaced every ``env.WINDOW_SAVE_INTERVAL_S`` after
#: a commit or an event): what a controller that Ray starts again in its place lists beside the parts
#: (a profile row or an event is never lost with the controller).
WINDOW = "window.json"
_PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
_LINEAGE_RE = re.compile(r"^\d{20}$")


def new_lineage() -> str:
    """The name of a new lineage of profile parts (sorts by creation time)."""
    return f"{time.time_ns():020d}"


class ProfileParts:
    """The parts of one lineage on storage: append-only Parquet files of evicted rows.

    Storage I/O only: called without the controller's lock (the maintenance thread writes, an RPC
    thread reads).

    Args:
        storage: the run's storage.
        lineage: this controller's lineage (:func:`new_lineage`, or :func:`newest_lineage`).
    """

    def __init__(self, storage: Storage, lineage: str, continued: bool = False):
        self.storage = storage
        self.lineage = lineage
        self.directory = f"{PROFILE_PARTS}/{lineage}"
        self._next = 1 + max((int(m.group(1)) for m in map(_PART_RE.match, self._names()) if m), default=0)
        rows, events = self.read_window() if continued else ([], [])
        self.predecessor: list[dict] = rows
        """The rows a dead controller of this lineage still held (its last window save; ``continued``:
        this controller replaces it): older than any part written since, so merged first."""
        self.predecessor_events: list[dict] = events
        """The events it held (restores, fallbacks, quarantines, interval changes), oldest first."""
        self._window_failing = False

    def _names(self) -> list[str]:
        try:
            return [n for n in self.storage.list_dir(self.directory) if _PART_RE.match(n)]
        except Exception as e:  # noqa: BLE001 - the profile is a report, never a reason to fail
            logger.warning("cf_ray: cannot list the profile parts at %s: %s", self.storage.uri(self.directory), e)
            return []

    def write(self, rows: list[dict]) -> str:
        """Append ``rows`` as the next part; returns its path."""
        path = f"{self.directory}/part-{self._next:06d}.parquet"
        self.storage.write_file(path, [parquet_bytes(profile_frame(rows))])
        self._next += 1
        return path

    def save_window(self, rows: list[dict], events: list[dict]) -> None:
        """Replace this lineage's window file (:data:`WINDOW`) with ``rows`` (the rows in memory and
        the predecessor's) and ``events`` (the controller's events window), so a controller that Ray
        starts again in this one's place still lists them (the maintenance thread, every
        ``env.WINDOW_SAVE_INTERVAL_S`` after a commit or an event). Never raises; a failure is logged
        once until a save works."""
        try:
            body = json.dumps({"rows": rows, "events": events}, default=_jsonable, allow_nan=True)
            self.storage.write_file(f"{self.directory}/{WINDOW}", [body.encode()])
            self._window_failing = False
        except Exception as e:  # noqa: BLE001 - the profile is a report, never a reason to fail
            if not self._window_failing:
                logger.warning("cf_ray: could not save the profile's rows and events in memory: %s", e)
            self._window_failing = True

    def read_window(self) -> tuple[list[dict], list[dict]]:
        """The rows and the events of this lineage's window file (``[]``: none, or unreadable, logged)."""
        path = f"{self.directory}/{WINDOW}"
        try:
            if not self.storage.exists(path):
                return [], []
            saved = json.loads(bytes(self.storage.read_file(path)))
        except Exception as e:  # noqa: BLE001 - the profile is a report, never a reason to fail
            logger.warning("cf_ray: skipping the profile window %s: %s", self.storage.uri(path), e)
            return [], []
        if not isinstance(saved, dict):
            logger.warning("cf_ray: skipping the profile window %s: not an object", self.storage.uri(path))
            return [], []

        def dicts(key: str) -> list[dict]:
            items = saved.get(key)
            return [d for d in items if isinstance(d, dict)] if isinstance(items, list) else []

        return dicts("rows"), dicts("events")

    def read_all(self) -> list[dict]:
        """Every row of every part, oldest part first (an unreadable part is skipped, logged)."""
        out: list[dict] = []
        for name in sorted(self._names()):
            path = f"{self.directory}/{name}"
            try:
                out.extend(read_parquet(self.storage, path).to_dict("records"))
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: skipping the profile part %s: %s", self.storage.uri(path), e)
        return out


def newest_lineage(storage: Storage) -> str | None:
    """The newest lineage on storage (what a controller that Ray restarted continues), or ``None``."""
    try:
        names = [n for n in storage.list_dir(PROFILE_PARTS) if _LINEAGE_RE.match(n)]
    except Exception:  # noqa: BLE001
        return None
    return max(names, default=None)


def delete_other_lineages(storage: Storage, keep: str) -> None:
    """Delete the parts of earlier controllers (their table is in ``profile.parquet`` when they
    finished, which this controller's save replaces, as before parts existed). Storage I/O."""
    try:
        names = [n for n in storage.list_dir(PROFILE_PARTS) if _LINEAGE_RE.match(n) and n != keep]
    except Exception:  # noqa: BLE001
        return
    for name in names:
        try:
            storage.delete_dir(posixpath.join(PROFILE_PARTS, name))
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not delete old profile parts %s: %s", name, e)


def merge_rows(*sources: Iterable[dict]) -> list[dict]:
    """Rows of several sources as one table in step order: rows of the same ``(generation,
    step)`` are merged, a later source's non-missing values winning."""
    merged: dict[tuple, dict] = {}
    for rows in sources:
        for r in rows:
            key = (r.get("generation"), r.get("step"))
            old = merged.get(key)
            if old is None:
                merged[key] = dict(r)
            else:
                old.update({k: v for k, v in r.items() if v is not None})
    return sorted(merged.values(), key=lambda r: (_sort_key(r.get("step")), _sort_key(r.get("generation"))))


def save_profile(
    storage: Storage,
    rows: Iterable[Mapping] | pd.DataFrame,
    iter_rows: Iterable[Mapping] | pd.DataFrame | None = None,
    *,
    restarts: Iterable[Mapping] | pd.DataFrame | None = None,
    goodput: Mapping | None = None,
) -> dict[str, FileInfo]:
    """Write the profile (and the iteration times) as Parquet at the storage's root, each file whole.

    Args:
        storage: the run's cf_ray root (e.g. an :class:`~cf_ray._engine.storage.fs.FsStorage`).
        rows: checkpoint rows (see :func:`profile_frame`).
        iter_rows: iteration samples (see :func:`iterations_frame`); ``None`` writes an empty table.
        restarts: the restarts (see :func:`restarts_frame`), written as ``restarts.parquet`` when given.
        goodput: where the wall time went (``Badput.breakdown``), written as ``goodput.json`` when given.

    Returns:
        ``{path: FileInfo}`` of the files written.
    """
    out = {PROFILE_FILE: storage.write_file(PROFILE_FILE, [parquet_bytes(profile_frame(rows))])}
    out[ITERATIONS_FILE] = storage.write_file(ITERATIONS_FILE, [parquet_bytes(iterations_frame(iter_rows or []))])
    if restarts is not None:
        out[RESTARTS_FILE] = storage.write_file(RESTARTS_FILE, [parquet_bytes(restarts_frame(restarts))])
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
        profile = coerce(read_parquet(storage, PROFILE_FILE), PROFILE_COLUMNS)
    else:
        profile = profile_frame([])
    if parts:
        saved = {_row_key(r): r for r in profile.to_dict("records")}
        extra = [r for r in parts if _row_key(r) not in saved]
        if extra:
            rows = sorted(
                [*saved.values(), *extra],
                key=lambda r: (_frame_sort_key(r.get("step")), _frame_sort_key(r.get("generation"))),
            )
            profile = profile_frame(rows)
    if storage.exists(ITERATIONS_FILE):
        iterations = coerce(read_parquet(storage, ITERATIONS_FILE), ITERATION_COLUMNS)
    else:
        iterations = iterations_frame([])
    return profile, iterations


def _read_profile_parts(storage: Storage) -> list[dict]:
    """Every row of every lineage's parts (oldest lineage, oldest part first), merged by key."""
    try:
        if not storage.exists(PROFILE_PARTS):
            return []
        lineages = sorted(n for n in storage.list_dir(PROFILE_PARTS) if n.isdigit())
    except Exception as e:  # noqa: BLE001 - missing parts only mean fewer rows
        logger.warning("cf_ray: cannot list the profile parts at %s: %s", storage.uri(PROFILE_PARTS), e)
        return []
    merged: dict[tuple, dict] = {}
    for lineage in lineages:
        directory = f"{PROFILE_PARTS}/{lineage}"
        try:
            names = sorted(n for n in storage.list_dir(directory) if n.startswith("part-") and n.endswith(".parquet"))
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: cannot list the profile parts at %s: %s", storage.uri(directory), e)
            continue
        for name in names:
            path = f"{directory}/{name}"
            try:
                rows = read_parquet(storage, path).to_dict("records")
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: skipping the profile part %s: %s", storage.uri(path), e)
                continue
            for r in rows:
                old = merged.get(_row_key(r))
                if old is None:
                    merged[_row_key(r)] = dict(r)
                else:
                    old.update({k: v for k, v in r.items() if not missing(v)})
    return list(merged.values())


def _row_key(r: Mapping) -> tuple:
    return tuple(None if missing(r.get(k)) else int(r[k]) for k in ("generation", "step"))


def _frame_sort_key(v) -> tuple:
    absent = missing(v)
    return (absent, 0 if absent else v)


def load_restarts(storage: Storage) -> pd.DataFrame:
    """The restarts table :func:`save_profile` wrote (:func:`restarts_frame`); empty when there is none."""
    if not storage.exists(RESTARTS_FILE):
        return restarts_frame([])
    return coerce(read_parquet(storage, RESTARTS_FILE), RESTART_COLUMNS)


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


def save_events(storage: Storage, events: Iterable[Event | Mapping]) -> FileInfo:
    """Write ``events`` (oldest first; typed, or already in their plain form) as ``events.json``:
    what the live ``events()`` returned last, each in its plain form
    (:meth:`~cf_ray._engine.protocol.events.Event.to_dict`)."""
    plain = [e.to_dict() if isinstance(e, Event) else dict(e) for e in events]
    return storage.write_file(EVENTS_FILE, [json.dumps(plain, default=_jsonable, allow_nan=True).encode()])


def load_events(storage: Storage) -> list[dict] | None:
    """What :func:`save_events` wrote, oldest first and in the plain form as it was written (a run
    of another cf_ray version may name kinds this one does not; a reader that needs them typed
    calls ``Event.from_dict``); ``None`` when the run saved none (it has not ended).

    Raises:
        CorruptCheckpointError: the file is not a JSON list of objects.
    """
    if not storage.exists(EVENTS_FILE):
        return None
    try:
        saved = json.loads(bytes(storage.read_file(EVENTS_FILE)))
    except ValueError as e:
        raise CorruptCheckpointError(f"{storage.uri(EVENTS_FILE)} is not JSON ({e})") from e
    if not isinstance(saved, list) or not all(isinstance(e, dict) for e in saved):
        raise CorruptCheckpointError(f"{storage.uri(EVENTS_FILE)} is not a list of events")
    return saved


def _jsonable(v: Any) -> Any:
    """A value JSON has no type for (a numpy number, an enum, a tuple's item) as one it has."""
    item = getattr(v, "item", None)
    if callable(item):
        return item()
    value = getattr(v, "value", None)
    return value if isinstance(value, (str, int, float)) else str(v)


def _sort_key(v) -> tuple:
    return (v is None, v if v is not None else 0)


__all__ = [
    "EVENTS_FILE",
    "GOODPUT_FILE",
    "ITERATIONS_FILE",
    "PROFILE_FILE",
    "PROFILE_PARTS",
    "RESTARTS_FILE",
    "ProfileParts",
    "delete_other_lineages",
    "load_events",
    "load_goodput",
    "load_profile",
    "load_restarts",
    "merge_rows",
    "new_lineage",
    "newest_lineage",
    "save_events",
    "save_goodput",
    "save_profile",
]
