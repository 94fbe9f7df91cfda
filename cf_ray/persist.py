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
call. A queued entry is replaced, not added to, when a newer one of the same section arrives (one persist in flight per section; intermediate snapshots that storage
cannot keep up with are skipped, never queued without bound).

Failure: an exception while writing is reported to the controller (``part_failed``) with the rank,
step and error; the thread goes on with the next entry; nothing is committed for that step, so the
previous committed checkpoint stays the latest.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from cf_ray import manifest as mf
from cf_ray.storage import Storage

logger = logging.getLogger("cf_ray")


@dataclass(slots=True)
class _Entry:
    generation: int
    step: int
    section: str
    ref: Any  # ObjectRef of the uint8 arena, owned by this holder
    index: bytes
    nbytes: int
    meta: dict = field(default_factory=dict)
    staged_at: float = 0.0


class Holder:
    """The holder's logic (the Ray actor class is :data:`HolderActor`)."""

    def __init__(self, run_key: str, storage: Storage, controller_name: str, namespace: str):
        self.run_key = run_key
        self.storage = storage
        self.controller_name = controller_name
        self.namespace = namespace
        self._lock = threading.Condition()
        self._latest: dict[str, list[_Entry]] = {}  # section -> the two newest entries, oldest first
        self._pending: dict[str, _Entry] = {}
        self._urgent: list[_Entry] = []  # displaced milestone/priority entries, written first
        self._writing: _Entry | None = None
        self._controller = None
        self._closed = False
        self._thread = threading.Thread(target=self._writer, name="cf_ray-persist", daemon=True)
        self._thread.start()

    def _ctl(self):
        if self._controller is None:
            self._controller = ray.get_actor(self.controller_name, namespace=self.namespace)
        return self._controller

    # -- called by workers -------------------------------------------------------------------
    def stage(self, generation: int, step: int, sections: dict[str, tuple[np.ndarray, bytes]], meta: dict) -> dict:
        """Take ownership of a snapshot's sections and queue them for persisting."""
        t0 = time.perf_counter()
        entries = []
        for name, (arena, index) in sections.items():
            # The argument lives in an object owned by the calling worker; re-put it so that this
            # holder owns the bytes and they survive the worker.
            ref = ray.put(arena)
            entries.append(_Entry(generation, step, name, ref, bytes(index), int(arena.nbytes), dict(meta), time.time()))
        put_s = time.perf_counter() - t0
        superseded = []
        with self._lock:
            for e in entries:
                kept = self._latest.setdefault(e.section, [])
                kept.append(e)
                del kept[:-2]
                old = self._pending.get(e.section)
                if old is not None and (old.meta.get("milestone") or old.meta.get("priority")):
                    # Milestones and preemption checkpoints are never skipped: write the newer one
                    # right after instead (a second slot, only in this case).
                    self._urgent.append(old)
                elif old is not None:
                    superseded.append((old.generation, old.step, old.section))
                if meta.get("persist", True):
                    self._pending[e.section] = e
            self._lock.notify_all()
        ctl = self._ctl()
        node = ray.get_runtime_context().get_node_id()
        for e in entries:
            ctl.part_staged.remote(e.generation, e.step, e.section, self._name(), e.nbytes,
                                   dict(meta, holder_put_s=put_s, node_id=node))
        for gen, st, sec in superseded:
            ctl.part_superseded.remote(gen, st, sec)
        return {"put_s": put_s}

    def get_section(self, generation: int, step: int, section: str) -> list | None:
        """``[ObjectRef of the arena, index bytes]`` if held, else ``None``."""
        with self._lock:
            for e in (*self._latest.get(section, ()), *self._urgent, self._writing, self._pending.get(section)):
                if e is not None and e.section == section and e.generation == generation and e.step == step:
                    return [e.ref, e.index]
        return None

    def idle(self) -> bool:
        with self._lock:
            return not self._pending and not self._urgent and self._writing is None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _name(self) -> str:
        return ray.get_runtime_context().get_actor_name() or ""

    # -- writer thread -------------------------------------------------------------------------
    def _next(self) -> _Entry | None:
        with self._lock:
            while not self._pending and not self._urgent and not self._closed:
                self._lock.wait(timeout=1.0)
            if self._urgent:
                self._writing = self._urgent.pop(0)
                return self._writing
            if not self._pending:
                return None
            # Priority first (preemption), then the oldest step, so commits happen in step order.
            key = min(self._pending, key=lambda k: (not self._pending[k].meta.get("priority", False),
                                                  self._pending[k].step, k))
            entry = self._pending.pop(key)
            self._writing = entry
            return entry

    def _writer(self) -> None:
        while True:
            entry = self._next()
            if entry is None:
                return
            t0 = time.perf_counter()
            try:
                arena = ray.get(entry.ref)
                directory = mf.step_dir(entry.step)
                files = mf.write_section(self.storage, directory, entry.generation, entry.section, arena, entry.index)
                del arena
                persist_s = time.perf_counter() - t0
                self._ctl().part_durable.remote(entry.generation, entry.step, entry.section,
                                                {k: v.to_json() for k, v in files.items()}, persist_s)
            except Exception as e:  # noqa: BLE001 - never kill the thread; the controller reports it
                logger.warning("cf_ray: persisting %s of step %d failed: %r", entry.section, entry.step, e)
                try:
                    self._ctl().part_failed.remote(entry.generation, entry.step, entry.section,
                                                   f"{type(e).__name__}: {e}")
                except Exception:  # noqa: BLE001
                    logger.exception("cf_ray: could not report a persist failure to the controller")
            finally:
                with self._lock:
                    self._writing = None
                    self._lock.notify_all()


HolderActor = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=0)(Holder)


def holder_name(run_key: str, node_id: str) -> str:
    return f"cf_ray.holder.{run_key}.{node_id}"


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
    ).remote(run_key, storage, controller_name, namespace)
