"""Which tier a just-in-time (preemption) checkpoint can reach before its deadline (#12).

A preemption notice with a deadline leaves a fixed time. The snapshot is in its holders' memory as
soon as it is staged; what is in doubt is whether it will be somewhere that survives the preempted
node before the node goes:

* **storage**: every section written by its holder and the manifest committed. Survives anything.
* **peer memory**: every section that lives on a node about to go (a *draining* node, as Ray's
  drain reports it; every node when no node is known to drain, e.g. a SIGTERM or a driver's
  ``notify_preemption``) has a copy in the holder of another, non-draining node, and every other
  section is in its own holder on a non-draining node. The snapshot is then the restore point
  through the memory path (``CommitBook.newest_in_memory``) once the node is lost, while the
  storage write goes on in the background and commits if it can.

The controller predicts each tier's time when the last section of the checkpoint is staged, from
what it measured on this run's earlier checkpoints (:class:`Bandwidths`), and chooses the first that
fits with a margin (:data:`SAFETY`): storage if it fits (it survives more), else peer memory, else
none (both go on best effort; the previous checkpoint stays the latest until one completes). It
records the prediction, and later the actual time of each tier, in the checkpoint's profile row.

No Ray and no torch here: the controller passes the node facts in, and the tests drive it directly.
"""

from __future__ import annotations

import collections
import enum
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: A tier fits when its predicted time times this is at most the time left: predictions come from a
#: few earlier checkpoints, and a deadline missed loses the checkpoint while one met early costs nothing.
SAFETY = 1.5

#: Bytes per second assumed for a holder's storage writes before any checkpoint of the run has been
#: measured (the first preemption notice may come before the first commit). Deliberately low — a
#: slow network disk or a throttled bucket, well below local NVMe or S3 from one node (hundreds of
#: MB/s) — so an unmeasured storage is trusted only with a generous deadline.
DEFAULT_STORAGE_BPS = 20e6

#: Seconds assumed for the manifest commit (one small file, fsync and rename) before one is measured.
DEFAULT_COMMIT_S = 1.0

#: Bytes per second assumed for a copy to a peer holder before any copy has been measured: a 1 Gb/s
#: link less Ray's object-transfer overhead, low for the 10-100 Gb/s links of training clusters.
DEFAULT_PEER_BPS = 50e6

#: Seconds added per peer copy before copies have been measured (two actor calls and a ``ray.put``).
DEFAULT_PEER_CALL_S = 0.5

#: Samples kept per holder (the newest; older ones may describe another load of the storage).
WINDOW = 8


class JitTier(enum.StrEnum):
    """Where a just-in-time checkpoint is safe: the profile table's ``jit_tier`` values."""

    STORAGE = "storage"
    PEER = "peer"
    NONE = "none"
    """Neither fits: both go on best effort."""


