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
        self._schedules: dict[int, int | None] = {0: self.policy.initial_interval()}
        self._adopted = 0
        self.interval: int | None = self._schedules[0]
        """The interval of the adopted schedule version (what the policy is asked with)."""
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
            self._schedules[s.schedule_version] = s.interval
            self.received = max(self.received, s.schedule_version)

    def want(self, level: RequestLevel) -> None:
        """Ask for a checkpoint at the next agreed step (any thread; the stronger request wins)."""
        if level > self.local_request:
            self.local_request = level

    def start_attempt(self, schedules: Iterable[Schedule]) -> None:
        """At restore: every schedule version so far, all adopted at once."""
        for s in schedules:
            self._schedules[s.schedule_version] = s.interval
        self.received = self._adopted = max(self._schedules)
        self.interval = self._schedules[self._adopted]

    # -- the decision ---------------------------------------------------------------------------------
    def decide(self, step: int, epoch: int, agreement: Agreement | None) -> tuple[CheckpointKind | None, bool]:
        """(the kind of checkpoint to take at ``step``, or ``None``; whether it is a milestone)."""
        kind = None
        if agreement is not None:
            if agreement.schedule_version > self._adopted and agreement.schedule_version in self._schedules:
                self._adopted = agreement.schedule_version
                self.interval = self._schedules[self._adopted]
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

    def saved(self, step: int) -> None:
        """A checkpoint was started at ``step``."""
        self.last_save_step = step
