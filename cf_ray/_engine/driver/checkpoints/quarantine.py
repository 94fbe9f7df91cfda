"""What the controller takes out of use, and only on its own evidence.

* **A committed checkpoint** is quarantined — taken out of the committed index (restore plans no
  longer name it, keep-last no longer counts nor deletes it), listed in ``quarantine.json`` with the
  reason and its generation (a later generation's commit of the same step is another checkpoint,
  not quarantined), kept on storage for inspection — only when the controller itself re-reads it and finds it
  damaged: its manifest unreadable, a file missing, or a file whose size or CRC-32 differs from the
  manifest's. A rank's read error is a *suspicion* (:meth:`Quarantine.suspect`): the re-read runs
  on the maintenance thread, off the RPC lock, and a checkpoint that reads back intact (a transient
  missing file, a flaky link) is logged and left as it is. A storage that cannot be read at all
  right now proves nothing either way: logged, left.
* **An in-memory snapshot** whose bytes failed a restore's verification (a block CRC or the
  fingerprints after loading: a ``restore_fallback`` event from memory, as the worker's restore
  reports it) is never offered to a later attempt's restore plan (:meth:`Quarantine.distrust`).
* **A suspect snapshot** (the run went non-finite after restoring it: trust-gated recovery) is
  distrusted through the same call, ``Controller.distrust(generation, step, reason)``, by the
  worker: its in-memory copies are never offered again, and when it was committed, the checkpoint
  is quarantined with the reason (no re-read: the bytes verify, the state they hold is what is
  suspect).

Each is an event (``quarantined``, ``distrusted``, ``verified``), a log line, and a metric
(``cf_ray_taken_out_total``). The distrusted snapshots are remembered in the controller's state on
storage (``control_state.json``), so a controller that starts again never offers them either.

Thread safety: the quarantine list has a lock of its own (``quarantine.json`` is written under it,
in order, never under the controller's lock); the committed index and the memory candidates are
changed under the controller's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from cf_ray._engine import env as _env
from cf_ray._engine.driver.checkpoints.commits import CommitBook
from cf_ray._engine.format.catalog import QUARANTINE, Quarantined, load_quarantine_entries, write_quarantine
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import MANIFEST, step_dir
from cf_ray._engine.observe.profile_book import ProfileBook
from cf_ray._engine.protocol.events import (
    DistrustedEvent,
    Event,
    QuarantinedEvent,
    QuarantineLiftedEvent,
    VerifiedEvent,
)
from cf_ray._engine.protocol.messages import Distrusted
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CheckpointNotFoundError, CorruptCheckpointError

try:  # the same CRC-32 as zlib's, faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency
    from zlib import crc32 as _crc32

logger = logging.getLogger("cf_ray")


class CannotTell(Exception):
    """Storage could not be read now (not a missing file, not damage): the re-read proves nothing."""


def damage_of(storage: Storage, step: int) -> str | None:
    """Re-read the committed checkpoint of ``step`` whole: what is wrong with it, or ``None`` when its
    manifest and every file it lists are there with their sizes and CRC-32s. Files are read in
    ``env.WRITE_CHUNK_BYTES`` ranges when the storage can (never a whole file in memory).

    Raises:
        CannotTell: storage could not be read (an I/O error other than a missing file).
    """
    directory = step_dir(step)
    try:
        m = read_manifest(storage, directory)
    except CheckpointNotFoundError:
        return f"its manifest {storage.uri(directory)}/{MANIFEST} is missing"
    except CorruptCheckpointError as e:
        return str(e)
    except OSError as e:
        raise CannotTell(f"{type(e).__name__}: {e}") from e
    for name, info in m.files.items():
        path = f"{directory}/{name}"
        try:
            size, crc = _size_and_crc(storage, path)
        except FileNotFoundError:
            return f"{storage.uri(path)} is missing"
        except (IsADirectoryError, NotADirectoryError) as e:
            return f"{storage.uri(path)} is not a file: {e}"
        except OSError as e:
            raise CannotTell(f"{type(e).__name__}: {e}") from e
        if size != info.size:
            return f"{storage.uri(path)} has {size} bytes, the manifest says {info.size}"
        if crc != info.crc32:
            return f"{storage.uri(path)} fails its checksum (crc32 {crc:#x} != {info.crc32:#x})"
    return None


def _size_and_crc(storage: Storage, path: str) -> tuple[int, int]:
    if not storage.ranged_reads:
        buf = storage.read_file(path)
        return int(buf.nbytes), _crc32(buf.data)
    chunk = max(1, _env.WRITE_CHUNK_BYTES)
    size = crc = 0
    while True:
        buf = np.asarray(storage.read_range(path, size, chunk), dtype=np.uint8)
        crc = _crc32(buf.data, crc)
        size += int(buf.nbytes)
        if buf.nbytes < chunk:
            return size, crc


class Quarantine:
    """The quarantined checkpoints and the distrusted snapshots of one run.

    Args:
        storage: the run's storage (``quarantine.json`` and the checkpoints re-read).
        lock: the controller's lock (the committed index, the memory candidates and the events).
        commits: the commit bookkeeping (the index and the memory candidates).
        book: where events go.
        run_soon: runs a function on the maintenance thread (the re-reads).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        lock: threading.RLock,
        commits: CommitBook,
        book: ProfileBook,
        run_soon: Callable[[Callable[[], None]], None],
    ):
        self.storage = storage
        self._lock = lock
        self._commits = commits
        self._book = book
        self._run_soon = run_soon
        self._file_lock = threading.Lock()  # quarantine.json, written in order
        self.entries: dict[int, Quarantined] = load_quarantine_entries(storage)
        """step -> the checkpoint quarantined (its generation) and why, as ``quarantine.json`` lists
        them (under its own lock)."""

    # -- committed checkpoints --------------------------------------------------------------------------
    def suspect(self, step: int, error: str) -> None:
        """A rank could not read the committed checkpoint of ``step`` (damage, a missing file): re-read
        it on the maintenance thread and quarantine it only if it is damaged."""
        self._run_soon(lambda: self._verify_quietly(step, error))

    def _verify_quietly(self, step: int, error: str) -> None:
        self.verify(step, error)

    def verify(self, step: int, error: str) -> bool:
        """Re-read ``step`` (storage I/O: never under the controller's lock); quarantine it when it is
        damaged. Returns whether it was quarantined."""
        with self._lock:
            known = step in self._commits.index
        if not known:
            return False  # already out of the index (deleted by keep-last, or quarantined)
        try:
            damage = damage_of(self.storage, step)
        except CannotTell as e:
            logger.warning(
                "cf_ray: a restore could not read checkpoint step %d (%s); re-reading it failed too (%s): "
                "left as it is (nothing proves it damaged)",
                step,
                error,
                e,
            )
            self._event(VerifiedEvent(step=step, intact=None, error=error, reread=str(e)))
            return False
        if damage is None:
            logger.warning(
                "cf_ray: a restore could not read checkpoint step %d (%s), but it reads back intact (every "
                "file's size and CRC-32 as its manifest says): not quarantined",
                step,
                error,
            )
            self._event(VerifiedEvent(step=step, intact=True, error=error))
            return False
        return self.quarantine(step, damage, damaged=True)

    def quarantine(self, step: int, why: str, generation: int | None = None, *, damaged: bool = False) -> bool:
        """Take the committed checkpoint of ``step`` (of ``generation`` when given) out of use, with
        ``why`` (``damaged``: for damaged bytes, which a re-commit lifts); ``True`` when it was in
        the committed index."""
        why = str(why)[:500]
        with self._lock:
            c = self._commits.index.get(step)
            if c is None or not self._commits.quarantine(step, why, generation):
                return False
            self._book.add_event(QuarantinedEvent(step=step, generation=c.generation, error=why, time=time.time()))
        with self._file_lock:
            # Of that generation's checkpoint alone: a later generation's commit of the step is not it.
            self.entries[step] = Quarantined(why, c.generation, damaged)
            try:
                write_quarantine(self.storage, dict(self.entries))
            except Exception as e:  # noqa: BLE001 - the index is already right; the file only outlives us
                logger.warning("cf_ray: could not write %s: %s", QUARANTINE, e)
        logger.warning(
            "cf_ray: checkpoint step %s (generation %d) quarantined (kept on storage, never restored from "
            "again, not counted by keep-last): %s",
            step,
            c.generation,
            why,
        )
        return True

    def recommitted(self, step: int, generation: int) -> None:
        """Step ``step`` was committed again, by ``generation`` (called under the controller's lock,
        after the commit): a quarantine of an earlier checkpoint of that step no longer applies —
        its manifest was replaced by the new one, a checkpoint of its own (a quarantined
        ``(generation, step)`` is never committed again). That holds whether the earlier one was
        damaged or its state suspect (trust-gated recovery: the next generation replays the step;
        should its state go non-finite again, the trust gate distrusts that checkpoint in turn). The
        entry leaves ``quarantine.json`` on the maintenance thread; until then, and if the controller
        dies first, readers already see the new checkpoint (the entry names the old generation).
        Keyed by step alone, every later listing (a new controller, a new driver, ``cf-ray ls``,
        ``resume_from``) would hide the new checkpoint, and keep-last would never delete it."""
        with self._file_lock:
            q = self.entries.get(step)
            if q is None or q.generation == generation:
                return
        self._run_soon(lambda: self._lift(step, generation))

    def _lift(self, step: int, generation: int) -> None:
        with self._file_lock:
            q = self.entries.get(step)
            if q is None or q.generation == generation:
                return
            del self.entries[step]
            why = q.why
            try:
                write_quarantine(self.storage, dict(self.entries))
            except Exception as e:  # noqa: BLE001 - the index is already right; the file only outlives us
                logger.warning("cf_ray: could not write %s: %s", QUARANTINE, e)
        self._event(QuarantineLiftedEvent(step=step, generation=generation, was=why))
        logger.warning(
            "cf_ray: checkpoint step %d committed again (generation %d): the quarantine of its earlier "
            "checkpoint (%s) is lifted",
            step,
            generation,
            why,
        )

    # -- in-memory snapshots ------------------------------------------------------------------------------
    def distrust(self, generation: int, step: int, reason: str, *, source: str = "") -> Distrusted:
        """Never offer the in-memory snapshot ``(generation, step)`` to a restore plan again; when that
        snapshot was committed, quarantine the checkpoint too (``source``: where the suspicion came
        from, for the event: ``memory`` for a failed verification, ``""`` for the worker's call)."""
        generation, step, reason = int(generation), int(step), str(reason)[:500]
        with self._lock:
            self._commits.distrust(generation, step)
            self._book.add_event(
                DistrustedEvent(generation=generation, step=step, reason=reason, source=source, time=time.time())
            )
        logger.warning(
            "cf_ray: the snapshot of step %d (generation %d) is never offered to a restore again: %s",
            step,
            generation,
            reason,
        )
        quarantined = False if source == "memory" else self.quarantine(step, reason, generation)
        return Distrusted(generation=generation, step=step, memory=True, quarantined=quarantined)

    def _event(self, event: Event) -> None:
        with self._lock:
            self._book.add_event(event.stamped(time.time()))


__all__ = ["CannotTell", "Quarantine", "damage_of"]
