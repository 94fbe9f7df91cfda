"""When a just-in-time (preemption) checkpoint is safe (#12, #24): derived from what happened, not
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
until #24 the controller predicted each tier's time from this run's bandwidths and only counted the
tier it chose, but the choice changed nothing that happens (both tiers always go on) — only when the
ranks were told — and with ``PreemptionConfig(hold=True)`` the ranks hold until the deadline anyway,
so the preemption benchmark (``benchmarks/results/cluster-2026-11-26.json``: 0 steps wasted, every
deadline made) could not show the prediction saving a step.

The profile row of a just-in-time checkpoint: ``deadline_unix``, ``jit_left_s`` (seconds to the
deadline when its last section was staged), ``jit_needs_copy`` (sections that needed a copy on
another node), ``actual_peer_s`` / ``actual_storage_s`` (seconds from then to each tier, absent when
it never happened), ``safe_tier``, ``safe_unix`` and ``made_deadline``.

No Ray and no torch here: the controller passes the node facts in, and the tests drive it directly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


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


__all__ = ["JitWatch", "SafeTier", "watch"]
