"""The controller's maintenance thread: keep-last clean-up, copies to the upload tiers, the
profile's parts and the policy's state, after each commit, off the actor's RPC threads (a slow
delete or upload never delays a worker's poll) and never under the controller's lock while it
does storage I/O.

No clean-up between a restore plan and the restore (:meth:`Maintenance.defer_deletions`): the plan
names checkpoints that a late commit of the previous attempt would otherwise push out
(``keep_last=1``); what was deferred runs once the attempt has restored.

Uploads (issue #16): a bounded queue (``CF_RAY_UPLOAD_QUEUE``; when full, the oldest queued upload
that is not a milestone is dropped, with a warning and an ``upload_dropped`` event); each file is
streamed from the primary storage in ``CF_RAY_WRITE_CHUNK_BYTES`` chunks (pyarrow input streams,
so memory stays a few chunks whatever the checkpoint's size) through the tier's ``write_file``,
whose size and CRC-32 must be the manifest's; a transient error (``OSError``) is retried with
exponential backoff (``CF_RAY_UPLOAD_RETRIES``, ``CF_RAY_UPLOAD_BACKOFF_S``); the tier's manifest is
written last. Keep-last never deletes a step whose upload is queued or running.
:meth:`Maintenance.uploads_pending` says what is left (``Checkpointer.finish`` waits on it).

Bounded work: the scan for leftover directories (uncommitted, older than the newest commit) lists
the whole ``checkpoints/`` folder, so it runs after a commit only once enough commits have passed
to pay for the previous listing (:data:`SCAN_ENTRIES_PER_COMMIT` entries per commit): constant
work per commit, however many checkpoints a run keeps.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cf_ray._engine import env as _env
from cf_ray._engine.driver.commits import CommitBook
from cf_ray._engine.driver.profile_book import ProfileBook
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.protocol.messages import SectionState
from cf_ray._engine.storage.base import chunked, is_symlink
from cf_ray._engine.storage.fs import Storage
from cf_ray.errors import CorruptCheckpointError, UnsafePathError

logger = logging.getLogger("cf_ray")

#: Directory entries the leftover scan may examine per commit, on average.
SCAN_ENTRIES_PER_COMMIT = 64
#: The longest wait between two tries of an upload.
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True, slots=True)
class _Upload:
    """One committed checkpoint to copy to the tiers."""

    step: int
    manifest: mf.Manifest


class _Permanent(Exception):
    """An upload error that a retry cannot fix (the source is damaged, unsafe or gone)."""


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
        periodic: ``(interval_s, fn)``: ``fn`` runs on this thread at most every ``interval_s``
            seconds, after a commit (the policy's state).
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
        periodic: tuple[float, Callable[[], None]] | None = None,
    ):
        self.storage = storage
        self.tiers: list[Storage] = list(tiers)
        self.keep_last = keep_last
        self.upload_milestones_only = upload_milestones_only
        self._lock = lock
        self._commits = commits
        self._book = book
        self._periodic = periodic
        self._unknown_seen: set[int] = set()  # uncommitted step directories of no known checkpoint
        self._restoring = False  # between prepare_restore() and restored(): no deletions
        self._cond = threading.Condition()  # this thread's queue; never held while taking the controller's lock
        self._uploads: collections.deque[_Upload] = collections.deque()
        self._uploading: int | None = None
        self._retain_due = False
        self._retain_tiers_due = False
        self._scan_forced = False
        self._parts_due = False
        self._once: collections.deque[Callable[[], None]] = collections.deque()
        self._busy = False
        self._stopping = threading.Event()
        self._commits_since_scan = 0
        self._last_listing = 0
        self._dirty = False  # a commit since the last periodic run
        self._last_periodic = time.monotonic()
        self._tier_milestones: list[dict[int, bool]] = [{} for _ in self.tiers]
        self._thread = threading.Thread(target=self._run, name="cf_ray-maintenance", daemon=True)
        self._thread.start()

    # -- called by the controller ----------------------------------------------------------------------
    def after_commit(self, step: int, m: mf.Manifest) -> None:
        """A checkpoint committed: upload it (if it goes to the tiers), then clean up."""
        with self._cond:
            self._commits_since_scan += 1
            self._dirty = True
            self._retain_due = True
            if self.tiers and not (self.upload_milestones_only and not m.milestone):
                self._enqueue_upload(_Upload(step, m))
            self._cond.notify_all()

    def _enqueue_upload(self, up: _Upload) -> None:
        limit = max(1, _env.get_int(_env.UPLOAD_QUEUE))
        if len(self._uploads) >= limit:
            victim = next((u for u in self._uploads if not u.manifest.milestone), None)
            if victim is None and not up.manifest.milestone:
                victim = up
            if victim is not None:
                if victim is not up:
                    self._uploads.remove(victim)
                logger.warning(
                    "cf_ray: the upload queue is full (%d, %s): step %d is not uploaded; storage is "
                    "the truth (raise %s, or upload milestones only)",
                    limit,
                    _env.UPLOAD_QUEUE,
                    victim.step,
                    _env.UPLOAD_QUEUE,
                )
                self._book.add_event(
                    {"event": "upload_dropped", "step": victim.step, "reason": "upload queue full", "time": time.time()}
                )
                if victim is up:
                    return
        self._uploads.append(up)

    def defer_deletions(self) -> None:
        """A restore plan is out: until :meth:`resume_deletions`, keep-last deletes nothing."""
        self._restoring = True

    def resume_deletions(self) -> None:
        """The attempt has restored: clean up again, starting with what was deferred."""
        self._restoring = False
        with self._cond:
            self._retain_due = self._retain_tiers_due = self._scan_forced = True
            self._cond.notify_all()

    def profile_batch_ready(self) -> None:
        """Rows left the profile's memory: write them as a part."""
        with self._cond:
            self._parts_due = True
            self._cond.notify_all()

    def run_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once on this thread (rare work: the clean-up of old profile parts)."""
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
            running = [] if self._uploading is None else [self._uploading]
            return running + [u.step for u in self._uploads]

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
            left = [u.step for u in self._uploads]
            self._uploads.clear()
            self._cond.notify_all()
        if left:
            logger.warning(
                "cf_ray: the controller stops with uploads of steps %s not done; they are committed on "
                "the primary storage",
                left,
            )

    # -- the thread ---------------------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._retain_due or self._parts_due or self._uploads or self._once or self._retain_tiers_due)

    def _periodic_due(self) -> bool:
        return (
            self._periodic is not None and self._dirty and time.monotonic() - self._last_periodic >= self._periodic[0]
        )

    def _next_task(self) -> Callable[[], None] | None:
        """The next thing to do (under ``_cond``); ``None`` when the thread should end."""
        while not self._stopping.is_set():
            if self._retain_due or self._retain_tiers_due:
                tiers, force = self._retain_tiers_due, self._scan_forced
                self._retain_due = self._retain_tiers_due = self._scan_forced = False
                return lambda: self._retain_all(tiers, force)
            if self._parts_due:
                self._parts_due = False
                return lambda: self._book.write_parts(self._lock)
            if self._once:
                return self._once.popleft()
            if self._uploads:
                up = self._uploads.popleft()
                self._uploading = up.step
                return lambda: self._upload(up)
            if self._periodic is not None and self._periodic_due():
                self._dirty = False
                self._last_periodic = time.monotonic()
                return self._periodic[1]
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
                    self._uploading = None
                    self._cond.notify_all()

    def _protected(self) -> set[int]:
        """Steps keep-last must not delete now: their upload is queued or running."""
        with self._cond:
            return {u.step for u in self._uploads} | ({self._uploading} if self._uploading is not None else set())

    def _retain_all(self, tiers: bool, force_scan: bool) -> None:
        self._retain(force_scan)
        if tiers:
            for i, tier in enumerate(self.tiers):
                self._retain_in(i, tier)

    # -- uploads --------------------------------------------------------------------------------------------
    def _upload(self, up: _Upload) -> None:
        for i, tier in enumerate(self.tiers):
            if self._upload_to(tier, up):
                self._tier_milestones[i][up.step] = up.manifest.milestone
                self._retain_in(i, tier)

    def _upload_to(self, tier: Storage, up: _Upload) -> bool:
        step, m = up.step, up.manifest
        directory = mf.step_dir(step)
        delay = max(0.0, _env.get_float(_env.UPLOAD_BACKOFF_S))
        tries = max(1, _env.get_int(_env.UPLOAD_RETRIES))
        for attempt in range(1, tries + 1):
            t0 = time.perf_counter()
            try:
                for name, info in m.files.items():
                    got = tier.write_file(f"{directory}/{name}", _stream(self.storage, f"{directory}/{name}"))
                    if got != info:
                        raise _Permanent(f"upload of {name} to {tier.uri()} wrote {got}, the manifest says {info}")
                mf.commit(tier, directory, m)  # the tier's own commit marker, written last
            except (
                _Permanent,
                CorruptCheckpointError,
                UnsafePathError,
                FileNotFoundError,
                IsADirectoryError,
                NotADirectoryError,
                PermissionError,
            ) as e:
                return self._upload_failed(step, tier, e)
            except OSError as e:  # transient: a network error, a throttled bucket, a full disk being cleaned
                if attempt >= tries or self._stopping.is_set():
                    return self._upload_failed(step, tier, e)
                logger.warning(
                    "cf_ray: upload of step %d to %s failed (try %d of %d), again in %.1f s: %s",
                    step,
                    tier.uri(),
                    attempt,
                    tries,
                    delay,
                    e,
                )
                if self._stopping.wait(delay):
                    return self._upload_failed(step, tier, e)
                delay = min(MAX_BACKOFF_S, max(delay * 2, 0.05))
                continue
            except Exception as e:  # noqa: BLE001
                return self._upload_failed(step, tier, e)
            self._book.add_event(
                {
                    "event": "upload",
                    "step": step,
                    "tier": tier.uri(directory),
                    "seconds": time.perf_counter() - t0,
                    "time": time.time(),
                }
            )
            return True
        return False

    def _upload_failed(self, step: int, tier: Storage, e: BaseException) -> bool:
        logger.warning("cf_ray: upload of step %d to %s failed: %s", step, tier.uri(), e)
        self._book.add_event(
            {"event": "upload_failed", "step": step, "tier": tier.uri(), "error": str(e), "time": time.time()}
        )
        return False

    # -- clean-up -----------------------------------------------------------------------------------------
    def _retain(self, force_scan: bool = False) -> None:
        protected = self._protected()
        doomed: list[int] = []
        with self._lock:
            if self._restoring:
                return  # deferred until restored()
            committed_index = self._commits.committed
            if self.keep_last is not None:
                committed = [(s, c.milestone) for s, c in committed_index.items()]
                doomed = [s for s in mf.to_delete(committed, self.keep_last) if s not in protected]
                # The index is updated *before* deleting, so a concurrent restore plan never names a
                # checkpoint that is being deleted (the same order as Ray's checkpoint manager).
                for s in doomed:
                    self._commits.remove_committed(s)
            newest = self._commits.newest_step()
        for s in doomed:
            _delete(self.storage, mf.step_dir(s))
        if newest is None:
            return
        with self._cond:
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
        # (a step committed since the listing was deleted here once — a milestone, in CI). A step
        # this controller has no record of may be one whose part_staged has not run yet (the actor
        # is threaded): it is deleted only if a later pass still finds it unknown and uncommitted.
        leftovers = mf.list_uncommitted(self.storage)
        with self._lock:
            committed_index = self._commits.committed
            self._last_listing = len(leftovers) + len(committed_index)
            states = self._commits.states_by_step()
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
            _delete(self.storage, f"{mf.CHECKPOINTS}/{name}")

    def _retain_in(self, i: int, tier: Storage) -> None:
        if self._restoring or self.keep_last is None:
            return  # deferred until restored(); or nothing to delete
        known = self._tier_milestones[i]
        committed = []
        steps = [c for c in mf.list_committed(tier)]
        for c in steps:
            if c.step not in known:
                try:
                    known[c.step] = mf.read_manifest(tier, c.path).milestone
                except Exception:  # noqa: BLE001
                    continue
            committed.append((c.step, known[c.step]))
        listed = {c.step for c in steps}
        for s in [s for s in known if s not in listed]:
            del known[s]
        for s in mf.to_delete(committed, self.keep_last):
            _delete(tier, mf.step_dir(s))
            known.pop(s, None)


def _stream(storage: Storage, path: str) -> Iterator[memoryview | bytes]:
    """A file of ``storage`` in ``CF_RAY_WRITE_CHUNK_BYTES`` chunks, read as it is consumed (a
    pyarrow input stream when the storage has one), never whole in memory."""
    if is_symlink(storage, path):
        raise UnsafePathError(f"refusing to upload {storage.uri(path)}: it is a symbolic link")
    size = max(1, _env.get_int(_env.WRITE_CHUNK_BYTES))
    fs, fs_path = getattr(storage, "fs", None), getattr(storage, "fs_path", None)
    if fs is None or not callable(fs_path):
        yield from chunked(storage.read_file(path), size)
        return
    with fs.open_input_stream(fs_path(path)) as f:
        while True:
            buf = f.read_buffer(size)
            if buf is None or buf.size == 0:
                return
            yield memoryview(buf)


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
