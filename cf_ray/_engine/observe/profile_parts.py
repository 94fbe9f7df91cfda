"""The profile's rows on storage while the run goes on (issue #16): when the controller's window of
rows is full, its oldest quarter leaves memory as one batch, which the maintenance thread appends to
storage as a Parquet part, ``profile/<lineage>/part-<n>.parquet`` (:class:`ProfileParts`), never
rewriting an earlier one; the rows still in memory, and the events window, are saved beside them as
``window.json`` (:data:`WINDOW`, replaced), so that a controller Ray starts again lists them too. The *lineage* is one controller and the controllers Ray restarts in its
place; a new controller (a new ``fit()``) starts a new one.

Storage I/O only: called without the controller's lock.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import time
from collections.abc import Iterable

from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")

#: Where the profile's parts live, relative to the run's storage.
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
        from cf_ray import report

        path = f"{self.directory}/part-{self._next:06d}.parquet"
        self.storage.write_file(path, [report._parquet_bytes(report.profile_frame(rows))])
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
        from cf_ray import report

        out: list[dict] = []
        for name in sorted(self._names()):
            path = f"{self.directory}/{name}"
            try:
                out.extend(report._read_parquet(self.storage, path).to_dict("records"))
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


def _jsonable(v):
    """A value of a row that JSON has no type for (a numpy number, a tuple) as one it has."""
    item = getattr(v, "item", None)
    return item() if callable(item) else str(v)


def _sort_key(v) -> tuple:
    return (v is None, v if v is not None else 0)


__all__ = [
    "PROFILE_PARTS",
    "ProfileParts",
    "delete_other_lineages",
    "merge_rows",
    "new_lineage",
    "newest_lineage",
]
