"""The storage contract: a base class with ``str`` paths, what a write returns, and path checks.

Every path given to a :class:`Storage` is *relative to its root* and checked by
:func:`safe_relpath`: no ``..``, no absolute path, no empty component, and on local disk no symlink
that resolves outside the root. A ``pathlib.Path`` would mangle ``s3://``, so paths are strings.

A backend implements six methods; every other ability has a default here, declared once, so that
callers call it instead of asking whether a backend has it. The backends are opened by URI scheme
through :func:`cf_ray._engine.storage.backends.open_storage`. This module needs no ``pyarrow``, so
code that only passes a storage around can name its type.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cf_ray._engine import env as _env
from cf_ray.errors import ConfigError, UnsafePathError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

try:  # the same CRC-32 as zlib's (the manifests do not change), and several times faster
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


class Storage(ABC):
    """Where checkpoints are written. All paths are relative to the storage's root.

    Call order: the writer (a holder actor, phase 2) calls :meth:`write_file` or
    :meth:`write_buffer` for data files; the controller calls :meth:`write_file` for the manifest
    last, then :meth:`delete_dir` for old checkpoints. Readers (any rank at restore, a user's
    evaluation script) call :meth:`list_dir`, :meth:`exists`, :meth:`read_file` and
    :meth:`read_range`.

    A backend implements the six abstract methods. The rest are optional abilities whose defaults
    are correct for any backend and cost whole-file reads; a backend overrides one where it can do
    better, and says so with :attr:`ranged_reads` where callers choose a reading plan by it.
    """

    ranged_reads: bool = False
    """Whether :meth:`read_range` reads only the bytes asked for. When False (the default reads the
    whole file), a restore at another number of ranks, DCP's reader and the verifiers read each
    file once, whole, instead of block by block."""

    # -- what every backend implements ---------------------------------------------------------
    @abstractmethod
    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> FileInfo:
        """Write ``path`` durably and atomically from ``chunks``; return its size and CRC-32."""

    @abstractmethod
    def read_file(self, path: str) -> np.ndarray:
        """The whole file as a writable ``uint8`` array."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under ``path``; empty if it does not exist."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or directory is at ``path``."""

    @abstractmethod
    def delete_dir(self, path: str) -> None:
        """Delete ``path`` and everything under it; no error if it does not exist."""

    @abstractmethod
    def uri(self, path: str = "") -> str:
        """A human-readable location of ``path`` for logs and errors."""

    # -- optional abilities, with defaults -----------------------------------------------------
    def read_range(self, path: str, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of ``path`` from ``offset`` as a ``uint8`` array, fewer at the end of
        the file, possibly read-only. The default reads the whole file (see :attr:`ranged_reads`)."""
        if nbytes <= 0:
            return np.empty(0, dtype=np.uint8)
        return self.read_file(path)[offset : offset + nbytes]

    def read_chunks(self, path: str, size: int) -> Iterator[memoryview | bytes]:
        """``path`` in chunks of at most ``size`` bytes, in order. The default reads the file whole
        first; a backend with streams reads each chunk as it is consumed."""
        yield from chunked(self.read_file(path), size)

    def write_buffer(self, path: str, buf: memoryview, crc32: int) -> tuple[FileInfo, int]:
        """Write ``path`` durably and atomically from one buffer whose CRC-32 the caller computed.
        Returns the file's info and the bytes copied on the host by the write. The default streams
        ``buf`` through :meth:`write_file`, which checksums it again: the info then carries the
        CRC-32 of the bytes written, which the caller compares with its own."""
        del crc32  # compared by the caller with the CRC-32 of what was written
        mv = buf.cast("B") if buf.format != "B" else buf
        return self.write_file(path, chunked(mv)), mv.nbytes

    def file_size(self, path: str) -> int | None:
        """The size of the file at ``path`` in bytes, ``None`` when nothing is there. The default
        reads the file."""
        return int(self.read_file(path).nbytes) if self.exists(path) else None

    def is_symlink(self, path: str) -> bool:
        """True when ``path`` is a symbolic link (wherever it points). Listings use it to skip such
        an entry instead of failing on it. The default, for backends without links, is False.

        Raises:
            UnsafePathError: ``path`` itself is not a safe relative path.
        """
        safe_relpath(path)
        return False

    def child(self, path: str) -> Storage:
        """A storage rooted at ``path`` under this one. The default prefixes every path."""
        rel = safe_relpath(path)
        return self if not rel else _Under(self, rel)

    def check_writable(self) -> None:
        """Write and delete a probe, so that a storage that cannot be written fails at the start.

        Raises:
            ConfigError: the storage cannot be written, with the reason and the location.
        """
        probe = f".cf_ray_probe_{uuid.uuid4().hex}"
        try:
            self.write_file(f"{probe}/ok", [b"ok"])
            self.delete_dir(probe)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot write here"
            raise not_writable(self, e) from e

    def pyarrow_location(self, path: str = "") -> tuple[pafs.FileSystem, str] | None:
        """The ``pyarrow`` file system and the path on it that hold ``path``, which is what Ray Train
        takes for a checkpoint and what ``cf-ray`` lists runs with; ``None`` (the default) for a
        backend that ``pyarrow`` cannot read, whose checkpoints are then not registered with Ray Train."""
        del path
        return None


