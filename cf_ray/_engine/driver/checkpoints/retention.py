"""Keep-last clean-up of the primary storage and the upload tiers, and the scan for leftovers, on
the maintenance thread (never under the controller's lock while it deletes).

No clean-up between a restore plan and the restore (:meth:`Retention.defer`): the plan names
checkpoints that a late commit of the previous attempt would otherwise push out (``keep_last=1``);
what was deferred runs once the attempt has restored.

What Ray Train lists loads: a step registered with it (``registered/step_<n>``, a pointer that
``result.best_checkpoints`` and ``get_checkpoint()`` hand back) counts toward ``keep_last`` but is
not deleted while its pointer is there. Ray Train refuses to start a run again when a directory it
lists is gone, so cf_ray never deletes a pointer: Ray's ``num_to_keep`` does, and keep-last then
deletes the step. Milestones and the resume point a final model names are never deleted or counted.

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
from cf_ray._engine.format.layout import CHECKPOINTS, POINTER, pointer_dir, step_dir
from cf_ray._engine.protocol.messages import SectionState
from cf_ray._engine.storage.base import Storage

logger = logging.getLogger("cf_ray")

#: Directory entries the leftover scan may examine per commit, on average.
SCAN_ENTRIES_PER_COMMIT = 64
#: Pointers of registered steps (``registered/step_<n>``) keep-last looks for per pass.
POINTER_CHECKS_PER_PASS = 8


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
        self._last_asked = -1  # the last registered step whose pointer was looked at
        self._said_listed = False

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
        if self.keep_last is not None:
            self._forget_unlisted()
        with self._lock:
            if self.restoring:
                return  # deferred until restored()
            committed_index = self._commits.committed
            if self.keep_last is not None:
                committed = [(s, c.kept) for s, c in committed_index.items()]  # milestones, resume points
                past = to_delete(committed, self.keep_last)
                listed = [s for s in past if committed_index[s].registered]  # Ray Train lists them
                doomed = [s for s in past if s not in protected and not committed_index[s].registered]
                if listed and not self._said_listed:
                    self._said_listed = True
                    logger.warning(
                        "cf_ray: keep-last keeps step %d beyond keep_last=%d: it is registered with Ray Train, "
                        "which lists it (result.best_checkpoints), and what Ray lists must load. Ray's "
                        "RunConfig(checkpoint_config=CheckpointConfig(num_to_keep=...)) bounds what it lists; "
                        "CheckpointConfig(register_with_ray=False) registers nothing (said once)",
                        listed[-1],
                        self.keep_last,
                    )
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

    def _forget_unlisted(self) -> None:
        """The registered steps that keep-last spares and whose pointer Ray Train deleted (its
        ``num_to_keep``) are ordinary checkpoints again: keep-last deletes them from this pass on.

        At most :data:`POINTER_CHECKS_PER_PASS` pointers are looked at per pass, in turn (bounded
        work per commit however many Ray lists). The newest registered step is never looked at: its
        rank writes the pointer after the controller marked it (``keep_registered``), so a pointer
        missing there may be one not written yet; a registration that failed leaves it marked until
        a newer one."""
        with self._lock:
            if self.restoring:
                return
            entries = self._commits.committed
            registered = sorted(s for s, c in entries.items() if c.registered)[:-1]
            past = set(to_delete([(s, c.kept) for s, c in entries.items()], self.keep_last))
            spared = [s for s in registered if s in past]
        ask = [s for s in spared if s > self._last_asked] + [s for s in spared if s <= self._last_asked]
        ask = ask[:POINTER_CHECKS_PER_PASS]
        if not ask:
            return
        self._last_asked = ask[-1]
        gone = [s for s in ask if not self.storage.exists(f"{pointer_dir(s)}/{POINTER}")]
        with self._lock:
            for s in gone:
                self._commits.index.unregister(s)

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


__all__ = ["POINTER_CHECKS_PER_PASS", "SCAN_ENTRIES_PER_COMMIT", "Retention"]
