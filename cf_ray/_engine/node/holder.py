"""Phase 2: the per-node holder actor keeps the newest snapshot of every section in the Ray object
store (owned by the holder, so it outlives the worker that took it) and a writer thread streams it
to storage, then tells the controller that the section is durable.

One holder per (run, node), named ``cf_ray.holder.<run key>.<node id>``, ``num_cpus=0``, detached,
pinned to its node. The writer runs in the holder's process, not in the training process, so a
persist never takes the training process's GIL, and a persist that has started finishes even when
the worker that staged it dies.

Bounded memory: per section the holder keeps the two newest staged entries (the newest may be
incomplete across ranks when a worker dies in the middle of a snapshot; the one before is then the
newest complete one), so ``2 x`` the section size, plus transiently the argument of a ``stage``
call.

Coalescing is per *checkpoint*, not per section: the writer finishes every section of the step it
has started, then takes the oldest step waiting; a newer snapshot supersedes the whole of an older
one that has not started (every one of its sections), never a part of it. So when storage is
slower than the interval, intermediate snapshots are skipped and the ones written are complete
and commit; with per-section replacement each section could end up belonging to a different step,
and nothing would commit until storage caught up. Milestones and preemption checkpoints are never
superseded (priority ones are written first).

Failure: an exception while writing is reported to the controller (``part_failed``) with the rank,
step and error; the thread goes on with the next entry; nothing is committed for that step, so the
previous committed checkpoint stays the latest.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from cf_ray._engine.driver.messages import PartDurable, PartFailed, PartStaged, PartSuperseded, SnapshotMeta
from cf_ray._engine.driver.naming import holder_name
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")


@dataclass(slots=True)
class _Entry:
    """One section of one snapshot, held by this holder."""

    generation: int
    step: int
    section: str
    ref: Any
    """ObjectRef of the uint8 arena, owned by this holder."""
    index: bytes
    """The section's encoded tensor index (``manifest.encode_index``)."""
    size_bytes: int
    """Size of the arena."""
    meta: SnapshotMeta
    """What the rank that staged it said of the snapshot."""


