"""The run's events: what happened to it, in order (restores, fallbacks, notices, interval changes,
uploads, quarantines, the durability watchdog, the trust gate), one typed class per kind.

Contract:

* Every event is a frozen :class:`~.messages.Message` (it crosses actor boundaries: a worker records
  one with the controller), so a process of another protocol version is refused, not misread.
* :meth:`Event.to_dict` is the plain form users read (``Checkpointer.events()``, ``cf_ray.Run(...)
  .events()``) and storage keeps (``events.json``, the profile's ``window.json``): ``{"event":
  <kind>, <field>: <value>, ...}``. A field named in a class's ``OMIT_NONE`` is left out while it is
  ``None`` (its emitter adds it only sometimes); every other field is always written. Keys a class
  does not name (a restart's details, a policy's failure-rate estimate, a newer writer's additions)
  are kept in :attr:`Event.extra` and written back as they came, never interpreted.
* :meth:`Event.from_dict` is the one way back: it looks the kind up in :data:`KINDS` (a table of
  classes, so reading an event never runs code it names) and refuses an unknown kind, or one of a
  class's required fields missing, with :class:`EventError`. ``from_dict(e.to_dict()) == e``.
* ``time`` (Unix seconds) is when the controller recorded it: a worker's event comes without one and
  the controller stamps it (:meth:`Event.stamped`), so every recorded event is timed by one clock.

No Ray, no torch, no storage here: the controller, the workers and the readers import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar

from cf_ray._engine.protocol.messages import IntegrityFailure, Message, ProtocolError


class EventError(ProtocolError):
    """An event's plain form that names no known kind or lacks one of its kind's fields."""


_NOT_FIELDS = frozenset({"version", "extra"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Event(Message):
    """One thing that happened to the run (a subclass per kind, :data:`KINDS`)."""

    KIND: ClassVar[str] = ""
    """The plain form's ``event`` value."""
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"time"})
    """The fields left out of the plain form while ``None``."""

    time: float | None = None
    """When the controller recorded it (Unix seconds); ``None`` until then."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The plain form's keys this class does not name, kept as they came."""

    @property
    def kind(self) -> str:
        return self.KIND

    def stamped(self, now: float) -> Event:
        """This event timed ``now`` unless it already has a time."""
        return self if self.time is not None else replace(self, time=now)

    def to_dict(self) -> dict[str, Any]:
        """The plain form (see the module's contract)."""
        out: dict[str, Any] = {"event": self.KIND}
        for f in fields(self):
            if f.name in _NOT_FIELDS:
                continue
            value = getattr(self, f.name)
            if value is None and f.name in self.OMIT_NONE:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out.update(self.extra)
        return out

    @classmethod
    def make(cls, **values: Any) -> Event:
        """An event of this class from its plain form's keys (those it does not name go to ``extra``)."""
        return _build(cls, values)

    @staticmethod
    def from_dict(plain: Mapping[str, Any]) -> Event:
        """The event ``plain`` is the plain form of.

        Raises:
            EventError: ``plain`` is not a mapping, names no kind of :data:`KINDS`, or lacks a field
                its kind requires.
        """
        if not isinstance(plain, Mapping):
            raise EventError(f"an event is a mapping with an 'event' key, not {type(plain).__name__}")
        kind = plain.get("event")
        cls = KINDS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise EventError(f"unknown event kind {kind!r}: this cf_ray knows {sorted(KINDS)}")
        return _build(cls, {k: v for k, v in plain.items() if k != "event"})


