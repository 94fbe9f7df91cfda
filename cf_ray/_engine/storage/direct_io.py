"""How bytes reach a local file: ``O_DIRECT`` writes through a page-aligned bounce buffer, and the
CRC-32 computed on a second thread while the bytes are written.

Files of at least one chunk (``env.WRITE_CHUNK_BYTES``, 16 MiB) are written with ``O_DIRECT``
through a page-aligned bounce buffer where the file system allows it: the kernel then DMAs from
that buffer instead of copying every byte into the page cache, so a checkpoint's write costs little
CPU, which it would otherwise take from training when every core trains. The tail, and every file on a file system that refuses ``O_DIRECT`` (tmpfs), is
written through the page cache. ``CF_RAY_DIRECT_IO=0`` turns it off.

:func:`write_with_crc` is used for every write of :class:`~cf_ray._engine.storage.fs.FsStorage`,
local or not; the rest only for local disk.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Iterable

from cf_ray._engine import env as _env
from cf_ray._engine.storage.base import FileInfo, _crc32


def write_all(fd: int, mv: memoryview) -> None:
    while mv.nbytes:
        n = os.write(fd, mv)
        mv = mv[n:]


_O_DIRECT = getattr(os, "O_DIRECT", 0)
_direct_refused: set[int] = set()  # devices whose file system refused O_DIRECT
_bounce = threading.local()


def direct_io_wanted(fd: int) -> bool:
    return bool(_O_DIRECT) and _env.get_int(_env.DIRECT_IO) != 0 and os.fstat(fd).st_dev not in _direct_refused


class DirectWriter:
    """Writes a stream to ``fd``: whole chunks with ``O_DIRECT`` from a page-aligned bounce buffer,
    the rest (small files, the tail) through the page cache.

    The bounce buffer (one per thread, ``env.WRITE_CHUNK_BYTES``) is filled from the stream and
    written when full; O_DIRECT needs an aligned address, length and file offset, which a full
    buffer at a multiple of its size always has. ``O_DIRECT`` is switched on with ``fcntl`` at the
    first full buffer and off again before the tail, so a file smaller than one chunk never uses it.
    """

    def __init__(self, fd: int):
        import mmap

        self.fd = fd
        size = _env.WRITE_CHUNK_BYTES
        size = max(size - size % mmap.PAGESIZE, mmap.PAGESIZE)
        buf = getattr(_bounce, "buf", None)
        if buf is None or len(buf) != size:
            buf = _bounce.buf = mmap.mmap(-1, size)  # page-aligned, reused by this thread
        self.buf = memoryview(buf)
        self.fill = 0
        self.direct = False
        self.refused = False

    def write(self, mv: memoryview) -> None:
        if self.refused and not self.fill:
            write_all(self.fd, mv)
            return
        cap = self.buf.nbytes
        while mv.nbytes:
            take = min(cap - self.fill, mv.nbytes)
            self.buf[self.fill : self.fill + take] = mv[:take]
            self.fill += take
            mv = mv[take:]
            if self.fill == cap:
                self._flush_full()

    def _flush_full(self) -> None:
        if not self.direct and not self.refused:
            try:
                self._set_direct(True)
            except OSError:
                self._refuse()
        off, n = 0, self.buf.nbytes
        while off < n:
            try:
                off += os.write(self.fd, self.buf[off:])
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                # This file system takes no O_DIRECT writes (or not of this alignment): go on
                # through the page cache from where the refused write started.
                self._set_direct(False)
                self._refuse()
        self.fill = 0

    def _refuse(self) -> None:
        self.refused = True
        _direct_refused.add(os.fstat(self.fd).st_dev)

    def _set_direct(self, on: bool) -> None:
        import fcntl

        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
        self.direct = on

    def close(self) -> None:
        if self.direct:
            self._set_direct(False)
        if self.fill:
            write_all(self.fd, self.buf[: self.fill])
            self.fill = 0


def write_aligned(fd: int, mv: memoryview) -> int:
    """Write ``mv`` to ``fd`` (at its current offset, 0), with ``O_DIRECT`` straight from ``mv``
    itself when it starts on a page boundary (a snapshot slot's data does): the kernel DMAs from the
    caller's memory, with no bounce copy and no page cache. The tail past the last whole page, and
    everything on a file system that refuses ``O_DIRECT``, goes through the page cache. Returns the
    bytes written through the page cache (copied by the kernel; the benchmark counts them)."""
    import mmap

    page = mmap.PAGESIZE
    n = mv.nbytes
    aligned = n - n % page
    addr = _address(mv)
    if not aligned or addr % page or not direct_io_wanted(fd):
        write_all(fd, mv)
        return n
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    chunk = max(_env.WRITE_CHUNK_BYTES // page, 1) * page
    off = 0
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
        while off < aligned:
            off += os.write(fd, mv[off : min(off + chunk, aligned)])
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _direct_refused.add(os.fstat(fd).st_dev)  # this file system takes no O_DIRECT writes
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    write_all(fd, mv[off:])
    return n - off


def _address(mv: memoryview) -> int:
    """The address of a buffer (read-only ones too: a read-only mapping), through numpy."""
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0])


#: A write given as a list or tuple of at most this many bytes in all (a manifest, an index, a
#: pointer: every checkpoint writes several) is checksummed on the calling thread: starting and
#: joining a checksum thread costs more than the CRC-32 of a few kilobytes.
INLINE_CRC_BYTES = 1 << 20


def write_with_crc(chunks: Iterable[memoryview | bytes], write) -> FileInfo:
    """Write ``chunks`` in order while a second thread computes their CRC-32 (for a small write
    given as a list or tuple, :data:`INLINE_CRC_BYTES`, on the calling thread).

    Both ``os.write``/pyarrow writes and the CRC-32 release the GIL on large buffers, so the
    checksum overlaps with the writes instead of adding to them (ISA-L's CRC-32 is far faster than
    a disk; zlib's, the fallback, is of the same order as one, so overlapping it matters).

    If the checksum thread fails, the write fails with its error (never a file with a made-up
    CRC-32), and never hangs: the thread keeps taking chunks after an error, and the writer stops
    handing them over if the thread is gone.
    """
    if isinstance(chunks, (list, tuple)):
        views = [memoryview(c).cast("B") for c in chunks]
        if sum(v.nbytes for v in views) <= INLINE_CRC_BYTES:
            crc, size = 0, 0
            for mv in views:
                crc, size = _crc32(mv, crc), size + mv.nbytes
                write(mv)
            return FileInfo(size, crc)
    pending: queue.Queue = queue.Queue(maxsize=4)
    result: dict = {"crc": 0, "size": 0, "error": None}

    def checksum() -> None:
        crc, size = 0, 0
        while (mv := pending.get()) is not None:
            if result["error"] is not None:
                continue  # drained, so that the writer never waits on a full queue
            try:
                crc = _crc32(mv, crc)
                size += mv.nbytes
            except BaseException as e:  # noqa: BLE001 - raised by the writer, below
                result["error"] = e
        result["crc"], result["size"] = crc, size

    def hand_over(item) -> None:
        while True:
            try:
                pending.put(item, timeout=0.5)
                return
            except queue.Full:
                if not t.is_alive():
                    raise RuntimeError("the CRC-32 thread of a write is gone") from result["error"]

    t = threading.Thread(target=checksum, name="cf_ray-crc32", daemon=True)
    t.start()
    try:
        for chunk in chunks:
            mv = memoryview(chunk).cast("B")
            hand_over(mv)
            write(mv)
            if result["error"] is not None:
                break
    finally:
        if t.is_alive():
            hand_over(None)
        t.join()
    if result["error"] is not None:
        raise OSError(f"the CRC-32 of a write failed: {result['error']!r}") from result["error"]
    return FileInfo(result["size"], result["crc"])
