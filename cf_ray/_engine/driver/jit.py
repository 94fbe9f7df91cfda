"""When a just-in-time (preemption) checkpoint is safe: derived from what happened, not
predicted.

A preemption notice with a deadline leaves a fixed time. The snapshot is in its holders' memory as
soon as it is staged; what is in doubt is whether it will be somewhere that survives the preempted
node before the node goes. It is *safe* at the first of:

* **storage**: every section written by its holder and the manifest committed. Survives anything.
* **peer memory**: every section that lives on a node about to go (a *draining* node, as Ray's
  drain reports it; every node when no node is known to drain, e.g. a SIGTERM or a driver's
  ``notify_preemption``) has a copy in the holder of another node that is not draining, and every
  other section is in its own holder on a node that is not draining. The snapshot is then the
  restore point through the memory path (``CommitBook.newest_in_memory``) once the node is lost.

The preempted ranks stop waiting as soon as one holds (``Controller.settled`` lists the step under
``safe`` when peer memory held first; ``committed`` when storage did); both go on in the background
regardless, since the holders write and copy on their own. There is no prediction to get wrong:
predicting each tier's time from this run's bandwidths and counting only the tier chosen would
change nothing that happens (both tiers always go on) — only when the ranks are told — and with
``PreemptionConfig(hold=True)`` the ranks hold until the deadline anyway.

The profile row of a just-in-time checkpoint: ``deadline_unix``, ``jit_left_s`` (seconds to the
deadline when its last section was staged), ``jit_needs_copy`` (sections that needed a copy on
another node), ``actual_peer_s`` / ``actual_storage_s`` (seconds from then to each tier, absent when
it never happened), ``safe_tier``, ``safe_unix`` and ``made_deadline``. The profile book holds the
row; the functions below decide what goes in it (:func:`staged`, :func:`peer_safe`,
:func:`committed`, :func:`failed`, :func:`abandoned`), and record a ``jit_safe`` event the first
time a checkpoint is safe.

No Ray and no torch here: the controller passes the node facts in, and the tests drive it directly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cf_ray._engine.protocol.events import JitSafeEvent
from cf_ray._engine.protocol.messages import SectionState

if TYPE_CHECKING:
    from cf_ray._engine.observe.profile_book import ProfileBook


class SafeTier(enum.StrEnum):
    """Where a just-in-time checkpoint became safe first: the profile table's ``safe_tier`` values."""

    STORAGE = "storage"
    PEER = "peer"


@dataclass(slots=True)
class JitWatch:
    """One just-in-time checkpoint, from the moment every section is staged: what makes it safe in a
    peer's memory, and when it became so."""

    deadline_unix: float
    staged_unix: float
    """When its last section was staged (every time below counts from here)."""
    draining: frozenset[str]
    """The nodes draining then (empty: not known, every node may be the one to go)."""
    needs_copy: frozenset[str]
    """Sections that must have a copy on another, non-draining node (their node may go)."""
    peer_safe_unix: float | None = None
    """When every section that needed one first had a copy on another usable node."""

    @property
    def left_s(self) -> float:
        return self.deadline_unix - self.staged_unix

    def row(self) -> dict:
        """The profile row's columns known when the watch starts."""
        return {"jit_left_s": round(self.left_s, 3), "jit_needs_copy": len(self.needs_copy)}

    def peer_safe(self, staged_nodes: Mapping[str, str], replicas: Mapping[str, Mapping[str, str]]) -> bool:
        """Whether every section that needs one has a copy on a node that is neither its own nor
        draining (``replicas``: section -> {peer holder: its node}, as ``part_replicated`` said)."""
        for sec in self.needs_copy:
            own = staged_nodes.get(sec, "")
            if not any(n and n != own and n not in self.draining for n in replicas.get(sec, {}).values()):
                return False
        return True


def watch(*, now_unix: float, deadline_unix: float, nodes: Mapping[str, str], draining: Iterable[str]) -> JitWatch:
    """Start watching a just-in-time checkpoint whose every section is staged.

    Args:
        now_unix: when its last section was staged.
        deadline_unix: the notice's deadline.
        nodes: section -> the node of the holder that has it (``""``: unknown).
        draining: the nodes Ray says are draining (empty: unknown, every node may be the one to go).
    """
    draining = frozenset(draining)
    needs = frozenset(sec for sec, node in nodes.items() if not draining or not node or node in draining)
    return JitWatch(deadline_unix=deadline_unix, staged_unix=now_unix, draining=draining, needs_copy=needs)


def staged(book: ProfileBook, generation: int, step: int, w: JitWatch) -> None:
    """Every section of a just-in-time checkpoint is staged: what it needs to be safe."""
    book.row(generation, step).update(w.row(), _jit_staged_unix=w.staged_unix)


def peer_safe(book: ProfileBook, generation: int, step: int, w: JitWatch) -> None:
    """Every section of a just-in-time checkpoint that needed one has a copy on another usable node."""
    t = w.peer_safe_unix
    if t is None:
        return
    row = book.row(generation, step)
    row["actual_peer_s"] = round(t - w.staged_unix, 3)
    _safe(book, row, generation, step, t, SafeTier.PEER)


def committed(book: ProfileBook, generation: int, step: int) -> None:
    """A checkpoint committed (its row has ``durable_unix``): a just-in-time one is safe in storage."""
    row = book.find_row(generation, step)
    if row is None or row.get("durable_unix") is None:
        return
    if row.get("_jit_staged_unix") is not None:
        row["actual_storage_s"] = round(row["durable_unix"] - row["_jit_staged_unix"], 3)
    if row.get("deadline_unix") is not None:
        _safe(book, row, generation, step, row["durable_unix"], SafeTier.STORAGE)


def failed(book: ProfileBook, generation: int, step: int) -> None:
    """A checkpoint failed: a just-in-time one not yet safe missed its deadline (one already safe in
    a peer's memory before the deadline made it)."""
    row = book.find_row(generation, step)
    if row is not None and row.get("deadline_unix") is not None and row.get("safe_unix") is None:
        row["made_deadline"] = False


def abandoned(book: ProfileBook, generation: int, step: int) -> None:
    """The attempt of a just-in-time checkpoint ended before it was durable: its row says so, and it
    missed its deadline unless it was already safe."""
    row = book.find_row(generation, step)
    if row is not None and row.get("deadline_unix") is not None:
        row.update(where=SectionState.ABANDONED.value, error="not durable when its attempt ended")
        failed(book, generation, step)


def _safe(book: ProfileBook, row: dict, generation: int, step: int, t: float, tier: SafeTier) -> None:
    """A just-in-time checkpoint is safe in ``tier`` at ``t``: the first such time decides whether
    the deadline was met, and is recorded as a ``jit_safe`` event."""
    if row.get("safe_unix") is not None and row["safe_unix"] <= t:
        return
    row.update(safe_unix=t, safe_tier=tier.value)
    if row.get("deadline_unix") is not None:
        row["made_deadline"] = t <= row["deadline_unix"]
    book.add_event(
        JitSafeEvent(
            step=step,
            generation=generation,
            tier=tier.value,
            deadline_unix=row.get("deadline_unix"),
            made_deadline=row.get("made_deadline"),
            time=t,
        )
    )


__all__ = ["JitWatch", "SafeTier", "abandoned", "committed", "failed", "peer_safe", "staged", "watch"]
