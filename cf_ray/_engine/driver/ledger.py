"""The controller's bookkeeping, under its one lock: the generation, the schedule (:mod:`.schedule`),
the commits (:mod:`.checkpoints.commits`), the profile (:mod:`cf_ray._engine.observe.profile_book`),
the checkpoint requests, and the controller's own small state on storage (:class:`~.recovery.ControlState`).

Every method takes the lock for the bookkeeping only: storage I/O (a manifest, the control state)
happens after it is released (a commit is decided under the lock, written without it, and recorded
under it again). Methods that settle steps return them, ``(generation, step, state, holders)``,
for the caller to tell the holders (:meth:`~.recovery.Roster.tell`), also without the lock.

No Ray here: the controller (:mod:`.controller`) passes the cluster's facts in, and tests build a
ledger in process.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from cf_ray._engine.driver import jit as _jit
from cf_ray._engine.driver.checkpoints.commits import CommitBook
from cf_ray._engine.driver.checkpoints.committed import CommitJob, load_committed
from cf_ray._engine.driver.recovery import ControlState
from cf_ray._engine.driver.schedule import ScheduleBook
from cf_ray._engine.driver.schedule import explain as explain_policy
from cf_ray._engine.format.commit import Manifest
from cf_ray._engine.observe.profile_book import ProfileBook
from cf_ray._engine.protocol.events import Event, NoticeEvent, RestoreEvent
from cf_ray._engine.protocol.messages import (
    CheckpointRequest,
    HolderState,
    Message,
    PartDurable,
    PartFailed,
    PartReplicated,
    PartStaged,
    PartSuperseded,
    Restored,
    RestoreSource,
    SectionState,
    Settled,
    SyncReply,
    SyncRequest,
)
from cf_ray._engine.storage.base import Storage
from cf_ray.policy import FrequencyPolicy, Sample

logger = logging.getLogger("cf_ray")

SettledList = list[tuple[int, int, SectionState, tuple[str, ...]]]


class Ledger:
    """The run's bookkeeping (see the module doc).

    Args:
        key: the run key.
        storage: the run's storage.
        policy: the checkpoint-frequency policy.
        resumed: this controller replaces one that died while workers ran (it numbers schedule
            versions, failures and requests above anything the earlier one handed out, and
            continues its profile).
        lineage: the profile's lineage to continue (``None``: a new one).
        on_commit: called with ``(step, manifest)`` after each commit, under the lock.
        on_profile_batch: called when profile rows left memory (the maintenance thread writes them).
    """

    def __init__(
        self,
        key: str,
        storage: Storage,
        policy: FrequencyPolicy,
        *,
        resumed: bool,
        lineage: str | None,
        on_commit: Callable[[int, Manifest], None],
        on_profile_batch: Callable[[], None],
    ):
        self.key = key
        self.storage = storage
        self.lock = threading.RLock()
        committed, newest_generation = load_committed(storage)
        self.control = ControlState(storage)
        saved_generation, restores, distrusted, failures = self.control.load()
        self.generation = max(newest_generation, saved_generation)
        self._state_seq = 0
        base = int(time.time() * 1000) if resumed else 0  # numbers above a predecessor's (see .schedule)
        self.schedule = ScheduleBook(policy, storage, version_base=base)
        self.book = ProfileBook(key, storage, self.schedule, lineage=lineage, seq_base=base, on_batch=on_profile_batch)
        self.book.log.restore_failures(failures)  # a predecessor's: FinishSummary.failures keeps them
        self.commits = CommitBook(
            storage,
            committed,
            book=self.book,
            schedule=self.schedule,
            on_commit=on_commit,
            restores=restores,
            distrusted=distrusted,
        )
        self.requests: collections.deque[CheckpointRequest] = collections.deque(maxlen=64)
        """Checkpoint requests from outside the workers (``notify_preemption``), the newest."""
        self._request_seq = base
        self.bells: dict[int, tuple[Any, int]] = {}
        """Each rank's doorbell for this generation, ``(actor handle, token)``
        (``protocol/doorbell.py``): rung with each checkpoint request and new schedule version."""
        self._ring_due = False
        """A checkpoint request or a new schedule version not rung yet (:meth:`take_rings`)."""
        self.world_size: int | None = None

    # -- attempts --------------------------------------------------------------------------------------
    def new_attempt(self, world_size: int, alive_nodes: set[str] | None) -> tuple[int, Any, tuple[int, ...], tuple]:
        """An attempt starts (rank 0's ``prepare_restore``): a new generation; returns it, the newest
        snapshot in memory on ``alive_nodes``, the committed steps (newest first) and the schedules.
        Writes the control state (outside the lock)."""
        with self.lock:
            self.generation += 1
            self._event(self.schedule.reprofile_if_resized(self.world_size, world_size))
            self.world_size = world_size
            self.requests.clear()  # a notice for the previous attempt is moot
            self.bells.clear()
            memory = self.commits.newest_in_memory(alive_nodes)  # copies on lost nodes do not count
            out = (self.generation, memory, tuple(self.commits.committed_steps(newest_first=True)), self.schedule.all())
            state = self._control_state()
        self.control.write(*state)
        return out

    def restored(self, info: Restored, alive_nodes: set[str] | None) -> SettledList:
        """Rank 0 reports where the attempt resumed from: snapshots of earlier generations past that
        step belong to a timeline this attempt replays and are abandoned (:meth:`CommitBook.abandon_after`)."""
        with self.lock:
            self.book.add_event(
                RestoreEvent.make(
                    **info.extra,
                    source=RestoreSource(info.source).value,
                    step=info.step,
                    epoch=info.epoch,
                    seconds=info.seconds,
                    world_size=info.world_size,
                    saved_world_size=info.saved_world_size,
                    generation=self.generation,
                    time=time.time(),
                )
            )
            self.commits.abandon_after(self.generation, info.step, alive_nodes)
            state = self._control_state()
            settled = self.commits.table.take_settled()
        self.control.write(*state)
        return settled

    def write_control_state(self) -> None:
        with self.lock:
            state = self._control_state()
        self.control.write(*state)

    def _control_state(self) -> tuple[int, int, dict[int, int], list[tuple[int, int]], list[dict]]:
        self._state_seq += 1
        return (
            self._state_seq,
            self.generation,
            dict(self.commits.table.restores),
            list(self.commits.distrusted),
            self.book.log.saved_failures(),
        )

    # -- workers ---------------------------------------------------------------------------------------
    def sync(self, req: SyncRequest) -> SyncReply:
        """A worker's poll: its samples in, the schedule and commit state out."""
        with self.lock:
            # A controller that started again continues above what the workers have seen.
            self.generation = max(self.generation, req.generation)
            self._event(self.schedule.continue_above(req.adopted_version))
            self.book.log.continue_above(req.seen_failures)
            self._request_seq = max(self._request_seq, req.seen_requests)
            current = req.generation == self.generation
            if req.bell is not None and current:
                self.bells[req.rank] = req.bell
            for s in req.samples:
                sample = Sample(**s)
                self.schedule.add_sample(sample)
                self.book.add_iteration(req.rank, sample.step, sample.iter_s, sample.iters)
            for stats in req.ckpt_stats:
                self.book.add_rank_timings(req.generation, req.rank, stats)
            self._replan()
            return SyncReply(
                schedules=self.schedule.since(req.adopted_version),
                committed_step=self.commits.newest_step() or 0,
                failures=self.book.log.failures_since(req.seen_failures),
                requests=tuple(r for r in self.requests if r.seq > req.seen_requests),
                bell_known=current and req.rank in self.bells,
            )

    def _replan(self) -> None:
        """Under the lock: ask the policy. A new schedule version is to be rung to every rank
        (:meth:`take_rings`): each fetches it at its next step instead of its next poll, and the
        ranks adopt it together as soon as every one has it."""
        published = self.schedule.replan()
        self._event(published)
        if published is not None:
            self._ring_due = True

    def take_rings(self) -> list[tuple[Any, int]]:
        """The ranks' doorbells, when a checkpoint request came or a new schedule version was
        published since the last call (for the caller to ring, outside the lock); ``[]`` otherwise."""
        with self.lock:
            if not self._ring_due:
                return []
            self._ring_due = False
            return list(self.bells.values())

    def request(self, deadline_unix: float | None, detail: str) -> CheckpointRequest:
        """A checkpoint request for every rank of this attempt, to be rung to them (:meth:`take_rings`)."""
        with self.lock:
            self._request_seq += 1
            req = CheckpointRequest(
                seq=self._request_seq,
                deadline_unix=deadline_unix,
                detail=str(detail),
                time_unix=time.time(),
                generation=self.generation,
            )
            self.requests.append(req)
            self.book.add_event(
                NoticeEvent(
                    seq=req.seq,
                    deadline_unix=req.deadline_unix,
                    detail=req.detail,
                    time=req.time_unix,
                    generation=req.generation,
                )
            )
            self._ring_due = True
            return req

    def forget_bell(self, rank: int) -> None:
        """``rank`` finished: its doorbell is not rung again."""
        with self.lock:
            self.bells.pop(rank, None)

    def settled(self, generation: int, steps: list[int]) -> Settled:
        with self.lock:
            return self.commits.settled_report(int(generation), [int(s) for s in steps])

    # -- holders ---------------------------------------------------------------------------------------
    # Each returns the step's state after the message (None when this controller knows nothing of it)
    # and the steps that settled; every one is idempotent (a holder re-sends what it is unsure arrived).
    def staged(self, msg: PartStaged, draining: set[str] | None) -> tuple[SectionState | None, SettledList]:
        with self.lock:
            self.generation = max(self.generation, msg.generation)
            job = self._staged(msg, resync=False, draining=draining)
            settled = self.commits.table.take_settled()
        return self._complete([job], settled, msg.generation, msg.step)

    def superseded(self, msg: PartSuperseded) -> tuple[SectionState | None, SettledList]:
        with self.lock:
            self.commits.superseded(msg.generation, msg.step, msg.section)
            return self.commits.table.state_of(msg.generation, msg.step), self.commits.table.take_settled()

    def replicated(self, msg: PartReplicated) -> SectionState | None:
        with self.lock:
            self.commits.replicated(msg)
            return self.commits.table.state_of(msg.generation, msg.step)

    def durable(self, msg: PartDurable) -> tuple[SectionState | None, SettledList]:
        with self.lock:
            job = self.commits.durable(msg)
            self.book.note_host_copies(
                msg.generation, msg.step, ("durable", msg.section), msg.copied_bytes, msg.crc_read_bytes
            )
            self._replan()  # a checkpoint's persist time may have reached the policy (its cadence)
            settled = self.commits.table.take_settled()
        return self._complete([job], settled, msg.generation, msg.step)

    def failed(self, msg: PartFailed) -> tuple[SectionState | None, SettledList]:
        with self.lock:
            self.commits.failed(msg.generation, msg.step, msg.section, msg.error, holder=msg.holder)
            return self.commits.table.state_of(msg.generation, msg.step), self.commits.table.take_settled()

    def apply_state(self, state: HolderState) -> SettledList:
        """What a holder holds and did (``Holder.resync``), applied as if each message came again."""
        with self.lock:
            self.generation = max(self.generation, state.generation)
            # The origins of the copies first (one whose node is lost can no longer say it staged them).
            jobs = self._apply((*state.staged, *state.replica_origins), state.outcomes)
            for msg in state.replicas:
                if self.commits.table.accepts(msg.generation, msg.step):
                    self.commits.replicated(msg, resync=True)
            settled = self.commits.table.take_settled()
        return self._complete(jobs, settled)[1]

    def apply_watch(
        self,
        staged: list[PartStaged],
        outcomes: list[Message],
        lost: list[tuple[tuple[int, int, str], str]],
        unfound: Iterable[tuple[int, int, str]],
    ) -> SettledList:
        """What the watch learnt (:mod:`.watch`): missed messages, sections whose holder lost them,
        and sections of an ended attempt that no holder ever had."""
        with self.lock:
            jobs = self._apply(staged, outcomes)
            for (gen, step, sec), name in lost:
                self.commits.failed(
                    gen,
                    step,
                    sec,
                    f"lost: holder {name} died or was restarted before it had written this section",
                    holder=name,
                    lost=True,
                )
            for gen, step in sorted({(g, s) for g, s, _ in unfound}):
                if gen < self.generation and self.commits.table.abandon(gen, step):
                    _jit.abandoned(self.book, gen, step)
                    logger.info(
                        "cf_ray: step %d of generation %d abandoned: a section was never handed to a "
                        "holder and its attempt is over",
                        step,
                        gen,
                    )
            settled = self.commits.table.take_settled()
        return self._complete(jobs, settled)[1]

    def _staged(self, msg: PartStaged, *, resync: bool, draining: set[str] | None = None) -> CommitJob | None:
        if not self.commits.table.accepts(msg.generation, msg.step):
            return None
        job = self.commits.staged(msg, resync=resync, draining=draining)
        self.book.note_staged(msg.generation, msg.step, msg.meta)
        self.book.note_host_copies(msg.generation, msg.step, ("staged", msg.section), msg.holder_copied_bytes, 0)
        return job

    def _apply(self, staged: tuple | list, outcomes: tuple | list) -> list[CommitJob | None]:
        jobs = [self._staged(m, resync=True) for m in staged]
        for o in outcomes:
            if isinstance(o, PartDurable):
                jobs.append(self.commits.durable(o, resync=True))
            elif isinstance(o, PartFailed):
                self.commits.failed(o.generation, o.step, o.section, o.error, holder=o.holder, resync=True)
            elif isinstance(o, PartSuperseded):
                self.commits.superseded(o.generation, o.step, o.section, resync=True)
        return jobs

    def _complete(
        self, jobs: list[CommitJob | None], settled: SettledList, generation: int | None = None, step: int | None = None
    ) -> tuple[SectionState | None, SettledList]:
        """Write the manifests of the steps that became complete (outside the lock), record the
        results (under it). Returns the state of ``(generation, step)`` afterwards (when given) and
        every step that settled."""
        for job in jobs:
            if job is None:
                continue
            result = self.commits.write(job)
            with self.lock:
                self.commits.finish(job, result)
                settled = settled + self.commits.table.take_settled()
        state = None
        if generation is not None and step is not None:
            with self.lock:
                state = self.commits.table.state_of(generation, step)
        return state, settled

    # -- what users read -----------------------------------------------------------------------------------
    def record_event(self, event: Event) -> None:
        """A worker's event, timed now unless it has a time."""
        with self.lock:
            self.book.add_event(event.stamped(time.time()))

    def _event(self, event: Event | None) -> None:
        if event is not None:
            self.book.add_event(event)

    def events(self) -> list[dict]:
        """The events in their plain form, oldest first."""
        with self.lock:
            return self.book.log.plain_events()

    def iteration_rows(self) -> list[dict]:
        with self.lock:
            return self.book.iteration_rows()

    def profile_rows(self) -> list[dict]:
        """Every row of this run's profile so far: the parts on storage and the rows in memory."""
        return self.book.all_rows(self.lock)

    def explain(self) -> Any:
        with self.lock:
            return explain_policy(self.schedule.policy)

    def pending_steps(self, generation: int) -> list[int]:
        with self.lock:
            return self.commits.table.awaited_steps(generation)

    def summary(self) -> dict:
        with self.lock:
            return {
                "generation": self.generation,
                "committed_steps": self.commits.committed_steps(),
                "interval": self.schedule.current_interval,
                "schedules": self.schedule.as_dicts(),
                "failures": self.book.log.failure_dicts(),
                "events": self.book.log.plain_events(),
                "pending": self.commits.table.pending_steps(),
                "restore_fallbacks": self.book.log.fallback_counts(),
                "distrusted": [list(k) for k in self.commits.distrusted],
                "goodput": self.book.breakdown(),
            }

    def save_window(self) -> None:
        """Save the profile rows in memory and the events as the lineage's window
        (:meth:`ProfileParts.save_window`): a controller that Ray starts again in this one's place
        lists them."""
        with self.lock:
            rows, events = self.book.profile_rows(), self.book.log.plain_events()
        self.book.parts.save_window(rows, events)

    def save_profile(self) -> None:
        """Write the profile table, the events and the policy's state to storage (never raises)."""
        self.book.save(self.lock)
        self.save_events()
        self.save_policy_state()

    def save_events(self) -> None:
        """Write the events as ``events.json`` beside the profile, so that a finished run's events
        stay readable (``Run.events()``) once the controller is gone; never raises (a report)."""
        from cf_ray._engine.observe.profile_files import save_events

        with self.lock:
            events = list(self.book.events)  # typed and frozen: their plain form is made outside the lock
        try:
            save_events(self.book.storage, events)
        except Exception as e:  # noqa: BLE001 - the events are a report, never a reason to fail
            logger.warning("cf_ray: could not save the run's events: %s", e)

    def save_policy_state(self) -> None:
        with self.lock:
            raw = self.schedule.state_bytes()
        self.schedule.write_state(raw)


__all__ = ["Ledger"]
