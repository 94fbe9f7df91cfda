"""Snapshot slots: shared memory that a node's holder owns and the workers of its node fill (#14).

A snapshot is copied once on the host: the worker copies its tensors straight into a *slot*, an
anonymous shared-memory file (``memfd_create``) that the holder created and keeps open, and that the
workers of its node open through ``/proc/<holder pid>/fd/<fd>`` and map. The memory belongs to the
holder: it outlives a worker that dies, and it is freed by the kernel when the holder goes (and the
last worker unmaps it) — a killed holder leaks nothing, unlike a file left in ``/dev/shm``. The holder persists from that
mapping (``O_DIRECT`` from the mapping itself: no bounce copy, no re-``put`` into the object store),
the worker computes the CRC-32 of every block as the copy lands (:func:`block_crcs_into`), and the
slot outlives the worker (the holder's file), so a restarted worker of the node restores from it in
place (it maps the file read-only: no copy out of it).

Two slots per section (:class:`SlotPair`): one being filled while the other is held and persisted.
Who may touch a slot is settled with ``flock`` on the slot's file (cheap, across processes, released
by the kernel when a process dies): the worker fills a slot under an exclusive lock; the holder reads
one (to persist, copy to a peer, or serve a restore on another node) under a shared lock, and keeps
a shared lock on a milestone or preemption checkpoint from its hand-off until it is written, so that
such a slot is never filled again first. A slot's header (its first page) says what it holds —
``(generation, step, seq)`` and whether it is complete — and every reader checks it under its lock:
a slot filled again since (a newer snapshot coalesced over one whose write had not started) is never
read as the older step.

No Ray and no torch here: the holder imports this module (it never imports torch), and so do the
worker's snapshotter and the restore.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import time
from dataclasses import dataclass

#: Bytes before a slot's data: the header, one page, so that the data is page-aligned (``O_DIRECT``).
HEADER_BYTES = mmap.PAGESIZE
_MAGIC = 0x63665F7261795F31  # "cf_ray_1"
_HEADER = struct.Struct("<QQqqQQ")  # magic, state, generation, step, seq, nbytes

EMPTY, FILLING, READY = 0, 1, 2


@dataclass(frozen=True, slots=True)
class SlotDesc:
    """A filled slot as the worker hands it to the holder (and the holder to a restore)."""

    path: str
    seq: int
    """The fill's number (a slot's header names the fill it holds)."""
    nbytes: int
    """Bytes of snapshot data in the slot (after the header)."""


@dataclass(frozen=True, slots=True)
class Header:
    state: int
    generation: int
    step: int
    seq: int
    nbytes: int

    def holds(self, generation: int, step: int, seq: int) -> bool:
        return self.state == READY and (self.generation, self.step, self.seq) == (generation, step, seq)


def private_buffer(nbytes: int):
    """``nbytes`` of this process's own memory (a uint8 numpy array), writable, its pages made
    present in one call (``MAP_POPULATE``): a restore that fills fresh memory page fault by page
    fault spends several times the copy itself on the faults."""
    import numpy as np

    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)


def release(buf, start: int, end: int) -> int:
    """Give the whole pages of ``buf[start:end]`` back to the system (``MADV_DONTNEED``: they read
    as zeros afterwards), when ``buf`` is a :func:`private_buffer`; returns the bytes released.
    For bytes nothing reads any more while other parts of the buffer stay in use."""
    m = getattr(buf, "base", None)
    m = m.obj if isinstance(m, memoryview) else m  # np.frombuffer's base is a view of the mmap
    if not isinstance(m, mmap.mmap):
        return 0
    a = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    b = end // mmap.PAGESIZE * mmap.PAGESIZE
    if b <= a:
        return 0
    m.madvise(mmap.MADV_DONTNEED, a, b - a)
    return b - a


def available() -> bool:
    """Whether this platform has anonymous shared-memory files (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def slot_size(nbytes: int) -> int:
    """File size of a slot holding ``nbytes``: header + data rounded up to a page."""
    return HEADER_BYTES + -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def read_header(buf) -> Header:
    magic, state, gen, step, seq, nbytes = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        return Header(EMPTY, -1, -1, -1, 0)
    return Header(int(state), int(gen), int(step), int(seq), int(nbytes))


def write_header(buf, state: int, generation: int, step: int, seq: int, nbytes: int) -> None:
    _HEADER.pack_into(buf, 0, _MAGIC, state, generation, step, seq, nbytes)


def try_lock(fd: int, exclusive: bool) -> bool:
    """``flock`` without waiting; False when another process holds a conflicting lock."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


class ReadLock:
    """A shared lock on a slot (its own open file description, so it is independent of any other
    lock this process holds on the file) and, once taken, the slot's data mapped read-only.

    Use: ``lk = ReadLock.take(desc.path, gen, step, desc.seq)``; ``None`` when the slot is being
    filled or holds another fill (``populate=True``: every page mapped at once, for a whole read).
    ``lk.data`` is a read-only memoryview of the data; ``lk.close()``.
    """

    __slots__ = ("fd", "map", "data")

    def __init__(self, fd: int, m: mmap.mmap, nbytes: int):
        self.fd = fd
        self.map = m
        self.data = memoryview(m)[HEADER_BYTES : HEADER_BYTES + nbytes]

    @classmethod
    def take(
        cls, path: str, generation: int, step: int, seq: int, *, wait_s: float = 0.0, populate: bool = False
    ) -> ReadLock | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            deadline = time.monotonic() + wait_s
            while not try_lock(fd, exclusive=False):
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.002)
            size = os.fstat(fd).st_size
            # ``populate``: the pages are mapped in one call, for a reader that reads all of them
            # (a restore): a fault per page of shared memory costs several times the copy.
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
            h = read_header(m)
            if not h.holds(generation, step, seq) or HEADER_BYTES + h.nbytes > size:
                m.close()
                os.close(fd)
                return None
            return cls(fd, m, h.nbytes)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        try:
            self.data.release()
            self.map.close()
        except BufferError:
            pass  # a view of it is still alive somewhere: the mapping goes with it
        try:
            os.close(self.fd)  # releases the lock
        except OSError:
            pass


class SlotPair:
    """The holder's side: the two slot files of one section, created and kept open here; closed by
    :meth:`close` (the memory is freed once no worker maps it any more)."""

    def __init__(self, section: str, nbytes: int):
        self.section = section
        self.nbytes = nbytes
        size = slot_size(nbytes)
        self.fds: list[int] = []
        for slot in (0, 1):
            fd = os.memfd_create(f"cf_ray-{section}-{slot}", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)  # sparse: pages are taken when the worker first writes them
            self.fds.append(fd)
        pid = os.getpid()
        self.paths = [f"/proc/{pid}/fd/{fd}" for fd in self.fds]

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    def resident_bytes(self) -> int:
        """Bytes of memory the two slots take now (pages written so far)."""
        total = 0
        for fd in self.fds:
            try:
                total += os.fstat(fd).st_blocks * 512
            except OSError:
                pass
        return total


class WriterSlot:
    """The worker's side of one slot file: mapped read-write, filled under an exclusive lock."""

    def __init__(self, path: str, nbytes: int):
        self.path = path
        self.nbytes = nbytes
        self.fd = os.open(path, os.O_RDWR)
        size = os.fstat(self.fd).st_size
        if size < slot_size(nbytes):
            os.close(self.fd)
            raise ValueError(f"slot {path} holds {size} bytes, {slot_size(nbytes)} needed")
        self.map = mmap.mmap(self.fd, size)
        self.locked = False
        self.seq = read_header(self.map).seq if read_header(self.map).state != EMPTY else 0

    def data(self) -> memoryview:
        return memoryview(self.map)[HEADER_BYTES : HEADER_BYTES + self.nbytes]

    def address(self) -> int:
        """The mapping's address (for ``cudaHostRegister``)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def try_fill(self) -> bool:
        """Take the slot for a new fill: exclusive lock, header FILLING. False when a reader holds it."""
        if not self.locked:
            if not try_lock(self.fd, exclusive=True):
                return False
            self.locked = True
        self.seq += 1
        write_header(self.map, FILLING, -1, -1, self.seq, self.nbytes)
        return True

    def seal(self, generation: int, step: int) -> SlotDesc:
        """The fill is complete: header READY with what it holds, lock released."""
        write_header(self.map, READY, generation, step, self.seq, self.nbytes)
        self.release()
        return SlotDesc(self.path, self.seq, self.nbytes)

    def release(self) -> None:
        if self.locked:
            unlock(self.fd)
            self.locked = False

    def close(self) -> None:
        self.release()
        try:
            self.map.close()
        except BufferError:
            pass  # a tensor still views it; unmapped when that goes
        os.close(self.fd)


# -- CRC-32 ------------------------------------------------------------------------------------------
_POLY = 0xEDB88320


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_SHIFT_CACHE: dict[int, list[int]] = {}


def _shift_operator(nbytes: int) -> list[int]:
    """The GF(2) operator that appends ``nbytes`` zero bytes to a CRC-32 (zlib's crc32_combine)."""
    op = _SHIFT_CACHE.get(nbytes)
    if op is not None:
        return op
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    result = [1 << n for n in range(32)]  # identity
    n = nbytes
    while n:
        even = _gf2_square(odd)
        if n & 1:
            result = [_gf2_times(even, result[k]) for k in range(32)]
        n >>= 1
        if not n:
            break
        odd = _gf2_square(even)
        if n & 1:
            result = [_gf2_times(odd, result[k]) for k in range(32)]
        n >>= 1
    if len(_SHIFT_CACHE) < 64:
        _SHIFT_CACHE[nbytes] = result
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's algorithm)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_shift_operator(len2), crc1) ^ crc2


def combine_blocks(crcs: list[int], block: int, total: int) -> int:
    """The CRC-32 of a whole buffer of ``total`` bytes from the CRC-32 of each ``block`` bytes of it."""
    crc = 0
    for k, c in enumerate(crcs):
        crc = crc32_combine(crc, c, min(block, total - k * block))
    return crc


__all__ = [
    "EMPTY",
    "FILLING",
    "HEADER_BYTES",
    "READY",
    "Header",
    "ReadLock",
    "SlotDesc",
    "SlotPair",
    "WriterSlot",
    "combine_blocks",
    "crc32_combine",
    "available",
    "read_header",
    "slot_size",
]
