"""The controller's pending table: every snapshot (a generation's step) in flight or settled not long
ago, with what each of its sections went through, and how the ones that left the table settled.

A step's state goes pending -> (committing ->) committed, or failed, superseded, abandoned. Messages
of a step that settled and left the table are answered from a bounded record of settled steps, the
committed index, and the restores (a step past a later attempt's restore point is abandoned, however
late its messages come). The table keeps :data:`MAX_PENDING` entries (settled ones are forgotten
first, pending ones never).

Not thread-safe on its own: the controller calls it under its lock.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from cf_ray._engine.driver.checkpoints.committed import CommittedIndex
from cf_ray._engine.driver.jit import JitWatch
from cf_ray._engine.format.layout import section_rank
from cf_ray._engine.protocol.messages import SectionState, Settled, SnapshotMeta
from cf_ray._engine.storage.base import FileInfo

#: How many (generation, step) entries the pending table keeps; older settled ones are forgotten.
MAX_PENDING = 64
#: How many settled steps are remembered after they left the pending table (late duplicates).
MAX_SETTLED = 1024
#: How many restores (generation -> restored step) are remembered.
MAX_RESTORES = 32
#: Seconds a failed step is answered as still settling while its other sections' outcomes are due
#: (their holder writes them one by one): ``wait()`` then reports one step's failures together. The
#: bound is for a holder that died after the failure (the watch only asks about pending steps).
SETTLING_S = 20.0


@dataclass(slots=True)
class Parts:
    """What each section of one checkpoint went through (section -> ...)."""

    expected: set[str] | None = None
    """The sections the checkpoint has; ``None`` until a ``part_staged`` says (its world size)."""
    staged: dict[str, str] = field(default_factory=dict)
    """section -> name of the holder that has it in memory."""
    staged_nodes: dict[str, str] = field(default_factory=dict)
    """section -> the node of that holder."""
    replicas: dict[str, dict[str, str]] = field(default_factory=dict)
    """section -> {holder of another node with a copy: its node} (peer replicas)."""
    writers: dict[str, str] = field(default_factory=dict)
    """section -> name of the holder that reported it durable or failed."""
    durable: dict[str, dict[str, FileInfo]] = field(default_factory=dict)
    """section -> its files on storage."""
    persist_s: dict[str, float] = field(default_factory=dict)
    """section -> seconds its holder spent writing it."""
    persist_cpu_s: dict[str, float | None] = field(default_factory=dict)
    """section -> CPU seconds its holder's writer thread spent on it (``None``: not measured)."""
    section_bytes: dict[str, int] = field(default_factory=dict)
    """section -> its size in bytes."""
    failed: dict[str, str] = field(default_factory=dict)
    """section -> why it could not be written."""
    superseded: set[str] = field(default_factory=set)
    """Sections that will never be written (replaced by a newer snapshot, or memory-only)."""


