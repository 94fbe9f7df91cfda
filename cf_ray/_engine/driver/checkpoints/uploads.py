"""Copies of committed checkpoints to the upload tiers, on the maintenance thread.

A bounded queue (``env.UPLOAD_QUEUE``; when full, the oldest queued upload that is not a milestone is
dropped, with a warning and an ``upload_dropped`` event); each file is streamed from the primary
storage in ``env.WRITE_CHUNK_BYTES`` chunks (pyarrow input streams, so memory stays a few chunks
whatever the checkpoint's size) through the tier's ``write_file``, whose size and CRC-32 must be the
manifest's; a transient error (``OSError``) is retried with exponential backoff (``env.UPLOAD_RETRIES``,
``env.UPLOAD_BACKOFF_S``); the tier's manifest is written last. Keep-last never deletes a step whose
upload is queued or running (:meth:`Uploads.protected`). :meth:`Uploads.pending` says what is left
(``Checkpointer.finish`` waits on it).

The queue is guarded by the maintenance thread's condition (shared); the uploads themselves run on
that thread without it and without the controller's lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cf_ray._engine import env as _env
from cf_ray._engine.format.catalog import list_committed
from cf_ray._engine.format.commit import Manifest, commit
from cf_ray._engine.format.layout import step_dir
from cf_ray._engine.observe.profile_book import ProfileBook
from cf_ray._engine.protocol.events import UploadDroppedEvent, UploadEvent, UploadFailedEvent
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CorruptCheckpointError, UnsafePathError

logger = logging.getLogger("cf_ray")

#: The longest wait between two tries of an upload.
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True, slots=True)
class Upload:
    """One committed checkpoint to copy to the tiers."""

    step: int
    manifest: Manifest


class _Permanent(Exception):
    """An upload error that a retry cannot fix (the source is damaged, unsafe or gone)."""


class Uploads:
    """The upload queue and the uploads.

    Args:
        storage: the run's (primary) storage.
        tiers: upload destinations (``Storage``), fastest first.
        milestones_only: copy only milestones.
        book: where uploads are recorded as events.
        cond: the maintenance thread's condition, which guards the queue.
        stopping: set when the maintenance thread stops (a retry's wait ends).
        uploaded: called with ``(tier index, step, milestone)`` after each successful upload.
    """

    def __init__(
        self,
        storage: Storage,
        tiers: list,
        *,
        milestones_only: bool,
        book: ProfileBook,
        cond: threading.Condition,
        stopping: threading.Event,
        uploaded: Callable[[int, int, bool], None],
    ):
        self.storage = storage
        self.tiers: list[Storage] = list(tiers)
        self.milestones_only = milestones_only
        self._book = book
        self._cond = cond
        self._stopping = stopping
        self._uploaded = uploaded
        self._queue: collections.deque[Upload] = collections.deque()
        self._running: int | None = None

    # -- the queue (under the condition) -------------------------------------------------------------------
    def wanted(self, m: Manifest) -> bool:
        return bool(self.tiers) and not (self.milestones_only and not m.milestone)

    def enqueue(self, up: Upload) -> None:
        """Queue ``up`` (under the condition); when the queue is full, drop the oldest ordinary one."""
        self._enqueue_upload(up)

    def _enqueue_upload(self, up: Upload) -> None:
        limit = max(1, _env.UPLOAD_QUEUE)
        if len(self._queue) >= limit:
            victim = next((u for u in self._queue if not u.manifest.milestone), None)
            if victim is None and not up.manifest.milestone:
                victim = up
            if victim is not None:
                if victim is not up:
                    self._queue.remove(victim)
                logger.warning(
                    "cf_ray: the upload queue is full (%d, %s): step %d is not uploaded; storage is "
                    "the truth (upload milestones only, or to a faster tier)",
                    limit,
                    "env.UPLOAD_QUEUE",
                    victim.step,
                )
                self._book.add_event(UploadDroppedEvent(step=victim.step, reason="upload queue full", time=time.time()))
                if victim is up:
                    return
        self._queue.append(up)

    def take(self) -> Upload | None:
        """The next upload, now running (under the condition)."""
        if not self._queue:
            return None
        up = self._queue.popleft()
        self._running = up.step
        return up

    def done(self) -> None:
        """The running upload ended (under the condition)."""
        self._running = None

    def has_work(self) -> bool:
        return bool(self._queue)

    def pending(self) -> list[int]:
        """Steps whose upload is queued or running, oldest first (under the condition)."""
        running = [] if self._running is None else [self._running]
        return running + [u.step for u in self._queue]

    def protected(self) -> set[int]:
        """Steps keep-last must not delete now (under the condition)."""
        return {u.step for u in self._queue} | ({self._running} if self._running is not None else set())

    def drop_all(self) -> list[int]:
        """Forget what is queued (the controller stops); returns those steps (under the condition)."""
        left = [u.step for u in self._queue]
        self._queue.clear()
        return left

    # -- the uploads (on the maintenance thread, without any lock) ------------------------------------------
    def run(self, up: Upload) -> None:
        for i, tier in enumerate(self.tiers):
            if self._upload_to(tier, up):
                self._uploaded(i, up.step, up.manifest.milestone)

    def _upload_to(self, tier: Storage, up: Upload) -> bool:
        step, m = up.step, up.manifest
        directory = step_dir(step)
        delay = max(0.0, _env.UPLOAD_BACKOFF_S)
        tries = max(1, _env.UPLOAD_RETRIES)
        for attempt in range(1, tries + 1):
            t0 = time.perf_counter()
            try:
                for name, info in m.files.items():
                    got = tier.write_file(f"{directory}/{name}", _stream(self.storage, f"{directory}/{name}"))
                    if got != info:
                        raise _Permanent(f"upload of {name} to {tier.uri()} wrote {got}, the manifest says {info}")
                commit(tier, directory, m)  # the tier's own commit marker, written last
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
                UploadEvent(step=step, tier=tier.uri(directory), seconds=time.perf_counter() - t0, time=time.time())
            )
            return True
        return False

    def _upload_failed(self, step: int, tier: Storage, e: BaseException) -> bool:
        logger.warning("cf_ray: upload of step %d to %s failed: %s", step, tier.uri(), e)
        self._book.add_event(UploadFailedEvent(step=step, tier=tier.uri(), error=str(e), time=time.time()))
        return False


def _stream(storage: Storage, path: str) -> Iterator[memoryview | bytes]:
    """A file of ``storage`` in ``env.WRITE_CHUNK_BYTES`` chunks, read as it is consumed where the
    backend streams (``Storage.read_chunks``)."""
    if storage.is_symlink(path):
        raise UnsafePathError(f"refusing to upload {storage.uri(path)}: it is a symbolic link")
    yield from storage.read_chunks(path, max(1, _env.WRITE_CHUNK_BYTES))


def tier_steps(tiers: list[Storage]) -> tuple[tuple[int, ...], ...]:
    """The committed steps on each upload tier, newest first (empty for a tier that cannot be listed)."""
    out = []
    for tier in tiers:
        try:
            out.append(tuple(sorted((c.step for c in list_committed(tier)), reverse=True)))
        except Exception as e:  # noqa: BLE001 - an unreachable tier is not a reason to fail a restore
            logger.warning("cf_ray: cannot list upload tier %s: %s", tier.uri(), e)
            out.append(())
    return tuple(out)


__all__ = ["MAX_BACKOFF_S", "Upload", "Uploads", "tier_steps"]
