"""Test helpers: a snapshot's bytes handed to a holder as a worker of its node hands them over
(copied into one of the holder's slots, with the CRC-32 of every block, then ``stage``)."""

from __future__ import annotations

import numpy as np

from cf_ray._engine.format.blocks import BLOCK_BYTES, block_crcs, with_blocks
from cf_ray._engine.memory import crc as _crc
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.protocol.messages import SlotDesc, SnapshotMeta, Stage, StagedSlot


def fill_slot(descs, generation: int, step: int, arena: np.ndarray) -> SlotDesc:
    """Copy ``arena`` into the free slot of ``descs`` holding the older fill; its filled descriptor."""
    slots = [_slots.WriterSlot(d, arena.nbytes) for d in descs]
    try:
        order = sorted(range(2), key=lambda k: (slots[k].header().state == _slots.READY, slots[k].header().step))
        for k in [*order, *range(2, len(slots))]:
            if slots[k].try_fill():
                if arena.nbytes:
                    slots[k].data()[:] = arena.data
                return slots[k].seal(generation, step)
        raise RuntimeError("every slot is held")
    finally:
        for s in slots:
            s.close()


def staged_slot(descs, generation: int, step: int, section: str, arena: np.ndarray, index: bytes) -> StagedSlot:
    crcs = block_crcs(arena)
    return StagedSlot(
        section=section,
        slot=fill_slot(descs, generation, step, arena),
        index=with_blocks(index, crcs),
        crc32=_crc.combine_blocks(crcs, BLOCK_BYTES, arena.nbytes),
    )


def stage_bytes(ray, holder, generation: int, step: int, sections: dict, meta: SnapshotMeta, timeout: float = 60):
    """``sections``: ``{name: (arena, index)}`` staged with the holder actor ``holder``; its reply."""
    staged = []
    for name, (arena, index) in sections.items():
        descs = ray.get(holder.arena.remote(name, arena.nbytes), timeout=timeout)
        staged.append(staged_slot(descs, generation, step, name, arena, index))
    msg = Stage(generation=generation, step=step, meta=meta, sections=tuple(staged))
    return ray.get(holder.stage.remote(msg), timeout=timeout)


def in_process_slots(phase1):
    """Give a worker's ``Phase1`` built without a holder (``holder=None``) a holder's slots made in
    this process (``SlotStore``), as its snapshotter's arena source; returns the store."""
    from cf_ray._engine.node.slot_store import SlotStore

    store = SlotStore("test")
    phase1._snap.arenas.source = store.arena
    return store
