"""The storage contract: a tiny Protocol with ``str`` paths, what a write returns, and path checks.

Every path given to a :class:`Storage` is *relative to its root* and checked by
:func:`safe_relpath`: no ``..``, no absolute path, no empty component, and on local disk no symlink
that resolves outside the root. A ``pathlib.Path`` would mangle ``s3://``, so paths are strings.

The one implementation, over ``pyarrow.fs``, is :class:`cf_ray._engine.storage.fs.FsStorage`; this
module needs no ``pyarrow`` so that code which only passes a storage around can name its type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from cf_ray._engine import env as _env
from cf_ray.errors import UnsafePathError

try:  # the same CRC-32 as zlib's (the manifests do not change), ~20 GB/s instead of ~1-3 GB/s
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    from zlib import crc32 as _crc32


@dataclass(frozen=True, slots=True)
class FileInfo:
    """What a manifest records of one file."""

    size: int
    """Size of the file in bytes."""
    crc32: int
    """CRC-32 (zlib's polynomial) of the whole file."""

    def to_json(self) -> dict:
        return {"size": self.size, "crc32": self.crc32}


@runtime_checkable
class Storage(Protocol):
    """Where checkpoints are written. All paths are relative to the storage's root.

    Call order: the writer (a holder actor, phase 2) calls :meth:`write_file` for data files; the
    controller calls :meth:`write_file` for the manifest last, then :meth:`delete_dir` for old
    checkpoints. Readers (any rank at restore, a user's evaluation script) call :meth:`list_dir`,
    :meth:`exists` and :meth:`read_file`. Optional: ``read_range(path, offset, nbytes)`` (a
    ``uint8`` array, shorter at the end of the file, possibly read-only), through which a restore
    at another number of ranks and DCP's reader read only the blocks they need; without it they
    read whole files.
    """

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> FileInfo:
        """Write ``path`` durably and atomically from ``chunks``; return its size and CRC-32."""
        ...

    def read_file(self, path: str) -> np.ndarray:
        """The whole file as a writable ``uint8`` array."""
        ...

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under ``path``; empty if it does not exist."""
        ...

    def exists(self, path: str) -> bool: ...

    def delete_dir(self, path: str) -> None:
        """Delete ``path`` and everything under it; no error if it does not exist."""
        ...

    def uri(self, path: str = "") -> str:
        """A human-readable location of ``path`` for logs and errors."""
        ...


def safe_relpath(path: str) -> str:
    """Normalise a relative path and refuse anything that could leave the root.

    Raises:
        UnsafePathError: ``path`` is absolute, contains ``..``, a backslash, a NUL or an empty part.
    """
    if not isinstance(path, str):
        raise UnsafePathError(f"path must be a string, got {type(path).__name__}")
    if path == "":
        return ""
    if path.startswith("/") or "\\" in path or "\x00" in path or ":" in path.split("/")[0]:
        raise UnsafePathError(f"path {path!r} must be relative to the checkpoint root")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"path {path!r} may not contain '..', '.' or empty components")
    return path


def is_symlink(storage: Storage, path: str) -> bool:
    """True when ``path`` is a symbolic link, for a storage that can tell (``FsStorage`` on local
    disk has ``is_symlink``); False for object stores and for storages without the method, which
    stays optional so that a minimal :class:`Storage` needs only the six methods above.

    Raises:
        UnsafePathError: ``path`` itself is not a safe relative path.
    """
    probe = getattr(storage, "is_symlink", None)
    return bool(probe(safe_relpath(path))) if callable(probe) else False


def _byte_view(buf: np.ndarray | memoryview | bytes) -> memoryview:
    """``buf`` as a flat memoryview of bytes, without a copy. ``ndarray.data`` is ``memoryview(ndarray)``;
    it is spelled so because numpy's stubs declare the buffer protocol only for Python >= 3.12."""
    return (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")


def chunked(buf: np.ndarray | memoryview | bytes, chunk: int | None = None) -> Iterable[memoryview]:
    """Yield ``buf`` in chunks of :data:`_env.WRITE_CHUNK_BYTES`."""
    size = chunk or _env.get_int(_env.WRITE_CHUNK_BYTES)
    mv = _byte_view(buf)
    for i in range(0, mv.nbytes, size):
        yield mv[i : i + size]
    if mv.nbytes == 0:
        yield mv


def crc32_of(buf: np.ndarray | memoryview | bytes) -> int:
    return _crc32(_byte_view(buf))