@dataclass(slots=True)
class FinalTry:
    """``finish()``'s persisted checkpoint of a step that was taken before (held in memory only, or
    failed): which of its tries, and the ranks that said they take it (:meth:`Pending.reopen_final`)."""

    attempt: int
    ranks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Pending:
    """One checkpoint (a generation's step) in flight, or settled not long ago."""

    generation: int
    step: int
    parts: Parts = field(default_factory=Parts)
    """What each of its sections went through."""
    meta: SnapshotMeta | None = None
    """Rank 0's description of the snapshot (another rank's until rank 0's arrives)."""
    state: SectionState = SectionState.PENDING
    persist_reported: bool = False
    """The persist times went to the policy."""
    committing: bool = False
    """Its manifest is being written (outside the lock): in flight, and committed at most once."""
    lost: bool = False
    """Failed because the holder that had a section died (or came back empty) before writing it:
    if a later attempt then restores before this step, it is abandoned instead (the attempt it
    belonged to ended, which is what the holder's death usually means)."""
    deadline_unix: float | None = None
    """A just-in-time checkpoint's deadline: the earliest any rank's notice said."""
    jit: JitWatch | None = None
    """A just-in-time checkpoint's watch (from the moment every section is staged,
    :mod:`cf_ray._engine.driver.jit`)."""
    memory_only: bool = False
    """Held in memory only (``SnapshotMeta.persist=False``): settled as superseded once every
    section is staged; a persisted snapshot of the same step (``finish()``) opens it again."""
    final: FinalTry | None = None
    """``finish()`` takes this step again, persisted (``None``: it does not): what the snapshot taken
    before it said (held in memory only, a rank's skip) no longer settles it."""
    settled_mono: float | None = None
    """When it settled (``time.monotonic()``; ``None``: not settled)."""
    verify_files: bool = False
    """Learnt from a holder's resync: its files are checked on storage before the commit (a step
    committed and deleted by keep-last before the controller started again must not come back)."""
    created_mono: float = field(default_factory=time.monotonic)

    def note_persist(self, persist: bool, section: str) -> None:
        """A section was staged with ``SnapshotMeta.persist``: False holds it in memory only; True
        for a step settled as held in memory only (``finish()`` takes it again) opens it again. Once
        ``finish()`` said it takes the step again (:attr:`final`), a held snapshot's late staging
        changes nothing."""
        if self.final is not None:
            return
        if not persist:
            self.parts.superseded.add(section)
            self.memory_only = True
        elif self.memory_only and self.state == SectionState.SUPERSEDED:
            self.memory_only, self.state = False, SectionState.PENDING
            self.parts.superseded.clear()

    def reopen_final(self, rank: int, attempt: int) -> bool:
        """``rank`` is about to take this step again in ``finish()``, persisted, for the ``attempt``-th
        time: the first rank to say so of an attempt opens the step again, with nothing of what the
        snapshots before it said (a memory-only hold settled as superseded, a rank's skip, a failed
        write). Returns False when there is nothing to open (committing or committed)."""
        if self.committing or self.state == SectionState.COMMITTED:
            return False
        if self.final is None or attempt > self.final.attempt:
            self.parts, self.state, self.final = Parts(), SectionState.PENDING, FinalTry(attempt)
            self.memory_only = self.lost = self.persist_reported = False
            self.jit, self.deadline_unix, self.settled_mono = None, None, None
        self.final.ranks.add(rank)
        return True

    def stale_failure(self, section: str, holder: str) -> bool:
        """A rank's report that it skipped ``section`` (``holder`` empty) sent before that rank said it
        takes the step again in ``finish()``: about the snapshot taken before, not this one."""
        return self.final is not None and not holder and section_rank(section) not in self.final.ranks

    def settling(self, now: float) -> bool:
        """Failed, and some of its sections a holder has are still to be written or failed (for at
        most :data:`SETTLING_S`): their failures come, and are reported with the first."""
        if self.state != SectionState.FAILED or self.settled_mono is None or now - self.settled_mono > SETTLING_S:
            return False
        parts = self.parts
        done = set(parts.durable) | set(parts.failed) | parts.superseded
        return any(sec not in done for sec in parts.staged)

    def held_in_full(self) -> bool:
        """Held in memory only, every section staged, still pending: to be settled as superseded."""
        return (
            self.memory_only
            and self.state == SectionState.PENDING
            and not self.committing
            and self.parts.expected is not None
            and self.parts.expected <= set(self.parts.staged)
        )

    def error(self) -> str | None:
        """Its failed sections and why, as one line (``None``: none failed)."""
        return "; ".join(f"{s}: {e}" for s, e in sorted(self.parts.failed.items())) or None