class Holder:
    """The holder's logic (the Ray actor class is :data:`HolderActor`)."""

    def __init__(self, storage: Storage, controller_name: str, namespace: str):
        self.storage = storage
        self.controller_name = controller_name
        self.namespace = namespace
        self._lock = threading.Condition()
        self._latest: dict[str, list[_Entry]] = {}  # section -> the two newest entries, oldest first
        # (generation, step) -> section -> entry, staged and not started; at most one ordinary
        # step (newer ones supersede it) besides milestones and priority checkpoints.
        self._waiting: dict[tuple[int, int], dict[str, _Entry]] = {}
        self._current: tuple[int, int] | None = None  # the step being written
        self._current_left: dict[str, _Entry] = {}  # its sections not yet started
        # Steps whose writing has started (newest last, bounded): never superseded, and finished
        # first when a section of theirs arrives late (another rank's stage call came after the
        # writer had moved on), so that nothing half-written is left behind.
        self._started: list[tuple[int, int]] = []
        self._writing: _Entry | None = None
        self._controller = None
        self._thread = threading.Thread(target=self._writer, name="cf_ray-persist", daemon=True)
        self._thread.start()

    def _ctl(self):
        if self._controller is None:
            self._controller = ray.get_actor(self.controller_name, namespace=self.namespace)
        return self._controller

    # -- called by workers -------------------------------------------------------------------
    def stage(self, generation: int, step: int, sections: dict[str, tuple[np.ndarray, bytes]],
              meta: SnapshotMeta) -> dict:
        """Take ownership of a snapshot's sections and queue them for persisting."""
        t0 = time.perf_counter()
        entries = []
        for name, (arena, index) in sections.items():
            # The argument lives in an object owned by the calling worker; re-put it so that this
            # holder owns the bytes and they survive the worker.
            ref = ray.put(arena)
            entries.append(_Entry(generation, step, name, ref, bytes(index), int(arena.nbytes), meta))
        put_s = time.perf_counter() - t0
        superseded = []
        key = (generation, step)
        with self._lock:
            for e in entries:
                kept = self._latest.setdefault(e.section, [])
                kept.append(e)
                del kept[:-2]
            if meta.persist:
                if key == self._current:  # a late section of the step being written
                    self._current_left.update({e.section: e for e in entries})
                else:
                    self._waiting.setdefault(key, {}).update({e.section: e for e in entries})
                    for older in [k for k in self._waiting if k < key]:
                        if older in self._started or any(e.meta.milestone or e.meta.priority
                                                         for e in self._waiting[older].values()):
                            continue  # never skipped
                        superseded += [(e.generation, e.step, e.section) for e in self._waiting.pop(older).values()]
            self._lock.notify_all()
        ctl = self._ctl()
        node = ray.get_runtime_context().get_node_id()
        for e in entries:
            ctl.part_staged.remote(PartStaged(generation=e.generation, step=e.step, section=e.section,
                                              holder=self._name(), nbytes=e.size_bytes, meta=meta,
                                              holder_put_s=put_s, node_id=node))
        for gen, st, sec in superseded:
            ctl.part_superseded.remote(PartSuperseded(generation=gen, step=st, section=sec))
        return {"put_s": put_s}

    def get_section(self, generation: int, step: int, section: str) -> list | None:
        """``[ObjectRef of the arena, index bytes]`` if held, else ``None``."""
        with self._lock:
            waiting = [e for secs in self._waiting.values() for e in secs.values()]
            for e in (*self._latest.get(section, ()), self._writing, *self._current_left.values(), *waiting):
                if e is not None and e.section == section and e.generation == generation and e.step == step:
                    return [e.ref, e.index]
        return None

    def _name(self) -> str:
        return ray.get_runtime_context().get_actor_name() or ""

    # -- writer thread -------------------------------------------------------------------------
    def _next(self) -> _Entry:
        """The next section to write (blocks until there is one)."""
        with self._lock:
            while not self._waiting and not self._current_left:
                self._lock.wait(timeout=1.0)
            if not self._current_left:
                # Finish started steps first, then priority (preemption), then the oldest step, so
                # commits happen in step order.
                self._current = min(self._waiting, key=lambda k: (
                    k not in self._started, not any(e.meta.priority for e in self._waiting[k].values()), k))
                self._current_left = self._waiting.pop(self._current)
                if self._current not in self._started:
                    self._started.append(self._current)
                    del self._started[:-16]
            section = min(self._current_left)
            self._writing = self._current_left.pop(section)
            return self._writing

    def _writer(self) -> None:
        while True:
            entry = self._next()
            t0 = time.perf_counter()
            try:
                arena = ray.get(entry.ref)
                directory = mf.step_dir(entry.step)
                files = mf.write_section(self.storage, directory, entry.generation, entry.section, arena, entry.index)
                del arena
                persist_s = time.perf_counter() - t0
                self._ctl().part_durable.remote(PartDurable(
                    generation=entry.generation, step=entry.step, section=entry.section,
                    files={k: v.to_json() for k, v in files.items()}, persist_s=persist_s))
            except Exception as e:  # noqa: BLE001 - never kill the thread; the controller reports it
                logger.warning("cf_ray: persisting %s of step %d failed: %r", entry.section, entry.step, e)
                try:
                    self._ctl().part_failed.remote(PartFailed(generation=entry.generation, step=entry.step,
                                                              section=entry.section, error=f"{type(e).__name__}: {e}"))
                except Exception:  # noqa: BLE001
                    logger.exception("cf_ray: could not report a persist failure to the controller")
            finally:
                with self._lock:
                    self._writing = None
                    self._lock.notify_all()


HolderActor = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=0)(Holder)


def get_or_create_holder(run_key: str, storage: Storage, controller_name: str, namespace: str):
    """The holder of this node for this run (created on first use, pinned to this node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    return HolderActor.options(
        name=holder_name(run_key, node_id),
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(storage, controller_name, namespace)


__all__ = ["Holder", "HolderActor", "get_or_create_holder"]
