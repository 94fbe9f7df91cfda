"""Phase 1 on a worker: copy the tracked state into reused host buffers on a background thread,
overlapped with the next forward/backward, then hand the bytes to the node's holder actor.

The training thread does only the cheap part of a snapshot (``state_dict()`` calls, which return
references, the small tensors that change outside ``optimizer.step()``, and the RNG states, which
the very next forward would change). The parameters and optimizer state, which change only in
``optimizer.step()``, are copied by the background thread while the next iteration computes; the
weight-update guard (:meth:`Snapshotter.wait_copy`, called before the next optimizer step) is
what makes that safe.

Buffers: one *arena* per section (a flat ``uint8`` tensor, pinned on CUDA machines), reused
while the layout stays the same. They are allocated and faulted in ahead of the first snapshot
(:meth:`Snapshotter.prepare`, on the background thread, a few steps before it): the first write
to new memory page-faults, and faulting in a 300 MB arena while the backward pass allocates and
frees its own buffers took ~1 s here (against ~30 ms for the copy into a warm arena), all of it a
guard wait on the training thread at the first checkpoint. On CUDA the copies are
``non_blocking`` on a side stream that first waits for the compute stream, so they overlap with
compute; on CPU they are plain ``copy_`` calls, which release the GIL.

Hand-off: the arenas are the node's holder's shared-memory slots (``slot_arena.py``): the worker
copies each section once, into a slot the holder owns (so the snapshot outlives this worker), and
hands over a typed :class:`~cf_ray._engine.protocol.messages.Stage` naming the slots, the indexes
with their block CRC-32s and each section's CRC-32 (``HolderActor.stage``): no bytes travel. (Until
issue 24 a platform without ``memfd_create``, or ``SHM_SLOTS=0``, passed the arena by value
through the object store, re-``put`` by the holder: two more passes on the host; cf_ray needs
Linux now, where Ray runs GPU training, and says so at once elsewhere.)

Late state: the tracked objects that are neither modules nor optimizers (LR schedulers, AMP's grad
scaler, user objects) are small and cannot change the weights, and users step a per-iteration
scheduler *after* ``ckpt.step(optimizer)``. So their ``state_dict()`` (and the optimizers'
``param_groups``, where a scheduler writes the learning rate) is taken again at the start
of the next Checkpointer call (``step()``, ``update()``, ``end_epoch()``, ``save()``, ``wait()``,
``finish()``, ...; :meth:`Snapshotter.capture_late`), before that call's guard, and written into
the slots the snapshot reserved for them: a checkpoint then holds the scheduler as it is after the
scheduler's step of that iteration, and ``resume`` continues bitwise. The model, the optimizer, the
RNG states and the data positions stay those of the checkpoint's step. The background thread waits
for that capture (at most ``late_wait_s``) before the hand-off; when the next call does not come in
time (or the object's layout changed), the state taken at the step is kept, with a warning once.
A preemption checkpoint captures it at once (its ``wait()`` is the next call).

Fingerprints: after the copy (and the late capture), the background thread records a fingerprint of
every tracked object in its section's tree (``fingerprint.py``): the restore checks each object
against it once it is loaded.

Two classes: :class:`Snapshotter`, the copy engine (no Ray; it calls back a ``hand_off``), and
:class:`Phase1`, what the Checkpointer drives (what a snapshot holds, its metadata, and the
hand-off to the holder, made again with a new holder of this node once when the holder died).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import ray.exceptions
import torch

from cf_ray._engine import env as _env
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.memory import crc as _crc
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.protocol.messages import CheckpointKind, SlotDesc, SnapshotMeta, Stage, StagedSlot, StageReply
from cf_ray._engine.storage.base import _crc32
from cf_ray._engine.worker import fingerprint as _fp
from cf_ray._engine.worker import sharded as _sharded
from cf_ray._engine.worker.cpu_budget import CpuBudget
from cf_ray._engine.worker.cpu_budget import mark as cpu_mark
from cf_ray._engine.worker.rng import rng_state
from cf_ray._engine.worker.slot_arena import SlotArena, SlotsBusy
from cf_ray._engine.worker.timing import Timing

logger = logging.getLogger("cf_ray")


@dataclass(slots=True)
class StagedSection:
    """One section of a snapshot as handed to the holder: the holder's slot it was copied into, its
    index with the block checksums (a restore from memory checks the bytes against them, and the
    holder's write too), the data's CRC-32, and the bytes as this worker maps them."""

    arena: np.ndarray
    index: bytes
    slot: SlotDesc
    crc32: int


#: A part of a snapshot taken again at the next Checkpointer call: (its path in the section's tree,
#: e.g. ``("objects", "scheduler")`` or ``("objects", "optimizer", "param_groups")``, and what
#: returns its state now, e.g. ``scheduler.state_dict``).
LateObject = tuple[tuple[str, ...], Callable[[], Any]]


@dataclass(slots=True)
class LateSlot:
    """Where a late object's state lies in a snapshot: its subtree and its entries in the arena."""

    section: str
    path: tuple[str, ...]
    state_fn: Callable[[], Any]
    first: int
    """Index of its first tensor entry in the section's table (its entries are contiguous)."""
    layout: tuple
    """(name, dtype, shape, kind) of each of its entries: a new state must have the same."""


@dataclass(slots=True)
class _Deferred:
    """A guarded tensor copied by the background thread: its section, where it goes, what it is."""

    section: str
    offset: int
    nbytes: int
    dst: torch.Tensor
    src: torch.Tensor


@dataclass(slots=True)
class SnapshotJob:
    """A snapshot in flight: what to copy, and what the hand-off needs."""

    step: int
    meta: Any
    """What the hand-off passes on (a :class:`SnapshotMeta` from the Checkpointer)."""
    flats: dict[str, _codec.Flat]
    arenas: dict[str, np.ndarray]
    generation: int = 0
    """The attempt's generation (a slot's header names it with the step)."""
    deferred: list[_Deferred] = field(default_factory=list)
    cuda_events: dict[int, Any] = field(default_factory=dict)
    """Device index -> the event its side stream waits for (recorded after the optimizer step and
    after the unguarded tensors' copies of that device were queued)."""
    cuda_sections: set[str] = field(default_factory=set)
    """Sections that device tensors were copied into by DMA (checksummed once those copies are done)."""
    timings: dict[str, float] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    """Section -> its :class:`SlotArena` (where a late capture writes)."""
    late: list[LateSlot] = field(default_factory=list)
    late_ready: threading.Event = field(default_factory=threading.Event)
    """Set once the late objects were captured (or there are none)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    sealed: bool = False
    """The background thread stopped waiting for the late capture (what is there is handed off)."""


@dataclass(slots=True)
class _Prepare:
    """A background job: allocate and fault in the arenas of these layouts."""

    layouts: dict[str, tuple[tuple, int]]  # section -> (layout key, nbytes)


#: Bytes copied before their blocks are checksummed, while they are still in the CPU's cache.
_CRC_WINDOW = 32 * mf.BLOCK_BYTES


class SnapshotSkipped(Exception):
    """A snapshot not taken because a section found no free slot in time (reported by the caller)."""


#: Gives the shared-memory slots of a section: (section, nbytes) -> the holder's slots of it.
ArenaSource = Callable[[str, int], "tuple[SlotDesc, ...] | list[SlotDesc]"]


_REFS = ("__cf_tensor__", "__cf_ndarray__")  # codec's tensor references in an encoded tree


def _refs(tree: Any) -> list[int]:
    """The tensor indices an encoded (sub)tree refers to, in order."""
    out: list[int] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if len(v) == 1:
                ((k, x),) = v.items()
                if k in _REFS and isinstance(x, int):
                    out.append(x)
                    return
            for x in v.values():
                walk(x)

    walk(tree)
    return out


def _shift_refs(tree: Any, by: int) -> Any:
    """An encoded (sub)tree whose tensor references are moved by ``by``."""
    if isinstance(tree, list):
        return [_shift_refs(x, by) for x in tree]
    if isinstance(tree, dict):
        if len(tree) == 1:
            ((k, x),) = tree.items()
            if k in _REFS and isinstance(x, int):
                return {k: x + by}
        return {k: _shift_refs(x, by) for k, x in tree.items()}
    return tree


def _subtree(tree: Any, path: tuple[str, ...]) -> Any:
    """The encoded subtree at ``path`` (``None`` when there is none)."""
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _late_slots(flats: dict[str, _codec.Flat], late: dict[str, list[LateObject]]) -> list[LateSlot]:
    slots = []
    for section, objs in late.items():
        flat = flats.get(section)
        if flat is None or not isinstance(flat.tree, dict):
            continue
        for path, state_fn in objs:
            sub = _subtree(flat.tree, path)
            if sub is None or not isinstance(_subtree(flat.tree, path[:-1]), dict):
                continue
            refs = _refs(sub)
            first = min(refs) if refs else 0
            if refs and refs != list(range(first, first + len(refs))):
                continue  # not contiguous (cannot happen with codec.flatten): keep the state at the step
            layout = tuple((e.name, e.dtype, e.shape, e.kind) for e in flat.entries[first : first + len(refs)])
            slots.append(LateSlot(section=section, path=path, state_fn=state_fn, first=first, layout=layout))
    return slots


class Snapshotter:
    """Phase 1 of one rank: at most one snapshot in flight, host buffers reused.

    Call order (training thread): :meth:`begin` at a checkpoint step, right after the optimizer
    step; :meth:`wait_copy` before every later optimizer step (the guard); :meth:`close` at the end.
    The background thread copies, then calls ``hand_off(job, sections)``.

    Args:
        rank: this worker's rank (names the thread and log lines).
        hand_off: called on the background thread with the job and its sections once the bytes
            are in the arena; returns when the receiver holds its own copy.
        arena_source: where the arenas live: the holder's shared-memory slots of each section.
        budget: where the background thread's time per part goes (``cpu_budget.py``).
    """

    def __init__(
        self,
        rank: int,
        hand_off: Callable[[SnapshotJob, dict[str, StagedSection]], None],
        arena_source: ArenaSource,
        budget: CpuBudget | None = None,
    ):
        self.rank = rank
        self._budget = budget if budget is not None else CpuBudget()
        self._hand_off = hand_off
        self._arena_source = arena_source
        self._arenas: dict[str, tuple[tuple, SlotArena]] = {}
        self._pin = torch.cuda.is_available()
        # One side stream per device: a tensor is copied on its own device's stream, which first
        # waits for an event recorded on that device's current stream after the optimizer step.
        self._streams: dict[int, Any] = {}
        self._slot_wait_warned = False
        self._queue: queue.Queue[SnapshotJob | _Prepare | None] = queue.Queue(maxsize=1)
        self._copy_done = threading.Event()
        self._copy_done.set()
        self._job_done = threading.Event()
        self._job_done.set()
        self._errors: list[tuple[int, BaseException]] = []
        self._lock = threading.Lock()
        self.last_timings: dict[str, float] = {}
        self.last_begin: dict[str, float] = {}
        self.prepare_s: float | None = None  # seconds the background thread spent in prepare()
        self.late_wait_s = 5.0
        """How long the background thread waits for :meth:`capture_late` before the hand-off."""
        self._late_job: SnapshotJob | None = None
        self._late_warned = False
        self.on_slot_wait: Callable[[float], bool] | None = None
        """Called (on the training thread) while :meth:`begin` waits for a free slot, about every
        :data:`~cf_ray._engine.worker.slot_arena.WAIT_TICK_S` with the seconds waited; True gives the wait up (the snapshot is skipped)."""
        self._next_wait_log = 0.0
        self._preparing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"cf_ray-snapshot-r{rank}", daemon=True)
        self._thread.start()

    # -- training thread ---------------------------------------------------------------------
    def begin(
        self,
        step: int,
        sections: dict[str, Any],
        is_guarded: Callable[[torch.Tensor], bool],
        meta: Any,
        late: dict[str, list[LateObject]] | None = None,
        generation: int = 0,
    ) -> float:
        """Start a snapshot of ``sections`` (name -> state tree). Returns seconds spent here.

        Tensors for which ``is_guarded`` is true (they change only in the optimizer step) and all
        CUDA tensors are copied in the background; everything else is copied now.

        A section whose two slots are both held (one being written, one pinned until written: a
        milestone or preemption checkpoint with a storage that stalls) waits for one at most
        ``env.SLOT_WAIT_S`` (60 s), saying so while it waits, and calls :attr:`on_slot_wait`; then the
        snapshot is not taken: :class:`SnapshotSkipped` (never a hang of the training thread).

        Args:
            late: per section, the objects whose state :meth:`capture_late` takes again at the next
                call (their state in ``sections`` reserves the room and is kept if that fails).

        Raises:
            SnapshotSkipped: no free slot within the wait; nothing of this snapshot was kept.
        """
        t_wait = time.perf_counter()
        self.capture_late()  # the previous snapshot's late objects: this is the next call
        self.wait_done()  # at most one snapshot in flight: wait for the previous hand-off
        t0 = time.perf_counter()
        wait_s = t0 - t_wait
        flats, arenas, deferred, buffers = {}, {}, [], {}
        devices: set[int] = set()
        cuda_sections: set[str] = set()
        slot_wait_s, copied = 0.0, 0
        for name, tree in sections.items():
            flat = _codec.flatten(tree)
            arena = self._arena_for(name, flat)
            slot_wait_s += self._acquire(arena, step, name, buffers)
            buffers[name] = arena
            for entry, leaf in zip(flat.entries, flat.leaves):
                dst = arena.dst(entry)
                if entry.kind == "numpy":
                    dst.numpy()[:] = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
                    copied += entry.nbytes
                    continue
                assert isinstance(leaf, torch.Tensor)  # the codec gives torch tensors kind "torch"
                if leaf.is_cuda:
                    devices.add(leaf.device.index or 0)
                    cuda_sections.add(name)
                if is_guarded(leaf):
                    deferred.append(_Deferred(name, entry.offset, entry.nbytes, dst, leaf))
                    continue
                if leaf.is_cuda:
                    # Ordered before the next forward on the compute stream, so no race with it; the
                    # event recorded below comes after it, and the background thread waits for that
                    # event before it reads the arena (checksums, hand-off), on every device.
                    dst.copy_(leaf, non_blocking=True)
                else:
                    dst.copy_(leaf)
                copied += entry.nbytes
            flats[name] = flat
            arenas[name] = arena.numpy()
        job = SnapshotJob(
            step=step,
            meta=meta,
            generation=generation,
            flats=flats,
            arenas=arenas,
            deferred=deferred,
            buffers=buffers,
            late=_late_slots(flats, late or {}),
            cuda_sections=cuda_sections,
        )
        if job.late:
            self._late_job = job
        else:
            job.late_ready.set()
        if devices:
            # Each device's side stream starts after the optimizer step's kernels on that device, and
            # after the copies of its unguarded tensors queued above (a device may have only those).
            job.cuda_events = {}
            for d in sorted(devices):
                with torch.cuda.device(d):
                    ev = torch.cuda.Event()
                    ev.record()
                    job.cuda_events[d] = ev
        job.timings["sync_s"] = time.perf_counter() - t0
        job.timings["wait_s"] = wait_s
        job.timings["slot_wait_s"] = slot_wait_s
        if slot_wait_s > 0.1 and not self._slot_wait_warned:
            self._slot_wait_warned = True
            logger.warning(
                "cf_ray: rank %d: the snapshot of step %d waited %.2f s for a free slot (the holder still "
                "persists the previous ones: the interval is shorter than a persist); the profile's "
                "slot_wait_s column has every wait",
                self.rank,
                step,
                slot_wait_s,
            )
        job.timings["copied_bytes"] = float(copied)
        job.timings["nbytes"] = float(sum(a.nbytes for a in arenas.values()))
        self.last_begin = dict(job.timings)
        self._copy_done.clear()
        self._job_done.clear()
        self._queue.put(job)
        return time.perf_counter() - t_wait

    def _acquire(self, arena: SlotArena, step: int, section: str, taken: dict[str, Any]) -> float:
        """A free slot of ``section``, waited for at most ``env.SLOT_WAIT_S`` (said while it waits);
        on giving up, the slots this snapshot took already (``taken``) are given back."""
        limit = _env.get_float(_env.SLOT_WAIT_S)
        self._next_wait_log = 1.0

        def waiting(waited_s: float) -> bool:
            if waited_s >= self._next_wait_log:
                self._next_wait_log = waited_s + _env.get_float(_env.WARN_INTERVAL_S)
                logger.warning(
                    "cf_ray: rank %d: the snapshot of step %d has waited %.0f s for a free slot of section %s: "
                    "the holder holds every slot (%s) until they are written, so storage is slow or stalled; "
                    "training goes on in %.0f s at most without this checkpoint",
                    self.rank,
                    step,
                    waited_s,
                    section,
                    arena.held(),
                    max(0.0, limit - waited_s),
                )
            return bool(self.on_slot_wait(waited_s)) if self.on_slot_wait is not None else False

        try:
            return arena.acquire(limit, waiting)
        except SlotsBusy as e:
            for other in taken.values():
                other.release()
            raise SnapshotSkipped(
                f"skipped: no free snapshot slot of section {section} within {e.waited_s:.0f} s "
                f"(the holder holds {e.held} until they are written: storage is slow or stalled)"
            ) from None

    def prepare(self, sections: dict[str, Any]) -> bool:
        """Allocate and fault in the arenas for ``sections`` (the trees :meth:`begin` will get) on
        the background thread, so that the first snapshot copies into resident memory.

        Call it on the training thread some steps before the first snapshot, once the state has its
        final layout (after the first optimizer step: Adam creates its state there). Returns False
        (and does nothing) when arenas exist or a job is in flight. A later :meth:`begin` waits for
        it; a section whose layout changed by then gets a new arena there, as without it.
        """
        if self._arenas or self.in_flight():
            return False
        layouts = {}
        for name, tree in sections.items():
            flat = _codec.flatten(tree)
            layouts[name] = (flat.layout_key(), flat.nbytes)
        self._preparing = True
        self._job_done.clear()
        self._queue.put(_Prepare(layouts))
        return True

    def preparing(self) -> bool:
        """Whether :meth:`prepare`'s job is still running (the iterations meanwhile compete with it)."""
        return self._preparing

    def capture_late(self, next_epoch: int | None = None) -> float:
        """At the start of the call after a snapshot's: take the late objects' state again, into the
        slots the snapshot reserved for them. Returns seconds spent (0 when nothing was waiting).

        Args:
            next_epoch: the call is ``end_epoch()`` right after the snapshot's step (the epoch's last):
                what is taken now holds the epoch's end (a per-epoch scheduler stepped before it), so
                the snapshot's counters say it resumes at ``next_epoch`` (the resumed loop then does
                not step them again)."""
        job, self._late_job = self._late_job, None
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        with job.lock:
            if not job.sealed:
                for slot in job.late:
                    self._capture(job, slot)
                if next_epoch is not None:
                    _resume_at_epoch(job, next_epoch)
        job.late_ready.set()
        return time.perf_counter() - t0

    def _capture(self, job: SnapshotJob, slot: LateSlot) -> None:
        try:
            new = _codec.flatten(slot.state_fn(), prefix=".".join(slot.path))
        except Exception as e:  # noqa: BLE001 - the state taken at the step is kept
            self._warn_late(f"state_dict() of {'.'.join(slot.path[1:])!r} failed at the next call ({e!r})")
            return
        layout = tuple((e.name, e.dtype, e.shape, e.kind) for e in new.entries)
        if layout != slot.layout:
            self._warn_late(
                f"the state of {'.'.join(slot.path[1:])!r} changed its tensors between the step and the next call"
            )
            return
        flat, arena = job.flats[slot.section], job.buffers[slot.section]
        for k, (entry, leaf) in enumerate(zip(new.entries, new.leaves)):
            dst = arena.dst(flat.entries[slot.first + k])
            if entry.kind == "numpy":
                dst.numpy()[:] = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
            else:
                dst.copy_(leaf)
            job.timings["copied_bytes"] = job.timings.get("copied_bytes", 0.0) + entry.nbytes
        _subtree(flat.tree, slot.path[:-1])[slot.path[-1]] = _shift_refs(new.tree, slot.first)

    def _warn_late(self, why: str) -> None:
        if not self._late_warned:
            self._late_warned = True
            logger.warning(
                "cf_ray: rank %d: %s; the checkpoint keeps that object's state as it was at the "
                "checkpoint's step (a scheduler stepped after ckpt.step() then resumes one step behind; "
                "step it inside `with ckpt.update():` instead)",
                self.rank,
                why,
            )

    def wait_copy(self) -> float:
        """The weight-update guard: block until the in-flight copy is done. Returns seconds waited."""
        if self._copy_done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._copy_done.wait()
        return time.perf_counter() - t0

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the in-flight snapshot has been handed off (or failed)."""
        return self._job_done.wait(timeout)

    def in_flight(self) -> bool:
        return not self._job_done.is_set()

    def take_errors(self) -> list[tuple[int, BaseException]]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def close(self, timeout: float | None = None) -> None:
        """Stop the background thread once the job in flight (if any) is done or ``timeout`` passed.
        Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self.capture_late()
        self.wait_done(timeout)
        self._queue.put(None)
        self._thread.join(timeout=5)

    def release_buffers(self) -> None:
        """Drop the host buffers (after :meth:`close`; a job still in flight keeps its own)."""
        for _, arena in self._arenas.values():
            arena.close()
        self._arenas.clear()

    def forget_slots(self) -> None:
        """The holder whose slots these are is gone: the next snapshot asks for new ones."""
        for _, arena in self._arenas.values():
            arena.close()
        self._arenas.clear()

    # -- internals -------------------------------------------------------------------------------
    def _arena_for(self, name: str, flat: _codec.Flat) -> SlotArena:
        key = flat.layout_key()
        cached = self._arenas.get(name)
        if cached is None or cached[0] != key:
            if cached is not None:
                cached[1].close()
            cached = (key, self._new_arena(name, flat.nbytes))
            self._arenas[name] = cached
        return cached[1]

    def _new_arena(self, name: str, nbytes: int, *, fault_in: bool = False) -> SlotArena:
        """The holder's slots of section ``name``, mapped."""
        arena = SlotArena(self._arena_source(name, nbytes), nbytes, self._pin)
        if fault_in:
            arena.fault_in()
        return arena

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Prepare):
                self._run_prepare(job)
                continue
            try:
                budget, m = self._budget, cpu_mark()
                t0 = time.perf_counter()
                try:
                    crcs = self._copy(job)
                finally:
                    job.timings["copy_s"] = time.perf_counter() - t0
                    self._copy_done.set()
                m = budget.lap("copy", m)
                crc_wall, crc_cpu = job.timings.get("crc_s", 0.0), job.timings.get("crc_cpu_s", 0.0)
                budget.add("copy", -crc_wall, -crc_cpu, calls=0)  # the copy's windows, less their CRCs
                budget.add("crc", crc_wall, crc_cpu)
                self._checksum_dma(job, crcs)  # after the guard: the weights may change meanwhile
                m = budget.lap("crc", m, calls=0)
                self._seal(job)
                m = budget.lap("seal_wait", m)
                self._checksum_late(job, crcs)
                m = budget.lap("index", m)
                for name, flat in job.flats.items():
                    fps = (
                        _fp.section_fingerprints(flat.tree, flat.entries, job.arenas[name])
                        if isinstance(flat.tree, dict)
                        else None
                    )
                    if fps:
                        flat.tree[_fp.KEY] = fps
                m = budget.lap("fingerprint", m)
                sections = {}
                for name, flat in job.flats.items():
                    arena, blocks = job.buffers[name], crcs[name]
                    sections[name] = StagedSection(
                        job.arenas[name],
                        mf.with_blocks(mf.encode_index(flat), blocks),
                        slot=arena.seal(job.generation, job.step),
                        crc32=_crc.combine_blocks(blocks, mf.BLOCK_BYTES, arena.nbytes),
                    )
                m = budget.lap("index", m, calls=0)
                t1 = time.perf_counter()
                self._hand_off(job, sections)
                job.timings["handoff_s"] = time.perf_counter() - t1
                budget.lap("handoff", m)
            except BaseException as e:  # noqa: BLE001 - surfaced at the next wait/close
                logger.warning("cf_ray: rank %d: snapshot of step %d failed: %r", self.rank, job.step, e)
                for arena in job.buffers.values():
                    arena.release()
                with self._lock:
                    self._errors.append((job.step, e))
            finally:
                self.last_timings = dict(job.timings, step=job.step)
                self._copy_done.set()
                self._job_done.set()

    def _seal(self, job: SnapshotJob) -> None:
        """Wait (at most ``late_wait_s``) for the late capture; from here on the job is not changed."""
        if not job.late:
            return
        captured = job.late_ready.wait(self.late_wait_s)
        with job.lock:
            job.sealed = True
        if not captured:
            self._warn_late(
                f"the next Checkpointer call did not come within {self.late_wait_s:.0f} s of the "
                f"checkpoint of step {job.step}"
            )

    def _run_prepare(self, job: _Prepare) -> None:
        try:
            t0 = time.perf_counter()
            for name, (key, nbytes) in job.layouts.items():
                self._arenas[name] = (key, self._new_arena(name, nbytes, fault_in=True))
            self.prepare_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - not fatal: begin() allocates what is missing
            logger.warning("cf_ray: rank %d: could not allocate snapshot buffers ahead: %r", self.rank, e)
            self._arenas.clear()
        finally:
            self._preparing = False
            self._job_done.set()

    def _copy(self, job: SnapshotJob) -> dict[str, list[int]]:
        """Copy the deferred tensors; returns, per section in a shared-memory slot, the CRC-32 of
        each of its blocks (``manifest.BLOCK_BYTES``), computed as the copy lands (see
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
                crcs[name] = _copy_checksummed(
                    arena, host, after_first=_fault_mid_copy(self.rank, job.step), crc_time=job.timings
                )
            else:
                for c in host:
                    c.dst.copy_(c.src)
        for stream in streams:
            stream.synchronize()
        copied += sum(c.nbytes for c in job.deferred if c.src.is_cuda)
        job.timings["copied_bytes"] = job.timings.get("copied_bytes", 0.0) + copied
        return crcs

    def _checksum_dma(self, job: SnapshotJob, crcs: dict[str, list[int]]) -> None:
        """The block checksums of sections that device tensors were copied into by DMA: the CPU never
        saw those bytes, so this is a read of the slot, done after the guard is released (the copy
        is complete; training goes on)."""
        for name, arena in job.buffers.items():
            if name not in crcs:
                crcs[name] = mf.block_crcs(arena.numpy())
                job.timings["crc_read_bytes"] = job.timings.get("crc_read_bytes", 0.0) + arena.nbytes

    def _checksum_late(self, job: SnapshotJob, crcs: dict[str, list[int]]) -> None:
        """Checksum again the blocks that the late capture wrote after the copy."""
        block = mf.BLOCK_BYTES
        for slot in job.late:
            blocks = crcs.get(slot.section)
            if blocks is None:
                continue
            flat, buf = job.flats[slot.section], job.arenas[slot.section]
            entries = flat.entries[slot.first : slot.first + len(slot.layout)]
            touched = {
                k for e in entries for k in range(e.offset // block, (e.offset + max(e.nbytes, 1) - 1) // block + 1)
            }
            for k in sorted(touched):
                if k < len(blocks):
                    blocks[k] = _crc32(buf[k * block : (k + 1) * block].data)


def _resume_at_epoch(job: SnapshotJob, epoch: int) -> None:
    """The snapshot's counters (every section that has them) and its metadata say ``epoch``."""
    for flat in job.flats.values():
        counters = flat.tree.get(mf.COUNTERS) if isinstance(flat.tree, dict) else None
        if isinstance(counters, dict) and "epoch" in counters:
            counters["epoch"] = epoch
    if dataclasses.is_dataclass(job.meta) and hasattr(job.meta, "epoch"):
        job.meta = dataclasses.replace(job.meta, epoch=epoch)  # pyright: ignore[reportArgumentType]