def _build(cls: type[Event], values: Mapping[str, Any]) -> Event:
    named = [f for f in fields(cls) if f.name not in _NOT_FIELDS]
    missing = [f.name for f in named if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise EventError(f"a {cls.KIND!r} event without {', '.join(missing)}: {dict(values)!r}"[:1000])
    names = {f.name for f in named}
    tuples = {f.name for f in named if f.default == ()}
    known: dict[str, Any] = {
        k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in values.items() if k in names
    }
    extra = {k: v for k, v in values.items() if k not in names and k != "event"}
    return cls(**known, extra=extra)


def as_event(event: Event | Mapping[str, Any]) -> Event:
    """``event`` typed: an :class:`Event` as it is, a plain form through :meth:`Event.from_dict`."""
    return event if isinstance(event, Event) else Event.from_dict(event)


# -- the controller's own --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreEvent(Event):
    """An attempt restored (rank 0's :class:`~.messages.Restored`): the run's start, or a restart."""

    KIND: ClassVar[str] = "restore"
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset(
        {
            "time",
            "epoch",
            "seconds",
            "world_size",
            "fallbacks",
            "rolled_back_from",
            "process_start_unix",
            "restore_begin_unix",
            "code_start_unix",
            "health_check_s",
            "spare",
        }
    )

    source: str
    """``fresh``, ``memory`` or ``storage``."""
    step: int
    epoch: int | None = None
    seconds: float | None = None
    """How long the restore took."""
    world_size: int | None = None
    saved_world_size: int | None = None
    fallbacks: Sequence[Mapping[str, Any]] | None = None
    """The candidates skipped on the way, and why."""
    rolled_back_from: int | None = None
    """The step whose state went non-finite, when this attempt rolled back past it."""
    process_start_unix: float | None = None
    restore_begin_unix: float | None = None
    code_start_unix: float | None = None
    """Rank 0's process start, its call of ``restore()`` and its load of cf_ray (a restart's parts)."""
    health_check_s: float | None = None
    spare: str | None = None
    """``taken`` when rank 0's new process was the spare its predecessor made ready, else why not."""
    generation: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class NoticeEvent(Event):
    """A notice from outside the workers (``cf_ray.notify_preemption``)."""

    KIND: ClassVar[str] = "notice"

    seq: int
    deadline_unix: float | None = None
    detail: str = ""
    generation: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class IntervalEvent(Event):
    """A new checkpoint interval published (the policy's, or published again above a predecessor's)."""

    KIND: ClassVar[str] = "interval"
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"time", "persist_every", "previous_persist_every"})

    interval: int | None
    """The new interval (``None``: the policy has not set one)."""
    previous: int | None = None
    persist_every: int | None = None
    previous_persist_every: int | None = None
    why: Any = ""
    """The policy's ``explain()`` (its own form) or a sentence."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReprofileEvent(Event):
    """A new number of workers: measured again from a fresh interval."""

    KIND: ClassVar[str] = "reprofile"

    world_size: int
    previous_world_size: int | None = None
    interval: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureRateEvent(Event):
    """The failure-rate estimate after a failure counted; the estimate's keys (the policy's form) are
    in :attr:`~Event.extra`."""

    KIND: ClassVar[str] = "failure_rate"

    why: str

    @property
    def hazard(self) -> Mapping[str, Any]:
        return self.extra


@dataclass(frozen=True, kw_only=True, slots=True)
class JitSafeEvent(Event):
    """A just-in-time checkpoint became safe in a tier; ``made_deadline``: before the notice's deadline."""

    KIND: ClassVar[str] = "jit_safe"

    step: int
    generation: int
    tier: str
    deadline_unix: float | None = None
    made_deadline: bool | None = None


# -- checkpoints on storage ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifiedEvent(Event):
    """A checkpoint a restore could not read, re-read by the controller: ``intact`` ``True`` (not
    quarantined) or ``None`` (the re-read failed too, ``reread``: why; left as it is)."""

    KIND: ClassVar[str] = "verified"
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"time", "reread"})

    step: int
    intact: bool | None = None
    error: str = ""
    reread: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class QuarantinedEvent(Event):
    """A committed checkpoint taken out of use (kept on storage, never restored from again)."""

    KIND: ClassVar[str] = "quarantined"

    step: int
    generation: int | None = None
    error: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuarantineLiftedEvent(Event):
    """A quarantined step committed again by ``generation``: the earlier quarantine (``was``) no longer applies."""

    KIND: ClassVar[str] = "quarantine_lifted"

    step: int
    generation: int | None = None
    was: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class DistrustedEvent(Event):
    """An in-memory snapshot never offered to a restore again (``source``: ``memory`` for failed
    verification, ``""`` for the worker's call)."""

    KIND: ClassVar[str] = "distrusted"

    generation: int
    step: int
    reason: str = ""
    source: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class UploadEvent(Event):
    """A committed checkpoint copied to an upload tier."""

    KIND: ClassVar[str] = "upload"

    step: int
    tier: str = ""
    seconds: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class UploadDroppedEvent(Event):
    """A checkpoint not uploaded (the upload queue was full)."""

    KIND: ClassVar[str] = "upload_dropped"

    step: int
    reason: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class UploadFailedEvent(Event):
    """An upload that failed for good."""

    KIND: ClassVar[str] = "upload_failed"

    step: int
    tier: str = ""
    error: str = ""


