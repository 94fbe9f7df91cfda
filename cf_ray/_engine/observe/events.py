"""The run's events and the failures the workers learn of, kept by the controller (bounded windows).

* Events: restores, fallbacks, notices, interval changes, uploads, quarantines, in order, typed
  (:class:`~cf_ray._engine.protocol.events.Event`); the newest ``env.EVENTS_WINDOW``. They are
  saved, in their plain form, with the profile's rows in memory (``profile_files.py``'s
  ``window.json``): a controller that starts again during the run lists them
  (:meth:`EventLog.restore_events`).
* Failures: a checkpoint that did not commit (a section or the manifest could not be written, a
  holder lost what it held), as the workers learn of them from ``sync`` (:class:`Failure`, each with
  a ``seq`` that keeps counting across controllers: workers ask for the failures after the last one
  they saw) and as ``summary()`` lists them: the newest ``env.EVENTS_WINDOW``. A failure of an
  earlier attempt reaches the ranks of the later one too: ``FinishSummary.failures`` and ``wait()``
  report it once (``earlier_attempt: True``), so a step lost with its node is never silent. The
  newest :data:`SAVED_FAILURES` are saved with the controller's state (``control_state.json``,
  :class:`~cf_ray._engine.driver.recovery.ControlState`): a controller that starts again during the
  run still lists them.
* The restores that fell back from a candidate, counted by source and cause (``verification``: the
  bytes failed their block checksums or the fingerprints after loading, or the read found damage;
  ``refused``: anything else), for the summary and the metrics.

No Ray, no storage: the profile (:class:`~.profile_book.ProfileBook`) calls it under the controller's lock.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cf_ray._engine.protocol.events import Event, EventError, RestoreFallbackEvent
from cf_ray._engine.protocol.messages import Failure

logger = logging.getLogger("cf_ray")

#: How many of the newest failures the controller's state on storage keeps (``control_state.json``).
SAVED_FAILURES = 64

#: The causes of a restore fallback (``summary()["restore_fallbacks"]``, the metric's ``cause`` tag).
VERIFICATION, REFUSED = "verification", "refused"


def fallback_cause(event: RestoreFallbackEvent) -> str:
    """Why a restore fell back: :data:`VERIFICATION` when the bytes did not verify (``corrupt``, or
    ``verification`` as the worker's restore says of a block checksum or fingerprint mismatch), else
    :data:`REFUSED`."""
    return VERIFICATION if event.corrupt or event.verification else REFUSED


class EventLog:
    """Events, failures and restore fallbacks of one run.

    Args:
        window: how many events (and failures) are kept, the newest.
        seq_base: the first failure's ``seq`` (a controller that starts again during a run counts
            above its predecessor).
    """

    def __init__(self, window: int, seq_base: int = 0):
        self.events: collections.deque[Event] = collections.deque(maxlen=max(1, window))
        """Restores, fallbacks, notices, interval changes, uploads, in order (the newest), typed."""
        self._failures: collections.deque[Failure] = collections.deque(maxlen=max(1, window))
        self._next_seq = int(seq_base)
        self.fallbacks: collections.Counter[tuple[str, str]] = collections.Counter()
        """(source, cause) -> restore candidates an attempt fell back from."""
        self.on_failure: Callable[[], None] | None = None
        """Called (under the controller's lock) after each failure added: the controller saves its
        state, with the failures, on its maintenance thread."""
        self.on_event: Callable[[], None] | None = None
        """Called (under the controller's lock) after each event added: the controller saves the
        window of events with the profile's rows (``window.json``), on its maintenance thread."""

    def add(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, RestoreFallbackEvent):
            self.fallbacks[(event.source, fallback_cause(event))] += 1
        if self.on_event is not None:
            self.on_event()

    def restore_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        """The events a predecessor saved (their plain form), listed again before any of this
        controller's (the restore fallbacks among them counted again); one that does not read as an
        event is skipped with a warning (the window is a report, never a reason to fail)."""
        on_event, self.on_event = self.on_event, None
        try:
            for plain in events:
                try:
                    event = Event.from_dict(plain)
                except EventError as e:
                    logger.warning("cf_ray: skipping a saved event: %s", e)
                    continue
                self.add(event)
        finally:
            self.on_event = on_event

    def plain_events(self) -> list[dict[str, Any]]:
        """The events in their plain form, oldest first (what users read and storage keeps)."""
        return [e.to_dict() for e in self.events]

    def add_failure(self, *, generation: int, step: int, section: str, rank: int, error: str) -> Failure:
        failure = Failure(seq=self._next_seq, step=step, section=section, rank=rank, error=error, generation=generation)
        self._next_seq += 1
        self._failures.append(failure)
        if self.on_failure is not None:
            self.on_failure()
        return failure

    def restore_failures(self, failures: list[Failure]) -> None:
        """The failures a predecessor saved (``control_state.json``): listed again, with their ``seq``
        (the ranks asked for those above what they saw), new ones numbered above them."""
        known = {f.seq for f in self._failures}
        for f in sorted(failures, key=lambda f: f.seq):
            if f.seq not in known:
                self._failures.append(f)
                self._next_seq = max(self._next_seq, f.seq + 1)

    def saved_failures(self) -> list[dict]:
        """The newest :data:`SAVED_FAILURES` failures, as the controller's state saves them."""
        return [f.as_dict() for f in list(self._failures)[-SAVED_FAILURES:]]

    def continue_above(self, seen_seq: int) -> None:
        """A rank has seen failure ``seen_seq`` of an earlier controller: count above it."""
        self._next_seq = max(self._next_seq, int(seen_seq) + 1)

    def failures_since(self, seen_seq: int) -> tuple[Failure, ...]:
        return tuple(f for f in self._failures if f.seq > seen_seq)

    def failure_dicts(self) -> list[dict]:
        """The failures as the controller's summary has them."""
        return [f.as_dict() for f in self._failures]

    def fallback_counts(self) -> dict[str, dict[str, int]]:
        """``{source: {cause: n}}`` of the restores that fell back (the summary's ``restore_fallbacks``)."""
        out: dict[str, dict[str, int]] = {}
        for (source, cause), n in sorted(self.fallbacks.items()):
            out.setdefault(source, {})[cause] = n
        return out


__all__ = ["REFUSED", "VERIFICATION", "EventLog", "fallback_cause"]