def _fault_mid_copy(rank: int, step: int) -> Callable[[], None] | None:
    """The fault injection of ``CF_RAY_FAULT_KILL_MID_COPY`` (env.py) for this rank and step, if set."""
    spec = os.environ.get(_env.FAULT_KILL_MID_COPY)
    if not spec:
        return None
    at, who, marker = spec.split("@", 2)
    if int(at) != step or int(who) != rank or os.path.exists(marker):
        return None

    def kill() -> None:
        with open(marker, "w") as f:
            f.write(f"{step}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


def _copy_checksummed(
    arena: SlotArena,
    pieces: list[_Deferred],
    after_first: Callable[[], None] | None = None,
    crc_time: dict[str, float] | None = None,
) -> list[int]:
    """Copy ``pieces`` into ``arena`` window by window (:data:`_CRC_WINDOW`), checksumming each
    window's blocks right after its copy, while the bytes are still in the CPU's cache: the CRC-32
    then costs no second pass over memory. Returns the CRC-32 of every block of the arena.
    ``after_first`` is called after the first piece's copy (fault injection only); the CRCs' wall and
    thread-CPU seconds are added to ``crc_time["crc_s"]`` and ``crc_time["crc_cpu_s"]`` when given."""
    block = mf.BLOCK_BYTES
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
    i, total = 0, arena.nbytes
    crc_wall = crc_cpu = 0.0
    for w0 in range(0, total, _CRC_WINDOW):
        w1 = min(total, w0 + _CRC_WINDOW)
        while i < len(runs) and runs[i][0] + runs[i][1] <= w0:
            i += 1
        j = i
        while j < len(runs) and runs[j][0] < w1:
            off, n, src = runs[j]
            a, b = max(off, w0), min(off + n, w1)
            whole[a:b].copy_(src[a - off : b - off])
            if after_first is not None:
                after_first()
                after_first = None
            j += 1
        c0 = cpu_mark()
        for k in range(w0, w1, block):
            crcs.append(_crc32(buf[k : min(k + block, total)].data))
        c1 = cpu_mark()
        crc_wall += c1[0] - c0[0]
        crc_cpu += c1[1] - c0[1]
    if crc_time is not None:
        crc_time["crc_s"] = crc_time.get("crc_s", 0.0) + crc_wall
        crc_time["crc_cpu_s"] = crc_time.get("crc_cpu_s", 0.0) + crc_cpu
    return crcs


def replica_due(step: int, every: int, interval: int | None, *, always: bool = False) -> bool:
    """Whether the snapshot of ``step`` is copied to peers (``CheckpointConfig.replica_every``):
    one in ``every``, those whose step lies in the first interval of a block of ``every`` intervals
    (the same steps on every rank and node, so the copied steps are complete); ``always`` (preemption
    checkpoints, milestones) and snapshots without an interval (manual, epoch boundaries) always."""
    if every <= 1 or always or not interval:
        return True
    return step % (every * interval) < interval


class Phase1:
    """Phase 1 of one rank as the :class:`~cf_ray.Checkpointer` drives it: what a snapshot holds,
    the :class:`Snapshotter` that copies it, and the hand-off of the bytes to this node's holder.

    Call order (training thread): :meth:`capture_late` at the start of every Checkpointer call;
    :meth:`take` at a checkpoint step, right after the optimizer step; :meth:`prepare_once` at the
    first step that takes none; :meth:`wait_copy` before every optimizer step (the guard);
    :meth:`close` at the end.

    Args:
        rank, world_size: this rank and the number of ranks.
        replicated: ``CheckpointConfig.replicated`` (rank 0 alone saves the tracked state).
        state, data: the tracked objects (replicated and per-rank).
        holder: this node's holder actor.
        timing: where the hand-off's timings go.
        resolve_holder: returns this node's holder, creating it when it is gone (``None``: the
            hand-off is not made again when the holder died).
        sharded: the tracked objects whose state is sharded (FSDP2/DTensor, ``sharded.py``): their
            state is taken with PyTorch's state-dict API and each rank saves its own shards, so the
            snapshot is per-rank (``replicated`` is then false).
        replicas, replica_label: ``CheckpointConfig.replicas`` (``-1`` for automatic) and
            ``replica_label`` (``""`` for none), passed to the holder with each snapshot.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        replicated: bool,
        state: Mapping[str, Any],
        data: Mapping[str, Any],
        holder,
        timing: Timing,
        resolve_holder: Callable[[], Any] | None = None,
        sharded: _sharded.ShardedState | None = None,
        replicas: int = 0,
        replica_label: str = "",
        replica_every: int = 1,
    ):
        self.rank = rank
        self._replicas = replicas
        self._replica_label = replica_label
        self._replica_every = replica_every
        self.world_size = world_size
        self.sharded = sharded
        self.replicated = replicated and sharded is None
        self.state = state
        self.data = data
        self.holder = holder
        self.generation = 0
        """This attempt's generation (names the snapshot in the holder)."""
        self._timing = timing
        self._resolve_holder = resolve_holder
        self._prepared = False
        _slots.require()  # Linux: the snapshots live in the holder's memfd slots
        self._snap = Snapshotter(rank, self._hand_off, arena_source=self._slots, budget=timing.budget)
        # Neither modules nor optimizers: their state is taken again at the next call (module doc);
        # so is the optimizers' param_groups (the learning rate a scheduler writes there).
        self._late_names = [n for n, o in state.items() if not isinstance(o, (torch.nn.Module, torch.optim.Optimizer))]
        self._optimizers = [n for n, o in state.items() if isinstance(o, torch.optim.Optimizer)]
        self.skipped: tuple[str, list[str]] | None = None
        """Why the last :meth:`take` skipped its snapshot, and the sections it would have held."""

    # -- the training thread ------------------------------------------------------------------------
    def take(
        self,
        step: int,
        epoch: int,
        kind: CheckpointKind,
        *,
        milestone: bool,
        interval: int | None,
        notice: dict,
        replica_interval: int | None = None,
    ) -> float | None:
        """Start the snapshot of ``step``; returns the seconds the snapshotter spent on this thread,
        ``None`` when it was skipped (no free slot in time: :attr:`skipped` says why and which sections).

        Args:
            notice: a preemption notice's deadline fields for the profile row (may be empty).
            replica_interval: the interval ``replica_every`` counts in (the policy's, fixed or adaptive).
        """
        due = replica_due(
            step, self._replica_every, replica_interval, always=milestone or kind is CheckpointKind.PREEMPT
        )
        sections = self._sections(step, epoch)
        meta = SnapshotMeta(
            rank=self.rank,
            world_size=self.world_size,
            replicated=self.replicated,
            epoch=epoch,
            kind=kind,
            milestone=milestone,
            priority=kind is CheckpointKind.PREEMPT,
            interval=interval,
            replicas=self._replicas if due else 0,
            replica_label=self._replica_label,
            **notice,
        )
        guarded = self._guarded_ptrs()
        self.skipped = None
        try:
            return self._snap.begin(
                step,
                sections,
                lambda t: t.data_ptr() in guarded,
                meta,
                late=self._late(sections),
                generation=self.generation,
            )
        except SnapshotSkipped as e:
            self.skipped = (str(e), sorted(sections))
            logger.warning("cf_ray: rank %d: the checkpoint of step %d is %s; training goes on", self.rank, step, e)
            return None

    def capture_late(self, next_epoch: int | None = None) -> float:
        """At the start of a Checkpointer call: the late objects of the last snapshot (module doc);
        ``next_epoch`` from ``end_epoch()`` right after it (:meth:`Snapshotter.capture_late`)."""
        return self._snap.capture_late(next_epoch)

    @property
    def on_slot_wait(self) -> Callable[[float], bool] | None:
        """Called while a snapshot waits for a free slot (:attr:`Snapshotter.on_slot_wait`)."""
        return self._snap.on_slot_wait

    @on_slot_wait.setter
    def on_slot_wait(self, fn: Callable[[float], bool] | None) -> None:
        self._snap.on_slot_wait = fn

    @property
    def late_wait_s(self) -> float:
        """How long the background thread waits for :meth:`capture_late`."""
        return self._snap.late_wait_s

    @late_wait_s.setter
    def late_wait_s(self, seconds: float) -> None:
        self._snap.late_wait_s = seconds

    def _late(self, sections: dict[str, Any]) -> dict[str, list]:
        """Per section, the late objects in it: ``(path, state_dict)``."""
        if not self._late_names:
            return {}
        if self.replicated:
            section, key = mf.SHARED, mf.OBJECTS
        else:
            section, key = mf.rank_section(self.rank), mf.STATE
        if section not in sections:
            return {}
        late: list = [((key, n), self.state[n].state_dict) for n in self._late_names]
        late += [((key, n, "param_groups"), self._param_groups_fn(n)) for n in self._optimizers]
        return {section: late}

    def prepare_once(self, step: int, epoch: int) -> bool:
        """Fault in the snapshot buffers in the background, the first time only. Returns whether
        that started now (the next iterations then compete with it)."""
        if self._prepared:
            return False
        # After the first optimizer step the state has its layout (Adam creates its state
        # there): fault in the snapshot buffers now, in the background, not at the first
        # checkpoint's copy (see the module doc).
        self._prepared = True
        return self._snap.prepare(self._sections(step, epoch))

    def wait_copy(self) -> float:
        """The weight-update guard (:meth:`Snapshotter.wait_copy`)."""
        return self._snap.wait_copy()

    def wait_done(self, timeout: float | None = None) -> bool:
        return self._snap.wait_done(timeout)

    def preparing(self) -> bool:
        return self._snap.preparing()

    def take_errors(self) -> list[tuple[int, BaseException]]:
        return self._snap.take_errors()

    @property
    def last_begin(self) -> dict[str, float]:
        """The snapshotter's timings of the last :meth:`take` (``wait_s``, ``nbytes``, ...)."""
        return self._snap.last_begin

    @property
    def last_timings(self) -> dict[str, float]:
        """The snapshotter's timings of its last finished job (``step``, ``copy_s``, ...)."""
        return self._snap.last_timings

    def close(self, timeout: float | None = 5) -> None:
        """Stop the background thread and drop the buffers (idempotent)."""
        self._snap.close(timeout=timeout)
        self._snap.release_buffers()

    # -- internals ------------------------------------------------------------------------------------
    def _param_groups_fn(self, name: str) -> Callable[[], Any]:
        """What returns an optimizer's ``param_groups`` now, as its snapshot holds them."""
        if self.sharded is not None and name in self.sharded.names:
            return lambda s=self.sharded: s.state_dict(name)["param_groups"]  # FQN-keyed, like the snapshot
        return lambda o=self.state[name]: o.state_dict()["param_groups"]

    def _state_dict(self, name: str, obj: Any) -> Any:
        if self.sharded is not None and name in self.sharded.names:
            return self.sharded.state_dict(name)
        return obj.state_dict()

    def _sections(self, step: int, epoch: int) -> dict[str, Any]:
        """This rank's snapshot: section name -> state tree (references; copied by the snapshotter)."""
        rank_tree = {
            mf.OBJECTS: {name: obj.state_dict() for name, obj in self.data.items()},
            mf.RNG: rng_state(),
            # rank and world_size: a restore checks that a rank's section is that rank's.
            mf.COUNTERS: {"step": step, "epoch": epoch, "rank": self.rank, "world_size": self.world_size},
        }
        sections: dict[str, Any] = {}
        replicated = (
            {name: self._state_dict(name, obj) for name, obj in self.state.items()}
            if (self.rank == 0 or not self.replicated)
            else None
        )
        if self.replicated:
            if self.rank == 0:
                sections[mf.SHARED] = {mf.OBJECTS: replicated}
        else:
            rank_tree[mf.STATE] = replicated
            if self.sharded is not None:
                rank_tree[_sharded.KEY] = self.sharded.describe()
        sections[mf.rank_section(self.rank)] = rank_tree
        return sections

    def _guarded_ptrs(self) -> set[int]:
        """Storage pointers of tensors that change only in the optimizer step (copied in the background)."""
        ptrs = set()
        for obj in self.state.values():
            if isinstance(obj, torch.nn.Module):
                ptrs.update(p.data_ptr() for p in obj.parameters())
            elif isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    ptrs.update(p.data_ptr() for p in group["params"])
                for st in obj.state.values():
                    ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        if self.sharded is not None:
            ptrs.update(self.sharded.guarded_ptrs())  # a DTensor's own data_ptr() is 0: its local shard's
        return ptrs

    def _slots(self, section: str, nbytes: int) -> tuple[SlotDesc, ...]:
        """The holder's shared-memory slots of ``section`` (the snapshotter's arena source)."""
        timeout = _env.get_float(_env.ACTOR_TIMEOUT_S)
        try:
            return ray.get(self.holder.arena.remote(section, nbytes), timeout=timeout)
        except ray.exceptions.RayActorError:
            if self._resolve_holder is None:
                raise
            self.holder = self._resolve_holder()
            return ray.get(self.holder.arena.remote(section, nbytes), timeout=timeout)

    def _hand_off(self, job: SnapshotJob, sections: dict[str, StagedSection]) -> None:
        """Background thread: tell this node's holder which slots hold the snapshot (a typed
        :class:`Stage`; it returns once the holder has recorded it), and the holder persists and
        copies them. When the holder is gone (a Ray actor error) or is a new one that does not know
        the slots (Ray restarted it), this node's holder is found or made again, the snapshot is
        copied from the old slots (still mapped here) into new ones and staged with it once, and the
        next snapshot uses the new slots. The incident is logged with the rank and the step."""
        meta = dataclasses.replace(
            job.meta,
            copy_s=job.timings.get("copy_s"),
            sync_s=job.timings.get("sync_s"),
            copied_bytes=int(job.timings.get("copied_bytes", 0)),
            crc_read_bytes=int(job.timings.get("crc_read_bytes", 0)),
            slot_wait_s=job.timings.get("slot_wait_s"),
        )
        staged = tuple(
            StagedSlot(section=name, slot=s.slot, index=s.index, crc32=s.crc32) for name, s in sections.items()
        )
        timeout = _env.get_float(_env.ACTOR_TIMEOUT_S)
        why = ""
        try:
            got: StageReply = ray.get(
                self.holder.stage.remote(Stage(generation=self.generation, step=job.step, meta=meta, sections=staged)),
                timeout=timeout,
            )
            if not got.recorded:
                why = f"it does not know the slots of {', '.join(got.unknown)} (it was restarted)"
        except ray.exceptions.RayActorError as e:
            if self._resolve_holder is None:
                raise
            why = f"it is gone ({type(e).__name__}: {e})"
        if why:
            logger.warning(
                "cf_ray: rank %d: this node's holder cannot take the snapshot of step %d: %s; copying it into "
                "the slots of this node's holder now and staging it again",
                self.rank,
                job.step,
                why,
            )
            if self._resolve_holder is not None:
                self.holder = self._resolve_holder()
            again = tuple(self._restage(name, s, job) for name, s in sections.items())
            extra = sum(s.arena.nbytes for s in sections.values())
            meta = dataclasses.replace(meta, copied_bytes=meta.copied_bytes + extra)
            ray.get(
                self.holder.stage.remote(Stage(generation=self.generation, step=job.step, meta=meta, sections=again)),
                timeout=timeout,
            )
            self._snap.forget_slots()
        self._timing.handed_off(job.step, job.timings)

    def _restage(self, name: str, s: StagedSection, job: SnapshotJob) -> StagedSlot:
        """Copy a staged section from its old slot (mapped here) into a slot of the current holder."""
        descs = self._slots(name, s.arena.nbytes)
        slot = _slots.WriterSlot(descs[0], s.arena.nbytes)
        try:
            if not slot.try_fill():
                raise RuntimeError(f"the new holder's slot of {name} is busy")
            slot.data()[:] = s.arena.data
            desc = slot.seal(self.generation, job.step)
        finally:
            slot.close()
        return StagedSlot(section=name, slot=desc, index=s.index, crc32=s.crc32)
