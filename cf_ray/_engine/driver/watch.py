"""The controller's watch: nobody waits for ever on a section whose message was lost or
whose holder died.

Every ``env.WATCH_INTERVAL_S`` the watch thread asks the holders about sections pending for at
least that long (``Holder.lookup``): an outcome this controller missed is applied; a section its
holder does not have (it died, or Ray restarted it empty) fails, so the steps after it commit; a
section of an earlier attempt that no holder was ever heard to have is abandoned. It reads the
pending table under the controller's lock, asks the holders without it, and applies the answers
under it again (:meth:`~.ledger.Ledger.apply_watch`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from cf_ray._engine import env as _env
from cf_ray._engine.driver.checkpoints.pending import PendingTable
from cf_ray._engine.driver.ledger import Ledger
from cf_ray._engine.driver.recovery import HolderBusy, Roster
from cf_ray._engine.protocol.messages import Message, PartStaged, SectionState

logger = logging.getLogger("cf_ray")

#: What ``Holder.lookup`` says of a section it does not have.
UNKNOWN = "unknown"

Key = tuple[int, int, str]


def watch_targets(table: PendingTable, min_age_s: float) -> tuple[dict[str, list[Key]], list[Key]]:
    """What to ask the holders about: sections of steps pending for at least ``min_age_s`` that some
    holder has or wrote and whose outcome this controller has not heard (by holder), and sections
    expected that no holder was heard of (orphans). Under the controller's lock."""
    by_holder: dict[str, list[Key]] = collections.defaultdict(list)
    orphans: list[Key] = []
    now = time.monotonic()
    for (gen, step), p in table.entries.items():
        if p.state != SectionState.PENDING or p.committing or now - p.created_mono < min_age_s:
            continue
        done = set(p.parts.durable) | set(p.parts.failed) | p.parts.superseded
        for sec, holder in p.parts.staged.items():
            if sec not in done:
                by_holder[holder].append((gen, step, sec))
        if p.parts.expected is None:  # its part_staged never came: ask who wrote a section
            for sec, holder in p.parts.writers.items():
                by_holder[holder].append((gen, step, sec))
        else:
            orphans += [(gen, step, sec) for sec in sorted(p.parts.expected - set(p.parts.staged) - done)]
    return dict(by_holder), orphans


class Watch:
    """The watch of one controller.

    Args:
        ledger: the controller's bookkeeping.
        roster: the run's holders.
    """

    def __init__(self, ledger: Ledger, roster: Roster):
        self._ledger = ledger
        self._roster = roster

    def loop(self, stopping: threading.Event) -> None:
        """The watch thread's body (until ``stopping``)."""
        while not stopping.wait(max(0.2, _env.WATCH_INTERVAL_S)):
            try:
                self.once()
            except Exception:  # noqa: BLE001 - the watch never dies
                logger.exception("cf_ray: the controller's watch failed")

    def once(self, min_age_s: float | None = None) -> None:
        """One pass over the sections pending for at least ``min_age_s`` (default
        ``env.WATCH_INTERVAL_S``)."""
        link = self._roster.link
        if link is None:
            return
        interval = _env.WATCH_INTERVAL_S
        min_age_s = interval if min_age_s is None else min_age_s
        with self._ledger.lock:
            by_holder, orphans = watch_targets(self._ledger.commits.table, min_age_s)
        known = self._roster.names()
        staged: list[PartStaged] = []
        outcomes: list[Message] = []
        lost: list[tuple[Key, str]] = []
        gone: set[str] = set()
        timeout_s = max(1.0, interval)
        for name, keys in by_holder.items():
            try:
                answer = link.lookup(name, keys, timeout_s=timeout_s)
            except HolderBusy:
                continue
            if answer is None:
                gone.add(name)
                lost += [(k, name) for k in keys]
                continue
            for key, (status, st, out) in zip(keys, answer):
                staged += [st] if st is not None else []
                outcomes += [out] if out is not None else []
                if status == UNKNOWN:
                    lost.append((key, name))
        unfound = set(orphans)
        for name in known if orphans else ():
            try:
                answer = link.lookup(name, orphans, timeout_s=timeout_s)
            except HolderBusy:
                unfound.clear()  # cannot tell: ask again next time
                continue
            if answer is None:
                gone.add(name)
                continue
            for key, (status, st, out) in zip(orphans, answer):
                if status != UNKNOWN:
                    unfound.discard(key)
                    staged += [st] if st is not None else []
                    outcomes += [out] if out is not None else []
        settled = self._ledger.apply_watch(staged, outcomes, lost, unfound)
        self._roster.drop(gone)
        self._roster.tell(settled)


__all__ = ["UNKNOWN", "Watch", "watch_targets"]
