""":class:`FsStorage`: a :class:`~cf_ray._engine.storage.base.Storage` over any ``pyarrow.fs`` file
system (local disk, S3, GCS, HDFS, Azure), with every optional ability of the base class.

Durability:
* local disk: data goes to a temporary name in the same directory, is fsynced, renamed into place,
  and the directory is fsynced (so is the parent of every directory made on the way). A reader never
  sees a half-written file under its final name.
  Files of at least one chunk (``env.WRITE_CHUNK_BYTES``, 16 MiB) are written with ``O_DIRECT``
  through a page-aligned bounce buffer where the file system allows it (see
  :mod:`cf_ray._engine.storage.direct_io`); ``CF_RAY_DIRECT_IO=0`` turns it off.
* object stores (S3, GCS): an object becomes visible only when its upload completes, so a plain
  write is atomic per object; rename would be a copy, so it is never used there.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from cf_ray._engine.storage.base import FileInfo, Storage, chunked, not_writable, safe_relpath
from cf_ray._engine.storage.direct_io import (
    DirectWriter,
    direct_io_wanted,
    write_aligned,
    write_all,
    write_with_crc,
)
from cf_ray.errors import ConfigError, UnsafePathError

T = TypeVar("T")


class FsStorage(Storage):
    """:class:`Storage` over any ``pyarrow.fs.FileSystem``, holding an ``(fs, root)`` pair.

    Args:
        fs: the filesystem (``LocalFileSystem``, ``S3FileSystem``, ``GcsFileSystem``, ...).
        root: the root path on ``fs`` (no URI scheme). Created if missing.
    """

    def __init__(self, fs: pafs.FileSystem, root: str):
        if not isinstance(fs, pafs.FileSystem):
            raise ConfigError(f"storage filesystem must be a pyarrow.fs.FileSystem, got {type(fs).__name__}")
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self._local = isinstance(fs, pafs.LocalFileSystem)
        if self._local:
            self.root = os.path.abspath(self.root)

    ranged_reads = True

    @classmethod
    def from_uri(cls, uri: str, filesystem: pafs.FileSystem | None = None) -> FsStorage:
        """Build from ``/local/path``, ``file://``, ``s3://bucket/prefix``, ``gs://...``; with a
        ``filesystem``, ``uri`` is the root's path on it. The opener
        :func:`~cf_ray._engine.storage.backends.open_storage` calls for these schemes."""
        if filesystem is not None:
            return cls(filesystem, uri)
        if "://" not in uri:
            return cls(pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri)))
        fs, path = pafs.FileSystem.from_uri(uri)
        return cls(fs, path)

    def __reduce__(self):
        return (FsStorage, (self.fs, self.root))

    def __repr__(self) -> str:
        return f"FsStorage({self.uri()})"

    def __eq__(self, other) -> bool:
        return isinstance(other, FsStorage) and other.root == self.root and other.fs.equals(self.fs)

    def __hash__(self) -> int:
        return hash((self.root, self.fs.type_name))

    # -- paths -----------------------------------------------------------------------------
    def _abs(self, path: str) -> str:
        rel = safe_relpath(path)
        full = posixpath.join(self.root, rel) if rel else self.root
        if self._local and rel:
            real = os.path.realpath(full)
            root_real = os.path.realpath(self.root)
            if real != root_real and not real.startswith(root_real + os.sep):
                raise UnsafePathError(f"path {path!r} resolves to {real}, outside the checkpoint root {root_real}")
        return full

    def is_symlink(self, path: str) -> bool:
        """True when ``path`` is a symbolic link on local disk (wherever it points); object stores
        have no links. Does not follow or resolve the link, so it never raises for one that leaves
        the root: listings use it to skip such an entry instead of failing on it."""
        rel = safe_relpath(path)
        return bool(rel) and self._local and os.path.islink(posixpath.join(self.root, rel))

    def uri(self, path: str = "") -> str:
        full = self._abs(path) if path else self.root
        scheme = {"local": "file", "s3": "s3", "gcs": "gs"}.get(self.fs.type_name, self.fs.type_name)
        return f"{scheme}://{full}" if scheme != "file" else full

    def fs_path(self, path: str = "") -> str:
        """The path on :attr:`fs` (what ``ray.train.Checkpoint(path, filesystem)`` takes)."""
        return self._abs(path) if path else self.root

    def child(self, path: str) -> FsStorage:
        """A storage rooted at ``path`` under this one."""
        return FsStorage(self.fs, self._abs(path))

    def check_writable(self) -> None:
        """Create the root and write/delete a probe file.

        Raises:
            ConfigError: the root cannot be created or written, with the reason and the location.
        """
        probe = f".cf_ray_probe_{uuid.uuid4().hex}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            self.write_file(probe, [b"ok"])
            self.fs.delete_file(self._abs(probe))
        except Exception as e:  # noqa: BLE001 - any failure means "cannot write here"
            raise not_writable(self, e) from e

    def pyarrow_location(self, path: str = "") -> tuple[pafs.FileSystem, str]:
        return self.fs, self.fs_path(path)

    def file_size(self, path: str) -> int | None:
        got = self.fs.get_file_info(self._abs(path))
        return None if got.type == pafs.FileType.NotFound else got.size

    def read_chunks(self, path: str, size: int) -> Iterator[memoryview | bytes]:
        """``path`` in chunks of at most ``size`` bytes, read from a ``pyarrow`` stream as they are
        consumed, never whole in memory.

        Raises:
            UnsafePathError: ``path`` is a symbolic link.
        """
        full = self._abs(path)
        if self._local and os.path.islink(full):
            raise UnsafePathError(f"refusing to read {full}: it is a symbolic link")
        with self.fs.open_input_stream(full) as f:
            while True:
                buf = f.read_buffer(size)
                if buf is None or buf.size == 0:
                    return
                yield memoryview(buf)

    # -- the six every backend implements ------------------------------------------------------
    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> FileInfo:
        full = self._abs(path)
        parent = posixpath.dirname(full)
        if self._local:

            def stream(fd: int) -> FileInfo:
                if direct_io_wanted(fd):
                    writer = DirectWriter(fd)
                    info = write_with_crc(chunks, writer.write)
                    writer.close()
                    return info
                return write_with_crc(chunks, lambda mv: write_all(fd, mv))

            return _replace_local(full, stream)
        self.fs.create_dir(parent, recursive=True)
        with self.fs.open_output_stream(full) as out:
            return write_with_crc(chunks, lambda mv: out.write(pa.py_buffer(mv)))

    def write_buffer(self, path: str, buf: memoryview, crc32: int) -> tuple[FileInfo, int]:
        """Write ``path`` durably and atomically from one buffer whose CRC-32 the caller computed
        (a snapshot slot: its blocks were checksummed as the worker copied them), so the bytes are
        not read again here. On local disk ``O_DIRECT`` from ``buf`` itself when it is page-aligned
        (``direct_io.write_aligned``). Returns the file's info and the bytes copied on the host by
        the write (through the page cache, or into the object store's stream buffers)."""
        full = self._abs(path)
        parent = posixpath.dirname(full)
        mv = buf.cast("B") if buf.format != "B" else buf
        if self._local:
            return FileInfo(mv.nbytes, crc32), _replace_local(full, lambda fd: write_aligned(fd, mv))
        self.fs.create_dir(parent, recursive=True)
        with self.fs.open_output_stream(full) as out:
            for chunk in chunked(mv):
                out.write(pa.py_buffer(chunk))
        return FileInfo(mv.nbytes, crc32), mv.nbytes

    def read_file(self, path: str) -> np.ndarray:
        full = self._abs(path)
        if self._local:
            if os.path.islink(full):
                raise UnsafePathError(f"refusing to read {full}: it is a symbolic link")
            size = os.path.getsize(full)
            buf = np.empty(size, dtype=np.uint8)
            with open(full, "rb", buffering=0) as f:
                view, got = buf.data, 0  # memoryview(buf), spelled so for numpy's stubs
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
            return buf[:got]
        with self.fs.open_input_file(full) as f:
            size = f.size()
            data = f.read_buffer(size)
        return np.frombuffer(data, dtype=np.uint8).copy()

    def read_range(self, path: str, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes of ``path`` from ``offset`` (fewer at the end of the file); read-only
        when they come from an object store (no copy of what pyarrow returns)."""
        full = self._abs(path)
        if nbytes <= 0:
            return np.empty(0, dtype=np.uint8)
        if self._local:
            if os.path.islink(full):
                raise UnsafePathError(f"refusing to read {full}: it is a symbolic link")
            buf = np.empty(nbytes, dtype=np.uint8)
            fd = os.open(full, os.O_RDONLY)
            try:
                view, got = buf.data, 0
                while got < nbytes:
                    n = os.preadv(fd, [view[got:]], offset + got)
                    if not n:
                        break
                    got += n
            finally:
                os.close(fd)
            return buf[:got]
        with self.fs.open_input_file(full) as f:
            data = f.read_at(nbytes, offset)
        return np.frombuffer(data, dtype=np.uint8)

    def list_dir(self, path: str) -> list[str]:
        full = self._abs(path)
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(full, allow_not_found=True))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(self._abs(path)).type != pafs.FileType.NotFound

    def delete_dir(self, path: str) -> None:
        full = self._abs(path)
        if not path:
            raise UnsafePathError("refusing to delete the checkpoint root")
        try:
            self.fs.delete_dir(full)
        except FileNotFoundError:
            pass


def _replace_local(full: str, write: Callable[[int], T]) -> T:
    """Write local file ``full`` atomically: ``write(fd)`` into a temporary file beside it, fsync,
    rename into place, fsync the directory. Returns what ``write`` returned; on an error the
    temporary file is removed and ``full`` is untouched."""
    parent = posixpath.dirname(full)
    _makedirs_durable(parent)
    tmp = posixpath.join(parent, f".tmp.{posixpath.basename(full)}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        out = write(fd)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _silently(os.unlink, tmp)
        raise
    os.close(fd)
    os.replace(tmp, full)
    _fsync_dir(parent)
    return out


def _makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, and each directory it creates is made durable: the
    entry of a new directory lives in its parent, so the parent is fsynced after the creation (a
    crash must not lose the directory of a file whose rename was fsynced)."""
    missing = []
    d = path
    while d and not os.path.isdir(d):
        missing.append(d)
        parent = posixpath.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            pass  # made meanwhile by another writer: made durable here too
        _fsync_dir(posixpath.dirname(d))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _silently(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass
