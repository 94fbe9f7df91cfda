"""Phase 1's copy engine: the bytes of a snapshot into its slots, with the CRC-32 of every block.

At :meth:`CopyEngine.copy_unguarded` (the training thread, right after the optimizer step) what
may change before the next optimizer step is copied at once; the guarded tensors (they change only
in the optimizer step) are copied by the snapshotter's thread in :meth:`CopyEngine.copy`. On CUDA
the copies are ``non_blocking`` on one side stream per device, which first waits for an event
recorded on the compute stream after the optimizer step, so they overlap with compute; on CPU they
are plain ``copy_`` calls, which release the GIL.

Checksums: a slot filled from host memory is copied window by window and each window's blocks are
checksummed right after its copy, while the bytes are still in the CPU's cache
(:func:`_copy_checksummed`: no second pass over memory); a slot that device tensors were copied
into by DMA is read once after the guard (:meth:`CopyEngine.checksum_dma`, on several threads: the
CPU's cores are idle while a GPU trains, and one thread's CRC-32 over a few GB of state can take
longer than a training step; :func:`crc_threads`); the blocks a late
capture wrote are checksummed again (:meth:`CopyEngine.checksum_late`). Where blocks begin and end,
and how an index carries their checksums, is the format's (``format/blocks.py``,
``format/sections.py``): this module asks it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cf_ray._engine import env as _env
from cf_ray._engine.format import blocks as _blocks
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format import sections as _sections
from cf_ray._engine.worker.cpu_budget import mark as cpu_mark
from cf_ray._engine.worker.snapshot.job import Deferred, SnapshotJob, StagedSection
from cf_ray._engine.worker.snapshot.slot_arena import SlotArena

#: Blocks copied before they are checksummed, while they are still in the CPU's cache.
CRC_WINDOW_BLOCKS = 32

#: Blocks per task when a slot filled by DMA is checksummed on several threads (16 MiB).
CRC_TASK_BLOCKS = 64

#: At most this many threads checksum a slot filled by DMA.
MAX_CRC_THREADS = 8


def crc_threads() -> int:
    """How many threads checksum a slot that device tensors were copied into: the cores this process
    may run on, shared with the other ranks on its node (``LOCAL_WORLD_SIZE``, which Ray Train's torch
    backend sets), at most :data:`MAX_CRC_THREADS`; ``CF_RAY_CRC_THREADS`` sets it (``env.py``). The CRC-32
    releases the GIL, so the threads run in parallel; they run after the guard, beside the GPU's
    work, on cores a GPU job leaves idle."""
    raw = os.environ.get(_env.CRC_THREADS, "").strip()
    if raw and raw != "0":
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"{_env.CRC_THREADS}={raw!r}: set it to a whole number of threads, e.g. 4") from None
        if n < 1:
            raise ValueError(f"{_env.CRC_THREADS}={raw!r}: set it to at least 1 (or 0 for the default)")
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(MAX_CRC_THREADS, cores // local))


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _crc_pool(threads: int) -> ThreadPoolExecutor:
    """The process's checksum threads (made once, on the first slot filled by DMA; idle between
    snapshots, joined at exit by ``concurrent.futures``)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cf_ray-crc")
        return _pool


def dma_block_crcs(buf: np.ndarray, threads: int) -> tuple[list[int], float]:
    """The CRC-32 of every block of ``buf`` (``format/blocks.py``'s :func:`block_crcs`), on up to
    ``threads`` threads, tasks of :data:`CRC_TASK_BLOCKS` blocks; with the CPU seconds spent on
    threads other than the caller's (0 when it did the work itself: its own are counted already)."""
    step = CRC_TASK_BLOCKS * _blocks.BLOCK_BYTES
    if threads <= 1 or buf.nbytes <= step:
        return _blocks.block_crcs(buf), 0.0

    def part(start: int) -> tuple[list[int], float]:
        c0 = time.thread_time()
        out = _blocks.block_crcs(buf[start : start + step])
        return out, time.thread_time() - c0

    crcs: list[int] = []
    cpu = 0.0
    for out, spent in _crc_pool(threads).map(part, range(0, buf.nbytes, step)):
        crcs += out
        cpu += spent
    return crcs, cpu


class CopyEngine:
    """The copies and checksums of one rank's snapshots; one side stream per CUDA device, reused."""

    def __init__(self, crc_threads: int | None = None):
        # One side stream per device: a tensor is copied on its own device's stream, which first
        # waits for an event recorded on that device's current stream after the optimizer step.
        self._streams: dict[int, Any] = {}
        self._crc_threads = crc_threads  # None: crc_threads(), at the first slot filled by DMA

    # -- the training thread -------------------------------------------------------------------------
    @staticmethod
    def copy_unguarded(
        name: str,
        flat: _codec.Flat,
        arena: SlotArena,
        is_guarded: Callable[[torch.Tensor], bool],
        job: SnapshotJob,
        devices: set[int],
    ) -> int:
        """Copy section ``name``'s tensors that are not guarded into ``arena`` now, and list the
        guarded ones in ``job.deferred`` (copied later by :meth:`copy`); the CUDA devices and
        sections involved go to ``devices`` and ``job.cuda_sections``. Returns the bytes copied."""
        copied = 0
        for entry, leaf in zip(flat.entries, flat.leaves):
            dst = arena.dst(entry)
            if entry.kind == "numpy":
                dst.numpy()[:] = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
                copied += entry.nbytes
                continue
            assert isinstance(leaf, torch.Tensor)  # the codec gives torch tensors kind "torch"
            if leaf.is_cuda:
                devices.add(leaf.device.index or 0)
                job.cuda_sections.add(name)
            if is_guarded(leaf):
                job.deferred.append(Deferred(name, entry.offset, entry.nbytes, dst, leaf))
                continue
            if leaf.is_cuda:
                # Ordered before the next forward on the compute stream, so no race with it; the
                # event recorded after it (record_events) comes after it, and the background thread
                # waits for that event before it reads the arena (checksums, hand-off), on every device.
                dst.copy_(leaf, non_blocking=True)
            else:
                dst.copy_(leaf)
            copied += entry.nbytes
        return copied

    @staticmethod
    def record_events(devices: set[int]) -> dict[int, Any]:
        """Each device's side stream starts after the optimizer step's kernels on that device, and
        after the copies of its unguarded tensors queued before (a device may have only those)."""
        events = {}
        for d in sorted(devices):
            with torch.cuda.device(d):
                ev = torch.cuda.Event()
                ev.record()
                events[d] = ev
        return events

    # -- the snapshotter's thread --------------------------------------------------------------------
    def copy(self, job: SnapshotJob) -> dict[str, list[int]]:
        """Copy the deferred tensors; returns, per section in a shared-memory slot, the CRC-32 of
        each of its blocks (``format/blocks.py``), computed as the copy lands (see
        :func:`_copy_checksummed`) — or after it, for sections that had device tensors."""
        streams = []
        for d, ev in job.cuda_events.items():
            stream = self._streams.get(d)
            if stream is None:
                stream = self._streams[d] = torch.cuda.Stream(device=d)
            streams.append(stream)
            with torch.cuda.stream(stream):
                stream.wait_event(ev)
                for c in job.deferred:
                    if c.src.is_cuda and (c.src.device.index or 0) == d:
                        c.dst.copy_(c.src, non_blocking=True)  # DMA into pinned (registered) memory
        on_device = job.cuda_sections | {c.section for c in job.deferred if c.src.is_cuda}
        crcs: dict[str, list[int]] = {}
        copied = 0
        for name, arena in job.buffers.items():
            host = [c for c in job.deferred if c.section == name and not c.src.is_cuda]
            copied += sum(c.nbytes for c in host)
            if name not in on_device:
                crcs[name] = _copy_checksummed(arena, host, crc_time=job.timings)
            else:
                for c in host:
                    c.dst.copy_(c.src)
        for stream in streams:
            stream.synchronize()
        copied += sum(c.nbytes for c in job.deferred if c.src.is_cuda)
        job.timings["copied_bytes"] = job.timings.get("copied_bytes", 0.0) + copied
        return crcs

    def checksum_dma(self, job: SnapshotJob, crcs: dict[str, list[int]]) -> None:
        """The block checksums of sections that device tensors were copied into by DMA: the CPU never
        saw those bytes, so this is a read of the slot, done after the guard is released (the copy
        is complete; training goes on), on :func:`crc_threads` threads; their CPU seconds go to
        ``job.timings["crc_pool_cpu_s"]``, the wall seconds to ``job.timings["crc_dma_s"]``."""
        for name, arena in job.buffers.items():
            if name not in crcs:
                if self._crc_threads is None:
                    self._crc_threads = crc_threads()
                t0 = time.perf_counter()
                crcs[name], cpu = dma_block_crcs(arena.numpy(), self._crc_threads)
                job.timings["crc_dma_s"] = job.timings.get("crc_dma_s", 0.0) + time.perf_counter() - t0
                job.timings["crc_read_bytes"] = job.timings.get("crc_read_bytes", 0.0) + arena.nbytes
                job.timings["crc_pool_cpu_s"] = job.timings.get("crc_pool_cpu_s", 0.0) + cpu

    @staticmethod
    def checksum_late(job: SnapshotJob, crcs: dict[str, list[int]]) -> None:
        """Checksum again the blocks that the late capture wrote after the copy."""
        for slot in job.late:
            blocks = crcs.get(slot.section)
            if blocks is None:
                continue
            flat, buf = job.flats[slot.section], job.arenas[slot.section]
            entries = flat.entries[slot.first : slot.first + len(slot.layout)]
            touched = {k for e in entries for k in _blocks.blocks_of(e.offset, e.nbytes)}
            for k in sorted(touched):
                if k < len(blocks):
                    blocks[k] = _blocks.block_crc(buf, k)

    @staticmethod
    def staged(job: SnapshotJob, crcs: dict[str, list[int]]) -> dict[str, StagedSection]:
        """Seal each section's slot and say what the holder is handed: the index with the block
        checksums (``format/sections.py``'s encoding) and the data's CRC-32 (from its blocks')."""
        out = {}
        for name, flat in job.flats.items():
            arena, blocks = job.buffers[name], crcs[name]
            out[name] = StagedSection(
                job.arenas[name],
                _sections.encode_index(flat, blocks),
                slot=arena.seal(job.generation, job.step),
                crc32=_blocks.data_crc32(blocks, arena.nbytes),
            )
        return out


