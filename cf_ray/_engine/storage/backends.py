"""Which backend opens a storage location: one table from URI scheme to backend, and the one opener.

Every place that builds a :class:`~cf_ray._engine.storage.base.Storage` from a user's location
(``storage_path``, ``upload_path``, a path given to ``cf_ray.load`` or ``cf-ray``) calls
:func:`open_storage`, so that adding a backend is one new module with a
:class:`~cf_ray._engine.storage.base.Storage` subclass plus one line in :data:`BACKENDS`. A backend
is imported only when a location of its scheme is opened, so that naming the table costs no import
of ``pyarrow`` or of a cloud SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

from cf_ray._engine.storage.base import Storage
from cf_ray.errors import ConfigError

_PYARROW = "cf_ray._engine.storage.fs:FsStorage"

#: URI scheme -> ``"module:class"`` of the backend that opens it. The class's
#: ``from_uri(uri, filesystem)`` builds the storage. A location without ``://`` is local disk
#: (``file``); with a ``filesystem`` object, the location is a path on that file system and the
#: backend is the one for its scheme (``file`` when it has none).
BACKENDS: dict[str, str] = {
    "file": _PYARROW,
    "s3": _PYARROW,
    "gs": _PYARROW,
    "gcs": _PYARROW,
    "hdfs": _PYARROW,
    "viewfs": _PYARROW,
    "abfs": _PYARROW,
    "abfss": _PYARROW,
}


def scheme_of(uri: str) -> str:
    """The scheme of ``uri`` (``file`` for a path without one)."""
    return uri.split("://", 1)[0].lower() if "://" in uri else "file"


def open_storage(uri: str, filesystem: Any = None) -> Storage:
    """The storage rooted at ``uri``, opened by the backend :data:`BACKENDS` names for its scheme.

    Args:
        uri: ``/local/path``, ``~/path``, ``file://...``, ``s3://bucket/prefix``, ``gs://...``; with
            ``filesystem``, the root's path on it.
        filesystem: a file system object the backend takes (``pyarrow.fs.FileSystem`` for the
            ``pyarrow`` backend), e.g. ``RunConfig(storage_filesystem=...)``.

    Raises:
        ConfigError: no backend for the scheme.
    """
    if not isinstance(uri, str):
        raise ConfigError(f"a storage location must be a string, got {type(uri).__name__}")
    scheme = scheme_of(uri)
    where = BACKENDS.get(scheme)
    if where is None:
        raise ConfigError(
            f"no storage backend for {scheme}:// (in {uri!r}); the schemes cf_ray opens are "
            f"{', '.join(sorted(BACKENDS))}"
        )
    module, name = where.split(":")
    backend = getattr(importlib.import_module(module), name)
    return backend.from_uri(uri, filesystem)


__all__ = ["BACKENDS", "open_storage", "scheme_of"]
