"""Phase 2 in the holder: the writer thread persists staged sections straight from their slots.

Coalescing is per *checkpoint*, not per section: the writer finishes every section of the step it
has started, then takes the oldest step waiting; a newer snapshot supersedes the whole of an older
one that has not started (every one of its sections), never a part of it. So when storage is slower
than the interval, intermediate snapshots are skipped and the ones written are complete and commit;
with per-section replacement each section could end up belonging to a different step, and nothing
would commit until storage caught up. Milestones and preemption checkpoints are never superseded
(priority ones are written first), and their slots are pinned from their hand-off on; so is every
section of a step once its writing has started (and a section of it that arrives late), so that a
started step is never lost in part to a refill.

A section is written with ``format/sections.py``'s ``write_section_slot`` under the slot's shared lock: the data file
with ``O_DIRECT`` straight from the mapping, its CRC-32 the worker's (combined from its blocks), so
the holder copies no byte; then the index. **Then the slot's bytes are checked against the index's
block CRCs** (one read pass, ``crc_read_bytes``): the worker checksummed them as it copied, and a
bit that changed in the holder's memory since (a bad DIMM, a stray write through the memfd) would
otherwise be written under the worker's CRC and commit a checkpoint that no restore can read (the
committed step would be quarantined at the next restore). Checked after the write,
so a change before or during it is caught; a failed check fails the section (``part_failed``,
naming the block): the step never commits and the previous checkpoint stays the latest. A slot
filled again by a newer snapshot before its write started is reported superseded. An exception
while writing is reported (``part_failed``) and the thread goes on.

One lock (a ``Condition``) over the queue; the outcome of each section goes to ``on_outcome`` (the
holder records it and sends it to the controller).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cf_ray._engine.format.blocks import BLOCK_BYTES
from cf_ray._engine.format.layout import step_dir
from cf_ray._engine.format.sections import index_blocks, write_section_slot
from cf_ray._engine.memory.crc import BlockCheck, BlockMismatch
from cf_ray._engine.node.slot_store import Held, Key, SlotStore, When
from cf_ray._engine.protocol.messages import PartDurable, PartFailed, PartSuperseded
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CorruptCheckpointError

logger = logging.getLogger("cf_ray")

#: Started steps remembered (finished first when a late section of theirs arrives).
_STARTED_KEPT = 16


class Writer:
    """The write queue and its thread.

    Args:
        storage: where sections are written.
        store: the holder's slots (pins, and the locks the writes take).
        holder: the holder's name (in every message).
        on_outcome: called (on the writer thread) with each section's ``PartDurable``, ``PartFailed``
            or ``PartSuperseded``.
    """

    def __init__(
        self,
        storage: Storage,
        store: SlotStore,
        holder: str,
        on_outcome: Callable[[PartDurable | PartFailed | PartSuperseded], None],
    ):
        self.storage = storage
        self._store = store
        self._holder = holder
        self._on_outcome = on_outcome
        self._cond = threading.Condition()
        # (generation, step) -> section -> entry, staged and not started; at most one ordinary step
        # (newer ones supersede it) besides milestones and priority checkpoints.
        self._waiting: dict[When, dict[str, Held]] = {}
        self._current: When | None = None  # the step being written
        self._current_left: dict[str, Held] = {}  # its sections not yet started
        self._started: list[When] = []  # newest last: never superseded, finished first
        self._writing: Held | None = None
        self.copied_bytes = 0
        """Bytes the writes copied on the host (the page cache's tails)."""
        self._thread = threading.Thread(target=self._run, name="cf_ray-persist", daemon=True)
        self._thread.start()

    def enqueue(self, entries: list[Held]) -> list[PartSuperseded]:
        """Queue one step's sections (all of the same ``(generation, step)``) for writing. Returns the
        sections of older steps, not started, that it supersedes (the caller records and sends them)."""
        if not entries:
            return []
        meta = entries[0].meta
        key = entries[0].when
        if meta.milestone or meta.priority:
            for e in entries:  # never superseded: its slot is not filled again before it is written
                self._store.pin(e, "write")
        superseded: list[PartSuperseded] = []
        with self._cond:
            if key == self._current:  # a late section of the step being written
                self._current_left.update({e.section: e for e in entries})
                for e in entries:
                    self._store.pin(e, "write")
            else:
                self._waiting.setdefault(key, {}).update({e.section: e for e in entries})
                for older in [k for k in self._waiting if k < key]:
                    if older in self._started or any(
                        e.meta.milestone or e.meta.priority for e in self._waiting[older].values()
                    ):
                        continue  # never skipped
                    for e in self._waiting.pop(older).values():
                        superseded.append(
                            PartSuperseded(generation=e.generation, step=e.step, section=e.section, holder=self._holder)
                        )
            self._cond.notify_all()
        return superseded

    def pending(self) -> set[Key]:
        """Sections waiting to be written or being written."""
        with self._cond:
            out = {e.key for secs in self._waiting.values() for e in secs.values()}
            out |= {e.key for e in self._current_left.values()}
            if self._writing is not None:
                out.add(self._writing.key)
            return out

    def entries(self) -> list[Held]:
        with self._cond:
            out = [e for secs in self._waiting.values() for e in secs.values()]
            out += list(self._current_left.values())
            if self._writing is not None:
                out.append(self._writing)
            return out

    def drain(self, timeout_s: float) -> dict:
        """Wait (at most ``timeout_s``) until nothing is queued or being written. Returns
        ``{"waiting": [[generation, step], ...], "writing": [generation, step, section] | None}``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting or self._current_left or self._writing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 0.5))
            waiting = sorted(
                [list(k) for k in self._waiting]
                + ([list(self._current)] if self._current_left and self._current is not None else [])
            )
            w = self._writing
            return {"waiting": waiting, "writing": None if w is None else [w.generation, w.step, w.section]}

    # -- the thread ---------------------------------------------------------------------------------
    def _next(self) -> Held:
        """The next section to write (blocks until there is one)."""
        with self._cond:
            while not self._waiting and not self._current_left:
                self._cond.wait(timeout=1.0)
            if not self._current_left:
                # Finish started steps first, then priority (preemption), then the oldest step, so
                # commits happen in step order.
                self._current = min(
                    self._waiting,
                    key=lambda k: (
                        k not in self._started,
                        not any(e.meta.priority for e in self._waiting[k].values()),
                        k,
                    ),
                )
                self._current_left = self._waiting.pop(self._current)
                # A step whose writing starts is never superseded, not even in part: its other
                # sections' slots are not filled again before they are written (without this, with
                # storage slower than two snapshots, every started step would lose a section and
                # nothing would commit).
                for e in self._current_left.values():
                    self._store.pin(e, "write")
                if self._current not in self._started:
                    self._started.append(self._current)
                    del self._started[:-_STARTED_KEPT]
            section = min(self._current_left)
            self._writing = self._current_left.pop(section)
            return self._writing

    def _run(self) -> None:
        while True:
            entry = self._next()
            outcome = self._write(entry)
            with self._cond:
                # The outcome is recorded before the entry stops being "being written": a lookup in
                # between never finds the section unknown.
                self._on_outcome(outcome)
                self._writing = None
                self._cond.notify_all()

    def _write(self, entry: Held) -> PartDurable | PartFailed | PartSuperseded:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        lk = self._store.take_pin(entry.key, "write") or self._store.take(entry)
        if lk is None:
            logger.info(
                "cf_ray: %s of step %d was overwritten by a newer snapshot before its write started; skipped",
                entry.section,
                entry.step,
            )
            return PartSuperseded(
                generation=entry.generation, step=entry.step, section=entry.section, holder=self._holder
            )
        try:
            files, copied = write_section_slot(
                self.storage,
                step_dir(entry.step),
                entry.generation,
                entry.section,
                lk.data,
                entry.index,
                entry.crc32,
            )
            self.copied_bytes += copied
            _check_blocks(entry, lk.data)
            return PartDurable(
                generation=entry.generation,
                step=entry.step,
                section=entry.section,
                files={k: v.to_json() for k, v in files.items()},
                persist_s=time.perf_counter() - t0,
                persist_cpu_s=time.thread_time() - cpu0,
                holder=self._holder,
                copied_bytes=copied,
                crc_read_bytes=lk.data.nbytes,
            )
        except Exception as e:  # noqa: BLE001 - never kill the thread; the controller reports it
            logger.warning("cf_ray: persisting %s of step %d failed: %r", entry.section, entry.step, e)
            return PartFailed(
                generation=entry.generation,
                step=entry.step,
                section=entry.section,
                error=f"{type(e).__name__}: {e}",
                holder=self._holder,
            )
        finally:
            lk.close()


def _check_blocks(entry: Held, data: memoryview) -> None:
    """The slot's bytes, as they are now, against the block CRCs the worker computed as it copied
    them; raises :class:`~cf_ray.errors.CorruptCheckpointError` naming the first block that differs."""
    blocks = index_blocks(entry.index, f"{entry.section} of step {entry.step}")
    try:
        BlockCheck(
            data,
            blocks.size if blocks is not None else BLOCK_BYTES,
            list(blocks.crc32) if blocks is not None else None,
            entry.crc32,
        ).finish()
    except BlockMismatch as e:
        raise CorruptCheckpointError(
            f"section {entry.section} of step {entry.step} changed in the holder's memory after the worker "
            f"checksummed it ({e}): not committed, the previous checkpoint stays the latest"
        ) from None


__all__ = ["Writer"]