def _copy_checksummed(
    arena: SlotArena,
    pieces: list[Deferred],
    crc_time: dict[str, float] | None = None,
) -> list[int]:
    """Copy ``pieces`` into ``arena`` window by window (:data:`CRC_WINDOW_BLOCKS` blocks, laid out by
    ``format/blocks.py``'s :func:`~cf_ray._engine.format.blocks.windows`), checksumming each window's
    blocks right after its copy, while the bytes are still in the CPU's cache: the CRC-32 then costs
    no second pass over memory. Returns the CRC-32 of every block of the arena. The CRCs' wall and
    thread-CPU seconds are added to ``crc_time["crc_s"]`` and ``crc_time["crc_cpu_s"]`` when given."""
    buf = arena.numpy()
    whole = arena.tensor
    runs = []  # (offset, nbytes, source bytes) of contiguous sources, in arena order
    for c in pieces:
        if c.nbytes == 0:
            continue
        if c.src.is_contiguous() and c.src.dtype == c.dst.dtype:
            runs.append((c.offset, c.nbytes, c.src.reshape(-1).view(torch.uint8)))
        else:
            c.dst.copy_(c.src)  # strided or cast: copied whole, checksummed with its window
    runs.sort(key=lambda r: r[0])
    crcs: list[int] = []
    i = 0
    crc_wall = crc_cpu = 0.0
    for w0, w1 in _blocks.windows(arena.nbytes, CRC_WINDOW_BLOCKS):
        while i < len(runs) and runs[i][0] + runs[i][1] <= w0:
            i += 1
        j = i
        while j < len(runs) and runs[j][0] < w1:
            off, n, src = runs[j]
            a, b = max(off, w0), min(off + n, w1)
            whole[a:b].copy_(src[a - off : b - off])
            j += 1
        c0 = cpu_mark()
        crcs += _blocks.block_crcs(buf[w0:w1])
        c1 = cpu_mark()
        crc_wall += c1[0] - c0[0]
        crc_cpu += c1[1] - c0[1]
    if crc_time is not None:
        crc_time["crc_s"] = crc_time.get("crc_s", 0.0) + crc_wall
        crc_time["crc_cpu_s"] = crc_time.get("crc_cpu_s", 0.0) + crc_cpu
    return crcs
