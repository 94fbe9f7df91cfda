"""The controller's commit bookkeeping: every section of every snapshot, staged in a holder
(memory), durable (storage), failed or superseded; a checkpoint commits — its manifest is written
— only when every section of that step and generation is durable.

The controller actor is threaded (``max_concurrency``), so Ray does not keep the order in which
holders sent ``part_staged`` and ``part_durable``: a section can be durable before the call saying
which sections the step has. A commit is therefore tried from both.

Every message is idempotent: a holder re-sends what it is not sure arrived (after a
timeout, to a controller that started again, in a resync), so the same ``part_staged`` or
``part_durable`` may come twice, or long after its step settled. A step commits once (the state
goes pending -> committing -> committed); messages of a step that settled and left the pending
table are answered from the table's record (:mod:`.pending`).

Storage I/O is never done under the controller's lock: a transition that completes a step
returns a :class:`~.committed.CommitJob`; the caller writes the manifest (:meth:`CommitBook.write`)
after releasing the lock and reports back (:meth:`CommitBook.finish`, under the lock again). While a
step is *committing* it counts as in flight (never cleaned up, never abandoned, never failed by a
late message), and keep-last never sees it (it is not in the committed index yet).

Memory restores (:meth:`CommitBook.newest_in_memory`) offer only snapshots whose step is pending,
committed or superseded (not written, still held), or failed only because a holder died (its
sections then from peer copies) — never one abandoned, failed otherwise, or distrusted (a snapshot whose bytes failed a restore's verification,
or that the run went non-finite after: ``Controller.distrust``).

Not thread-safe on its own: the controller calls it under its lock (so does the maintenance
thread, for the committed index and the states of the steps in flight), except :meth:`write`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from cf_ray._engine.driver import jit as _jit
from cf_ray._engine.driver.checkpoints.committed import (
    CommitJob,
    CommitResult,
    Committed,
    CommittedIndex,
    files_present,
)
from cf_ray._engine.driver.checkpoints.pending import Pending, PendingTable
from cf_ray._engine.driver.schedule import ScheduleBook
from cf_ray._engine.format.commit import Manifest, commit
from cf_ray._engine.format.layout import MANIFEST, SHARED, rank_section, section_files, section_rank, step_dir
from cf_ray._engine.observe.profile_book import ProfileBook
from cf_ray._engine.protocol.messages import (
    CheckpointKind,
    MemorySnapshot,
    PartDurable,
    PartReplicated,
    PartStaged,
    SectionState,
    Settled,
)
from cf_ray._engine.storage.base import FileInfo, Storage
from cf_ray.policy import Sample

logger = logging.getLogger("cf_ray")

#: How many distrusted in-memory snapshots are remembered (the newest; older ones are long gone from memory).
MAX_DISTRUSTED = 64


def per_holder_persist(p: Pending) -> dict[str, float]:
    """Seconds each holder spent writing this checkpoint's sections (it writes them in turn)."""
    out: dict[str, float] = collections.defaultdict(float)
    for sec, secs in p.parts.persist_s.items():
        out[p.parts.staged.get(sec, "")] += secs
    return out


def per_rank_persist_cpu(p: Pending) -> dict[int, float]:
    """CPU seconds the holders' writers spent on each rank's sections of this checkpoint (the shared
    section counts as rank 0's); a rank without a figure is left out."""
    out: dict[int, float] = collections.defaultdict(float)
    for sec, secs in p.parts.persist_cpu_s.items():
        if secs is not None:
            out[section_rank(sec)] += secs
    return dict(out)


