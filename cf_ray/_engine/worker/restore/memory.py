"""Reading a section of a memory candidate (a snapshot its holders keep): from the holder that took
it, else from a holder of another node with a copy (a peer replica: the section's own node may be
lost); in place from a slot of a holder of this node (mapped read-only), over a direct transfer from
a holder of another node (``memory/wire.py``). Every byte is checked against its block's CRC-32
before anything uses it (``integrity.py``); a copy that fails is refused and the next one tried.
"""

from __future__ import annotations

import logging
import os
from typing import cast

import numpy as np
import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.format.sections import Section, parse_index_blocks
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.memory import wire as _wire
from cf_ray._engine.protocol.messages import MemorySnapshot, SectionAt, SlotDesc, StreamDesc
from cf_ray._engine.worker.restore import integrity as _integrity
from cf_ray._engine.worker.restore.record import RestoreRecord
from cf_ray._engine.worker.restore.storage import describe
from cf_ray.errors import CorruptCheckpointError

logger = logging.getLogger("cf_ray")


class MemoryReader:
    """This rank's reads of memory candidates.

    Args:
        rank: this rank.
        record: where the bytes read (by how) and the copies refused are kept.
    """

    def __init__(self, rank: int, record: RestoreRecord):
        self.rank = rank
        self.record = record

    def section(self, cand: MemorySnapshot, section: str) -> Section:
        """A section from the memory of its holder, else of a holder of another node with a copy
        (a peer replica: the section's own node may be lost): in place from a slot of a holder of
        this node, over a direct transfer from a holder of another node (``memory/wire.py``)."""
        first = cand.sections.get(section)
        if first is None:
            raise LookupError(f"no holder has section {section}")
        errors: list[str] = []
        bad: list[CorruptCheckpointError] = []
        holders = (first, *cand.replicas.get(section, ()))
        for holder_name in holders:
            try:
                holder = ray.get_actor(holder_name, namespace=_env.namespace())
                at = self._ask(holder, holder_name, cand, section)
                if isinstance(at.where, StreamDesc):
                    try:
                        arena = _wire.fetch(at.where, _env.get_float(_env.ACTOR_TIMEOUT_S))
                    except (OSError, LookupError):
                        holder.withdraw_offer.remote(at.where.token)  # its slot is released now
                        raise
                    how = "direct"
                else:
                    arena, how = self._map_slot(at.where, cand, section), "in_place"
            except (ValueError, LookupError, OSError, ray.exceptions.RayError) as e:
                errors.append(f"{holder_name}: {describe(e)}")
                continue
            try:  # every byte checked against its block's CRC-32 before anything uses it (integrity.py)
                got = self._memory_section(at, arena, section)
                _integrity.verify_section(got, f"section {section} of step {cand.step} from {holder_name} ({how})")
            except CorruptCheckpointError as e:
                errors.append(f"{holder_name}: {describe(e)}")
                bad.append(e)
                self.record.refusals.refuse(
                    e,
                    generation=cand.generation,
                    step=cand.step,
                    section=section,
                    holder=holder_name,
                    how=how,
                    next_="trying the next copy" if holder_name != holders[-1] else "trying the next checkpoint",
                )
                continue
            if holder_name != first:
                logger.warning(
                    "cf_ray: rank %d: %s of step %d from a peer's copy (%s)", self.rank, section, cand.step, holder_name
                )
            self.record.count(how, arena.nbytes)
            return got
        if bad:  # damage, not a copy gone: the snapshot is refused as damaged
            raise CorruptCheckpointError(
                f"no intact copy of section {section} of step {cand.step}: {'; '.join(errors)}"
            )
        raise LookupError(f"no copy of section {section} of step {cand.step} could be read: {'; '.join(errors)}")

    @staticmethod
    def _node_id() -> str:
        try:
            return ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside Ray: every memory read is then a stream
            return ""

    def _ask(self, holder, holder_name: str, cand: MemorySnapshot, section: str) -> SectionAt:
        """Where ``holder`` has ``section`` of the candidate's step."""
        got = ray.get(
            holder.get_section.remote(cand.generation, cand.step, section, self._node_id()),
            timeout=_env.get_float(_env.ACTOR_TIMEOUT_S),
        )
        if got is None:
            raise LookupError(f"holder {holder_name} no longer has section {section} of step {cand.step}")
        return cast(SectionAt, got)

    @staticmethod
    def _map_slot(desc: SlotDesc, cand: MemorySnapshot, section: str) -> np.ndarray:
        """A section in a snapshot slot of a holder of this node, mapped read-only and read in place
        (the restore loads from it: no copy out of the slot first). The mapping stays as long as
        the arrays that view it."""
        lk = _slots.ReadLock.take(desc, cand.generation, cand.step, wait_s=1.0, populate=True)
        if lk is None:
            raise LookupError(f"the slot of section {section} of step {cand.step} was filled again since")
        arr = np.frombuffer(lk.data, dtype=np.uint8)
        # No snapshot is taken while this attempt restores, so nothing fills the slot meanwhile; the
        # shared lock is released now (a reader never blocks the next snapshot); the mapping stays
        # as long as the array that views it.
        _slots.unlock(lk.fd)
        os.close(lk.fd)
        return arr

    @staticmethod
    def _memory_section(at: SectionAt, arena: np.ndarray, section: str) -> Section:
        """The section from the bytes a holder gave and its index (which carries the CRC-32 of every
        block: ``at.index``; of the whole: ``at.crc32``). A streamed buffer is this process's own."""
        tree, entries, blocks = parse_index_blocks(at.index, f"memory:{section}")
        return Section(tree, entries, arena, private=isinstance(at.where, StreamDesc), blocks=blocks)