class PendingTable:
    """The pending entries, the settled record and the restores.

    Args:
        index: the committed index (a step committed there answers late messages about it).
        restores: generation -> the step that attempt restored (persisted by the controller):
            older generations' steps past it are abandoned.
    """

    def __init__(self, index: CommittedIndex, restores: dict[int, int] | None = None):
        self.index = index
        self.entries: dict[tuple[int, int], Pending] = {}
        """(generation, step) -> :class:`Pending`."""
        self.settled: collections.OrderedDict[tuple[int, int], tuple[SectionState, str | None]] = (
            collections.OrderedDict()
        )
        """Settled steps that left the table: (state, error), the newest :data:`MAX_SETTLED`."""
        self.restores: dict[int, int] = dict(restores or {})
        self.settled_out: list[tuple[int, int, SectionState, tuple[str, ...]]] = []
        """Steps that settled since the caller last took them: (generation, step, state, holders)
        (the controller tells those holders, outside the lock)."""

    # -- entries ------------------------------------------------------------------------------------------
    def get(self, generation: int, step: int) -> Pending | None:
        return self.entries.get((generation, step))

    def entry(self, generation: int, step: int, *, resync: bool) -> Pending | None:
        """The pending entry of a message, made on first mention; ``None`` when the message is
        about a step that settled and was forgotten, is committed, or was abandoned by a restore."""
        p = self.entries.get((generation, step))
        if p is not None:
            return p
        if self.late_state(generation, step) is not None:
            return None
        p = self.entries[(generation, step)] = Pending(generation, step, verify_files=resync)
        # Keep the table small: forget old settled entries (remembering how they settled), never
        # pending ones.
        if len(self.entries) > MAX_PENDING:
            for k in sorted(self.entries)[: len(self.entries) - MAX_PENDING]:
                old = self.entries[k]
                if old.state != SectionState.PENDING:
                    del self.entries[k]
                    self.settled[k] = (old.state, old.error())
                    while len(self.settled) > MAX_SETTLED:
                        self.settled.popitem(last=False)
        return p

    def late_state(self, generation: int, step: int) -> tuple[SectionState, str | None] | None:
        """The state of a step that is not in the table: settled and forgotten, committed (on
        storage), or abandoned by a later restore; ``None`` when nothing says."""
        known = self.settled.get((generation, step))
        if known is not None:
            return known
        c = self.index.get(step)
        if c is not None and c.generation == generation:
            return SectionState.COMMITTED, None
        if c is not None and c.generation > generation:
            return SectionState.ABANDONED, None  # a later attempt committed this step again
        if any(gen > generation and step > restored for gen, restored in self.restores.items()):
            return SectionState.ABANDONED, None
        return None

    def state_of(self, generation: int, step: int) -> SectionState | None:
        """Where ``(generation, step)`` stands; ``None`` when this controller never heard of it."""
        p = self.entries.get((generation, step))
        if p is not None:
            return p.state
        known = self.late_state(generation, step)
        return None if known is None else known[0]

    def accepts(self, generation: int, step: int) -> bool:
        """Whether a message about ``(generation, step)`` changes anything (not a late one about a
        step that settled and was forgotten, is committed, or was abandoned by a restore)."""
        return (generation, step) in self.entries or self.late_state(generation, step) is None

    def forget_as_failed(self, generation: int, step: int, why: str) -> None:
        """Late messages about ``(generation, step)`` are answered as failed (a quarantined checkpoint
        is never committed again)."""
        self.settled[(generation, step)] = (SectionState.FAILED, why)

    # -- settling ------------------------------------------------------------------------------------------
    def settle(self, p: Pending, state: SectionState, *, tell: bool = True) -> None:
        """``p`` is settled; its holders are told (``take_settled``) unless ``tell`` is False."""
        p.state, p.settled_mono = state, time.monotonic()
        holders = tuple(sorted(set(p.parts.staged.values()) | set(p.parts.writers.values())))
        if holders and tell:
            self.settled_out.append((p.generation, p.step, state, holders))

    def take_settled(self) -> list[tuple[int, int, SectionState, tuple[str, ...]]]:
        out, self.settled_out = self.settled_out, []
        return out

    def reopen_final(self, generation: int, step: int, rank: int, attempt: int) -> bool:
        """``finish()`` on ``rank`` takes ``(generation, step)`` again, persisted (:meth:`Pending.reopen_final`):
        its entry, made or remembered again if it settled and was forgotten, is opened until that
        snapshot commits or fails. False: committed already (or committing)."""
        self.settled.pop((generation, step), None)
        p = self.entry(generation, step, resync=False)
        return p is not None and p.reopen_final(rank, attempt)

    def abandon(self, generation: int, step: int) -> bool:
        """One entry still pending is abandoned (nothing will complete it). Returns whether it was."""
        p = self.entries.get((generation, step))
        if p is None or p.state != SectionState.PENDING or p.committing:
            return False
        self.settle(p, SectionState.ABANDONED)
        return True

    def abandon_after(self, generation: int, step: int) -> list[Pending]:
        """Entries of generations before ``generation`` still pending past ``step`` become
        abandoned (a timeline the attempt restored at ``step`` replays), and so do their late
        messages; so do those that failed only because their holder died (``lost``): their attempt
        ended. Returns the entries abandoned now. Superseded ones past ``step`` (held in memory
        only, or replaced before they were written) are abandoned too, their holders told, but not
        returned (nothing was to be written): else they would stay memory restore candidates, and a
        later attempt could go back into the timeline this one replaced, past its commits."""
        self.restores[generation] = step
        for g in sorted(self.restores)[:-MAX_RESTORES]:
            del self.restores[g]
        out = []
        for (gen, st), p in self.entries.items():
            if gen >= generation or st <= step:
                continue
            in_flight = p.state == SectionState.PENDING and not p.committing
            if in_flight or (p.state == SectionState.FAILED and p.lost):
                self.settle(p, SectionState.ABANDONED)
                out.append(p)
            elif p.state == SectionState.SUPERSEDED:
                self.settle(p, SectionState.ABANDONED)
        return out

    # -- queries -------------------------------------------------------------------------------------------
    def pending_steps(self) -> list[int]:
        """Steps (sorted) with an entry still pending, of any generation."""
        return sorted(k[1] for k, p in self.entries.items() if p.state == SectionState.PENDING)

    def awaited_steps(self, generation: int) -> list[int]:
        """Steps (sorted) of ``generation`` still pending, none of whose sections is superseded
        (what ``Checkpointer.wait`` waits for)."""
        return sorted(
            k[1]
            for k, p in self.entries.items()
            if k[0] == generation and p.state == SectionState.PENDING and not p.parts.superseded
        )

    def states_by_step(self) -> dict[int, set[SectionState]]:
        """step -> the states of its entries (of every generation); a committing one is pending."""
        states: dict[int, set[SectionState]] = {}
        for (_, step), p in self.entries.items():
            states.setdefault(step, set()).add(p.state)
        return states

    def in_flight_steps(self) -> set[int]:
        """Steps with an entry still pending or committing (keep-last and clean-up leave them)."""
        return {k[1] for k, p in self.entries.items() if p.state == SectionState.PENDING}

    def report(self, generation: int, steps: list[int]) -> Settled:
        """Which of ``steps`` (of ``generation``) are settled, and how (the ``settled`` RPC), and which
        of them are just-in-time checkpoints safe in a peer's memory (still pending on storage)."""
        safe = [
            int(s)
            for s in steps
            if (p := self.get(generation, int(s))) is not None
            and p.state == SectionState.PENDING
            and p.jit is not None
            and p.jit.peer_safe_unix is not None
        ]
        out: dict[str, list[int]] = {"committed": [], "superseded": [], "abandoned": [], "pending": [], "unknown": []}
        failed: dict[int, str] = {}
        now = time.monotonic()
        for step in steps:
            step = int(step)
            p = self.entries.get((generation, step))
            if p is not None:
                state, error = p.state, p.error()
                if state == SectionState.PENDING and p.parts.superseded and not p.committing:
                    state = SectionState.SUPERSEDED  # a memory-only section: it will never be written
                elif p.settling(now):
                    state = SectionState.PENDING  # its other sections' failures are due: said together
            else:
                known = self.late_state(generation, step)
                if known is None:
                    out["unknown"].append(step)
                    continue
                state, error = known
            if state == SectionState.FAILED:
                failed[step] = error or "failed"
            else:
                out[state.value].append(step)
        return Settled(
            generation=generation,
            committed=tuple(out["committed"]),
            failed=failed,
            superseded=tuple(out["superseded"]),
            abandoned=tuple(out["abandoned"]),
            pending=tuple(out["pending"]),
            unknown=tuple(out["unknown"]),
            safe=tuple(safe),
            newest_committed=self.index.newest(),
        )


__all__ = ["MAX_PENDING", "MAX_RESTORES", "MAX_SETTLED", "SETTLING_S", "FinalTry", "Parts", "Pending", "PendingTable"]
