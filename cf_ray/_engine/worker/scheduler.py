"""When this rank checkpoints: the schedule versions it has received from the controller and the
one all ranks adopted, out-of-schedule requests (manual, preemption), milestones, and the policy's
decision, turned into a checkpoint kind.

Everything here is decided from the agreement (:mod:`cf_ray._engine.worker.control`), so every rank
takes the same decision at the same step.
"""

from __future__ import annotations

from collections.abc import Iterable

from cf_ray._engine.protocol.messages import CheckpointKind, RequestLevel, Schedule
from cf_ray._engine.worker.control import Agreement
from cf_ray.config import CheckpointConfig
from cf_ray.policy import SaveContext
from cf_ray.policy.base import persist_every_of


class Scheduler:
    """The checkpoint decision of one rank.

    Call order (training thread): :meth:`start_attempt` at restore (then :meth:`saved` with the
    restored step); :meth:`decide` after every optimizer step with that step's agreement;
    :meth:`epoch_end_due` at the end of an epoch; :meth:`saved` whenever a checkpoint was started. :meth:`receive` with the controller's replies
    and :meth:`want` (any thread) feed the next exchange.
    """

    def __init__(self, config: CheckpointConfig):
        self.policy = config.policy
        self.milestone_every = config.milestone_every
        self._schedules: dict[int, Schedule] = {
            0: Schedule(
                schedule_version=0, interval=self.policy.initial_interval(), persist_every=persist_every_of(self.policy)
            )
        }
        self._adopted = 0
        self.interval: int | None = self._schedules[0].interval
        """The interval of the adopted schedule version (what the policy is asked with)."""
        self.persist_every = self._schedules[0].persist_every
        """The persist cadence of the adopted schedule version (:meth:`persist_due`)."""
        self._held_only = 0
        """Scheduled snapshots held in memory only since the last persisted one (this attempt)."""
        self.last_persisted = True
        """Whether the last checkpoint started (``last_save_step``) is to be persisted."""
        self.received = 0
        """The newest schedule version this rank has received (posted in the exchange)."""
        self.local_request = RequestLevel.NONE
        """This rank's out-of-schedule request not yet agreed on (posted in the exchange)."""
        self.last_save_step = 0
        """The step of the last checkpoint started (or restored from)."""

    # -- inputs --------------------------------------------------------------------------------------
    def receive(self, schedules: Iterable[Schedule]) -> None:
        """Schedule versions from the controller (adopted once every rank has them)."""
        for s in schedules:
            self._schedules[s.schedule_version] = s
            self.received = max(self.received, s.schedule_version)

    def want(self, level: RequestLevel) -> None:
        """Ask for a checkpoint at the next agreed step (any thread; the stronger request wins)."""
        if level > self.local_request:
            self.local_request = level

    def start_attempt(self, schedules: Iterable[Schedule]) -> None:
        """At restore: every schedule version so far, all adopted at once."""
        for s in schedules:
            self._schedules[s.schedule_version] = s
        self.received = self._adopted = max(self._schedules)
        self._adopt()
        self._held_only = self.persist_every  # the first scheduled snapshot of an attempt is persisted
        self.last_persisted = True

    def _adopt(self) -> None:
        s = self._schedules[self._adopted]
        self.interval, self.persist_every = s.interval, max(1, int(s.persist_every))

    # -- the decision ---------------------------------------------------------------------------------
    def decide(self, step: int, epoch: int, agreement: Agreement | None) -> tuple[CheckpointKind | None, bool]:
        """(the kind of checkpoint to take at ``step``, or ``None``; whether it is a milestone)."""
        kind = None
        if agreement is not None:
            if agreement.schedule_version > self._adopted and agreement.schedule_version in self._schedules:
                self._adopted = agreement.schedule_version
                self._adopt()
            if agreement.save_request:
                kind = (
                    CheckpointKind.PREEMPT if agreement.save_request >= RequestLevel.PREEMPT else CheckpointKind.MANUAL
                )
                if self.local_request <= agreement.save_request:
                    self.local_request = RequestLevel.NONE
        ctx = SaveContext(step=step, epoch=epoch, last_save_step=self.last_save_step, interval=self.interval)
        milestone = bool(self.milestone_every and step % self.milestone_every == 0)
        if kind is None and (milestone or self.policy.should_save(step, ctx)):
            kind = CheckpointKind.SCHEDULED
        return kind, milestone

    def epoch_end_due(self, step: int, epoch: int) -> bool:
        """Whether the policy takes a checkpoint at the end of an epoch (``EpochEnd``)."""
        ctx = SaveContext(
            step=step, epoch=epoch, last_save_step=self.last_save_step, interval=self.interval, epoch_end=True
        )
        return bool(self.policy.should_save(step, ctx))

    def persist_due(self, kind: CheckpointKind, milestone: bool) -> bool:
        """Whether the checkpoint about to be started (of ``kind``) is persisted; call once per
        checkpoint, before it starts. Every rank takes the same checkpoints under the same adopted
        schedule version, so every rank answers the same.

        A scheduled checkpoint is persisted when ``persist_every - 1`` scheduled ones since the
        last persisted one were held in memory only (the first of an attempt always is); a manual,
        preemption, epoch-end or milestone checkpoint always is, and counts as the persisted one."""
        if kind is CheckpointKind.SCHEDULED and not milestone and self._held_only + 1 < self.persist_every:
            self._held_only += 1
            self.last_persisted = False
            return False
        self._held_only = 0
        self.last_persisted = True
        return True

    def saved(self, step: int) -> None:
        """A checkpoint was started at ``step``."""
        self.last_save_step = step
