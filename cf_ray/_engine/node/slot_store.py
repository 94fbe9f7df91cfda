"""The holder's memory: the slots its node's workers fill, the copies it keeps for holders of other
nodes, what holds them, and when they are freed. One lock, no thread, no Ray.

**Slots of this node's sections.** Per section :data:`SLOTS_PER_SECTION` slot files
(``memory/slots.py``), made on the first snapshot of that size: the worker fills the older of the
first two, and the third (the *spare*) only when this holder holds both (one being written, one
pinned): the spare's pages are taken only then. So the memory per section is two slots, plus one
while a milestone, a preemption checkpoint or the protected copied step (below) is held.

**Pins** are shared locks (``ReadLock``) this holder keeps on a slot so that the worker does not fill
it again: ``write`` for a milestone or preemption checkpoint until it is written, and for every
section of a step whose writing has started (the writer takes the lock over to write from it);
``protect`` for the protected copied step.

**The protected copied step.** With ``replica_every`` above 1 only some steps are copied to
other nodes, and after a node loss only a copied step can be restored from memory — if this holder
still has its *own* sections of it too. So the newest copied step that is complete as far as this
holder can tell (every own section of it copied to a peer, and a copy of it from every origin whose
copies of the previously protected step this holder keeps) is protected: its own slots pinned, its
copies kept, until a newer step is complete or a commit at least as new makes memory restores of it
pointless. Without that, a step not copied would be staged over the survivor's own slot of the
copied step (the slot the worker alternates to while the other is being written), and the restore
after a node loss would fall back to storage.

**Peer copies.** A copy of another node's section is received into a slot file of its own,
sealed once complete (nothing can change it afterwards). Per (origin holder, section): the copy of
the protected step and the newest other one at most (one of them may be being received).

**Freeing.** A commit ``(g, s)`` (the controller's ``forget``) frees the copies older than
it and the slots of every section whose newest snapshot here is older than the commit (older in
``(generation, step)`` order: a late commit of an older generation frees nothing of a newer one's):
its rank was on another node at that step (re-placed, an elastic resize), no memory restore can
take it (memory is taken only when at least as new as storage), and its slots go unless a
write still needs them. So what a holder holds is bounded by the sections of the ranks on its node.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.memory.slots import ReadLock, Slot
from cf_ray._engine.protocol.messages import SlotDesc, SnapshotMeta

#: Slot files per section of this node: two the worker alternates between, and a spare.
SLOTS_PER_SECTION = 3
#: Copied steps whose completeness is tracked (the newest).
_TRACKED_STEPS = 8

Key = tuple[int, int, str]
When = tuple[int, int]


@dataclass(slots=True)
class Held:
    """One section of one snapshot this holder has: its own (a worker of this node filled the slot)
    or a copy of another node's (``origin`` names that node's holder)."""

    generation: int
    step: int
    section: str
    slot: SlotDesc
    """The filled slot (``seq`` names the fill)."""
    index: bytes
    """The encoded index, with the CRC-32 of every block of the data."""
    crc32: int
    """The data's CRC-32."""
    meta: SnapshotMeta
    origin: str = ""
    origin_node: str = ""
    copy_s: float = 0.0
    """For a copy: seconds from the start of its transfer to this holder owning it."""

    @property
    def key(self) -> Key:
        return (self.generation, self.step, self.section)

    @property
    def when(self) -> When:
        return (self.generation, self.step)

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes


def _older(when: When, than: When) -> bool:
    """Whether a snapshot at ``when`` can no longer be restored from memory once ``than`` is committed:
    ``(generation, step)`` in order. An older generation's step, however high, belongs to a timeline a
    newer attempt replaced; a newer generation's step, however low, is not older than a late commit
    of an older generation (freeing it would make the worker stage into slots its holder no longer knows)."""
    return when < than


