"""Keep-last clean-up of the primary storage and the upload tiers, and the scan for leftovers, on
the maintenance thread (never under the controller's lock while it deletes).

No clean-up between a restore plan and the restore (:meth:`Retention.defer`): the plan names
checkpoints that a late commit of the previous attempt would otherwise push out (``keep_last=1``);
what was deferred runs once the attempt has restored.

Bounded work: the scan for leftover directories (uncommitted, older than the newest commit) lists
the whole ``checkpoints/`` folder, so it runs after a commit only once enough commits have passed
to pay for the previous listing (:data:`SCAN_ENTRIES_PER_COMMIT` entries per commit): constant
work per commit, however many checkpoints a run keeps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cf_ray._engine.driver.checkpoints.commits import CommitBook
from cf_ray._engine.format.catalog import list_committed, list_uncommitted, to_delete
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import CHECKPOINTS, step_dir
from cf_ray._engine.protocol.messages import SectionState
from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")

#: Directory entries the leftover scan may examine per commit, on average.
SCAN_ENTRIES_PER_COMMIT = 64


class Retention:
    """Keep-last and the leftover scan.

    Args:
        storage: the run's (primary) storage.
        tiers: the upload tiers.
        keep_last: how many checkpoints to keep (milestones aside); ``None``: all.
        lock: the controller's lock (the committed index and the pending table are read under it).
        commits: the controller's commit bookkeeping.
    """

    def __init__(
        self, storage: Storage, tiers: list, *, keep_last: int | None, lock: threading.RLock, commits: CommitBook
    ):
        self.storage = storage
        self.tiers: list[Storage] = list(tiers)
        self.keep_last = keep_last
        self._lock = lock
        self._commits = commits
        self._unknown_seen: set[int] = set()  # uncommitted step directories of no known checkpoint
        self.restoring = False
        """Between a restore plan and the restore: no deletions."""
        self._commits_since_scan = 0
        self._last_listing = 0
        self._tier_milestones: list[dict[int, bool]] = [{} for _ in self.tiers]

    def committed(self) -> None:
        """A checkpoint committed (the scan's budget grows)."""
        self._commits_since_scan += 1

    def uploaded(self, i: int, step: int, milestone: bool) -> None:
        """Tier ``i`` has ``step`` now: keep-last of that tier."""
        self._tier_milestones[i][step] = milestone
        self.retain_in(i, self.tiers[i])

    def retain_all(self, tiers: bool, force_scan: bool, protected: Callable[[], set[int]]) -> None:
        """Keep-last of the primary storage (never a step in ``protected()``: its upload is queued or
        running), the leftover scan when due, and keep-last of each tier (``tiers``)."""
        self._retain(force_scan, protected())
        if tiers:
            for i, tier in enumerate(self.tiers):
                self.retain_in(i, tier)

    def _retain(self, force_scan: bool, protected: set[int]) -> None:
        doomed: list[int] = []
        with self._lock:
            if self.restoring:
                return  # deferred until restored()
            committed_index = self._commits.committed
            if self.keep_last is not None:
                committed = [(s, c.kept) for s, c in committed_index.items()]  # milestones, resume points
                doomed = [s for s in to_delete(committed, self.keep_last) if s not in protected]
                # The index is updated *before* deleting, so a concurrent restore plan never names a
                # checkpoint that is being deleted (the same order as Ray's checkpoint manager).
                for s in doomed:
                    self._commits.index.remove(s)
            newest = self._commits.newest_step()
        for s in doomed:
            _delete(self.storage, step_dir(s))
        if newest is None:
            return
        due = force_scan or self._commits_since_scan * SCAN_ENTRIES_PER_COMMIT >= self._last_listing
        if due:
            self._commits_since_scan = 0
        if due:
            self._scan_leftovers(newest)

    def _scan_leftovers(self, newest: int) -> None:
        # Directories without a manifest older than the newest commit are dead: a crashed writer's
        # leftovers, failed or superseded snapshots. Checkpoints commit out of step order when a
        # rank's section arrives late at its holder, so an older one may still be in flight, or may
        # commit between this listing and the check below: the check asks what the step is *now*
        # (else a step committed since the listing, a milestone say, would be deleted). A step
        # this controller has no record of may be one whose part_staged has not run yet (the actor
        # is threaded): it is deleted only if a later pass still finds it unknown and uncommitted.
        leftovers = list_uncommitted(self.storage)
        with self._lock:
            committed_index = self._commits.committed
            self._last_listing = len(leftovers) + len(committed_index)
            states = self._commits.table.states_by_step()
            unknown = {step for _, step in leftovers if step not in states and step not in committed_index}
            dead = [
                name
                for name, step in leftovers
                if step < newest
                and step not in committed_index
                and (step in self._unknown_seen if step in unknown else SectionState.PENDING not in states[step])
            ]
            self._unknown_seen = unknown
        for name in dead:
            _delete(self.storage, f"{CHECKPOINTS}/{name}")

    def retain_in(self, i: int, tier: Storage) -> None:
        if self.restoring or self.keep_last is None:
            return  # deferred until restored(); or nothing to delete
        known = self._tier_milestones[i]
        committed = []
        steps = [c for c in list_committed(tier)]
        for c in steps:
            if c.step not in known:
                try:
                    known[c.step] = read_manifest(tier, c.path).milestone
                except Exception:  # noqa: BLE001
                    continue
            committed.append((c.step, known[c.step]))
        listed = {c.step for c in steps}
        for s in [s for s in known if s not in listed]:
            del known[s]
        for s in to_delete(committed, self.keep_last):
            _delete(tier, step_dir(s))
            known.pop(s, None)


def _delete(storage: Storage, path: str) -> None:
    try:
        storage.delete_dir(path)
    except Exception as e:  # noqa: BLE001 - a failed delete is logged, never fatal
        logger.warning("cf_ray: could not delete %s: %s", storage.uri(path), e)


__all__ = ["SCAN_ENTRIES_PER_COMMIT", "Retention"]
