"""Snapshot slots: shared memory a node's holder owns and the processes of its node fill and read.

A snapshot is copied once on the host: the worker copies its tensors straight into a *slot*, an
anonymous shared-memory file (``memfd_create``) that the holder created and keeps open, and that the
processes of its node open through ``/proc/<holder pid>/fd/<fd>`` and map. The memory belongs to the
holder: it outlives a worker that dies, and the kernel frees it when the holder goes (and the last
mapping is gone) — a killed holder leaks nothing, unlike a file left in ``/dev/shm``. The holder
persists from that mapping (``O_DIRECT`` from the mapping itself), the worker computes the CRC-32 of
every block as the copy lands, and a restarted worker of the node restores from it in place.

Layout: a header page, then the data (page-aligned, for ``O_DIRECT``). The header says what the
slot holds — ``(generation, step, seq)``, whether it is complete — and carries the slot file's
*nonce* (random, written by the holder when it made the file).

Identity: ``/proc/<pid>/fd/<n>`` names whatever that process has open under ``n`` *now*;
a holder that died and a new process that reused its pid and fd number would hand out another
file. So whoever opens a slot (:func:`open_checked`) checks, before a byte is written or read, that
the link names the memfd the holder described (``/memfd:cf_ray.<run>.<section>.<n> (deleted)``),
that the file opened is the holder's (inode and device of its own fd), and that the header's nonce
is the one described (:class:`~cf_ray._engine.protocol.messages.SlotDesc`). A mismatch is
:class:`SlotGone`.

Locks: who may touch a slot is settled with ``flock`` on the slot's file (cheap, across processes,
released by the kernel when a process dies): the worker fills a slot under an exclusive lock; a
reader (the holder persisting it or serving it, a restore) holds a shared lock and checks the header
names its fill: a slot filled again since is never read as the older step.

Sealing: a slot the worker fills again and again cannot be sealed (``F_SEAL_FUTURE_WRITE`` is for
good: no new writable mapping, no ``write``, ever again). A slot filled once — a peer's copy, which
the holder receives itself — is sealed once full (:meth:`Slot.seal`): no process, the holder included,
can change it afterwards.

No Ray and no torch here.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import mmap
import os
import secrets
import struct
import sys
import time
from dataclasses import dataclass

from cf_ray._engine.protocol.messages import SlotDesc
from cf_ray.errors import CfRayError

#: Bytes before a slot's data: the header, one page, so that the data is page-aligned (``O_DIRECT``).
HEADER_BYTES = mmap.PAGESIZE
_MAGIC = 0x63665F7261795F32  # "cf_ray_2": a header with a nonce
_HEADER = struct.Struct("<QQqqQQQ")  # magic, state, generation, step, seq, nbytes, nonce

EMPTY, FILLING, READY = 0, 1, 2

#: Linux's limit on a memfd's name (``NAME_MAX`` less the ``memfd:`` prefix).
_NAME_MAX = 249
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


class SlotGone(LookupError):
    """The file a slot descriptor names is not that slot any more (its holder is gone, or the fd
    number now names another file), or its header is not the one the holder wrote."""


@dataclass(frozen=True, slots=True)
class Header:
    state: int
    generation: int
    step: int
    seq: int
    nbytes: int
    nonce: int

    def holds(self, generation: int, step: int, seq: int) -> bool:
        return self.state == READY and (self.generation, self.step, self.seq) == (generation, step, seq)


def available() -> bool:
    """Whether this platform has anonymous shared-memory files that other processes can open (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def require() -> None:
    """Raise a :class:`~cf_ray.errors.CfRayError` that says what to do when :func:`available` is false."""
    if not available():
        raise CfRayError(
            f"cf_ray needs Linux: snapshots live in anonymous shared memory (memfd_create) that the node's "
            f"holder owns and the workers of its node open through /proc, and this platform ({sys.platform}) "
            "has none; run the training workers on Linux (as Ray runs GPU training)"
        )


def memfd_name(run: str, section: str, k: int) -> str:
    """The name of slot ``k`` of ``section`` of run ``run`` (what ``readlink`` of its fd shows)."""
    tail = f".{section}.{k}"
    return f"cf_ray.{run}"[: _NAME_MAX - len(tail)] + tail


def slot_size(nbytes: int) -> int:
    """File size of a slot holding ``nbytes``: header + data rounded up to a page."""
    return HEADER_BYTES + -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def read_header(buf) -> Header:
    magic, state, gen, step, seq, nbytes, nonce = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        return Header(EMPTY, -1, -1, -1, 0, -1)
    return Header(int(state), int(gen), int(step), int(seq), int(nbytes), int(nonce))


def write_header(buf, state: int, generation: int, step: int, seq: int, nbytes: int, nonce: int) -> None:
    _HEADER.pack_into(buf, 0, _MAGIC, state, generation, step, seq, nbytes, nonce)


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


def open_checked(desc: SlotDesc, writable: bool) -> int:
    """Open the slot ``desc`` names, after checking it is that slot (module doc); returns the fd.

    Raises:
        SlotGone: the path is gone or names another file.
    """
    try:
        link = os.readlink(desc.path)
    except OSError as e:
        raise SlotGone(f"slot {desc.name}: {desc.path} is gone ({e.strerror})") from None
    if link != f"/memfd:{desc.name} (deleted)":
        raise SlotGone(f"slot {desc.name}: {desc.path} now names {link!r}")
    try:
        fd = os.open(desc.path, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise SlotGone(f"slot {desc.name}: {desc.path} is gone") from None
    st = os.fstat(fd)
    if (st.st_ino, st.st_dev) != (desc.ino, desc.dev):
        os.close(fd)
        raise SlotGone(f"slot {desc.name}: {desc.path} is another file of the same name")
    return fd


class Slot:
    """The holder's side of one slot file: created and kept open here (the memory is freed once it is
    closed and no other process maps it any more).

    Args:
        name: the memfd's name (:func:`memfd_name`).
        nbytes: bytes of data it holds.
        sealable: the slot is filled once, by this process (:meth:`fill`, :meth:`seal`).
    """

    def __init__(self, name: str, nbytes: int, *, sealable: bool = False):
        flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0)
        self.fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(self.fd, slot_size(nbytes))  # sparse: pages are taken when first written
            nonce = int.from_bytes(secrets.token_bytes(8), "little")
            head = bytearray(_HEADER.size)
            write_header(head, EMPTY, -1, -1, 0, nbytes, nonce)
            os.pwrite(self.fd, head, 0)
            st = os.fstat(self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        self.desc = SlotDesc(
            path=f"/proc/{os.getpid()}/fd/{self.fd}",
            name=name,
            ino=st.st_ino,
            dev=st.st_dev,
            nonce=nonce,
            nbytes=nbytes,
        )
        self._map: mmap.mmap | None = None
        self._reader: mmap.mmap | None = None

    @property
    def nbytes(self) -> int:
        return self.desc.nbytes

    def reader(self) -> mmap.mmap:
        """The slot mapped read-only, once, for every read this process makes of it (:class:`ReadLock`
        borrows it): a slot persisted at every checkpoint is not mapped and unmapped each time, which
        would cost more CPU than the write itself (page tables of the whole slot built and torn down)."""
        if self._reader is None:
            self._reader = mmap.mmap(self.fd, slot_size(self.nbytes), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return self._reader

    def fill(self) -> memoryview:
        """The data, mapped writable, for this process to fill (a sealable slot, once)."""
        self._map = mmap.mmap(self.fd, slot_size(self.nbytes))
        write_header(self._map, FILLING, -1, -1, 0, self.nbytes, self.desc.nonce)
        return memoryview(self._map)[HEADER_BYTES : HEADER_BYTES + self.nbytes]

    def seal(self, generation: int, step: int, seq: int = 1) -> SlotDesc:
        """The fill is complete (every view of :meth:`fill` released): header ``READY``, unmapped, and
        sealed — nothing can write to it any more, nor resize it. Returns its filled descriptor."""
        assert self._map is not None
        write_header(self._map, READY, generation, step, seq, self.nbytes, self.desc.nonce)
        self._map.close()
        self._map = None
        seals = fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        return dataclasses.replace(self.desc, seq=seq)

    def resident_bytes(self) -> int:
        """Bytes of memory the slot takes now (pages written so far)."""
        try:
            return os.fstat(self.fd).st_blocks * 512
        except OSError:
            return 0

    def close(self) -> None:
        for m in (self._map, self._reader):
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass  # a view is still alive (a ReadLock's): unmapped when it goes
        self._map = self._reader = None
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


class ReadLock:
    """A shared lock on a slot (its own open file description, so it is independent of any other
    lock this process holds on the file) and, once taken, the slot's data mapped read-only.

    Use: ``lk = ReadLock.take(desc, gen, step)``; ``None`` when the slot is being filled or holds
    another fill (``populate=True``: every page mapped at once, for a whole read; ``mapping``: the
    holder's own kept mapping of the slot, :meth:`Slot.reader`, borrowed instead of a new one).
    ``lk.data`` is a read-only memoryview of the data; ``lk.close()``.
    """

    __slots__ = ("fd", "map", "data")

    def __init__(self, fd: int, m: mmap.mmap | None, whole: memoryview, nbytes: int):
        self.fd = fd
        self.map = m
        """Its own mapping (``None``: the holder's kept one, borrowed; ``data`` keeps it mapped)."""
        self.data = whole[HEADER_BYTES : HEADER_BYTES + nbytes]
        whole.release()

    @classmethod
    def take(
        cls,
        desc: SlotDesc,
        generation: int,
        step: int,
        *,
        wait_s: float = 0.0,
        populate: bool = False,
        mapping: mmap.mmap | None = None,
    ) -> ReadLock | None:
        """Raises :class:`SlotGone` when ``desc`` names no such slot any more."""
        fd = open_checked(desc, writable=False)
        m: mmap.mmap | None = None
        whole: memoryview | None = None
        taken = False
        try:
            deadline = time.monotonic() + wait_s
            while not try_lock(fd, exclusive=False):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.002)
            size = os.fstat(fd).st_size
            whole = _borrow(mapping, size)
            if whole is None:
                # ``populate``: the pages are mapped in one call, for a reader that reads all of them
                # (a restore): a fault per page of shared memory costs several times the copy.
                flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
                m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
                whole = memoryview(m)
            h = read_header(whole)
            if h.nonce != desc.nonce:
                raise SlotGone(f"slot {desc.name}: its header is not the one its holder wrote")
            if not h.holds(generation, step, desc.seq) or HEADER_BYTES + h.nbytes > size:
                return None
            lk = cls(fd, m, whole, h.nbytes)
            taken = True
            return lk
        finally:
            if not taken:  # busy, another fill, gone or an error: nothing of it stays open
                if whole is not None:
                    whole.release()
                if m is not None:
                    m.close()
                try:
                    os.close(fd)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.data.release()
            if self.map is not None:
                self.map.close()
        except BufferError:
            pass  # a view of it is still alive somewhere: the mapping goes with it
        try:
            os.close(self.fd)  # releases the lock
        except OSError:
            pass


def _borrow(mapping: mmap.mmap | None, size: int) -> memoryview | None:
    """A view of the holder's kept mapping of a slot (:meth:`Slot.reader`): while a view lives the
    mapping cannot be unmapped, so a slot freed meanwhile stays readable until the lock closes.
    ``None``: no mapping, one closed already (its slot was freed), or one of another size."""
    if mapping is None:
        return None
    try:
        view = memoryview(mapping)
    except ValueError:  # closed
        return None
    if view.nbytes != size:
        view.release()
        return None
    return view


class WriterSlot:
    """The worker's side of one slot file: mapped read-write, filled under an exclusive lock.

    Raises:
        SlotGone: ``desc`` names no such slot (checked before anything is mapped).
        ValueError: the slot is too small for ``nbytes``.
    """

    def __init__(self, desc: SlotDesc, nbytes: int):
        self.desc = desc
        self.nbytes = nbytes
        self.fd = open_checked(desc, writable=True)
        try:
            size = os.fstat(self.fd).st_size
            if size < slot_size(nbytes):
                raise ValueError(f"slot {desc.name} holds {size} bytes, {slot_size(nbytes)} needed")
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        h = read_header(self.map)
        if h.nonce != desc.nonce:
            self.map.close()
            os.close(self.fd)
            raise SlotGone(f"slot {desc.name}: its header is not the one its holder wrote")
        self.locked = False
        self.seq = h.seq

    def data(self) -> memoryview:
        return memoryview(self.map)[HEADER_BYTES : HEADER_BYTES + self.nbytes]

    def header(self) -> Header:
        return read_header(self.map)

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
        write_header(self.map, FILLING, -1, -1, self.seq, self.nbytes, self.desc.nonce)
        return True

    def seal(self, generation: int, step: int) -> SlotDesc:
        """The fill is complete: header READY with what it holds, lock released; its descriptor."""
        write_header(self.map, READY, generation, step, self.seq, self.nbytes, self.desc.nonce)
        self.release()
        return dataclasses.replace(self.desc, seq=self.seq, nbytes=self.nbytes)

    def empty(self) -> None:
        """Give up the fill in progress (the snapshot failed): the slot reads as empty."""
        if self.locked:
            write_header(self.map, EMPTY, -1, -1, self.seq, self.nbytes, self.desc.nonce)
            self.release()

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


__all__ = [
    "EMPTY",
    "FILLING",
    "HEADER_BYTES",
    "READY",
    "Header",
    "ReadLock",
    "Slot",
    "SlotGone",
    "WriterSlot",
    "available",
    "memfd_name",
    "open_checked",
    "private_buffer",
    "read_header",
    "release",
    "require",
    "slot_size",
    "try_lock",
    "unlock",
    "write_header",
]