class CommitBook:
    """The transitions of the pending table, the commit of complete checkpoints, the committed
    index, and which in-memory snapshots a restore may take.

    Args:
        storage: the run's storage (manifests are written there).
        committed: the committed index to start from (:func:`~.committed.load_committed`).
        book: the profile (rows, failures, metrics) each transition is recorded in.
        schedule: where the persist times go (the policy's samples).
        on_commit: called with ``(step, manifest)`` after each commit (clean-up and uploads), under
            the controller's lock.
        restores, distrusted: generation -> the step it restored; ``(generation, step)`` never to offer again.
    """

    def __init__(
        self,
        storage: Storage,
        committed: dict[int, Committed],
        *,
        book: ProfileBook,
        schedule: ScheduleBook,
        on_commit: Callable[[int, Manifest], None],
        restores: dict[int, int] | None = None,
        distrusted: list[tuple[int, int]] | None = None,
    ):
        self.storage = storage
        self.index = CommittedIndex(committed)
        """The checkpoints a restore may read."""
        self.table = PendingTable(self.index, restores)
        self.distrusted: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict(
            ((int(g), int(s)), None) for g, s in (distrusted or [])[-MAX_DISTRUSTED:]
        )
        """``(generation, step)`` of in-memory snapshots never offered to a restore again, the newest."""
        self._book = book
        self._schedule = schedule
        self._on_commit = on_commit
        self._io_lock = threading.Lock()  # manifest writes in turn (never the controller's lock)
        newest = self.index.newest()
        self._hint_step = newest if newest is not None else -1  # the newest 'latest' hint written

    # -- the committed index and what restores may take ------------------------------------------------
    @property
    def committed(self) -> dict[int, Committed]:
        """step -> :class:`Committed` (read-only use: change it through :attr:`index`)."""
        return self.index.entries

    def newest_step(self) -> int | None:
        return self.index.newest()

    def committed_steps(self, *, newest_first: bool = False) -> list[int]:
        return self.index.steps(newest_first=newest_first)

    def quarantine(self, step: int, why: str, generation: int | None = None) -> bool:
        """Take a committed step out of the index (keep-last no longer counts it, restore plans no
        longer name it) and answer late messages about it as failed, so it is never committed
        again; ``True`` when it was in the index (of ``generation``, when given)."""
        c = self.index.get(step)
        if c is None or (generation is not None and c.generation != generation):
            return False
        self.index.remove(step)
        self.table.forget_as_failed(c.generation, step, f"quarantined: {why}")
        return True

    def distrust(self, generation: int, step: int) -> None:
        """Never offer the in-memory snapshot ``(generation, step)`` to a restore plan again."""
        self.distrusted[(int(generation), int(step))] = None
        while len(self.distrusted) > MAX_DISTRUSTED:
            self.distrusted.popitem(last=False)

    def newest_in_memory(self, alive_nodes: set[str] | None = None) -> MemorySnapshot | None:
        """The newest snapshot every section of which some holder has (a memory restore): its own
        holder, or a peer's replica. With ``alive_nodes``, a copy on a node not in it does not count
        (the node is lost: a snapshot whose section had no surviving copy is passed over).

        Never offered: an abandoned step (another timeline), a distrusted one, one that failed unless
        only because a holder died (``Pending.lost``: then its sections count by their peer copies). A
        superseded one still is (in memory; storage may never get it), until a later attempt resumes
        before its step (then it is abandoned: :meth:`.pending.PendingTable.abandon_after`). The
        restore verifies every byte."""

        def alive(node: str | None) -> bool:
            return alive_nodes is None or not node or node in alive_nodes

        entries = sorted(self.table.entries.items(), key=lambda kv: (kv[0][1], kv[0][0]), reverse=True)
        for (gen, step), p in entries:
            if (gen, step) in self.distrusted:
                continue
            if p.state == SectionState.ABANDONED:
                continue
            if p.state == SectionState.FAILED and not p.lost:
                continue
            if not (p.parts.expected and p.parts.expected <= set(p.parts.staged) and p.meta is not None):
                continue
            copies: dict[str, list[str]] = {}
            for sec in p.parts.expected:
                own = alive(p.parts.staged_nodes.get(sec)) and sec not in p.parts.failed
                found = [p.parts.staged[sec]] if own else []
                found += [
                    h for h, node in sorted(p.parts.replicas.get(sec, {}).items()) if alive(node) and h not in found
                ]
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

    def settled_report(self, generation: int, steps: list[int]) -> Settled:
        """Which of ``steps`` (of ``generation``) are settled, and how; and which are safe (the
        ``settled`` RPC, less ``resynced``: :meth:`.pending.PendingTable.report`)."""
        return self.table.report(generation, steps)

    # -- just-in-time checkpoints (:mod:`cf_ray._engine.driver.jit`) ---------------------------------------
    def _start_jit(self, p: Pending, draining: set[str] | None) -> None:
        """Once every section of a just-in-time checkpoint is staged: what makes it safe in a peer's
        memory (``draining``: the nodes Ray says are draining, asked by the caller outside the lock;
        ``None`` when unknown, e.g. learnt in a resync: any node may go)."""
        if (
            p.jit is not None
            or p.deadline_unix is None
            or p.meta is None
            or p.parts.expected is None
            or not p.parts.expected <= set(p.parts.staged)
            or p.state != SectionState.PENDING
        ):
            return
        p.jit = _jit.watch(
            now_unix=time.time(),
            deadline_unix=p.deadline_unix,
            nodes={sec: p.parts.staged_nodes.get(sec, "") for sec in p.parts.expected},
            draining=draining or (),
        )
        _jit.staged(self._book, p.generation, p.step, p.jit)
        logger.warning(
            "cf_ray: just-in-time checkpoint of step %d staged, %.1f s to the deadline: safe once committed, "
            "or once %s",
            p.step,
            p.jit.left_s,
            f"{len(p.jit.needs_copy)} section(s) of a node that may go have a copy on another node"
            if p.jit.needs_copy
            else "staged (no section lives on a draining node)",
        )
        self._check_peer_safe(p)

    def _check_peer_safe(self, p: Pending) -> None:
        if p.jit is None or p.jit.peer_safe_unix is not None or p.state != SectionState.PENDING:
            return
        if p.jit.peer_safe(p.parts.staged_nodes, p.parts.replicas):
            p.jit.peer_safe_unix = time.time()
            _jit.peer_safe(self._book, p.generation, p.step, p.jit)

    # -- transitions -----------------------------------------------------------------------------------
    def staged(self, msg: PartStaged, *, resync: bool = False, draining: set[str] | None = None) -> CommitJob | None:
        """A section is held by a holder. ``draining``: the nodes Ray says are draining, asked by the
        caller outside the lock for a just-in-time checkpoint's section."""
        p = self.table.entry(msg.generation, msg.step, resync=resync)
        if p is None:
            return None
        meta = msg.meta
        p.note_persist(meta.persist, msg.section)
        p.parts.staged[msg.section] = msg.holder
        if msg.node_id:
            p.parts.staged_nodes[msg.section] = msg.node_id
        p.parts.section_bytes[msg.section] = msg.nbytes
        if meta.rank == 0 or p.meta is None:
            p.meta = meta
        if CheckpointKind(meta.kind) is CheckpointKind.PREEMPT and meta.deadline_unix is not None:
            if p.deadline_unix is None or meta.deadline_unix < p.deadline_unix:
                p.deadline_unix = float(meta.deadline_unix)
        job = None
        if p.parts.expected is None:
            p.parts.expected = {rank_section(r) for r in range(int(meta.world_size))}
            if meta.replicated:
                p.parts.expected.add(SHARED)
            # The controller is a threaded actor: a holder's part_durable calls may run before
            # the part_staged that says which sections to expect, so commit from here as well.
            self._report_persist(p)
            job = self._try_commit(p)
        if p.held_in_full():  # settled, still a memory candidate; holders keep no record of it: untold
            self.table.settle(p, SectionState.SUPERSEDED, tell=False)
            self._book.note_superseded(p.generation, p.step, held=True)
        self._start_jit(p, draining)
        return job

    def replicated(self, msg: PartReplicated, *, resync: bool = False) -> None:
        """A peer holds a copy of a section (``msg.holder``), or the copy failed or was skipped.
        ``resync``: said again by the peer (``Holder.resync``): where the copy is, nothing counted twice."""
        p = self.table.get(msg.generation, msg.step)
        if msg.holder and not msg.error and not msg.skipped and p is not None:
            p.parts.replicas.setdefault(msg.section, {})[msg.holder] = msg.node_id
            self._check_peer_safe(p)
        if not resync:
            self._book.note_replicated(msg)

    def superseded(self, generation: int, step: int, section: str, *, resync: bool = False) -> None:
        p = self.table.entry(generation, step, resync=resync)
        if p is None:
            return
        p.parts.superseded.add(section)
        if p.state == SectionState.PENDING and not p.committing:
            self.table.settle(p, SectionState.SUPERSEDED)
            self._book.note_superseded(generation, step)

    def durable(self, msg: PartDurable, *, resync: bool = False) -> CommitJob | None:
        """A section is written (``msg``): recorded, and the checkpoint committed once complete."""
        p = self.table.entry(msg.generation, msg.step, resync=resync)
        if p is None:
            return None
        section, holder = msg.section, msg.holder
        p.parts.durable[section] = {k: FileInfo(int(v["size"]), int(v["crc32"])) for k, v in msg.files.items()}
        p.parts.persist_s[section], p.parts.persist_cpu_s[section] = msg.persist_s, msg.persist_cpu_s
        if holder:
            p.parts.writers[section] = holder
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
        p = self.table.entry(generation, step, resync=resync)
        if p is None or p.committing or p.state == SectionState.COMMITTED or p.stale_failure(section, holder):
            return  # every section is durable, or a rank's skip of the step before finish() took it again
        if holder:
            p.parts.writers[section] = holder
        if section in p.parts.failed and p.state == SectionState.FAILED:
            return  # the same failure again (a re-sent message)
        p.parts.failed[section] = error
        p.lost = lost and (p.state != SectionState.FAILED or p.lost)
        self.table.settle(p, SectionState.FAILED)
        self._book.log.add_failure(
            generation=generation, step=step, section=section, rank=section_rank(section), error=error
        )
        self._book.note_failed(generation, step, section, error)
        _jit.failed(self._book, generation, step)
        logger.warning("cf_ray: checkpoint of step %d not committed: %s failed: %s", step, section, error)
        self._book.record_metrics(generation, step)

    def abandon_after(self, generation: int, step: int, alive_nodes: set[str] | None = None) -> list[tuple[int, int]]:
        """The attempt ``generation`` restored at ``step``: entries of earlier generations still in
        flight past it are abandoned (:meth:`PendingTable.abandon_after`). One of them that had a
        section on a node no longer alive (``alive_nodes``; ``None``: unknown) was lost with its node
        before the watch could say so: it is reported as a failure of its attempt (the ranks of the
        new attempt report it once, ``FinishSummary.failures``), never dropped silently."""
        out = []
        for p in self.table.abandon_after(generation, step):
            out.append((p.generation, p.step))
            gone = sorted(
                (sec, node)
                for sec, node in p.parts.staged_nodes.items()
                if alive_nodes is not None and node and node not in alive_nodes and sec not in p.parts.durable
            )
            if gone and not p.parts.failed:
                sec, node = gone[0]
                error = f"lost: node {node} was lost before this section was written; its attempt ended"
                p.parts.failed[sec] = error
                self._book.log.add_failure(
                    generation=p.generation, step=p.step, section=sec, rank=section_rank(sec), error=error
                )
                self._book.note_failed(p.generation, p.step, sec, error)
                logger.warning("cf_ray: checkpoint of step %d not committed: %s %s", p.step, sec, error)
            _jit.abandoned(self._book, p.generation, p.step)
        return out

    def _report_persist(self, p: Pending) -> None:
        """Workers cannot see phase 2: its times reach the policy from here, once every section of
        the checkpoint is durable (a small section durable first must not pass for the whole
        checkpoint's persist time)."""
        if p.persist_reported or p.parts.expected is None or not p.parts.expected <= set(p.parts.durable):
            return
        p.persist_reported = True
        # A holder writes its sections one after the other: a rank's persist time is the time its
        # holder spent writing this checkpoint (what "one persist in flight" has to fit).
        per_holder = per_holder_persist(p)
        cpu = per_rank_persist_cpu(p)
        for sec in sorted(p.parts.persist_s):
            rank = section_rank(sec)
            if sec == SHARED and rank_section(0) in p.parts.persist_s:
                continue  # rank 0's sample comes with its own section (same holder)
            persist = per_holder[p.parts.staged.get(sec, "")]
            sample = Sample(rank=rank, step=p.step, ckpt_step=p.step, persist_s=persist, persist_cpu_s=cpu.get(rank))
            self._schedule.add_sample(sample)

    def _try_commit(self, p: Pending) -> CommitJob | None:
        """The decision, under the lock: a complete step becomes *committing* (once)."""
        if (
            p.state != SectionState.PENDING
            or p.committing
            or p.parts.expected is None
            or p.meta is None
            or not p.parts.expected <= set(p.parts.durable)
        ):
            return None
        files: dict[str, FileInfo] = {}
        sections = {}
        for sec in sorted(p.parts.expected):
            files.update(p.parts.durable[sec])
            data, index = section_files(p.generation, sec)
            sections[sec] = {"data": data, "index": index}
        meta = p.meta
        m = Manifest(
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
            generation=p.generation, step=p.step, manifest=m, directory=step_dir(p.step), verify_files=p.verify_files
        )

    # -- the commit itself --------------------------------------------------------------------------------
    def write(self, job: CommitJob) -> CommitResult:
        """Write the manifest (the commit point) and, for the newest step so far, the ``latest``
        hint. Storage I/O: called *without* the controller's lock; manifests are written one at a
        time (their own lock), so the hint never goes back to an older step."""
        with self._io_lock:
            t0 = time.perf_counter()
            try:
                if job.verify_files and not files_present(self.storage, job.directory, job.manifest.files):
                    return CommitResult(missing=True)
                if job.step > self._hint_step:
                    commit(self.storage, job.directory, job.manifest)
                    self._hint_step = job.step
                else:
                    self.storage.write_file(f"{job.directory}/{MANIFEST}", [job.manifest.to_bytes()])
            except Exception as e:  # noqa: BLE001 - a failed commit leaves the previous one the latest
                return CommitResult(error=f"{type(e).__name__}: {e}")
            return CommitResult(commit_s=time.perf_counter() - t0)

    def finish(self, job: CommitJob, result: CommitResult) -> None:
        """Record what :meth:`write` did (under the lock): committed, failed or abandoned."""
        p = self.table.entries[(job.generation, job.step)]  # a committing entry is pending: never pruned
        p.committing = False
        if result.missing:
            logger.info(
                "cf_ray: step %d (generation %d), re-learnt after a restart, is no longer on storage "
                "(deleted by keep-last): not committed again",
                job.step,
                job.generation,
            )
            self.table.settle(p, SectionState.ABANDONED)
            return
        if result.error is not None:
            self.failed(p.generation, p.step, "manifest", result.error)
            return
        m = job.manifest
        self.table.settle(p, SectionState.COMMITTED)
        self.index.add(
            p.step, Committed(path=job.directory, milestone=m.milestone, generation=p.generation, epoch=m.epoch)
        )
        row = self._book.note_committed(
            p.generation,
            p.step,
            where=self.storage.uri(job.directory),
            commit_s=result.commit_s,
            persist_s=max(per_holder_persist(p).values()),
            total_bytes=sum(p.parts.section_bytes.values()),
            epoch=m.epoch,
            kind=m.kind,
            milestone=m.milestone,
        )
        _jit.committed(self._book, p.generation, p.step)
        logger.info("cf_ray: committed step %d (%d bytes) at %s", p.step, row["bytes"], row["where"])
        self._book.record_metrics(p.generation, p.step)
        self._on_commit(p.step, m)


__all__ = ["MAX_DISTRUSTED", "CommitBook", "per_holder_persist"]
