"""A run's events on storage: what its controller recorded (restores, fallbacks, interval changes,
failure counts, quarantines, notices), saved with the profile at the run's end as ``events.json``,
so that ``cf_ray.Run(storage_path, name).events()`` reads them after the controller is gone, as
``profile()`` reads the profile table. The file holds what the live ``events()`` returned last:
the controller's window of events, oldest first, each in its plain form
(:meth:`~cf_ray._engine.protocol.events.Event.to_dict`). Reading gives that plain form back as it
was written (a run of another cf_ray version may name kinds this one does not; a reader that needs
them typed calls ``Event.from_dict``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from cf_ray._engine.protocol.events import Event
from cf_ray._engine.storage.base import FileInfo, Storage
from cf_ray.errors import CorruptCheckpointError

#: Where the events are saved with the profile (``<storage_path>/<run_name>/cf_ray/events.json``).
EVENTS_FILE = "events.json"


def _jsonable(v: Any) -> Any:
    """A value JSON has no type for (a numpy number, an enum, a tuple's item) as one it has."""
    item = getattr(v, "item", None)
    if callable(item):
        return item()
    value = getattr(v, "value", None)
    return value if isinstance(value, (str, int, float)) else str(v)


def save_events(storage: Storage, events: Iterable[Event | Mapping]) -> FileInfo:
    """Write ``events`` (oldest first; typed, or already in their plain form) as ``events.json``,
    whole, through :meth:`Storage.write_file` (a reader sees the previous file or this one, never a
    torn one)."""
    plain = [e.to_dict() if isinstance(e, Event) else dict(e) for e in events]
    body = json.dumps(plain, default=_jsonable, allow_nan=True)
    return storage.write_file(EVENTS_FILE, [body.encode()])


def load_events(storage: Storage) -> list[dict] | None:
    """What :func:`save_events` wrote, oldest first; ``None`` when the run saved none (it has not
    ended, or an older cf_ray ran it).

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


__all__ = ["EVENTS_FILE", "load_events", "save_events"]