class Bandwidths:
    """What this run measured of each tier, per holder: storage (bytes a holder wrote for one
    checkpoint, and the seconds it took) and peer copies (bytes a holder copied to a peer, seconds).
    A holder not measured yet is predicted from every holder's samples, and with none from the
    conservative defaults above."""

    def __init__(self, window: int = WINDOW):
        self._storage: dict[str, collections.deque[tuple[int, float]]] = collections.defaultdict(
            lambda: collections.deque(maxlen=window)
        )
        self._peer: dict[str, collections.deque[tuple[int, float]]] = collections.defaultdict(
            lambda: collections.deque(maxlen=window)
        )
        self._commit_s: collections.deque[float] = collections.deque(maxlen=window)

    def add_storage(self, holder: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._storage[holder].append((int(nbytes), float(seconds)))

    def add_peer(self, holder: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._peer[holder].append((int(nbytes), float(seconds)))

    def add_commit(self, seconds: float) -> None:
        if seconds >= 0:
            self._commit_s.append(float(seconds))

    @property
    def measured(self) -> dict[str, bool]:
        """Whether each tier has a measurement (the profile row says when a default was used)."""
        return {JitTier.STORAGE.value: bool(self._storage), JitTier.PEER.value: bool(self._peer)}

    def storage_s(self, holder: str, nbytes: int) -> float:
        """Seconds ``holder`` is predicted to take to write ``nbytes`` (one checkpoint's sections)."""
        return nbytes / _bps(self._storage, holder, DEFAULT_STORAGE_BPS)

    def commit_s(self) -> float:
        return max(self._commit_s) if self._commit_s else DEFAULT_COMMIT_S

    def peer_s(self, holder: str, sizes: Iterable[int]) -> float:
        """Seconds ``holder`` is predicted to take to copy sections of ``sizes`` to peers, one
        after the other (its replication thread copies one at a time)."""
        sizes = list(sizes)
        if not sizes:
            return 0.0
        if self._peer:  # measured seconds already hold the call overhead
            return sum(sizes) / _bps(self._peer, holder, DEFAULT_PEER_BPS)
        return sum(sizes) / DEFAULT_PEER_BPS + DEFAULT_PEER_CALL_S * len(sizes)


def _bps(samples: Mapping[str, collections.deque[tuple[int, float]]], holder: str, default: float) -> float:
    """The holder's own bytes per second over its window; else the median over holders; else ``default``."""
    own = samples.get(holder)
    if own:
        return sum(b for b, _ in own) / sum(s for _, s in own)
    rates = [sum(b for b, _ in q) / sum(s for _, s in q) for q in samples.values() if q]
    return statistics.median(rates) if rates else default


@dataclass(slots=True)
class JitPlan:
    """The tier chosen for one just-in-time checkpoint, what was predicted, and what happened."""

    deadline_unix: float
    decided_unix: float
    left_s: float
    """Seconds from the decision to the deadline."""
    tier: JitTier
    predicted_storage_s: float
    predicted_peer_s: float | None
    """``None``: no peer tier (replication off, or no holder of the run on another usable node)."""
    draining: frozenset[str]
    """The nodes draining when the decision was taken (empty: not known, every node may go)."""
    needs_copy: frozenset[str]
    """Sections that must have a copy on another node for the peer tier (their node may go)."""
    defaults: tuple[str, ...] = ()
    """Tiers predicted from the defaults (nothing of them measured yet)."""
    peer_safe_unix: float | None = None
    """When every section that needed one first had a copy on another usable node."""

    def row(self) -> dict:
        """The profile row's columns of the decision."""
        return {
            "jit_tier": self.tier.value,
            "jit_left_s": round(self.left_s, 3),
            "predicted_storage_s": round(self.predicted_storage_s, 3),
            "predicted_peer_s": None if self.predicted_peer_s is None else round(self.predicted_peer_s, 3),
            "jit_defaults": ",".join(self.defaults) or None,
        }

    def event(self) -> dict:
        return {"event": "jit_tier", "deadline_unix": self.deadline_unix, "time": self.decided_unix, **self.row()}

    def peer_safe(self, staged_nodes: Mapping[str, str], replicas: Mapping[str, Mapping[str, str]]) -> bool:
        """Whether every section that needs one has a copy on a node that is neither its own nor
        draining (``replicas``: section -> {peer holder: its node}, as ``part_replicated`` said)."""
        for sec in self.needs_copy:
            own = staged_nodes.get(sec, "")
            if not any(n and n != own and n not in self.draining for n in replicas.get(sec, {}).values()):
                return False
        return True


def plan(
    *,
    now_unix: float,
    deadline_unix: float,
    sections: Mapping[str, tuple[str, str, int]],
    draining: Iterable[str],
    peer_nodes: Iterable[str] | None,
    bandwidths: Bandwidths,
) -> JitPlan:
    """Predict both tiers and choose one.

    Args:
        now_unix: when the decision is taken (the last section was staged).
        deadline_unix: the notice's deadline.
        sections: section -> (its holder, that holder's node, its bytes).
        draining: the nodes Ray says are draining (empty: unknown, every node may be the one to go).
        peer_nodes: the nodes with a holder of this run that could take a copy (any node; those
            draining are left out here); ``None`` when replication is off.
        bandwidths: this run's measurements.
    """
    draining = frozenset(draining)
    left = deadline_unix - now_unix
    per_holder: dict[str, int] = collections.defaultdict(int)
    for holder, _node, nbytes in sections.values():
        per_holder[holder] += int(nbytes)
    storage_s = max((bandwidths.storage_s(h, b) for h, b in per_holder.items()), default=0.0)
    storage_s += bandwidths.commit_s()
    needs = frozenset(sec for sec, (_h, node, _b) in sections.items() if not draining or not node or node in draining)
    peer_s: float | None = None
    if not needs:
        peer_s = 0.0  # no section lives on a node that is going: its own holder keeps it
    elif peer_nodes is not None:
        usable = {n for n in peer_nodes if n and n not in draining}
        if all(usable - {sections[sec][1]} for sec in needs):
            copies: dict[str, list[int]] = collections.defaultdict(list)
            for sec in needs:
                copies[sections[sec][0]].append(int(sections[sec][2]))
            peer_s = max((bandwidths.peer_s(h, sizes) for h, sizes in copies.items()), default=0.0)
    if storage_s * SAFETY <= left:
        tier = JitTier.STORAGE
    elif peer_s is not None and peer_s * SAFETY <= left:
        tier = JitTier.PEER
    else:
        tier = JitTier.NONE
    measured = bandwidths.measured
    defaults = tuple(
        t
        for t, used in ((JitTier.STORAGE.value, True), (JitTier.PEER.value, peer_s is not None and bool(needs)))
        if used and not measured[t]
    )
    return JitPlan(
        deadline_unix=deadline_unix,
        decided_unix=now_unix,
        left_s=left,
        tier=tier,
        predicted_storage_s=storage_s,
        predicted_peer_s=peer_s,
        draining=draining,
        needs_copy=needs,
        defaults=defaults,
    )


__all__ = [
    "DEFAULT_COMMIT_S",
    "DEFAULT_PEER_BPS",
    "DEFAULT_PEER_CALL_S",
    "DEFAULT_STORAGE_BPS",
    "SAFETY",
    "Bandwidths",
    "JitPlan",
    "JitTier",
    "plan",
]