# -- the workers' ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreFallbackEvent(Event):
    """A restore candidate rank 0 fell back from. ``corrupt`` or ``verification``: its bytes failed
    (the controller re-reads a checkpoint of this run's storage, or takes a memory snapshot out of
    later plans); ``non_finite``: its state went non-finite."""

    KIND: ClassVar[str] = "restore_fallback"
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset(
        {"time", "where", "error", "rank", "corrupt", "step", "generation", "verification", "non_finite"}
    )

    source: str
    where: str | None = None
    error: str | None = None
    rank: int | None = None
    corrupt: bool | None = None
    step: int | None = None
    generation: int | None = None
    verification: bool | None = None
    non_finite: bool | None = None

    @property
    def damaged(self) -> bool:
        """The bytes failed (``corrupt``, ``verification``, or a ``damage`` key of the plain form)."""
        return bool(self.corrupt or self.verification or self.extra.get("damage"))


@dataclass(frozen=True, kw_only=True, slots=True)
class IntegrityFailureEvent(Event):
    """A copy of a section whose bytes failed their checks as a rank read it (:class:`~.messages.IntegrityFailure`)."""

    KIND: ClassVar[str] = "integrity_failure"

    rank: int
    generation: int
    step: int
    section: str
    holder: str
    how: str
    blocks: Sequence[int] = ()
    block_bytes: int = 0
    error: str = ""

    @classmethod
    def of(cls, failure: IntegrityFailure) -> IntegrityFailureEvent:
        """The event the controller records of ``failure``."""
        return cls(
            rank=failure.rank,
            generation=failure.generation,
            step=failure.step,
            section=failure.section,
            holder=failure.holder,
            how=failure.how,
            blocks=failure.blocks,
            block_bytes=failure.block_bytes,
            error=failure.error,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FinalNotDurableEvent(Event):
    """``finish()``'s final state not committed in its wait: the final model names ``resume_step``."""

    KIND: ClassVar[str] = "final_not_durable"

    step: int
    resume_step: int | None = None
    waited_s: float | None = None
    limit_s: float | None = None
    generation: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DurabilityLostEvent(Event):
    """Rank 0's watchdog: checkpoints are not becoming durable (once per episode). ``since_step``,
    ``waited_s``, ``limit_s`` come with this rank's own episode."""

    KIND: ClassVar[str] = "durability_lost"
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"time", "since_step", "waited_s", "limit_s"})

    step: int
    rank: int | None = None
    committed_step: int | None = None
    generation: int | None = None
    action: str | None = None
    failures: Sequence[str] = ()
    reason: str | None = None
    since_step: int | None = None
    waited_s: float | None = None
    limit_s: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DurabilityRestoredEvent(Event):
    """Rank 0's watchdog: a checkpoint committed again after a ``durability_lost``."""

    KIND: ClassVar[str] = "durability_restored"

    step: int
    rank: int | None = None
    committed_step: int | None = None
    lost_s: float | None = None
    reason: str | None = None
    generation: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RolledBackEvent(Event):
    """The loss went non-finite at ``step`` after restoring ``restored_step``: that step is distrusted
    and the next attempt restores an older one."""

    KIND: ClassVar[str] = "rolled_back"

    step: int
    restored_step: int | None = None
    rolled_back_from: int | None = None
    attempt: int | None = None
    detail: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrustExhaustedEvent(Event):
    """The loss went non-finite again after a rollback: the run stops (fields as :class:`RolledBackEvent`)."""

    KIND: ClassVar[str] = "trust_exhausted"

    step: int
    restored_step: int | None = None
    rolled_back_from: int | None = None
    attempt: int | None = None
    detail: str = ""


#: Every kind, by its plain form's ``event`` value.
KINDS: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in (
        RestoreEvent,
        NoticeEvent,
        IntervalEvent,
        ReprofileEvent,
        FailureRateEvent,
        JitSafeEvent,
        VerifiedEvent,
        QuarantinedEvent,
        QuarantineLiftedEvent,
        DistrustedEvent,
        UploadEvent,
        UploadDroppedEvent,
        UploadFailedEvent,
        RestoreFallbackEvent,
        IntegrityFailureEvent,
        FinalNotDurableEvent,
        DurabilityLostEvent,
        DurabilityRestoredEvent,
        RolledBackEvent,
        TrustExhaustedEvent,
    )
}


__all__ = [
    "KINDS",
    "DistrustedEvent",
    "DurabilityLostEvent",
    "DurabilityRestoredEvent",
    "Event",
    "EventError",
    "FailureRateEvent",
    "FinalNotDurableEvent",
    "IntegrityFailureEvent",
    "IntervalEvent",
    "JitSafeEvent",
    "NoticeEvent",
    "QuarantineLiftedEvent",
    "QuarantinedEvent",
    "ReprofileEvent",
    "RestoreEvent",
    "RestoreFallbackEvent",
    "RolledBackEvent",
    "TrustExhaustedEvent",
    "UploadDroppedEvent",
    "UploadEvent",
    "UploadFailedEvent",
    "VerifiedEvent",
    "as_event",
]
