"""The controller's commit bookkeeping: every section of every snapshot, staged in a holder
(memory), durable (storage), failed or superseded; a checkpoint commits — its manifest is written
— only when every section of that step and generation is durable.

The controller actor is threaded (``max_concurrency``), so Ray does not keep the order in which a
holder sent ``part_staged`` and ``part_durable``: a section can be durable before the call saying
which sections the step has. A commit is therefore tried from both.

Not thread-safe on its own: the controller calls it under its lock (so does the maintenance
thread, for the committed index and the states of the steps in flight).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cf_ray._engine.driver.messages import CheckpointKind, MemorySnapshot, PartStaged, SectionState, SnapshotMeta
from cf_ray._engine.driver.profile_book import ProfileBook
from cf_ray._engine.driver.schedule import ScheduleBook
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.storage.fs import FileInfo, Storage
from cf_ray.policy import Sample

logger = logging.getLogger("cf_ray")

#: How many (generation, step) entries the pending table keeps; older settled ones are forgotten.
MAX_PENDING = 64


@dataclass(slots=True)
class _Pending:
    """One checkpoint (a generation's step) in flight, or settled not long ago."""

    generation: int
    step: int
    expected: set[str] | None = None
    """The sections the checkpoint has; ``None`` until a ``part_staged`` says (its world size)."""
    staged: dict[str, str] = field(default_factory=dict)
    """section -> name of the holder that has it in memory."""
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


@dataclass(frozen=True, slots=True)
class Committed:
    """One entry of the committed index."""

    path: str
    """The checkpoint's directory, relative to the run's storage."""
    milestone: bool
    generation: int
    epoch: int


def load_committed(storage: Storage) -> tuple[dict[int, Committed], int]:
    """The committed checkpoints on storage (step -> entry) and the newest generation among them
    (0 when there is none): what a controller that starts again rebuilds from storage."""
    committed: dict[int, Committed] = {}
    gens = [0]
    for c in mf.list_committed(storage):
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
        on_commit: called with ``(step, manifest)`` after each commit (clean-up and uploads).
    """

    def __init__(self, storage: Storage, committed: dict[int, Committed], *, book: ProfileBook,
                 schedule: ScheduleBook, on_commit: Callable[[int, mf.Manifest], None]):
        self.storage = storage
        self.committed = committed
        """step -> :class:`Committed`, the checkpoints a restore may read."""
        self.pending: dict[tuple[int, int], _Pending] = {}
        """(generation, step) -> :class:`_Pending`."""
        self._book = book
        self._schedule = schedule
        self._on_commit = on_commit

    # -- queries ----------------------------------------------------------------------------------------
    def newest_step(self) -> int | None:
        return max(self.committed) if self.committed else None

    def committed_steps(self, *, newest_first: bool = False) -> list[int]:
        return sorted(self.committed, reverse=newest_first)

    def pending_steps(self) -> list[int]:
        """Steps (sorted) with an entry still pending, of any generation."""
        return sorted(k[1] for k, p in self.pending.items() if p.state == SectionState.PENDING)

    def awaited_steps(self, generation: int) -> list[int]:
        """Steps (sorted) of ``generation`` still pending, none of whose sections is superseded
        (what ``Checkpointer.wait`` waits for)."""
        return sorted(k[1] for k, p in self.pending.items() if k[0] == generation and p.state == SectionState.PENDING
                      and not p.superseded)

    def states_by_step(self) -> dict[int, set[SectionState]]:
        """step -> the states of its entries (of every generation)."""
        states: dict[int, set[SectionState]] = {}
        for (_, step), p in self.pending.items():
            states.setdefault(step, set()).add(p.state)
        return states

    def newest_in_memory(self) -> MemorySnapshot | None:
        """The newest snapshot every section of which some holder has (a memory restore)."""
        for (gen, step), p in sorted(self.pending.items(), key=lambda kv: (kv[0][1], kv[0][0]), reverse=True):
            if p.expected and p.expected <= set(p.staged):
                return MemorySnapshot(generation=gen, step=step, sections=dict(p.staged),
                                      world_size=p.meta.world_size, epoch=p.meta.epoch,
                                      replicated=p.meta.replicated)
        return None

    # -- transitions ----------------------------------------------------------------------------------------
    def staged(self, msg: PartStaged) -> None:
        meta = msg.meta
        p = self._pend(msg.generation, msg.step)
        p.staged[msg.section] = msg.holder
        p.section_bytes[msg.section] = msg.nbytes
        if meta.rank == 0 or p.meta is None:
            p.meta = meta
        if p.expected is None:
            p.expected = {mf.rank_section(r) for r in range(int(meta.world_size))}
            if meta.replicated:
                p.expected.add(mf.SHARED)
            # The controller is a threaded actor: a holder's part_durable calls may run before
            # the part_staged that says which sections to expect, so commit from here as well.
            self._report_persist(p)
            self._try_commit(p)
        if not meta.persist:
            p.superseded.add(msg.section)

    def superseded(self, generation: int, step: int, section: str) -> None:
        p = self._pend(generation, step)
        p.superseded.add(section)
        if p.state == SectionState.PENDING:
            p.state = SectionState.SUPERSEDED
            self._book.note_superseded(generation, step)

    def durable(self, generation: int, step: int, section: str, files: dict[str, dict[str, int]],
                persist_s: float) -> None:
        p = self._pend(generation, step)
        p.durable[section] = {k: FileInfo(int(v["size"]), int(v["crc32"])) for k, v in files.items()}
        p.persist_s[section] = persist_s
        self._report_persist(p)
        self._try_commit(p)

    def failed(self, generation: int, step: int, section: str, error: str) -> None:
        p = self._pend(generation, step)
        p.failed[section] = error
        p.state = SectionState.FAILED
        self._book.add_failure(generation=generation, step=step, section=section, rank=mf.section_rank(section),
                               error=error)
        self._book.note_failed(generation, step, section, error)
        logger.warning("cf_ray: checkpoint of step %d not committed: %s failed: %s", step, section, error)
        self._book.record_metrics(generation, step)

    def abandon_after(self, generation: int, step: int) -> list[tuple[int, int]]:
        """Entries of generations before ``generation`` still pending past ``step`` become
        abandoned (a timeline the attempt restored at ``step`` replays). Returns their keys."""
        out = []
        for (gen, st), p in self.pending.items():
            if gen < generation and p.state == SectionState.PENDING and st > step:
                p.state = SectionState.ABANDONED
                out.append((gen, st))
        return out

    def _pend(self, generation: int, step: int) -> _Pending:
        p = self.pending.get((generation, step))
        if p is None:
            p = self.pending[(generation, step)] = _Pending(generation, step)
            # Keep the table small: forget old settled entries, never pending ones of this generation.
            if len(self.pending) > MAX_PENDING:
                for k in sorted(self.pending)[: len(self.pending) - MAX_PENDING]:
                    if self.pending[k].state != SectionState.PENDING:
                        del self.pending[k]
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
            self._schedule.add_sample(Sample(rank=rank, step=p.step, ckpt_step=p.step,
                                             persist_s=per_holder[p.staged.get(sec, "")]))

    def _try_commit(self, p: _Pending) -> None:
        if p.state != SectionState.PENDING or p.expected is None or not p.expected <= set(p.durable):
            return
        files: dict[str, FileInfo] = {}
        sections = {}
        for sec in sorted(p.expected):
            files.update(p.durable[sec])
            data, index = mf.section_files(p.generation, sec)
            sections[sec] = {"data": data, "index": index}
        meta = p.meta
        m = mf.Manifest(step=p.step, epoch=int(meta.epoch), world_size=int(meta.world_size),
                        generation=p.generation, replicated=bool(meta.replicated),
                        kind=CheckpointKind(meta.kind).value, milestone=bool(meta.milestone),
                        sections=sections, files=files, created_unix=time.time(),
                        extra={"data_world_size": meta.world_size})
        directory = mf.step_dir(p.step)
        try:
            t0 = time.perf_counter()
            newest_before = max(self.committed) if self.committed else -1
            mf.commit(self.storage, directory, m) if p.step > newest_before else \
                self.storage.write_file(f"{directory}/{mf.MANIFEST}", [m.to_bytes()])
            commit_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a failed commit leaves the previous one the latest
            self.failed(p.generation, p.step, "manifest", f"{type(e).__name__}: {e}")
            return
        p.state = SectionState.COMMITTED
        self.committed[p.step] = Committed(path=directory, milestone=m.milestone, generation=p.generation,
                                           epoch=m.epoch)
        row = self._book.note_committed(p.generation, p.step, where=self.storage.uri(directory), commit_s=commit_s,
                                        persist_s=max(_per_holder_persist(p).values()),
                                        total_bytes=sum(p.section_bytes.values()), epoch=m.epoch, kind=m.kind,
                                        milestone=m.milestone)
        logger.info("cf_ray: committed step %d (%d bytes) at %s", p.step, row["bytes"], row["where"])
        self._book.record_metrics(p.generation, p.step)
        self._on_commit(p.step, m)