class SlotStore:
    """The slots and copies of one holder (module doc).

    Args:
        run: the run key (in every slot file's name).
    """

    def __init__(self, run: str):
        self._run = run or "run"
        self._lock = threading.Lock()
        self._sets: dict[str, list[Slot]] = {}
        self._fills: dict[str, dict[str, Held]] = {}  # section -> slot name -> the fill staged in it
        self._newest: dict[str, When] = {}  # section -> the newest step staged here
        self._copies: dict[tuple[str, str], list[tuple[Held, Slot]]] = {}  # oldest first
        self._copy_seq = 0
        self._pins: dict[tuple[Key, str], ReadLock] = {}
        self._due: dict[When, set[str]] = {}  # own sections of a copied step
        self._copied: dict[When, set[str]] = {}  # of those, copied to a peer
        self._protected: When | None = None

    # -- this node's sections ----------------------------------------------------------------------
    def arena(self, section: str, nbytes: int, timeout_s: float | None = None) -> tuple[SlotDesc, ...]:  # noqa: ARG002
        """The slots of ``section`` for snapshots of ``nbytes`` (made on first use, made again when the
        size changed: the old ones are then freed, their fills unreadable). ``timeout_s``: as a
        worker's arena source is asked (in process, nothing here waits on another process)."""
        with self._lock:
            slots = self._sets.get(section)
            if slots is None or slots[0].nbytes != nbytes:
                if slots is not None:
                    self._free_set(section)
                slots = [Slot(_slots.memfd_name(self._run, section, k), nbytes) for k in range(SLOTS_PER_SECTION)]
                self._sets[section] = slots
                self._fills[section] = {}
            return tuple(s.desc for s in slots)

    def known(self, desc: SlotDesc) -> bool:
        """Whether ``desc`` is one of this holder's slots (not one of a previous life's)."""
        with self._lock:
            return any(s.desc.name == desc.name and s.desc.ino == desc.ino for sl in self._sets.values() for s in sl)

    def add_own(self, held: Held) -> None:
        """A worker of this node staged ``held``: the fill its slot holds now."""
        with self._lock:
            fills = self._fills.setdefault(held.section, {})
            fills[held.slot.name] = held
            if held.when > self._newest.get(held.section, (-1, -1)):
                self._newest[held.section] = held.when
            if held.meta.replicas != 0:
                self._due.setdefault(held.when, set()).add(held.section)
                for old in sorted(self._due)[:-_TRACKED_STEPS]:
                    self._due.pop(old, None)
                    self._copied.pop(old, None)

    # -- finding and holding -----------------------------------------------------------------------
    def find(self, generation: int, step: int, section: str) -> Held | None:
        """The section of that step, if this holder has it (its own, or a copy)."""
        with self._lock:
            for h in self._fills.get(section, {}).values():
                if h.when == (generation, step):
                    return h
            for (_, sec), kept in self._copies.items():
                for h, _slot in kept:
                    if sec == section and h.when == (generation, step):
                        return h
        return None

    def own(self) -> list[Held]:
        with self._lock:
            return [h for fills in self._fills.values() for h in fills.values()]

    def copies(self) -> list[Held]:
        """The copies this holder keeps for holders of other nodes."""
        with self._lock:
            return [h for kept in self._copies.values() for h, _ in kept]

    def take(self, held: Held, *, wait_s: float = 0.0) -> ReadLock | None:
        """A shared lock on ``held``'s slot and its data (through the slot's kept mapping,
        :meth:`Slot.reader`), or ``None`` when the slot holds another fill now."""
        with self._lock:
            mapping = self._reader_of(held)
        return _lock_slot(held, mapping, wait_s)

    def _reader_of(self, held: Held):
        """The kept read-only mapping of ``held``'s slot, when this holder still has that slot (under
        the lock); ``None``: the lock maps it itself (and finds it gone)."""
        mine = [*self._sets.get(held.section, ()), *(s for _, s in self._copies.get((held.origin, held.section), ()))]
        for slot in mine:
            if (slot.desc.name, slot.desc.ino) == (held.slot.name, held.slot.ino):
                return slot.reader()
        return None

    def pin(self, held: Held, reason: str) -> bool:
        """Keep ``held``'s slot from being filled again (``reason``: ``write`` or ``protect``);
        False when it already holds another fill."""
        with self._lock:
            if (held.key, reason) in self._pins:
                return True
            lk = _lock_slot(held, self._reader_of(held))
            if lk is None:
                return False
            self._pins[(held.key, reason)] = lk
            return True

    def take_pin(self, key: Key, reason: str) -> ReadLock | None:
        """Hand a pin over to the caller (who closes it)."""
        with self._lock:
            return self._pins.pop((key, reason), None)

    def unpin(self, key: Key, reason: str) -> None:
        lk = self.take_pin(key, reason)
        if lk is not None:
            lk.close()

    # -- copies for other nodes -------------------------------------------------------------------
    def new_copy(self, origin: str, origin_node: str, section: str, nbytes: int) -> Slot:
        """A slot file to receive a copy of ``origin``'s ``section`` into; the older copies of it are
        dropped first but the protected step's and one other (module doc)."""
        with self._lock:
            kept = self._copies.get((origin, section), [])
            keep = [c for c in kept if c[0].when == self._protected]
            others = [c for c in kept if c[0].when != self._protected]
            if not keep and others:
                keep.append(others.pop())  # the newest: nothing newer is complete yet
            for _, slot in others:
                slot.close()
            self._copies[(origin, section)] = sorted(keep, key=lambda c: c[0].when)
            self._copy_seq += 1
            name = _slots.memfd_name(self._run, f"{section}.from.{origin_node[:12] or 'peer'}", self._copy_seq)
        return Slot(name, nbytes, sealable=True)

    def add_copy(self, held: Held, slot: Slot) -> None:
        """A complete, checked, sealed copy: kept (and the protected step may move on)."""
        with self._lock:
            kept = self._copies.setdefault((held.origin, held.section), [])
            kept.append((held, slot))
            kept.sort(key=lambda c: c[0].when)
            while len(kept) > 2:  # a copy received meanwhile: the newest two
                kept.pop(0)[1].close()
            self._advance()

    def note_copied(self, held: Held) -> None:
        """An own section of a copied step has a copy on a peer now."""
        with self._lock:
            if held.when in self._due:
                self._copied.setdefault(held.when, set()).add(held.section)
                self._advance()

    # -- the protected copied step ----------------------------------------------------------------
    def protected(self) -> When | None:
        with self._lock:
            return self._protected

    def _copy_sections(self, when: When | None) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for (origin, sec), kept in self._copies.items():
            if any(h.when == when for h, _ in kept):
                out.setdefault(origin, set()).add(sec)
        return out

    def _complete(self, when: When) -> bool:
        own = self._due.get(when)
        if not own or not own <= self._copied.get(when, set()):
            return False
        theirs, before = self._copy_sections(when), self._copy_sections(self._protected)
        return all(secs <= theirs.get(origin, set()) for origin, secs in before.items())

    def _advance(self) -> None:
        """Protect the newest complete copied step newer than the protected one (under the lock)."""
        newer = [w for w in self._due if (self._protected is None or w > self._protected) and self._complete(w)]
        if not newer:
            return
        when = max(newer)
        held = [h for fills in self._fills.values() for h in fills.values() if h.when == when]
        pinned = []
        for h in held:
            lk = _lock_slot(h, self._reader_of(h))
            if lk is None:  # filled again already: this step cannot be kept whole
                for key in pinned:
                    self._pins.pop((key, "protect")).close()
                return
            self._pins[(h.key, "protect")] = lk
            pinned.append(h.key)
        self._release_protection()
        self._protected = when

    def _release_protection(self) -> None:
        for key, reason in [k for k in self._pins if k[1] == "protect" and k[0][:2] == self._protected]:
            self._pins.pop((key, reason)).close()
        self._protected = None

    # -- freeing ---------------------------------------------------------------------------------
    def committed(self, generation: int, step: int, pending: set[Key]) -> None:
        """Checkpoint ``(generation, step)`` is on storage: free what no restore can take any more
        (module doc); ``pending``: the sections the writer still has to write (kept)."""
        than = (generation, step)
        with self._lock:
            for key in list(self._copies):
                kept = []
                for h, slot in self._copies[key]:
                    if _older(h.when, than):
                        slot.close()
                    else:
                        kept.append((h, slot))
                if kept:
                    self._copies[key] = kept
                else:
                    del self._copies[key]
            if self._protected is not None and _older(self._protected, than):
                self._release_protection()
            needed = {k[2] for k in pending} | {k[0][2] for k in self._pins}
            for section in list(self._sets):
                if section not in needed and _older(self._newest.get(section, (-1, -1)), than):
                    self._free_set(section)

    def _free_set(self, section: str) -> None:
        for key in [k for k in self._pins if k[0][2] == section]:
            self._pins.pop(key).close()
        for slot in self._sets.pop(section, []):
            slot.close()
        self._fills.pop(section, None)
        self._newest.pop(section, None)

    # -- accounting ------------------------------------------------------------------------------
    def held_bytes(self) -> dict:
        """``slots``: resident bytes of this node's sections' slots; ``copies``: of the copies kept
        for other nodes; ``sections``/``copied_sections``: how many of each."""
        with self._lock:
            own = sum(s.resident_bytes() for sl in self._sets.values() for s in sl)
            theirs = sum(slot.resident_bytes() for kept in self._copies.values() for _, slot in kept)
            return {"slots": own, "copies": theirs, "sections": len(self._sets), "copied_sections": len(self._copies)}

    def close(self) -> None:
        with self._lock:
            for lk in self._pins.values():
                lk.close()
            self._pins.clear()
            for section in list(self._sets):
                self._free_set(section)
            for kept in self._copies.values():
                for _, slot in kept:
                    slot.close()
            self._copies.clear()


def _lock_slot(held: Held, mapping, wait_s: float = 0.0) -> ReadLock | None:
    try:
        return ReadLock.take(held.slot, held.generation, held.step, wait_s=wait_s, mapping=mapping)
    except _slots.SlotGone:
        return None


__all__ = ["SLOTS_PER_SECTION", "Held", "SlotStore"]
