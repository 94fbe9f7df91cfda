"""Trust-gated recovery (#23): what a run's restores must never use again, and the first steps after
a restore, watched.

**Distrusted snapshots.** A snapshot whose bytes failed a check (a block's CRC-32, a fingerprint
after loading: ``integrity.py``) or whose state went non-finite is *distrusted*: rank 0 tells the
controller (:class:`~cf_ray._engine.protocol.messages.Distrust`: its ``distrust()`` where it has one,
and the ``distrusted`` event it records either way), and every later restore plan of the run leaves it
out. The worker does not rely on the controller for that: at the start of every restore rank 0
reads the controller's events back (:class:`Distrusted`), and the restore skips a candidate named
there. A bit flipped in a holder's memory distrusts that memory copy only (the checkpoint of the same
step on storage is intact and is the next candidate); a non-finite state distrusts the step on every
tier (the same bytes).

**The first steps after a restore.** The loop tells cf_ray its loss (``ckpt.step(optimizer,
loss=loss)``, a tensor or a float). During the first :data:`DEFAULT_STEPS` steps after a restore
(``CF_RAY_TRUST_STEPS``; the only steps whose loss is read, so a GPU loss is synchronised only
there), a non-finite loss is posted in the agreement (``control.NON_FINITE``), and one step later
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

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.messages import Distrust, DistrustReason, RestoreSource
from cf_ray.errors import RestoreError

logger = logging.getLogger("cf_ray")

#: Steps after a restore whose loss is checked (``CF_RAY_TRUST_STEPS``).
DEFAULT_STEPS = 3
#: The event of a rollback (rank 0, once per suspect).
ROLLED_BACK = "rolled_back"
#: The event that stops the run: a non-finite loss after a rollback.
EXHAUSTED = "trust_exhausted"


class NonFiniteAfterRestore(RestoreError):
    """The first steps after a restore gave a non-finite loss: the attempt ends so that the next one
    restores an older checkpoint (or, after a rollback already, the run stops)."""


@dataclass(frozen=True, slots=True)
class Distrusted:
    """What the run's restores must not use, as the controller's events say."""

    entries: tuple[dict, ...] = ()
    """The ``distrusted`` events (``Distrust.event()``), oldest first."""
    exhausted: dict | None = None
    """The ``trust_exhausted`` event, when the run was stopped."""

    @classmethod
    def from_events(cls, events: Iterable[dict]) -> Distrusted:
        entries, exhausted = [], None
        for e in events:
            if not isinstance(e, dict):
                continue
            if e.get("event") == "distrusted" and isinstance(e.get("step"), int):
                entries.append(e)
            elif e.get("event") == EXHAUSTED:
                exhausted = e
        return cls(tuple(entries), exhausted)

    def adding(self, msg: Distrust) -> Distrusted:
        """With ``msg`` too (what this restore just distrusted: its other copies are not tried)."""
        return Distrusted((*self.entries, msg.event()), self.exhausted)

    def why_not(self, source: RestoreSource, generation: int, step: int) -> str | None:
        """Why a restore may not use the snapshot of ``(generation, step)`` found in ``source``
        (``None``: it may). ``generation`` -1: any generation of ``step``."""
        for e in self.entries:
            gen = e.get("generation", -1)
            if e["step"] != step or (gen != generation and -1 not in (gen, generation)):
                continue
            if e.get("reason") == DistrustReason.NON_FINITE.value or e.get("source") == source.value:
                return f"{e.get('reason')}: {e.get('detail', '')}"
        return None

    def trusts(self, source: RestoreSource, generation: int, step: int) -> bool:
        """Whether a restore may use the snapshot of ``(generation, step)`` found in ``source``."""
        return self.why_not(source, generation, step) is None

    def rollback_into(self, attempt: int) -> dict | None:
        """The ``distrusted`` event (non-finite, after a restore) of the attempt before ``attempt``:
        this attempt is the rollback it asked for (``None``: it is not)."""
        for e in reversed(self.entries):
            if e.get("reason") == DistrustReason.NON_FINITE.value and e.get("attempt") == attempt - 1:
                if e.get("restored_step") is not None:
                    return e
        return None


def trust_steps() -> int:
    return max(0, _env.get_int(_env.TRUST_STEPS))


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
    loss; :attr:`posted` into each exchange; :meth:`taken` for each snapshot; :meth:`distrusts` and
    :meth:`error` when the agreement says some rank's loss went non-finite.
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

    def distrusts(self, detail: str) -> list[Distrust]:
        """Rank 0's messages to the controller when the agreement says the loss went non-finite: the
        restored step and every snapshot taken since (they descend from it)."""
        assert self.restored_step is not None
        out = [
            Distrust(
                step=self.restored_step,
                generation=self.restored_generation,
                source=self.source,
                reason=DistrustReason.NON_FINITE,
                detail=detail,
                rank=self.rank,
                attempt=self.attempt,
                restored_step=self.restored_step,
            )
        ]
        out += [
            Distrust(
                step=s,
                generation=self.attempt,
                source=RestoreSource.MEMORY,
                reason=DistrustReason.NON_FINITE,
                detail=f"taken after the restore of step {self.restored_step}, whose loss went non-finite",
                rank=self.rank,
                attempt=self.attempt,
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
            event = {
                "event": EXHAUSTED if self.exhausted else ROLLED_BACK,
                "step": at_step,
                "restored_step": self.restored_step,
                "rolled_back_from": self.rolled_back_from,
                "attempt": self.attempt,
                "detail": self.describe(at_step),
            }
            try:
                tell_controller(link, self.distrusts(self.describe(at_step)))
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


def tell_controller(link: Any, messages: list[Distrust]) -> None:
    """Rank 0 tells the controller which snapshots to distrust, and waits until it has recorded them
    (the next attempt's plan, asked by another process, must see them). A committed checkpoint of a
    step distrusted for a non-finite state is quarantined too (the controller ignores a step it has
    not committed)."""
    if not messages:
        return
    # SEAM (#23, driver side): a controller with distrust(msg) leaves the snapshot out of every later
    # plan, quarantines its committed checkpoint, and records msg.event(). Until then the worker
    # records the events itself (restores read them back: Distrusted), and a committed checkpoint of
    # a non-finite step is quarantined through the corrupt restore_fallback event the controller
    # already handles (marked "distrust": the restore did not fall back from it).
    if link.has("distrust"):
        for msg in messages:
            link.call("distrust", msg, timeout_s=_env.get_float(_env.ACTOR_TIMEOUT_S))
        return
    events = [m.event() for m in messages]
    events += [
        {
            "event": "restore_fallback",
            "source": RestoreSource.STORAGE.value,
            "where": f"step {m.step}",
            "error": f"distrusted ({m.reason.value}): {m.detail}",
            "rank": m.rank,
            "corrupt": True,
            "step": m.step,
            "distrust": True,
        }
        for m in messages
        if m.reason is DistrustReason.NON_FINITE
    ]
    for event in events:
        link.record_event(event, wait=True)


def rollbacks(events: Iterable[dict]) -> list[dict]:
    """The run's rollbacks past a snapshot that went non-finite, from the controller's events
    (``FinishSummary.rollbacks``)."""
    out = []
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("event") in (ROLLED_BACK, EXHAUSTED):
            out.append(
                {
                    "suspect_step": e.get("restored_step"),
                    "at_step": e.get("step"),
                    "reason": "non-finite loss after the restore",
                    "stopped": e.get("event") == EXHAUSTED,
                }
            )
        elif e.get("event") == "restore" and e.get("rolled_back_from") is not None:
            out.append(
                {
                    "suspect_step": e["rolled_back_from"],
                    "restored_step": e.get("step"),
                    "reason": "non-finite saved state",
                    "stopped": False,
                }
            )
    return out


def stopped_error(exhausted: dict) -> NonFiniteAfterRestore:
    """What a restore raises in a run that was stopped (a ``trust_exhausted`` event)."""
    return NonFiniteAfterRestore(
        "cf_ray: this run was stopped at its attempt "
        f"{exhausted.get('attempt')}: {exhausted.get('detail', 'the loss went non-finite after a rollback')}. "
        "It is not restored again; start a new run (CheckpointConfig(resume_from=...) a checkpoint older "
        f"than step {exhausted.get('restored_step')})"
    )


__all__ = [
    "DEFAULT_STEPS",
    "Distrusted",
    "NonFiniteAfterRestore",
    "TrustGate",
    "is_finite",
    "rollbacks",
    "stopped_error",
    "tell_controller",
]
