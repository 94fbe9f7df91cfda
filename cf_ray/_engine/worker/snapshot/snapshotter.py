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
to new memory page-faults, and faulting in an arena while the backward pass allocates and frees
its own buffers costs many times the copy into a warm arena, all of it a guard wait on the training
thread at the first checkpoint. How the bytes are copied and
checksummed: ``copy_engine.py``.

Hand-off: the arenas are the node's holder's shared-memory slots: the worker copies each section
once, into a slot the holder owns, and hands over a typed ``Stage`` naming them (``handoff.py``).

Late state: the small objects that are neither modules nor optimizers (schedulers, ...) are taken
again at the start of the next Checkpointer call, into the slots the snapshot reserved for them
(``late_capture.py`` says why and how).

Fingerprints: after the copy (and the late capture), the background thread records a fingerprint of
every tracked object in its section's tree (``fingerprint.py``): the restore checks each object
against it once it is loaded.

Here: :class:`Snapshotter`, the background thread and its queue (no Ray; it calls back a
``hand_off``), and :class:`Phase1`, what the Checkpointer drives (what a snapshot holds and its
metadata). Their parts, one job each: the arenas of each section and the wait for a free slot
(``arenas.py``), the copies and block checksums (``copy_engine.py``), the late capture
(``late_capture.py``), the hand-off to the holder, made again with a new holder of this node once
when the holder died (``handoff.py``), and the job they share (``job.py``), all in ``snapshot/``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.layout import COUNTERS, OBJECTS, RNG, SHARED, STATE, rank_section
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.protocol.messages import CheckpointKind, SnapshotMeta
from cf_ray._engine.worker.cpu_budget import CpuBudget
from cf_ray._engine.worker.cpu_budget import mark as cpu_mark
from cf_ray._engine.worker.restore import sharded as _sharded
from cf_ray._engine.worker.snapshot import fingerprint as _fp
from cf_ray._engine.worker.snapshot.arenas import ArenaSource, SectionArenas, SnapshotSkipped
from cf_ray._engine.worker.snapshot.copy_engine import CopyEngine
from cf_ray._engine.worker.snapshot.handoff import HolderHandOff, ReplicaPlan, replica_due
from cf_ray._engine.worker.snapshot.job import LateObject, SnapshotJob, StagedSection
from cf_ray._engine.worker.snapshot.late_capture import LateCapture, late_slots
from cf_ray._engine.worker.snapshot.rng import rng_state
from cf_ray._engine.worker.timing import Timing

logger = logging.getLogger("cf_ray")

__all__ = [
    "ArenaSource",
    "LateObject",
    "Phase1",
    "SnapshotJob",
    "SnapshotSkipped",
    "Snapshotter",
    "StagedSection",
    "replica_due",
]


