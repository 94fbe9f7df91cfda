"""The late capture of a snapshot (:class:`LateCapture`).

Late state: the tracked objects that are neither modules nor optimizers (LR schedulers, AMP's grad
scaler, user objects) are small and cannot change the weights, and users step a per-iteration
scheduler *after* ``ckpt.step(optimizer)``. So their ``state_dict()`` (and the optimizers'
``param_groups``, where a scheduler writes the learning rate) is taken again at the start
of the next Checkpointer call (``step()``, ``update()``, ``end_epoch()``, ``save()``, ``wait()``,
``finish()``, ...; :meth:`LateCapture.capture`), before that call's guard, and written into
the slots the snapshot reserved for them: a checkpoint then holds the scheduler as it is after the
scheduler's step of that iteration, and ``resume`` continues bitwise. The model, the optimizer, the
RNG states and the data positions stay those of the checkpoint's step. The background thread waits
for that capture (at most :attr:`LateCapture.wait_s`, :meth:`LateCapture.seal`) before the hand-off; when the next call does not come in
time (or the object's layout changed), the state taken at the step is kept, with a warning once.
A preemption checkpoint captures it at once (its ``wait()`` is the next call).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.layout import COUNTERS
from cf_ray._engine.worker.snapshot.job import LateObject, LateSlot, SnapshotJob

logger = logging.getLogger("cf_ray")

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


def late_slots(flats: dict[str, _codec.Flat], late: dict[str, list[LateObject]]) -> list[LateSlot]:
    """Where each late object's state lies in a snapshot's sections (those it can be found in)."""
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


class LateCapture:
    """The late objects of the snapshot in flight: taken again at the next call, sealed before the
    hand-off.

    Args:
        rank: this worker's rank (log lines).
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.wait_s = 5.0
        """How long the background thread waits for :meth:`capture` before the hand-off."""
        self._job: SnapshotJob | None = None
        self._warned = False

    def expect(self, job: SnapshotJob) -> None:
        """``job`` was just begun: its late objects (if any) are taken at the next call."""
        if job.late:
            self._job = job
        else:
            job.late_ready.set()

    def capture(self, next_epoch: int | None = None) -> float:
        """At the start of the call after a snapshot's: take the late objects' state again, into the
        slots the snapshot reserved for them. Returns seconds spent (0 when nothing was waiting).

        Args:
            next_epoch: the call is ``end_epoch()`` right after the snapshot's step (the epoch's last):
                what is taken now holds the epoch's end (a per-epoch scheduler stepped before it), so
                the snapshot's counters say it resumes at ``next_epoch`` (the resumed loop then does
                not step them again)."""
        job, self._job = self._job, None
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

    def seal(self, job: SnapshotJob) -> None:
        """Wait (at most :attr:`wait_s`) for the late capture; from here on the job is not changed."""
        if not job.late:
            return
        captured = job.late_ready.wait(self.wait_s)
        with job.lock:
            job.sealed = True
        if not captured:
            self._warn(
                f"the next Checkpointer call did not come within {self.wait_s:.0f} s of the "
                f"checkpoint of step {job.step}"
            )

    def _capture(self, job: SnapshotJob, slot: LateSlot) -> None:
        try:
            new = _codec.flatten(slot.state_fn(), prefix=".".join(slot.path))
        except Exception as e:  # noqa: BLE001 - the state taken at the step is kept
            self._warn(f"state_dict() of {'.'.join(slot.path[1:])!r} failed at the next call ({e!r})")
            return
        layout = tuple((e.name, e.dtype, e.shape, e.kind) for e in new.entries)
        if layout != slot.layout:
            self._warn(
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

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "cf_ray: rank %d: %s; the checkpoint keeps that object's state as it was at the "
                "checkpoint's step (a scheduler stepped after ckpt.step() then resumes one step behind; "
                "step it inside `with ckpt.update():` instead)",
                self.rank,
                why,
            )


def _resume_at_epoch(job: SnapshotJob, epoch: int) -> None:
    """The snapshot's counters (every section that has them) and its metadata say ``epoch``."""
    for flat in job.flats.values():
        counters = flat.tree.get(COUNTERS) if isinstance(flat.tree, dict) else None
        if isinstance(counters, dict) and "epoch" in counters:
            counters["epoch"] = epoch
    if dataclasses.is_dataclass(job.meta) and hasattr(job.meta, "epoch"):
        job.meta = dataclasses.replace(job.meta, epoch=epoch)  # pyright: ignore[reportArgumentType]