def not_writable(storage: Storage, e: BaseException) -> ConfigError:
    """The error of a storage that failed its write probe: the location, the cause, and what to do."""
    return ConfigError(
        f"checkpoint storage {storage.uri()} is not writable ({type(e).__name__}: {e}); "
        "pass a storage_path you can write to (RunConfig(storage_path=...) or "
        "CheckpointConfig(storage_path=...))"
    )


class _Under(Storage):
    """The part of ``parent`` under ``prefix``: every path prefixed, every ability the parent's."""

    def __init__(self, parent: Storage, prefix: str):
        self.parent = parent
        self.prefix = prefix
        self.ranged_reads = parent.ranged_reads

    def _p(self, path: str) -> str:
        rel = safe_relpath(path)
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def __reduce__(self):
        return (_Under, (self.parent, self.prefix))

    def __eq__(self, other) -> bool:
        return isinstance(other, _Under) and (other.parent, other.prefix) == (self.parent, self.prefix)

    def __hash__(self) -> int:
        return hash((self.parent, self.prefix))

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> FileInfo:
        return self.parent.write_file(self._p(path), chunks)

    def read_file(self, path: str) -> np.ndarray:
        return self.parent.read_file(self._p(path))

    def list_dir(self, path: str) -> list[str]:
        return self.parent.list_dir(self._p(path))

    def exists(self, path: str) -> bool:
        return self.parent.exists(self._p(path))

    def delete_dir(self, path: str) -> None:
        if not safe_relpath(path):
            raise UnsafePathError("refusing to delete the checkpoint root")
        self.parent.delete_dir(self._p(path))

    def uri(self, path: str = "") -> str:
        return self.parent.uri(self._p(path))

    def read_range(self, path: str, offset: int, nbytes: int) -> np.ndarray:
        return self.parent.read_range(self._p(path), offset, nbytes)

    def read_chunks(self, path: str, size: int) -> Iterator[memoryview | bytes]:
        return self.parent.read_chunks(self._p(path), size)

    def write_buffer(self, path: str, buf: memoryview, crc32: int) -> tuple[FileInfo, int]:
        return self.parent.write_buffer(self._p(path), buf, crc32)

    def file_size(self, path: str) -> int | None:
        return self.parent.file_size(self._p(path))

    def is_symlink(self, path: str) -> bool:
        return self.parent.is_symlink(self._p(path))

    def child(self, path: str) -> Storage:
        rel = safe_relpath(path)
        return self if not rel else _Under(self.parent, self._p(rel))

    def pyarrow_location(self, path: str = "") -> tuple[pafs.FileSystem, str] | None:
        return self.parent.pyarrow_location(self._p(path))


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


def _byte_view(buf: np.ndarray | memoryview | bytes) -> memoryview:
    """``buf`` as a flat memoryview of bytes, without a copy. ``ndarray.data`` is ``memoryview(ndarray)``;
    it is spelled so because numpy's stubs declare the buffer protocol only for Python >= 3.12."""
    return (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")


def chunked(buf: np.ndarray | memoryview | bytes, chunk: int | None = None) -> Iterable[memoryview]:
    """Yield ``buf`` in chunks of :data:`_env.WRITE_CHUNK_BYTES`."""
    size = chunk or _env.WRITE_CHUNK_BYTES
    mv = _byte_view(buf)
    for i in range(0, mv.nbytes, size):
        yield mv[i : i + size]
    if mv.nbytes == 0:
        yield mv


def crc32_of(buf: np.ndarray | memoryview | bytes) -> int:
    """The CRC-32 (zlib's polynomial) of ``buf``."""
    return _crc32(_byte_view(buf))
