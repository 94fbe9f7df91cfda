"""Phase 1's hand-off to this node's holder: the slots of a section asked of it, and a typed
:class:`~cf_ray._engine.protocol.messages.Stage` naming the slots a snapshot was copied into. When
the holder is gone, or is a new one that does not know the slots (Ray restarted it), this node's
holder is found or made again and the snapshot is copied into its slots and staged once more. Also
which snapshots are copied to peers (:class:`ReplicaPlan`, :func:`replica_due`).

Hand-off: the arenas are the node's holder's shared-memory slots (``snapshot/slot_arena.py``,
``snapshot/arenas.py``): the worker copies each section once, into a slot the holder owns (so the
snapshot outlives this worker), and hands over a typed
:class:`~cf_ray._engine.protocol.messages.Stage` naming the slots, the indexes with their block
CRC-32s and each section's CRC-32 (``HolderActor.stage``): no bytes travel. There is no by-value
path through the object store (re-``put`` by the holder: two more passes on the host): cf_ray needs
Linux's ``memfd_create``, where Ray runs GPU training, and says so at once elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.protocol.messages import SlotDesc, Stage, StagedSlot, StageReply
from cf_ray._engine.worker.snapshot.arenas import SnapshotSkipped
from cf_ray._engine.worker.snapshot.job import SnapshotJob, StagedSection
from cf_ray._engine.worker.timing import Timing

logger = logging.getLogger("cf_ray")


def replica_due(step: int, every: int, interval: int | None, *, always: bool = False) -> bool:
    """Whether the snapshot of ``step`` is copied to peers (``CheckpointConfig.replica_every``):
    one in ``every``, those whose step lies in the first interval of a block of ``every`` intervals
    (the same steps on every rank and node, so the copied steps are complete); ``always`` (preemption
    checkpoints, milestones) and snapshots without an interval (manual, epoch boundaries) always."""
    if every <= 1 or always or not interval:
        return True
    return step % (every * interval) < interval


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """How this rank's snapshots are copied to peers, as the holder is told with each snapshot."""

    replicas: int = 0
    """``CheckpointConfig.replicas`` (``-1`` for automatic)."""
    label: str = ""
    """``replica_label`` (``""`` for none)."""
    every: int = 1
    """``replica_every``: one snapshot in ``every`` is copied (:func:`replica_due`)."""

    def due(self, step: int, interval: int | None, *, always: bool = False) -> bool:
        """Whether the snapshot of ``step`` is copied to peers (:func:`replica_due`)."""
        return replica_due(step, self.every, interval, always=always)


class HolderHandOff:
    """This rank's link to its node's holder for phase 1.

    Args:
        rank: this worker's rank (log lines).
        holder: this node's holder actor.
        timing: where the hand-off's timings go.
        resolve_holder: returns this node's holder, creating it when it is gone (``None``: the
            hand-off is not made again when the holder died).
    """

    def __init__(self, rank: int, holder: Any, timing: Timing, resolve_holder: Callable[[], Any] | None = None):
        self.rank = rank
        self.holder = holder
        self.generation = 0
        """This attempt's generation (names the snapshot in the holder)."""
        self._timing = timing
        self._resolve_holder = resolve_holder
        self.on_new_holder: Callable[[], None] | None = None
        """Called after a snapshot was staged again with a new holder (the snapshotter forgets the
        old slots: the next snapshot asks for new ones)."""

    def slots(self, section: str, nbytes: int, timeout_s: float | None = None) -> tuple[SlotDesc, ...]:
        """The holder's shared-memory slots of ``section`` (the snapshotter's arena source).

        ``timeout_s``: what is left of the bound of the snapshot that asks (a layout change, on the
        training thread): the call, and the one to a new holder when this one is gone, end within
        it, else :class:`SnapshotSkipped` — the snapshot is skipped, training goes on. ``None``
        (buffers made ahead, a re-stage on the background thread): each call within
        ``env.ACTOR_TIMEOUT_S``.

        Raises:
            SnapshotSkipped: ``timeout_s`` given, and the holder did not answer within it.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def ask() -> tuple[SlotDesc, ...]:
            timeout = _env.get_float(_env.ACTOR_TIMEOUT_S)
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.monotonic()))
            try:
                return tuple(ray.get(self.holder.arena.remote(section, nbytes), timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                if deadline is None:
                    raise
                raise SnapshotSkipped(
                    f"skipped: this node's holder did not give the slots of section {section} (a new layout, "
                    f"{nbytes} bytes) within the snapshot's {_env.SLOT_WAIT_S:.0f} s"
                ) from None

        try:
            return ask()
        except ray.exceptions.RayActorError:
            if self._resolve_holder is None:
                raise
            self.holder = self._resolve_holder()
            return ask()

    def hand_off(self, job: SnapshotJob, sections: dict[str, StagedSection]) -> None:
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
            if self.on_new_holder is not None:
                self.on_new_holder()
        self._timing.handed_off(job.step, job.timings)

    def _restage(self, name: str, s: StagedSection, job: SnapshotJob) -> StagedSlot:
        """Copy a staged section from its old slot (mapped here) into a slot of the current holder."""
        descs = self.slots(name, s.arena.nbytes)
        slot = _slots.WriterSlot(descs[0], s.arena.nbytes)
        try:
            if not slot.try_fill():
                raise RuntimeError(f"the new holder's slot of {name} is busy")
            slot.data()[:] = s.arena.data
            desc = slot.seal(self.generation, job.step)
        finally:
            slot.close()
        return StagedSlot(section=name, slot=desc, index=s.index, crc32=s.crc32)
