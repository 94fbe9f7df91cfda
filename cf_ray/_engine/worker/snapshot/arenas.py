"""The snapshot arenas of one rank: per section, the holder's slots mapped here (a
:class:`~cf_ray._engine.worker.snapshot.slot_arena.SlotArena`), reused while the section's layout stays the
same, faulted in ahead of the first snapshot (``snapshotter.py``'s module doc says why), and a free
slot of each waited for (said while it waits) before a snapshot is skipped
(:class:`SnapshotSkipped`, never a hang of the training thread); so is the previous snapshot's
hand-off to the holder (:meth:`SectionArenas.wait_previous`) and the holder's slots of a section
whose layout changed. All of one snapshot's waits share one bound, ``env.SLOT_WAIT_S``
(:attr:`SectionArenas.deadline`), not one each.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cf_ray._engine import env as _env
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.protocol.messages import SlotDesc
from cf_ray._engine.worker.snapshot.slot_arena import SlotArena, SlotsBusy

logger = logging.getLogger("cf_ray")

#: Gives the shared-memory slots of a section: ``(section, nbytes, timeout_s=...)`` -> the holder's
#: slots of it; ``timeout_s`` (``None``: the source's own bound) is what is left of a snapshot's bound,
#: past which the source raises :class:`SnapshotSkipped`.
ArenaSource = Callable[..., "tuple[SlotDesc, ...] | list[SlotDesc]"]


class SnapshotSkipped(Exception):
    """A snapshot not taken because a section found no free slot in time (reported by the caller)."""


class SectionArenas:
    """Section name -> its arena (the layout it was made for, the mapped slots).

    Args:
        rank: this worker's rank (log lines).
        source: where the arenas live: the holder's shared-memory slots of each section.
    """

    def __init__(self, rank: int, source: ArenaSource):
        self.rank = rank
        self.source = source
        self._cache: dict[str, tuple[tuple, SlotArena]] = {}
        self._pin = torch.cuda.is_available()
        self.on_slot_wait: Callable[[float], bool] | None = None
        """Called (on the training thread) while a snapshot waits for a free slot, about every
        :data:`~cf_ray._engine.worker.snapshot.slot_arena.WAIT_TICK_S` with the seconds waited; True gives the wait up (the snapshot is skipped)."""
        self._next_wait_log = 0.0
        self._slot_wait_warned = False
        self.prepare_s: float | None = None
        """Seconds the background thread spent in :meth:`fault_in`."""
        self.preparing = False
        """A :meth:`fault_in` is queued or running (set by the snapshotter, cleared when it is done)."""
        self.deadline: float | None = None
        """While a snapshot is begun (``Snapshotter.begin`` sets it): the ``time.monotonic()`` by
        which it is taken or skipped. Every wait of it shares this one bound (:meth:`left`): the
        previous hand-off, a free slot of each section, the holder's slots of a new layout."""

    def of(self, name: str) -> SlotArena | None:
        """The arena of section ``name`` now (``None`` when it has none)."""
        cached = self._cache.get(name)
        return cached[1] if cached is not None else None

    def sections(self) -> list[str]:
        """The sections that have an arena."""
        return sorted(self._cache)

    def for_flat(self, name: str, flat: _codec.Flat, taken: dict[str, Any] | None = None) -> SlotArena:
        """The arena of section ``name`` for a state of ``flat``'s layout (a new one when it changed:
        the holder is asked within what is left of the bound; on :class:`SnapshotSkipped` the slots
        this snapshot took already, ``taken``, are given back)."""
        key = flat.layout_key()
        cached = self._cache.get(name)
        if cached is None or cached[0] != key:
            if cached is not None:
                del self._cache[name]
                cached[1].close()
            try:
                cached = (key, self._new(name, flat.nbytes, timeout_s=None if self.deadline is None else self.left()))
            except SnapshotSkipped:
                for other in (taken or {}).values():
                    other.release()
                raise
            self._cache[name] = cached
        return cached[1]

    @contextlib.contextmanager
    def bounded(self) -> Iterator[None]:
        """One snapshot's waits (``Snapshotter.begin``), all under one bound, :attr:`deadline`."""
        self.deadline = time.monotonic() + _env.SLOT_WAIT_S
        try:
            yield
        finally:
            self.deadline = None

    def left(self) -> float:
        """Seconds the snapshot being begun may still wait (``env.SLOT_WAIT_S`` when none is)."""
        limit = _env.SLOT_WAIT_S
        return limit if self.deadline is None else max(0.0, min(limit, self.deadline - time.monotonic()))

    def fault_in(self, layouts: dict[str, tuple[tuple, int]]) -> None:
        """Allocate and fault in the arenas of these layouts (section -> (layout key, nbytes)); on a
        failure, none (logged: not fatal, a snapshot allocates what is missing)."""
        try:
            t0 = time.perf_counter()
            for name, (key, nbytes) in layouts.items():
                self._cache[name] = (key, self._new(name, nbytes, fault_in=True))
            self.prepare_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - not fatal: begin() allocates what is missing
            logger.warning("cf_ray: rank %d: could not allocate snapshot buffers ahead: %r", self.rank, e)
            self._cache.clear()

    def close(self) -> None:
        """Drop every arena (a job still in flight keeps its own); the next snapshot asks for new ones."""
        for _, arena in self._cache.values():
            arena.close()
        self._cache.clear()

    def acquire(self, arena: SlotArena, step: int, section: str, taken: dict[str, Any]) -> float:
        """A free slot of ``section``, waited for at most what is left of the bound (:meth:`left`; said while it waits);
        on giving up, the slots this snapshot took already (``taken``) are given back.

        Raises:
            SnapshotSkipped: no free slot within the wait.
        """
        limit = self.left()
        self._next_wait_log = 1.0

        def waiting(waited_s: float) -> bool:
            if self._say_now(waited_s):
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

    def wait_previous(self, step: int, done: threading.Event) -> float:
        """At most one snapshot in flight: wait for the previous one's hand-off to this node's holder
        (``done``) at most what is left of the bound (:meth:`left`), saying so while it waits; a hand-off to a holder that
        stopped answering (Ray restarting it, a call stuck in Ray) never holds the training thread
        for longer. (The watchdog is not fed here: a hand-off is not a storage wait, and polling the
        controller with the in-flight snapshot's timings would confuse its episodes.) Returns seconds
        waited.

        Raises:
            SnapshotSkipped: the previous hand-off did not return within the wait.
        """
        if done.is_set():
            return 0.0
        limit = self.left()
        t0 = time.monotonic()
        self._next_wait_log = 1.0
        while not done.wait(0.25):
            waited = time.monotonic() - t0
            if self._say_now(waited):
                logger.warning(
                    "cf_ray: rank %d: the snapshot of step %d has waited %.0f s for the previous snapshot's "
                    "hand-off to this node's holder (the holder does not answer: restarting, or stuck); "
                    "training goes on in %.0f s at most without this checkpoint",
                    self.rank,
                    step,
                    waited,
                    max(0.0, limit - waited),
                )
            if waited >= limit:
                raise SnapshotSkipped(
                    f"skipped: the previous snapshot's hand-off to this node's holder has not returned in "
                    f"{waited:.0f} s (the holder does not answer)"
                )
        return time.monotonic() - t0

    def _say_now(self, waited_s: float) -> bool:
        """Whether a wait of ``waited_s`` so far is to be said now: first after 1 s, then every
        ``env.WARN_INTERVAL_S`` (the caller sets ``_next_wait_log`` to 1.0 as its wait starts)."""
        if waited_s < self._next_wait_log:
            return False
        self._next_wait_log = waited_s + _env.WARN_INTERVAL_S
        return True

    def waited(self, step: int, slot_wait_s: float) -> None:
        """A snapshot waited ``slot_wait_s`` for its slots: said once, when it is long."""
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

    def _new(self, name: str, nbytes: int, *, fault_in: bool = False, timeout_s: float | None = None) -> SlotArena:
        """The holder's slots of section ``name``, mapped (asked within ``timeout_s``, when given)."""
        arena = SlotArena(self.source(name, nbytes, timeout_s=timeout_s), nbytes, self._pin)
        if fault_in:
            arena.fault_in()
        return arena
