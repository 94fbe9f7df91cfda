"""Trust-gated recovery: what a run's restores must never use again, and the first steps after
a restore, watched.

**Distrusted snapshots.** A snapshot whose bytes failed a check (a block's CRC-32, a fingerprint
after loading: ``integrity.py``) or whose state went non-finite is never offered to a restore of the
run again. The controller keeps that list (``driver/checkpoints/quarantine.py``): a memory ``restore_fallback``
event whose bytes failed verification (rank 0's, with the snapshot's ``generation`` and ``step``)
takes that in-memory snapshot out of every later plan; ``controller.distrust(generation, step,
reason)`` (:func:`tell_controller`: a non-finite state) does that and quarantines the checkpoint of
that snapshot on storage too. A bit flipped in a holder's memory leaves the checkpoint on storage
intact (it is the next candidate); a non-finite state is the same on every tier. Within one restore
the worker skips the other copies of what it just refused itself (:class:`RunTrust`), and it reads
the controller's events back for what the trust gate recorded (a rollback, a stopped run).

**The first steps after a restore.** The loop tells cf_ray its loss (``ckpt.step(optimizer,
loss=loss)``, a tensor or a float). During the first ``env.TRUST_STEPS`` (3) steps after a restore
(the only steps whose loss is read, so a GPU loss is synchronised only there), a non-finite loss is posted in the agreement (``control.NON_FINITE``), and one step later
every rank acts on it at the same step: rank 0 distrusts the restored step and every snapshot this
attempt took (they descend from it), records a ``rolled_back`` event, logs once, and every rank
raises :class:`NonFiniteAfterRestore` (a :class:`~cf_ray.errors.RestoreError`). Ray Train starts the
worker group again (``FailureConfig.max_failures``), and its restore takes the newest checkpoint
older than the suspect one, from storage. Why not in place: the loop's own position (its epoch
variable, its ``DataLoader`` iterator) cannot be rewound from inside ``step()``, and only a loop that
starts again at ``restore()`` replays the same samples in the same order — bitwise as an
uninterrupted run. (A non-finite *saved state* is caught before training, inside ``restore()``, and
falls back in place: ``integrity.check_finite``.)

**Once, never a loop.** When the attempt after a rollback goes non-finite too (or a restore already
went back past a non-finite state in this attempt), the error names both steps and says that the
run stops; a ``trust_exhausted`` event is recorded, and every later attempt of the run raises the
same at its restore instead of training (Ray Train's remaining ``max_failures`` end quickly).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.events import (
    Event,
    EventError,
    RestoreEvent,
    RolledBackEvent,
    TrustExhaustedEvent,
    as_event,
)
from cf_ray._engine.protocol.messages import RestoreSource
from cf_ray.errors import RestoreError

logger = logging.getLogger("cf_ray")


class NonFiniteAfterRestore(RestoreError):
    """The first steps after a restore gave a non-finite loss: the attempt ends so that the next one
    restores an older checkpoint (or, after a rollback already, the run stops)."""


class Reason(str, enum.Enum):
    """Why a restore stopped trusting a snapshot."""

    INTEGRITY = "integrity"
    """Its bytes failed a check before use (a block's CRC-32), or changed under the load."""
    NON_FINITE = "non_finite"
    """Its saved state holds NaN or infinity, or the first steps after restoring it gave a
    non-finite loss: the run went back past it."""


@dataclass(frozen=True, slots=True)
class Suspect:
    """A snapshot a restore (or the trust gate) stopped trusting."""

    step: int
    generation: int
    """The generation that took it (-1: unknown)."""
    source: RestoreSource
    """Where it was found: a holder's memory, or a committed checkpoint on storage."""
    reason: Reason
    detail: str

    def covers(self, source: RestoreSource, generation: int, step: int) -> bool:
        """Whether the snapshot of ``(generation, step)`` found in ``source`` is this one, or the same
        state: a bit flipped in memory leaves the storage copy intact; a non-finite state is on every tier."""
        if step != self.step or -1 not in (generation, self.generation) and generation != self.generation:
            return False
        return self.reason is Reason.NON_FINITE or source is self.source


@dataclass(frozen=True, slots=True)
class RunTrust:
    """What one restore knows of the run's trust: the trust gate's own events (a rollback, a stopped
    run), read back from the controller by rank 0 at the plan, and what this restore refused."""

    rollbacks: tuple[RolledBackEvent, ...] = ()
    """The ``rolled_back`` events, oldest first."""
    exhausted: TrustExhaustedEvent | None = None
    """The ``trust_exhausted`` event, when the run was stopped."""
    suspects: tuple[Suspect, ...] = ()
    """What this restore refused itself (its other copies are not tried)."""

    @classmethod
    def from_events(cls, events: Iterable[Event | Mapping[str, Any]]) -> RunTrust:
        """The trust gate's events among the controller's (typed, or their plain form; one that does
        not read as an event is not the trust gate's and is passed over)."""
        rollbacks, exhausted = [], None
        for e in _typed(events):
            if isinstance(e, RolledBackEvent):
                rollbacks.append(e)
            elif isinstance(e, TrustExhaustedEvent):
                exhausted = e
        return cls(tuple(rollbacks), exhausted)

    def adding(self, suspect: Suspect) -> RunTrust:
        return RunTrust(self.rollbacks, self.exhausted, (*self.suspects, suspect))

    def why_not(self, source: RestoreSource, generation: int, step: int) -> str | None:
        """Why this restore may not use the snapshot of ``(generation, step)`` found in ``source``
        (``None``: it may)."""
        for s in self.suspects:
            if s.covers(source, generation, step):
                return f"{s.reason.value}: {s.detail}"
        return None

    def rollback_into(self, attempt: int) -> RolledBackEvent | None:
        """The ``rolled_back`` event of the attempt before ``attempt``: this attempt is the rollback it
        asked for (``None``: it is not)."""
        return next((e for e in reversed(self.rollbacks) if e.attempt == attempt - 1), None)


def trust_steps() -> int:
    return max(0, int(_env.TRUST_STEPS))


def is_finite(loss: Any) -> bool:
    """Whether a loss (a tensor of any device, or a number) is finite; reads a tensor's value."""
    try:
        value = loss.detach().float().sum().item() if hasattr(loss, "detach") else float(loss)
    except (TypeError, ValueError):
        return True  # not a number cf_ray can read: not judged
    return math.isfinite(value)


@dataclass(slots=True)
class TrustGate:
    """The first steps after a restore, on one rank.

    Call order (training thread): :meth:`start` after a restore; :meth:`loss` with each step's
    loss; :attr:`posted` into each exchange; :meth:`taken` for each snapshot; :meth:`roll_back` (which
    raises :meth:`error`) when the agreement says some rank's loss went non-finite.
    """

    rank: int
    steps: int = field(default_factory=trust_steps)
    restored_step: int | None = None
    """The step this attempt restored (``None``: fresh, nothing is watched)."""
    restored_generation: int = -1
    source: RestoreSource = RestoreSource.FRESH
    attempt: int = 0
    rolled_back_from: int | None = None
    """This attempt restored an older step because a newer one went non-finite (its step)."""
    posted: int = 0
    """The step whose loss went non-finite on this rank (0: none), for the agreement."""
    bad_value: float | None = None
    taken_steps: list[int] = field(default_factory=list)

    def start(
        self,
        *,
        restored_step: int | None,
        restored_generation: int,
        source: RestoreSource,
        attempt: int,
        rolled_back_from: int | None,
    ) -> None:
        self.restored_step = restored_step if source is not RestoreSource.FRESH else None
        self.restored_generation, self.source, self.attempt = restored_generation, source, attempt
        self.rolled_back_from = rolled_back_from
        self.posted, self.bad_value = 0, None
        self.taken_steps.clear()

    def watching(self, step: int) -> bool:
        """Whether the loss of ``step`` is checked (one of the first :attr:`steps` after a restore)."""
        return self.restored_step is not None and 0 < step - self.restored_step <= self.steps

    def loss(self, step: int, loss: Any) -> None:
        """The loss of ``step`` (computed before its update): read only while :meth:`watching`."""
        if loss is None or self.posted or not self.watching(step):
            return
        if not is_finite(loss):
            self.posted = step
            try:
                self.bad_value = float(loss.detach().float().sum().item() if hasattr(loss, "detach") else loss)
            except (TypeError, ValueError):
                self.bad_value = float("nan")

    def taken(self, step: int) -> None:
        """A snapshot of ``step`` was taken in this attempt (it descends from the restored state)."""
        if self.restored_step is not None:
            self.taken_steps.append(step)

    @property
    def exhausted(self) -> bool:
        """A rollback happened already for this attempt: another non-finite loss stops the run."""
        return self.rolled_back_from is not None

    def suspects(self, detail: str) -> list[Suspect]:
        """What rank 0 distrusts when the agreement says the loss went non-finite: the restored step
        and every snapshot taken since (they descend from it)."""
        assert self.restored_step is not None
        out = [Suspect(self.restored_step, self.restored_generation, self.source, Reason.NON_FINITE, detail)]
        out += [
            Suspect(
                s,
                self.attempt,
                RestoreSource.MEMORY,
                Reason.NON_FINITE,
                f"taken after the restore of step {self.restored_step}, whose loss went non-finite",
            )
            for s in sorted(set(self.taken_steps))
        ]
        return out

    def describe(self, at_step: int) -> str:
        value = f" ({self.bad_value})" if self.posted and self.bad_value is not None else ""
        return (
            f"the loss went non-finite{value} at step {at_step}, "
            f"{at_step - (self.restored_step or 0)} step(s) after restoring step {self.restored_step} "
            f"from {self.source.value}"
        )

    def roll_back(self, link: Any, at_step: int) -> NoReturn:
        """The agreement says some rank's loss went non-finite at ``at_step``: rank 0 distrusts the
        restored step and what this attempt took, and says so once; every rank raises."""
        error = self.error(at_step)
        if self.rank == 0:
            logger.warning("%s", error)
            stop = TrustExhaustedEvent if self.exhausted else RolledBackEvent
            event = stop(
                step=at_step,
                restored_step=self.restored_step,
                rolled_back_from=self.rolled_back_from,
                attempt=self.attempt,
                detail=self.describe(at_step),
            )
            try:
                tell_controller(link, self.suspects(self.describe(at_step)))
                link.record_event(event, wait=True)
            except Exception as e:  # noqa: BLE001 - the error below is raised whatever happens here
                logger.warning("cf_ray: could not tell the controller about the rollback: %r", e)
        raise error

    def error(self, at_step: int) -> NonFiniteAfterRestore:
        """What every rank raises at the agreed step."""
        what = f"cf_ray: rank {self.rank}: {self.describe(at_step)}"
        if self.exhausted:
            return NonFiniteAfterRestore(
                f"{what}, and this attempt is already a rollback past step {self.rolled_back_from}, whose "
                f"state went non-finite too: both step {self.rolled_back_from} and step {self.restored_step} "
                "lead to non-finite values, so the cause is not one damaged snapshot. The run stops here "
                "(every later attempt of it raises this at restore): look at the data and the loop around "
                f"these steps, then start a new run (resume_from= a checkpoint older than step {self.restored_step})"
            )
        return NonFiniteAfterRestore(
            f"{what}: step {self.restored_step} is distrusted (never restored again), and so is every "
            "snapshot taken since. The attempt ends here so that the next one restores the newest "
            f"checkpoint older than step {self.restored_step} from storage and replays from it (this needs "
            "ray.train.FailureConfig(max_failures >= 1)); a second non-finite loss after that stops the run"
        )


def tell_controller(link: Any, suspects: list[Suspect]) -> None:
    """Rank 0 has the controller distrust each suspect (``distrust(generation, step, reason)``: never
    offered to a restore again, its committed checkpoint quarantined), and waits for each answer (the
    next attempt's plan, asked by another process, must not offer it)."""
    timeout = _env.get_float(_env.ACTOR_TIMEOUT_S)
    for s in suspects:
        link.call("distrust", s.generation, s.step, f"{s.reason.value}: {s.detail}"[:500], timeout_s=timeout)


def _typed(events: Iterable[Event | Mapping[str, Any]]) -> Iterator[Event]:
    for e in events:
        try:
            yield as_event(e)
        except EventError:
            continue


def rollbacks(events: Iterable[Event | Mapping[str, Any]]) -> list[dict]:
    """The run's rollbacks past a snapshot that went non-finite, from the controller's events
    (``FinishSummary.rollbacks``)."""
    out = []
    for e in _typed(events):
        if isinstance(e, (RolledBackEvent, TrustExhaustedEvent)):
            out.append(
                {
                    "suspect_step": e.restored_step,
                    "at_step": e.step,
                    "reason": "non-finite loss after the restore",
                    "stopped": isinstance(e, TrustExhaustedEvent),
                }
            )
        elif isinstance(e, RestoreEvent) and e.rolled_back_from is not None:
            out.append(
                {
                    "suspect_step": e.rolled_back_from,
                    "restored_step": e.step,
                    "reason": "non-finite saved state",
                    "stopped": False,
                }
            )
    return out


def stopped_error(exhausted: TrustExhaustedEvent) -> NonFiniteAfterRestore:
    """What a restore raises in a run that was stopped (a ``trust_exhausted`` event)."""
    return NonFiniteAfterRestore(
        "cf_ray: this run was stopped at its attempt "
        f"{exhausted.attempt}: {exhausted.detail or 'the loss went non-finite after a rollback'}. "
        "It is not restored again; start a new run (CheckpointConfig(resume_from=...) a checkpoint older "
        f"than step {exhausted.restored_step})"
    )


__all__ = [
    "NonFiniteAfterRestore",
    "Reason",
    "RunTrust",
    "Suspect",
    "TrustGate",
    "is_finite",
    "rollbacks",
    "stopped_error",
    "tell_controller",
]
