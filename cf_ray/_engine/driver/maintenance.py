"""The controller's maintenance thread: keep-last clean-up and copies to the upload tiers, after
each commit, off the actor's RPC threads (a slow delete or upload never delays a worker's poll).

No clean-up between a restore plan and the restore (:meth:`Maintenance.defer_deletions`): the plan
names checkpoints that a late commit of the previous attempt would otherwise push out
(``keep_last=1``); what was deferred runs once the attempt has restored.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time

from cf_ray._engine.driver.commits import CommitBook
from cf_ray._engine.driver.messages import SectionState
from cf_ray._engine.driver.profile_book import ProfileBook
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")


class _Task(enum.Enum):
    AFTER_COMMIT = "after_commit"
    """Upload the new checkpoint to the tiers, then clean up the primary storage."""
    RETAIN = "retain"
    """Clean up the primary storage and every tier (what was deferred during a restore)."""


class Maintenance:
    """Clean-up and uploads on a thread of their own.

    Args:
        storage: the run's (primary) storage.
        tiers: upload destinations (``Storage``), fastest first.
        keep_last: how many checkpoints to keep (milestones aside); ``None``: all.
        upload_milestones_only: copy only milestones to the tiers.
        lock: the controller's lock (the committed index and the pending table are read under it).
        commits: the controller's commit bookkeeping.
        book: where uploads are recorded as events.
    """

    def __init__(self, storage: Storage, *, tiers: list, keep_last: int | None, upload_milestones_only: bool,
                 lock: threading.RLock, commits: CommitBook, book: ProfileBook):
        self.storage = storage
        self.tiers: list[Storage] = list(tiers)
        self.keep_last = keep_last
        self.upload_milestones_only = upload_milestones_only
        self._lock = lock
        self._commits = commits
        self._book = book
        self._unknown_seen: set[int] = set()  # uncommitted step directories of no known checkpoint
        self._restoring = False  # between prepare_restore() and restored(): no deletions
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cf_ray-maintenance", daemon=True)
        self._thread.start()

    # -- called by the controller ----------------------------------------------------------------------
    def after_commit(self, step: int, m: mf.Manifest) -> None:
        self._queue.put((_Task.AFTER_COMMIT, step, m))

    def defer_deletions(self) -> None:
        """A restore plan is out: until :meth:`resume_deletions`, keep-last deletes nothing."""
        self._restoring = True

    def resume_deletions(self) -> None:
        """The attempt has restored: clean up again, starting with what was deferred."""
        self._restoring = False
        self._queue.put((_Task.RETAIN,))

    def idle(self) -> bool:
        """True when no upload or clean-up is queued or running."""
        return self._queue.unfinished_tasks == 0

    def stop(self) -> None:
        """The thread ends after what is queued."""
        self._queue.put(None)

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                if item[0] is _Task.AFTER_COMMIT:
                    _, step, m = item
                    self._upload(step, m)
                    self._retain()
                elif item[0] is _Task.RETAIN:
                    self._retain()
                    for tier in self.tiers:
                        self._retain_in(tier)
            except Exception:  # noqa: BLE001 - a failed delete or upload never kills the thread
                logger.exception("cf_ray: maintenance after step %s failed", item[1] if len(item) > 1 else "?")
            finally:
                self._queue.task_done()

    def _upload(self, step: int, m: mf.Manifest) -> None:
        if not self.tiers or (self.upload_milestones_only and not m.milestone):
            return
        directory = mf.step_dir(step)
        for tier in self.tiers:
            t0 = time.perf_counter()
            try:
                for name in m.files:
                    buf = mf.read_verified(self.storage, directory, m, name)
                    info = tier.write_file(f"{directory}/{name}", [buf])
                    if info != m.files[name]:
                        raise OSError(f"upload of {name} to {tier.uri()} wrote {info}, expected {m.files[name]}")
                mf.commit(tier, directory, m)  # the tier's own commit marker, written last
                self._book.add_event({"event": "upload", "step": step, "tier": tier.uri(directory),
                                      "seconds": time.perf_counter() - t0, "time": time.time()})
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: upload of step %d to %s failed: %s", step, tier.uri(), e)
                self._book.add_event({"event": "upload_failed", "step": step, "tier": tier.uri(), "error": str(e),
                                      "time": time.time()})
            else:
                self._retain_in(tier)

    def _retain(self) -> None:
        with self._lock:
            committed_index = self._commits.committed
            if self._restoring:
                return  # deferred until restored()
            committed = [(s, c.milestone) for s, c in committed_index.items()]
            doomed = mf.to_delete(committed, self.keep_last)
            # The index is updated *before* deleting, so a concurrent restore plan never names a
            # checkpoint that is being deleted (the same order as Ray's checkpoint manager).
            for s in doomed:
                committed_index.pop(s, None)
            newest = max(committed_index) if committed_index else None
        for s in doomed:
            _delete(self.storage, mf.step_dir(s))
        if newest is None:
            return
        # Directories without a manifest older than the newest commit are dead: a crashed writer's
        # leftovers, failed or superseded snapshots. Checkpoints commit out of step order when a
        # rank's section arrives late at its holder, so an older one may still be in flight, or may
        # commit between this listing and the check below: the check asks what the step is *now*
        # (a step committed since the listing was deleted here once — a milestone, in CI). A step
        # this controller has no record of may be one whose part_staged has not run yet (the actor
        # is threaded): it is deleted only if a later pass still finds it unknown and uncommitted.
        leftovers = mf.list_uncommitted(self.storage)
        with self._lock:
            states = self._commits.states_by_step()
            unknown = {step for _, step in leftovers if step not in states and step not in committed_index}
            dead = [name for name, step in leftovers if step < newest and step not in committed_index and (
                step in self._unknown_seen if step in unknown else SectionState.PENDING not in states[step])]
            self._unknown_seen = unknown
        for name in dead:
            _delete(self.storage, f"{mf.CHECKPOINTS}/{name}")

    def _retain_in(self, tier: Storage) -> None:
        if self._restoring:
            return  # deferred until restored()
        committed = []
        for c in mf.list_committed(tier):
            try:
                committed.append((c.step, mf.read_manifest(tier, c.path).milestone))
            except Exception:  # noqa: BLE001
                continue
        for s in mf.to_delete(committed, self.keep_last):
            _delete(tier, mf.step_dir(s))


def tier_steps(tiers: list[Storage]) -> tuple[tuple[int, ...], ...]:
    """The committed steps on each upload tier, newest first (empty for a tier that cannot be listed)."""
    out = []
    for tier in tiers:
        try:
            out.append(tuple(sorted((c.step for c in mf.list_committed(tier)), reverse=True)))
        except Exception as e:  # noqa: BLE001 - an unreachable tier is not a reason to fail a restore
            logger.warning("cf_ray: cannot list upload tier %s: %s", tier.uri(), e)
            out.append(())
    return tuple(out)


def _delete(storage: Storage, path: str) -> None:
    try:
        storage.delete_dir(path)
    except Exception as e:  # noqa: BLE001 - a failed delete is logged, never fatal
        logger.warning("cf_ray: could not delete %s: %s", storage.uri(path), e)