@dataclass(slots=True)
class _Prepare:
    """A background job: allocate and fault in the arenas of these layouts."""

    layouts: dict[str, tuple[tuple, int]]  # section -> (layout key, nbytes)


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
        self.arenas = SectionArenas(rank, arena_source)
        self._engine = CopyEngine()
        self._late = LateCapture(rank)
        self._queue: queue.Queue[SnapshotJob | _Prepare | None] = queue.Queue(maxsize=1)
        self._copy_done = threading.Event()
        self._copy_done.set()
        self._job_done = threading.Event()
        self._job_done.set()
        self._errors: list[tuple[int, BaseException]] = []
        self._lock = threading.Lock()
        self.last_timings: dict[str, float] = {}
        self.last_begin: dict[str, float] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"cf_ray-snapshot-r{rank}", daemon=True)
        self._thread.start()

    @property
    def late_wait_s(self) -> float:
        """How long the background thread waits for :meth:`capture_late` before the hand-off."""
        return self._late.wait_s

    @late_wait_s.setter
    def late_wait_s(self, seconds: float) -> None:
        self._late.wait_s = seconds

    @property
    def on_slot_wait(self) -> Callable[[float], bool] | None:
        """Called (on the training thread) while :meth:`begin` waits for a free slot
        (:attr:`SectionArenas.on_slot_wait <cf_ray._engine.worker.snapshot.arenas.SectionArenas.on_slot_wait>`)."""
        return self.arenas.on_slot_wait

    @on_slot_wait.setter
    def on_slot_wait(self, fn: Callable[[float], bool] | None) -> None:
        self.arenas.on_slot_wait = fn

    @property
    def prepare_s(self) -> float | None:
        """Seconds the background thread spent in :meth:`prepare`'s job (``None`` before it ran)."""
        return self.arenas.prepare_s

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
        milestone or preemption checkpoint with a storage that stalls) waits for one, saying so while
        it waits, and calls :attr:`on_slot_wait`. Everything this call waits for — the previous
        snapshot's hand-off, a free slot of each section, the holder's slots of a section whose
        layout changed — shares one bound, ``env.SLOT_WAIT_S`` (60 s) in all, not one per section or
        per call (rank 0 of a replicated model has three sections); past it the snapshot is not
        taken: :class:`SnapshotSkipped` (never a hang of the training thread).

        Args:
            late: per section, the objects whose state :meth:`capture_late` takes again at the next
                call (their state in ``sections`` reserves the room and is kept if that fails).

        Raises:
            SnapshotSkipped: not taken within the bound; nothing of this snapshot was kept.
        """
        t_wait = time.perf_counter()
        self.capture_late()  # the previous snapshot's late objects: this is the next call
        with self.arenas.bounded():  # one bound for every wait of this snapshot
            self.arenas.wait_previous(step, self._job_done)  # one in flight: bounded, said while it waits
            t0 = time.perf_counter()
            wait_s = t0 - t_wait
            job = SnapshotJob(step=step, meta=meta, generation=generation, flats={}, arenas={})
            devices: set[int] = set()
            slot_wait_s, copied = 0.0, 0
            for name, tree in sections.items():
                flat = _codec.flatten(tree)
                arena = self.arenas.for_flat(name, flat, job.buffers)
                slot_wait_s += self.arenas.acquire(arena, step, name, job.buffers)
                job.buffers[name] = arena
                copied += self._engine.copy_unguarded(name, flat, arena, is_guarded, job, devices)
                job.flats[name] = flat
                job.arenas[name] = arena.numpy()
        job.late = late_slots(job.flats, late or {})
        self._late.expect(job)
        if devices:
            job.cuda_events = self._engine.record_events(devices)
        job.timings["sync_s"] = time.perf_counter() - t0
        job.timings["wait_s"] = wait_s
        job.timings["slot_wait_s"] = slot_wait_s
        self.arenas.waited(step, slot_wait_s)
        job.timings["copied_bytes"] = float(copied)
        job.timings["nbytes"] = float(sum(a.nbytes for a in job.arenas.values()))
        self.last_begin = dict(job.timings)
        self._copy_done.clear()
        self._job_done.clear()
        self._queue.put(job)
        return time.perf_counter() - t_wait

    def prepare(self, sections: dict[str, Any]) -> bool:
        """Allocate and fault in the arenas for ``sections`` (the trees :meth:`begin` will get) on
        the background thread, so that the first snapshot copies into resident memory.

        Call it on the training thread some steps before the first snapshot, once the state has its
        final layout (after the first optimizer step: Adam creates its state there). Returns False
        (and does nothing) when arenas exist or a job is in flight. A later :meth:`begin` waits for
        it; a section whose layout changed by then gets a new arena there, as without it.
        """
        if self.arenas.sections() or self.in_flight():
            return False
        layouts = {}
        for name, tree in sections.items():
            flat = _codec.flatten(tree)
            layouts[name] = (flat.layout_key(), flat.nbytes)
        self.arenas.preparing = True
        self._job_done.clear()
        self._queue.put(_Prepare(layouts))
        return True

    def preparing(self) -> bool:
        """Whether :meth:`prepare`'s job is still running (the iterations meanwhile compete with it)."""
        return self.arenas.preparing

    def capture_late(self, next_epoch: int | None = None) -> float:
        """At the start of the call after a snapshot's: take the late objects' state again, into the
        slots the snapshot reserved for them (:meth:`LateCapture.capture
        <cf_ray._engine.worker.snapshot.late_capture.LateCapture.capture>`). Returns seconds spent."""
        return self._late.capture(next_epoch)

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
        self.arenas.close()

    def forget_slots(self) -> None:
        """The holder whose slots these are is gone: the next snapshot asks for new ones."""
        self.arenas.close()

    # -- the background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Prepare):
                try:
                    self.arenas.fault_in(job.layouts)
                finally:
                    self.arenas.preparing = False
                    self._job_done.set()
                continue
            try:
                self._snapshot(job)
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

    def _snapshot(self, job: SnapshotJob) -> None:
        """One job: the deferred copy (then the guard is released), the checksums, the late
        capture's seal, the fingerprints, the index, the hand-off; each part's time in the budget."""
        budget, m = self._budget, cpu_mark()
        t0, cpu0 = time.perf_counter(), m[1]
        try:
            crcs = self._engine.copy(job)
        finally:
            job.timings["copy_s"] = time.perf_counter() - t0
            self._copy_done.set()
        m = budget.lap("copy", m)
        crc_wall, crc_cpu = job.timings.get("crc_s", 0.0), job.timings.get("crc_cpu_s", 0.0)
        budget.add("copy", -crc_wall, -crc_cpu, calls=0)  # the copy's windows, less their CRCs
        budget.add("crc", crc_wall, crc_cpu)
        self._engine.checksum_dma(job, crcs)  # after the guard: the weights may change meanwhile
        m = budget.lap("crc", m, calls=0)
        budget.add("crc", 0.0, pool_cpu := job.timings.pop("crc_pool_cpu_s", 0.0), calls=0)  # its threads' CPU
        self._late.seal(job)
        m = budget.lap("seal_wait", m)
        self._engine.checksum_late(job, crcs)
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
        sections = self._engine.staged(job, crcs)
        m = budget.lap("index", m, calls=0)
        t1 = time.perf_counter()
        self._hand_off(job, sections)
        job.timings["handoff_s"] = time.perf_counter() - t1
        job.timings["cpu_s"] = budget.lap("handoff", m)[1] - cpu0 + pool_cpu  # the policy's Sample.copy_cpu_s


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
        self._replicas = ReplicaPlan(replicas, replica_label, replica_every)
        self.world_size = world_size
        self.sharded = sharded
        self.replicated = replicated and sharded is None
        self.state = state
        self.data = data
        self._holder = HolderHandOff(rank, holder, timing, resolve_holder)
        self._prepared = False
        _slots.require()  # Linux: the snapshots live in the holder's memfd slots
        self._snap = Snapshotter(rank, self._holder.hand_off, arena_source=self._holder.slots, budget=timing.budget)
        self._holder.on_new_holder = self._snap.forget_slots
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
        persist: bool = True,
    ) -> float | None:
        """Start the snapshot of ``step``; returns the seconds the snapshotter spent on this thread,
        ``None`` when it was skipped (no free slot in time: :attr:`skipped` says why and which sections).

        Args:
            notice: a preemption notice's deadline fields for the profile row (may be empty).
            replica_interval: the interval ``replica_every`` counts in (the policy's, fixed or adaptive).
            persist: False: the holder keeps it in memory only (the schedule's ``persist_every``).
        """
        due = self._replicas.due(step, replica_interval, always=milestone or kind is CheckpointKind.PREEMPT)
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
            persist=persist,
            replicas=self._replicas.replicas if due else 0,
            replica_label=self._replicas.label,
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
                generation=self._holder.generation,
            )
        except SnapshotSkipped as e:
            self.skipped = (str(e), sorted(sections))
            logger.warning("cf_ray: rank %d: the checkpoint of step %d is %s; training goes on", self.rank, step, e)
            return None

    @property
    def holder(self) -> Any:
        """This node's holder actor (a new one after the old one died)."""
        return self._holder.holder

    @property
    def generation(self) -> int:
        """This attempt's generation (names the snapshot in the holder)."""
        return self._holder.generation

    @generation.setter
    def generation(self, generation: int) -> None:
        self._holder.generation = generation

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
            section, key = SHARED, OBJECTS
        else:
            section, key = rank_section(self.rank), STATE
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
            OBJECTS: {name: obj.state_dict() for name, obj in self.data.items()},
            RNG: rng_state(),
            # rank and world_size: a restore checks that a rank's section is that rank's.
            COUNTERS: {"step": step, "epoch": epoch, "rank": self.rank, "world_size": self.world_size},
        }
        sections: dict[str, Any] = {}
        replicated = (
            {name: self._state_dict(name, obj) for name, obj in self.state.items()}
            if (self.rank == 0 or not self.replicated)
            else None
        )
        if self.replicated:
            if self.rank == 0:
                sections[SHARED] = {OBJECTS: replicated}
        else:
            rank_tree[STATE] = replicated
            if self.sharded is not None:
                rank_tree[_sharded.KEY] = self.sharded.describe()
        sections[rank_section(self.rank)] = rank_tree
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
