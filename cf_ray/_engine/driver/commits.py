"""The controller's commit bookkeeping: every section of every snapshot, staged in a holder
(memory), durable (storage), failed or superseded; a checkpoint commits — its manifest is written
— only when every section of that step and generation is durable.

The controller actor is threaded (``max_concurrency``), so Ray does not keep the order in which
holders sent ``part_staged`` and ``part_durable``: a section can be durable before the call saying
which sections the step has. A commit is therefore tried from both.

Every message is idempotent (issue #16): a holder re-sends what it is not sure arrived (after a
timeout, to a controller that started again, in a resync), so the same ``part_staged`` or
``part_durable`` may come twice, or long after its step settled. A step commits once (the state
goes pending -> committing -> committed); messages of a step that settled and left the pending
table are answered from a bounded record of settled steps, the committed index, and the restores
(a step past a later attempt's restore point is abandoned, however late its messages come).

Storage I/O is never done under the controller's lock: a transition that completes a step
returns a :class:`CommitJob`; the caller writes the manifest (:meth:`CommitBook.write`) after
releasing the lock and reports back (:meth:`CommitBook.finish`, under the lock again). While a
step is *committing* it counts as in flight (never cleaned up, never abandoned, never failed by a
late message), and keep-last never sees it (it is not in the committed index yet).

Not thread-safe on its own: the controller calls it under its lock (so does the maintenance
thread, for the committed index and the states of the steps in flight), except :meth:`write`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cf_ray._engine.driver import jit_tier
from cf_ray._engine.driver.profile_book import ProfileBook
from cf_ray._engine.driver.schedule import ScheduleBook
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.format.manifest import load_quarantine
from cf_ray._engine.protocol.messages import (
    CheckpointKind,
    MemorySnapshot,
    PartReplicated,
    PartStaged,
    SectionState,
    SnapshotMeta,
)
from cf_ray._engine.storage.fs import FileInfo, Storage
from cf_ray.policy import Sample

logger = logging.getLogger("cf_ray")

#: How many (generation, step) entries the pending table keeps; older settled ones are forgotten.
MAX_PENDING = 64
#: How many settled steps are remembered after they left the pending table (late duplicates).
MAX_SETTLED = 1024
#: How many restores (generation -> restored step) are remembered.
MAX_RESTORES = 32


@dataclass(slots=True)
class _Pending:
    """One checkpoint (a generation's step) in flight, or settled not long ago."""

    generation: int
    step: int
    expected: set[str] | None = None
    """The sections the checkpoint has; ``None`` until a ``part_staged`` says (its world size)."""
    staged: dict[str, str] = field(default_factory=dict)
    """section -> name of the holder that has it in memory."""
    staged_nodes: dict[str, str] = field(default_factory=dict)
    """section -> the node of that holder."""
    replicas: dict[str, dict[str, str]] = field(default_factory=dict)
    """section -> {holder of another node with a copy: its node} (peer replicas, #12)."""
    writers: dict[str, str] = field(default_factory=dict)
    """section -> name of the holder that reported it durable or failed."""
    durable: dict[str, dict[str, FileInfo]] = field(default_factory=dict)
    """section -> its files on storage."""
    persist_s: dict[str, float] = field(default_factory=dict)
    """section -> seconds its holder spent writing it."""
    section_bytes: dict[str, int] = field(default_factory=dict)
    """section -> its size in bytes."""
    failed: dict[str, str] = field(default_factory=dict)
    """section -> why it could not be written."""
    superseded: set[str] = field(default_factory=set)
    """Sections that will never be written (replaced by a newer snapshot, or memory-only)."""
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
    jit: jit_tier.JitPlan | None = None
    """The tier chosen for a just-in-time checkpoint (decided once every section is staged)."""
    verify_files: bool = False
    """Learnt from a holder's resync: its files are checked on storage before the commit (a step
    committed and deleted by keep-last before the controller started again must not come back)."""
    created_mono: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class Committed:
    """One entry of the committed index."""

    path: str
    """The checkpoint's directory, relative to the run's storage."""
    milestone: bool
    generation: int
    epoch: int


@dataclass(frozen=True, slots=True)
class CommitJob:
    """A complete step whose manifest is to be written, outside the controller's lock."""

    generation: int
    step: int
    manifest: mf.Manifest
    directory: str
    verify_files: bool


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What writing a :class:`CommitJob` did."""

    commit_s: float = 0.0
    error: str | None = None
    """Why the manifest could not be written (the step fails)."""
    missing: bool = False
    """A resync-derived step whose files are gone (deleted by keep-last): abandoned, not failed."""


def load_committed(storage: Storage) -> tuple[dict[int, Committed], int]:
    """The committed checkpoints on storage (step -> entry) and the newest generation among them
    (0 when there is none): what a controller that starts again rebuilds from storage. Quarantined
    steps (:data:`QUARANTINE`) are left out."""
    committed: dict[int, Committed] = {}
    gens = [0]
    quarantined = load_quarantine(storage)
    for c in mf.list_committed(storage):
        if c.step in quarantined:
            continue
        try:
            m = mf.read_manifest(storage, c.path)
        except Exception as e:  # noqa: BLE001 - a bad manifest is skipped, readers verify again
            logger.warning("cf_ray: ignoring %s: %s", c.path, e)
            continue
        committed[c.step] = Committed(path=c.path, milestone=m.milestone, generation=m.generation, epoch=m.epoch)
        gens.append(m.generation)
    return committed, max(gens)


def _per_holder_persist(p: _Pending) -> dict[str, float]:
    """Seconds each holder spent writing this checkpoint's sections (it writes them in turn)."""
    out: dict[str, float] = collections.defaultdict(float)
    for sec, secs in p.persist_s.items():
        out[p.staged.get(sec, "")] += secs
    return out


class CommitBook:
    """The pending table, the commit of complete checkpoints and the committed index.

    Args:
        storage: the run's storage (manifests are written there).
        committed: the committed index to start from (:func:`load_committed`).
        book: the profile (rows, failures, metrics) each transition is recorded in.
        schedule: where the persist times go (the policy's samples).
        on_commit: called with ``(step, manifest)`` after each commit (clean-up and uploads), under
            the controller's lock.
        restores: generation -> the step that attempt restored (persisted by the controller):
            older generations' steps past it are abandoned.
    """

    def __init__(
        self,
        storage: Storage,
        committed: dict[int, Committed],
        *,
        book: ProfileBook,
        schedule: ScheduleBook,
        on_commit: Callable[[int, mf.Manifest], None],
        restores: dict[int, int] | None = None,
        draining: Callable[[], set[str]] | None = None,
    ):
        self.storage = storage
        self.committed = committed
        """step -> :class:`Committed`, the checkpoints a restore may read (change it through
        :meth:`add_committed` and :meth:`remove_committed`)."""
        self._newest: int | None = max(committed) if committed else None
        self.pending: dict[tuple[int, int], _Pending] = {}
        """(generation, step) -> :class:`_Pending`."""
        self._settled: collections.OrderedDict[tuple[int, int], tuple[SectionState, str | None]] = (
            collections.OrderedDict()
        )
        """Settled steps that left the pending table: (state, error), the newest :data:`MAX_SETTLED`."""
        self.restores: dict[int, int] = dict(restores or {})
        self.settled_out: list[tuple[int, int, SectionState, tuple[str, ...]]] = []
        """Steps that settled since the caller last took them: (generation, step, state, holders)
        (the controller tells those holders, outside the lock)."""
        self._book = book
        self._schedule = schedule
        self._on_commit = on_commit
        self._io_lock = threading.Lock()  # manifest writes in turn (never the controller's lock)
        self._hint_step = self._newest if self._newest is not None else -1  # the newest 'latest' hint written
        self.draining = draining or (lambda: set())
        """The nodes Ray says are draining (asked once per just-in-time checkpoint, for its tier)."""
        self.bandwidths = jit_tier.Bandwidths()
        """What this run measured of storage writes and peer copies (the just-in-time tier's prediction)."""

    # -- the committed index ----------------------------------------------------------------------------
    def add_committed(self, step: int, entry: Committed) -> None:
        self.committed[step] = entry
        if self._newest is None or step > self._newest:
            self._newest = step

    def quarantine(self, step: int, why: str) -> bool:
        """Take a committed step that a restore found corrupt out of the index (keep-last no longer
        counts it, restore plans no longer name it) and answer late messages about it as failed,
        so it is never committed again; ``True`` when it was in the index."""
        c = self.committed.get(step)
        if c is None:
            return False
        self.remove_committed(step)
        self._settled[(c.generation, step)] = (SectionState.FAILED, f"quarantined: {why}")
        return True

    def remove_committed(self, step: int) -> None:
        self.committed.pop(step, None)
        if step == self._newest:
            self._newest = max(self.committed) if self.committed else None

    # -- queries ----------------------------------------------------------------------------------------
    def newest_step(self) -> int | None:
        return self._newest

    def committed_steps(self, *, newest_first: bool = False) -> list[int]:
        return sorted(self.committed, reverse=newest_first)

    def pending_steps(self) -> list[int]:
        """Steps (sorted) with an entry still pending, of any generation."""
        return sorted(k[1] for k, p in self.pending.items() if p.state == SectionState.PENDING)

    def awaited_steps(self, generation: int) -> list[int]:
        """Steps (sorted) of ``generation`` still pending, none of whose sections is superseded
        (what ``Checkpointer.wait`` waits for)."""
        return sorted(
            k[1]
            for k, p in self.pending.items()
            if k[0] == generation and p.state == SectionState.PENDING and not p.superseded
        )

    def states_by_step(self) -> dict[int, set[SectionState]]:
        """step -> the states of its entries (of every generation); a committing one is pending."""
        states: dict[int, set[SectionState]] = {}
        for (_, step), p in self.pending.items():
            states.setdefault(step, set()).add(p.state)
        return states

    def in_flight_steps(self) -> set[int]:
        """Steps with an entry still pending or committing (keep-last and clean-up leave them)."""
        return {k[1] for k, p in self.pending.items() if p.state == SectionState.PENDING}

    def newest_in_memory(self, alive_nodes: set[str] | None = None) -> MemorySnapshot | None:
        """The newest snapshot every section of which some holder has (a memory restore): its own
        holder, or a peer's replica. With ``alive_nodes``, a copy on a node not in it does not count
        (the node is lost: a snapshot whose section had no surviving copy is passed over)."""

        def alive(node: str | None) -> bool:
            return alive_nodes is None or not node or node in alive_nodes

        for (gen, step), p in sorted(self.pending.items(), key=lambda kv: (kv[0][1], kv[0][0]), reverse=True):
            if not (p.expected and p.expected <= set(p.staged) and p.meta is not None):
                continue
            copies: dict[str, list[str]] = {}
            for sec in p.expected:
                found = [p.staged[sec]] if alive(p.staged_nodes.get(sec)) else []
                found += [h for h, node in sorted(p.replicas.get(sec, {}).items()) if alive(node) and h not in found]
                if not found:
                    break
                copies[sec] = found
            else:
                return MemorySnapshot(
                    generation=gen,
                    step=step,
                    sections={sec: hs[0] for sec, hs in copies.items()},
                    world_size=p.meta.world_size,
                    epoch=p.meta.epoch,
                    replicated=p.meta.replicated,
                    replicas={sec: tuple(hs[1:]) for sec, hs in copies.items() if len(hs) > 1},
                )
        return None

    def replicated(self, msg: PartReplicated, *, resync: bool = False) -> None:
        """A peer holds a copy of a section (``msg.holder``), or the copy failed or was skipped.
        ``resync``: said again by the peer (``Holder.resync``): where the copy is, nothing counted twice."""
        p = self.pending.get((msg.generation, msg.step))
        if msg.holder and not msg.error and not msg.skipped:
            if not resync:
                self.bandwidths.add_peer(msg.origin, msg.nbytes, msg.seconds)
            if p is not None:
                p.replicas.setdefault(msg.section, {})[msg.holder] = msg.node_id
                self._check_peer_safe(p)
        if not resync:
            self._book.note_replicated(msg)

    def draining_nodes(self) -> set[str]:
        """The nodes Ray says are draining; empty when it cannot say (then any node may be the one to go)."""
        try:
            return set(self.draining())
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not ask Ray which nodes are draining (%r); assuming any may go", e)
            return set()

    def safe_steps(self, generation: int, steps: list[int]) -> list[int]:
        """Those of ``steps`` that are just-in-time checkpoints safe in the tier chosen for them and
        not committed yet: in a peer's memory (the preempted rank's wait may end; storage goes on)."""
        out = []
        for step in steps:
            p = self.pending.get((generation, int(step)))
            if (
                p is not None
                and p.jit is not None
                and p.jit.tier != jit_tier.JitTier.STORAGE
                and p.jit.peer_safe_unix is not None
            ):
                out.append(int(step))
        return out

    def _decide_tier(self, p: _Pending, draining: set[str] | None) -> None:
        """Once every section of a just-in-time checkpoint is staged: predict each tier from this
        run's measurements and choose (:mod:`.jit_tier`). Under the controller's lock; asks Ray which
        nodes are draining (a GCS call) only when the caller did not (a resync)."""
        if (
            p.jit is not None
            or p.deadline_unix is None
            or p.meta is None
            or p.expected is None
            or not p.expected <= set(p.staged)
            or p.state != SectionState.PENDING
        ):
            return
        if draining is None:
            draining = self.draining_nodes()
        peer_nodes = None
        if p.meta.replicas != 0:
            peer_nodes = {n for q in self.pending.values() for n in q.staged_nodes.values()}
            peer_nodes |= {n for q in self.pending.values() for r in q.replicas.values() for n in r.values()}
        p.jit = jit_tier.plan(
            now_unix=time.time(),
            deadline_unix=p.deadline_unix,
            sections={
                sec: (p.staged[sec], p.staged_nodes.get(sec, ""), p.section_bytes.get(sec, 0)) for sec in p.expected
            },
            draining=draining,
            peer_nodes=peer_nodes,
            bandwidths=self.bandwidths,
        )
        self._book.note_jit_plan(p.generation, p.step, p.jit)
        logger.warning(
            "cf_ray: just-in-time checkpoint of step %d: %.1f s to the deadline; storage predicted %.2f s, "
            "a peer's memory %s: %s",
            p.step,
            p.jit.left_s,
            p.jit.predicted_storage_s,
            "not available" if p.jit.predicted_peer_s is None else f"{p.jit.predicted_peer_s:.2f} s",
            {
                jit_tier.JitTier.STORAGE: "storage",
                jit_tier.JitTier.PEER: "safe once a peer holds a copy of every section (storage goes on)",
                jit_tier.JitTier.NONE: "neither fits, both go on; the previous checkpoint stays the latest until one completes",
            }[p.jit.tier],
        )
        self._check_peer_safe(p)

    def _check_peer_safe(self, p: _Pending) -> None:
        if p.jit is None or p.jit.peer_safe_unix is not None or p.state != SectionState.PENDING:
            return
        if p.jit.peer_safe(p.staged_nodes, p.replicas):
            p.jit.peer_safe_unix = time.time()
            self._book.note_jit_peer_safe(p.generation, p.step, p.jit)

    def state_of(self, generation: int, step: int) -> SectionState | None:
        """Where ``(generation, step)`` stands; ``None`` when this controller never heard of it."""
        p = self.pending.get((generation, step))
        if p is not None:
            return p.state
        known = self._late_state(generation, step)
        return None if known is None else known[0]

    def accepts(self, generation: int, step: int) -> bool:
        """Whether a message about ``(generation, step)`` changes anything (not a late one about a
        step that settled and was forgotten, is committed, or was abandoned by a restore)."""
        return (generation, step) in self.pending or self._late_state(generation, step) is None

    def settled_report(self, generation: int, steps: list[int]) -> dict:
        """Which of ``steps`` (of ``generation``) are settled, and how (the ``settled`` RPC)."""
        out: dict = {
            "generation": generation,
            "committed": [],
            "failed": {},
            "superseded": [],
            "abandoned": [],
            "pending": [],
            "unknown": [],
        }
        for step in steps:
            step = int(step)
            p = self.pending.get((generation, step))
            if p is not None:
                state, error = p.state, "; ".join(f"{s}: {e}" for s, e in sorted(p.failed.items())) or None
                if state == SectionState.PENDING and p.superseded and not p.committing:
                    state = SectionState.SUPERSEDED  # a memory-only section: it will never be written
            else:
                known = self._late_state(generation, step)
                if known is None:
                    out["unknown"].append(step)
                    continue
                state, error = known
            if state == SectionState.FAILED:
                out["failed"][step] = error or "failed"
            else:
                out[state.value].append(step)
        out["newest_committed"] = self._newest
        return out

    def _late_state(self, generation: int, step: int) -> tuple[SectionState, str | None] | None:
        """The state of a step that is not in the pending table: settled and forgotten, committed
        (on storage), or abandoned by a later restore; ``None`` when nothing says."""
        known = self._settled.get((generation, step))
        if known is not None:
            return known
        c = self.committed.get(step)
        if c is not None and c.generation == generation:
            return SectionState.COMMITTED, None
        if c is not None and c.generation > generation:
            return SectionState.ABANDONED, None  # a later attempt committed this step again
        if any(gen > generation and step > restored for gen, restored in self.restores.items()):
            return SectionState.ABANDONED, None
        return None

    # -- transitions ----------------------------------------------------------------------------------------
    def staged(self, msg: PartStaged, *, resync: bool = False, draining: set[str] | None = None) -> CommitJob | None:
        """A section is held by a holder. ``draining``: the nodes Ray says are draining, asked by the
        caller outside the lock for a just-in-time checkpoint's section (``None``: asked here if needed)."""
        p = self._entry(msg.generation, msg.step, resync=resync)
        if p is None:
            return None
        meta = msg.meta
        p.staged[msg.section] = msg.holder
        if msg.node_id:
            p.staged_nodes[msg.section] = msg.node_id
        p.section_bytes[msg.section] = msg.nbytes
        if meta.rank == 0 or p.meta is None:
            p.meta = meta
        if CheckpointKind(meta.kind) is CheckpointKind.PREEMPT and meta.deadline_unix is not None:
            if p.deadline_unix is None or meta.deadline_unix < p.deadline_unix:
                p.deadline_unix = float(meta.deadline_unix)
        if not meta.persist:
            p.superseded.add(msg.section)
        if p.expected is None:
            p.expected = {mf.rank_section(r) for r in range(int(meta.world_size))}
            if meta.replicated:
                p.expected.add(mf.SHARED)
            # The controller is a threaded actor: a holder's part_durable calls may run before
            # the part_staged that says which sections to expect, so commit from here as well.
            self._report_persist(p)
            self._decide_tier(p, draining)
            return self._try_commit(p)
        self._decide_tier(p, draining)
        return None

    def superseded(self, generation: int, step: int, section: str, *, resync: bool = False) -> None:
        p = self._entry(generation, step, resync=resync)
        if p is None:
            return
        p.superseded.add(section)
        if p.state == SectionState.PENDING and not p.committing:
            self._settle(p, SectionState.SUPERSEDED)
            self._book.note_superseded(generation, step)

    def durable(
        self,
        generation: int,
        step: int,
        section: str,
        files: dict[str, dict[str, int]],
        persist_s: float,
        *,
        holder: str = "",
        resync: bool = False,
    ) -> CommitJob | None:
        p = self._entry(generation, step, resync=resync)
        if p is None:
            return None
        p.durable[section] = {k: FileInfo(int(v["size"]), int(v["crc32"])) for k, v in files.items()}
        p.persist_s[section] = persist_s
        if holder:
            p.writers[section] = holder
        self._report_persist(p)
        return self._try_commit(p)

    def failed(
        self,
        generation: int,
        step: int,
        section: str,
        error: str,
        *,
        holder: str = "",
        resync: bool = False,
        lost: bool = False,
    ) -> None:
        """A section could not be written (``lost``: its holder died before writing it)."""
        p = self._entry(generation, step, resync=resync)
        if p is None or p.committing or p.state == SectionState.COMMITTED:
            return  # every section is durable: a late or stale failure changes nothing
        if holder:
            p.writers[section] = holder
        if section in p.failed and p.state == SectionState.FAILED:
            return  # the same failure again (a re-sent message)
        p.failed[section] = error
        p.lost = lost and (p.state != SectionState.FAILED or p.lost)
        self._settle(p, SectionState.FAILED)
        self._book.add_failure(
            generation=generation, step=step, section=section, rank=mf.section_rank(section), error=error
        )
        self._book.note_failed(generation, step, section, error)
        logger.warning("cf_ray: checkpoint of step %d not committed: %s failed: %s", step, section, error)
        self._book.record_metrics(generation, step)

    def abandon(self, generation: int, step: int) -> bool:
        """One entry still pending is abandoned (nothing will complete it). Returns whether it was."""
        p = self.pending.get((generation, step))
        if p is None or p.state != SectionState.PENDING or p.committing:
            return False
        self._settle(p, SectionState.ABANDONED)
        return True

    def abandon_after(self, generation: int, step: int) -> list[tuple[int, int]]:
        """Entries of generations before ``generation`` still pending past ``step`` become
        abandoned (a timeline the attempt restored at ``step`` replays), and so do their late
        messages; so do those that failed only because their holder died (``lost``): their attempt
        ended. Returns the keys abandoned now."""
        self.restores[generation] = step
        for g in sorted(self.restores)[:-MAX_RESTORES]:
            del self.restores[g]
        out = []
        for (gen, st), p in self.pending.items():
            in_flight = p.state == SectionState.PENDING and not p.committing
            if gen < generation and st > step and (in_flight or (p.state == SectionState.FAILED and p.lost)):
                self._settle(p, SectionState.ABANDONED)
                out.append((gen, st))
        return out

    def take_settled(self) -> list[tuple[int, int, SectionState, tuple[str, ...]]]:
        out, self.settled_out = self.settled_out, []
        return out

    def _settle(self, p: _Pending, state: SectionState) -> None:
        p.state = state
        holders = tuple(sorted(set(p.staged.values()) | set(p.writers.values())))
        if holders:
            self.settled_out.append((p.generation, p.step, state, holders))

    def _entry(self, generation: int, step: int, *, resync: bool) -> _Pending | None:
        """The pending entry of a message, made on first mention; ``None`` when the message is
        about a step that settled and was forgotten, is committed, or was abandoned by a restore."""
        p = self.pending.get((generation, step))
        if p is not None:
            return p
        if self._late_state(generation, step) is not None:
            return None
        p = self.pending[(generation, step)] = _Pending(generation, step, verify_files=resync)
        # Keep the table small: forget old settled entries (remembering how they settled), never
        # pending ones.
        if len(self.pending) > MAX_PENDING:
            for k in sorted(self.pending)[: len(self.pending) - MAX_PENDING]:
                old = self.pending[k]
                if old.state != SectionState.PENDING:
                    del self.pending[k]
                    self._settled[k] = (
                        old.state,
                        "; ".join(f"{s}: {e}" for s, e in sorted(old.failed.items())) or None,
                    )
                    while len(self._settled) > MAX_SETTLED:
                        self._settled.popitem(last=False)
        return p

    def _report_persist(self, p: _Pending) -> None:
        """Workers cannot see phase 2: its times reach the policy from here, once every section of
        the checkpoint is durable (a small section durable first must not pass for the whole
        checkpoint's persist time)."""
        if p.persist_reported or p.expected is None or not p.expected <= set(p.durable):
            return
        p.persist_reported = True
        # A holder writes its sections one after the other: a rank's persist time is the time its
        # holder spent writing this checkpoint (what "one persist in flight" has to fit).
        per_holder = _per_holder_persist(p)
        for sec in sorted(p.persist_s):
            rank = mf.section_rank(sec)
            if sec == mf.SHARED and mf.rank_section(0) in p.persist_s:
                continue  # rank 0's sample comes with its own section (same holder)
            self._schedule.add_sample(
                Sample(rank=rank, step=p.step, ckpt_step=p.step, persist_s=per_holder[p.staged.get(sec, "")])
            )

    def _try_commit(self, p: _Pending) -> CommitJob | None:
        """The decision, under the lock: a complete step becomes *committing* (once)."""
        if (
            p.state != SectionState.PENDING
            or p.committing
            or p.expected is None
            or p.meta is None
            or not p.expected <= set(p.durable)
        ):
            return None
        files: dict[str, FileInfo] = {}
        sections = {}
        for sec in sorted(p.expected):
            files.update(p.durable[sec])
            data, index = mf.section_files(p.generation, sec)
            sections[sec] = {"data": data, "index": index}
        meta = p.meta
        m = mf.Manifest(
            step=p.step,
            epoch=int(meta.epoch),
            world_size=int(meta.world_size),
            generation=p.generation,
            replicated=bool(meta.replicated),
            kind=CheckpointKind(meta.kind).value,
            milestone=bool(meta.milestone),
            sections=sections,
            files=files,
            created_unix=time.time(),
            extra={"data_world_size": meta.world_size},
        )
        p.committing = True
        return CommitJob(
            generation=p.generation, step=p.step, manifest=m, directory=mf.step_dir(p.step), verify_files=p.verify_files
        )

    # -- the commit itself ------------------------------------------------------------------------------
    def write(self, job: CommitJob) -> CommitResult:
        """Write the manifest (the commit point) and, for the newest step so far, the ``latest``
        hint. Storage I/O: called *without* the controller's lock; manifests are written one at a
        time (their own lock), so the hint never goes back to an older step."""
        with self._io_lock:
            t0 = time.perf_counter()
            try:
                if job.verify_files and not _files_present(self.storage, job.directory, job.manifest.files):
                    return CommitResult(missing=True)
                if job.step > self._hint_step:
                    mf.commit(self.storage, job.directory, job.manifest)
                    self._hint_step = job.step
                else:
                    self.storage.write_file(f"{job.directory}/{mf.MANIFEST}", [job.manifest.to_bytes()])
            except Exception as e:  # noqa: BLE001 - a failed commit leaves the previous one the latest
                return CommitResult(error=f"{type(e).__name__}: {e}")
            return CommitResult(commit_s=time.perf_counter() - t0)

    def finish(self, job: CommitJob, result: CommitResult) -> None:
        """Record what :meth:`write` did (under the lock): committed, failed or abandoned."""
        p = self.pending[(job.generation, job.step)]  # a committing entry is pending: never pruned
        p.committing = False
        if result.missing:
            logger.info(
                "cf_ray: step %d (generation %d), re-learnt after a restart, is no longer on storage "
                "(deleted by keep-last): not committed again",
                job.step,
                job.generation,
            )
            self._settle(p, SectionState.ABANDONED)
            return
        if result.error is not None:
            self.failed(p.generation, p.step, "manifest", result.error)
            return
        m = job.manifest
        self._measure_storage(p, result.commit_s)
        self._settle(p, SectionState.COMMITTED)
        self.add_committed(
            p.step, Committed(path=job.directory, milestone=m.milestone, generation=p.generation, epoch=m.epoch)
        )
        row = self._book.note_committed(
            p.generation,
            p.step,
            where=self.storage.uri(job.directory),
            commit_s=result.commit_s,
            persist_s=max(_per_holder_persist(p).values()),
            total_bytes=sum(p.section_bytes.values()),
            epoch=m.epoch,
            kind=m.kind,
            milestone=m.milestone,
        )
        logger.info("cf_ray: committed step %d (%d bytes) at %s", p.step, row["bytes"], row["where"])
        self._book.record_metrics(p.generation, p.step)
        self._on_commit(p.step, m)

    def _measure_storage(self, p: _Pending, commit_s: float) -> None:
        """Each holder's bytes and seconds on this checkpoint, and the manifest's commit time."""
        nbytes: dict[str, int] = collections.defaultdict(int)
        for sec, holder in p.staged.items():
            nbytes[holder] += p.section_bytes.get(sec, 0)
        for holder, secs in _per_holder_persist(p).items():
            self.bandwidths.add_storage(holder, nbytes.get(holder, 0), secs)
        self.bandwidths.add_commit(commit_s)

    # -- the watch (see recovery.py) ------------------------------------------------------------------
    def watch_targets(
        self, min_age_s: float
    ) -> tuple[dict[str, list[tuple[int, int, str]]], list[tuple[int, int, str]]]:
        """What to ask the holders about: sections of steps pending for at least ``min_age_s``
        that some holder has or wrote and whose outcome this controller has not heard (by holder),
        and sections expected that no holder was heard of (orphans)."""
        by_holder: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
        orphans: list[tuple[int, int, str]] = []
        now = time.monotonic()
        for (gen, step), p in self.pending.items():
            if p.state != SectionState.PENDING or p.committing or now - p.created_mono < min_age_s:
                continue
            done = set(p.durable) | set(p.failed) | p.superseded
            for sec, holder in p.staged.items():
                if sec not in done:
                    by_holder[holder].append((gen, step, sec))
            if p.expected is None:  # its part_staged never came: ask who wrote a section
                for sec, holder in p.writers.items():
                    by_holder[holder].append((gen, step, sec))
            else:
                orphans += [(gen, step, sec) for sec in sorted(p.expected - set(p.staged) - done)]
        return dict(by_holder), orphans


def _files_present(storage: Storage, directory: str, files: dict[str, FileInfo]) -> bool:
    """Whether every file is on storage with its size (its content is verified by readers)."""
    fs = getattr(storage, "fs", None)
    fs_path = getattr(storage, "fs_path", None)
    for name, info in files.items():
        path = f"{directory}/{name}"
        if fs is not None and callable(fs_path):
            got = fs.get_file_info(fs_path(path))
            if got.size is None or got.size != info.size:
                return False
        elif not storage.exists(path):
            return False
    return True
