"""The controller's maintenance thread: keep-last clean-up (:mod:`.checkpoints.retention`), copies to
the upload tiers (:mod:`.checkpoints.uploads`), the profile's parts and window, the policy's state and
the re-reads of checkpoints a restore found damaged (:mod:`.checkpoints.quarantine`), after each
commit, off the actor's RPC threads (a slow delete, upload or re-read never delays a worker's poll)
and never under the controller's lock while it does storage I/O.

One condition of its own guards what is due (and the upload queue); the thread takes the
controller's lock only for its reads of the committed index and the pending table.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from cf_ray._engine.driver.checkpoints.commits import CommitBook
from cf_ray._engine.driver.checkpoints.retention import Retention
from cf_ray._engine.driver.checkpoints.uploads import Upload, Uploads
from cf_ray._engine.format.commit import Manifest
from cf_ray._engine.observe.profile_book import ProfileBook
from cf_ray._engine.storage.base import Storage

logger = logging.getLogger("cf_ray")

#: What can be due, besides the uploads and the one-off tasks.
_RETAIN, _RETAIN_TIERS, _SCAN, _PARTS = "retain", "retain_tiers", "scan", "parts"


class Maintenance:
    """Clean-up, uploads, profile parts and periodic saves on a thread of their own.

    Args:
        storage: the run's (primary) storage.
        tiers: upload destinations (``Storage``), fastest first.
        keep_last: how many checkpoints to keep (milestones aside); ``None``: all.
        upload_milestones_only: copy only milestones to the tiers.
        lock: the controller's lock (the committed index and the pending table are read under it).
        commits: the controller's commit bookkeeping.
        book: where uploads are recorded as events, and whose profile parts are written here.
        periodic: ``(interval_s, fn)`` pairs: each ``fn`` runs on this thread at most every
            ``interval_s`` seconds, after a commit or :meth:`changed` (the policy's state, the
            profile's window).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        tiers: list,
        keep_last: int | None,
        upload_milestones_only: bool,
        lock: threading.RLock,
        commits: CommitBook,
        book: ProfileBook,
        periodic: list[tuple[float, Callable[[], None]]] | None = None,
    ):
        self._lock = lock
        self._book = book
        self._periodic = list(periodic or [])
        self._cond = threading.Condition()  # what is due; never held while taking the controller's lock
        self._stopping = threading.Event()
        self.retention = Retention(storage, tiers, keep_last=keep_last, lock=lock, commits=commits)
        self.uploads = Uploads(
            storage,
            tiers,
            milestones_only=upload_milestones_only,
            book=book,
            cond=self._cond,
            stopping=self._stopping,
            uploaded=self.retention.uploaded,
        )
        self._due: set[str] = set()
        self._once: collections.deque[Callable[[], None]] = collections.deque()
        self._busy = False
        self._dirty = [False] * len(self._periodic)  # a commit since each periodic task last ran
        self._last_periodic = [time.monotonic()] * len(self._periodic)
        self._thread = threading.Thread(target=self._run, name="cf_ray-maintenance", daemon=True)
        self._thread.start()

    @property
    def tiers(self) -> list[Storage]:
        return self.uploads.tiers

    # -- called by the controller ----------------------------------------------------------------------
    def after_commit(self, step: int, m: Manifest) -> None:
        """A checkpoint committed: upload it (if it goes to the tiers), then clean up."""
        with self._cond:
            self.retention.committed()
            self._dirty = [True] * len(self._periodic)
            self._due.add(_RETAIN)
            if self.uploads.wanted(m):
                self.uploads.enqueue(Upload(step, m))
            self._cond.notify_all()

    def changed(self) -> None:
        """Something the periodic saves save changed besides a commit (an event): they run again,
        each no more often than its interval."""
        with self._cond:
            self._dirty = [True] * len(self._periodic)
            self._cond.notify_all()

    def defer_deletions(self) -> None:
        """A restore plan is out: until :meth:`resume_deletions`, keep-last deletes nothing."""
        self.retention.restoring = True

    def resume_deletions(self) -> None:
        """The attempt has restored: clean up again, starting with what was deferred."""
        self.retention.restoring = False
        with self._cond:
            self._due |= {_RETAIN, _RETAIN_TIERS, _SCAN}
            self._cond.notify_all()

    def profile_batch_ready(self) -> None:
        """Rows left the profile's memory: write them as a part."""
        with self._cond:
            self._due.add(_PARTS)
            self._cond.notify_all()

    def run_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once on this thread (rare work: the clean-up of old profile parts, a re-read)."""
        with self._cond:
            self._once.append(fn)
            self._cond.notify_all()

    def idle(self) -> bool:
        """True when no upload, clean-up or write is queued or running."""
        with self._cond:
            return not self._has_work() and not self._busy

    def uploads_pending(self) -> list[int]:
        """Steps whose upload is queued or running, oldest first."""
        with self._cond:
            return self.uploads.pending()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until :meth:`idle` (at most ``timeout_s``). Returns whether it is."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._has_work() or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 1.0))
            return True

    def stop(self) -> None:
        """The thread ends after the task it is running; what is still queued is logged, not done."""
        self._stopping.set()
        with self._cond:
            left = self.uploads.drop_all()
            self._cond.notify_all()
        if left:
            logger.warning(
                "cf_ray: the controller stops with uploads of steps %s not done; they are committed on "
                "the primary storage",
                left,
            )

    # -- the thread ---------------------------------------------------------------------------------------
    def _protected(self) -> set[int]:
        """Steps keep-last must not delete now: their upload is queued or running."""
        with self._cond:
            return self.uploads.protected()

    def _has_work(self) -> bool:
        return bool(self._due or self._once or self.uploads.has_work())

    def _periodic_due(self) -> int | None:
        """The first periodic task due (a commit since it last ran, its interval passed), or ``None``."""
        now = time.monotonic()
        for i, (interval_s, _) in enumerate(self._periodic):
            if self._dirty[i] and now - self._last_periodic[i] >= interval_s:
                return i
        return None

    def _next_task(self) -> Callable[[], None] | None:
        """The next thing to do (under ``_cond``); ``None`` when the thread should end."""
        while not self._stopping.is_set():
            if self._due & {_RETAIN, _RETAIN_TIERS}:
                tiers, force = _RETAIN_TIERS in self._due, _SCAN in self._due
                self._due -= {_RETAIN, _RETAIN_TIERS, _SCAN}
                return lambda: self.retention.retain_all(tiers, force, self._protected)
            if _PARTS in self._due:
                self._due.discard(_PARTS)
                return lambda: self._book.write_parts(self._lock)
            if self._once:
                return self._once.popleft()
            up = self.uploads.take()
            if up is not None:
                return lambda: self.uploads.run(up)
            due = self._periodic_due()
            if due is not None:
                self._dirty[due] = False
                self._last_periodic[due] = time.monotonic()
                return self._periodic[due][1]
            self._cond.wait(timeout=1.0)
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                task = self._next_task()
                if task is None:
                    self._cond.notify_all()
                    return
                self._busy = True
            try:
                task()
            except Exception:  # noqa: BLE001 - a failed delete or upload never kills the thread
                logger.exception("cf_ray: maintenance task failed")
            finally:
                with self._cond:
                    self._busy = False
                    self.uploads.done()
                    self._cond.notify_all()


__all__ = ["Maintenance"]
