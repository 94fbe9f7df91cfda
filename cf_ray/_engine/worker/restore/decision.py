"""The restore's one decision, shared by every rank (``restorer.py``), and what it tells people.

Every phase of a restore ends with an exchange of every rank's :class:`Status` (an all-gather on
cf_ray's own group). :func:`decide` raises on every rank when some rank failed; a candidate some
rank skipped is skipped by every rank, and :class:`Fallbacks` says so: a warning per rank and a
``restore_fallback`` event (rank 0). When the snapshot itself failed a check, no later restore of
the run is offered it (``trust_gate.py``): the event of a memory snapshot whose bytes failed says
``verification`` with its ``generation`` and ``step`` (the controller takes it out of every later
plan), and a non-finite state is distrusted through ``controller.distrust`` (its checkpoint on
storage quarantined too).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from cf_ray._engine.format.layout import parse_step_dir
from cf_ray._engine.protocol.events import RestoreFallbackEvent
from cf_ray._engine.protocol.messages import RestoreSource
from cf_ray._engine.worker.restore.storage import describe
from cf_ray._engine.worker.restore.trust_gate import Reason, Suspect, tell_controller
from cf_ray.errors import CfRayError, RestoreError

logger = logging.getLogger("cf_ray")


class Verdict(enum.IntEnum):
    OK = 0
    SKIP = 1
    """This candidate cannot be used: every rank goes on with the next one."""
    FAIL = 2
    """Every rank raises."""


@dataclass(frozen=True, slots=True)
class Status:
    """One rank's outcome of a phase, as exchanged with every rank."""

    verdict: Verdict
    rank: int
    error: str = ""
    """``Type: message`` of what went wrong."""
    error_type: type | None = None
    """For ``FAIL``: the cf_ray error type every rank raises (``None``: RestoreError)."""
    damage: bool = False
    """For ``SKIP``: the cause was damage or a missing file, not a refusal of the content."""
    corrupt: bool = False
    """For ``SKIP``: the cause was a :class:`CorruptCheckpointError` (the event says so; the controller quarantines it)."""
    distrust: str = ""
    """For ``SKIP``: why the snapshot itself is not to be trusted again (a ``trust_gate.Reason``
    value: its bytes failed their checks, or its state is non-finite); ``""``: it may be tried again."""
    epoch: int = -1
    """For ``OK`` after validation: the epoch this rank's section says to resume at (rank 0's wins:
    its late capture at ``end_epoch()`` decides whether a checkpoint of an epoch's last step resumes
    at the next epoch, and the other ranks may hold no late objects)."""


@dataclass(frozen=True, slots=True)
class PlanFailed:
    """What rank 0 broadcasts instead of a plan when it could not get one."""

    error: str


def fail_status(rank: int, e: BaseException) -> Status:
    """Every rank raises ``e``'s type when it is a cf_ray error of its own, else a RestoreError."""
    keep = isinstance(e, CfRayError) and type(e) is not CfRayError
    return Status(Verdict.FAIL, rank, describe(e), error_type=type(e) if keep else None)


def decide(statuses: list[Status], where: str) -> None:
    """Raise on every rank when some rank failed; the error names that rank and its cause."""
    failed = next((s for s in statuses if s.verdict is Verdict.FAIL), None)
    if failed is None:
        return
    at = f" restoring {where}" if where else ""
    msg = failed.error.split(": ", 1)[1] if ": " in failed.error else failed.error
    text = (
        f"{msg} (rank {failed.rank}{at}; raised on every rank)"
        if failed.error_type is not None
        else f"cf_ray: restore failed on rank {failed.rank}{at}: {failed.error}; every rank stops here"
    )
    cls = failed.error_type if failed.error_type is not None else RestoreError
    try:
        err = cls(text)
    except Exception:  # noqa: BLE001 - a type that takes other arguments
        err = RestoreError(text)
    raise err


class Fallbacks:
    """The candidates every rank skipped in one restore, said once each.

    Args:
        rank: this rank.
        link: the line to the controller (``record_event``, ``distrust``).
        own: whether a storage is this run's own (its primary storage or an upload tier).
        primary: this run's primary storage (its committed checkpoints are quarantined when corrupt).
    """

    def __init__(self, rank: int, link: Any, own: Any, primary: Any):
        self.rank = rank
        self.link = link
        self._own = own
        self._primary = primary
        self.items: list[dict] = []
        """``where``, ``rank``, ``error``, ``distrust`` of each candidate skipped."""
        self.rolled_back_from: int | None = None
        """The newest step skipped because its saved state is non-finite."""

    def clear(self) -> None:
        self.items, self.rolled_back_from = [], None

    def add(
        self, source: RestoreSource, where: str, mine: Status, statuses: list[Status], cand: Any, generation: int
    ) -> Suspect | None:
        """Every rank skips ``cand``; ``generation``: the one that took it (-1 when unknown). Returns
        what every rank now distrusts of it (``None``: nothing; it may be tried again later)."""
        first = next(s for s in statuses if s.verdict is Verdict.SKIP)
        why = mine.error if mine.verdict is Verdict.SKIP else f"rank {first.rank}: {first.error}"
        logger.warning("cf_ray: rank %d: cannot restore %s (%s); falling back", self.rank, where, why)
        bad = next((s for s in statuses if s.distrust), None)  # the snapshot itself failed a check
        memory = source is RestoreSource.MEMORY
        step = cand.step if memory else parse_step_dir(cand[1])
        reason = Reason(bad.distrust) if bad is not None else None
        if reason is Reason.NON_FINITE and step is not None:
            self.rolled_back_from = max(step, self.rolled_back_from or step)
        self.items.append(
            {"where": where, "rank": first.rank, "error": first.error[:500], "distrust": reason.value if reason else ""}
        )
        suspect = None
        if bad is not None and reason is not None and step is not None and (memory or self._own(cand[0])):
            suspect = Suspect(step, generation, source, reason, f"rank {bad.rank}: {bad.error}"[:1000])
        if self.rank != 0:
            return suspect
        named: dict[str, Any] = {}
        if memory:
            # The controller takes a memory snapshot whose bytes failed out of every later plan.
            named.update(step=step, generation=generation, verification=reason is Reason.INTEGRITY)
        elif cand[0] is self._primary and step is not None:
            # A committed checkpoint of this run's own storage: a corrupt one makes the controller
            # re-read it (and quarantine it only if it is damaged).
            named.update(step=step, generation=generation)
        self.link.record_event(
            RestoreFallbackEvent(
                source=source.value,
                where=where,
                error=first.error,
                rank=first.rank,
                corrupt=first.corrupt and reason is not Reason.NON_FINITE,
                non_finite=True if reason is Reason.NON_FINITE else None,
                **named,
            )
        )
        if suspect is not None and reason is Reason.NON_FINITE:
            try:  # never offered again, and its checkpoint on storage quarantined with the reason
                tell_controller(self.link, [suspect])
            except Exception as e:  # noqa: BLE001 - this restore goes on; a later one checks it again
                logger.warning("cf_ray: could not tell the controller to distrust %s: %s", where, describe(e))
        return suspect

    def extra(self) -> dict[str, Any]:
        """What the ``restore`` event adds: the candidates skipped and a rollback."""
        out: dict[str, Any] = {}
        if self.items:
            out["fallbacks"] = list(self.items)
        if self.rolled_back_from is not None:
            out["rolled_back_from"] = self.rolled_back_from
        return out


__all__ = ["Fallbacks", "PlanFailed", "Status", "Verdict", "decide", "fail_status"]
