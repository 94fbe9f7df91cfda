"""The committed checkpoints of a run's root: finding the run a path names, listing its checkpoints
(safely: a link or an unreadable entry is skipped with a warning), the quarantine list of those a
restore found corrupt, and keep-last."""

from __future__ import annotations

import json
import logging
import os
import posixpath
from dataclasses import dataclass
from typing import Any

from cf_ray._engine.format.commit import Manifest, UnsafeCheckpointError, _uri, read_manifest, read_pointer
from cf_ray._engine.format.layout import CHECKPOINTS, DIR_RE, MANIFEST, POINTER, REGISTERED, RESUME_KEY, step_dir
from cf_ray._engine.storage.backends import open_storage
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CfRayError, CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError

logger = logging.getLogger("cf_ray")


@dataclass(frozen=True, slots=True)
class CommittedCheckpoint:
    """A committed checkpoint found in storage."""

    name: str
    """Directory name, e.g. ``step_000000000120``."""
    kind: str
    """``step`` (resumable) or ``final`` (model weights only)."""
    step: int
    """Optimizer steps taken when it was written."""

    @property
    def path(self) -> str:
        return f"{CHECKPOINTS}/{self.name}"


#: Committed checkpoints taken out of use (a restore found them corrupt, or their state suspect):
#: ``{"version": 1, "steps": {"<step>": "<why>"}, "damaged": [<step>, ...], "generations": {"<step>":
#: <generation>}}`` at the run's root. A quarantine is of one checkpoint, ``(generation, step)``: a
#: later generation's commit of the same step replaces that checkpoint's manifest and is not
#: quarantined (a step without a generation, written before they were saved, is quarantined whatever
#: its checkpoint's generation). A quarantined checkpoint stays on storage for inspection, is never
#: restored from again, never counts toward keep-last, and is never deleted by it.
QUARANTINE = "quarantine.json"


@dataclass(frozen=True, slots=True)
class Quarantined:
    """One entry of :data:`QUARANTINE`."""

    why: str
    generation: int | None
    """The generation whose checkpoint of the step is quarantined (``None``: any, an older file)."""
    damaged: bool
    """Quarantined for damaged bytes (the controller's own re-read), not for a suspect state."""


def load_quarantine(storage: Storage) -> dict[int, str]:
    """The steps whose checkpoint on storage is quarantined, and why (empty when there is no file; a
    damaged file is reported). A step committed again since by another generation is not among
    them: its manifest (read for the steps listed only) names a generation not quarantined."""
    out = {}
    for step, q in load_quarantine_entries(storage).items():
        if q.generation is not None:
            try:
                if read_manifest(storage, step_dir(step)).generation != q.generation:
                    continue  # replaced by another generation's commit: that one is not quarantined
            except (CfRayError, OSError):
                pass  # gone or unreadable: still quarantined (nothing else there to restore)
        out[step] = q.why
    return out


def load_quarantine_entries(storage: Storage) -> dict[int, Quarantined]:
    """Every entry of :data:`QUARANTINE` as written (empty when there is no file; a damaged file is
    reported), whether or not a later commit replaced its checkpoint."""
    try:
        if not storage.exists(QUARANTINE):
            return {}
        raw = json.loads(bytes(storage.read_file(QUARANTINE)))
        steps = {int(k): str(v) for k, v in raw["steps"].items()}
        damaged = {int(s) for s in raw.get("damaged", ())}
        gens = {int(k): int(v) for k, v in raw.get("generations", {}).items()}
        return {s: Quarantined(why, gens.get(s), s in damaged) for s, why in steps.items()}
    except Exception as e:  # noqa: BLE001 - a damaged list quarantines nothing; say so
        logger.warning("cf_ray: cannot read %s (%s); no checkpoint is quarantined", storage.uri(QUARANTINE), e)
        return {}


def write_quarantine(storage: Storage, entries: dict[int, Quarantined]) -> None:
    """Write the quarantine list (storage I/O: never under the controller's lock)."""
    body = {
        "version": 1,
        "steps": {str(k): q.why for k, q in sorted(entries.items())},
        "damaged": sorted(s for s, q in entries.items() if q.damaged),
        "generations": {str(k): q.generation for k, q in sorted(entries.items()) if q.generation is not None},
    }
    storage.write_file(QUARANTINE, [json.dumps(body).encode()])


def list_committed(
    storage: Storage, *, kinds: tuple[str, ...] = ("step",), skip_quarantined: bool = False
) -> list[CommittedCheckpoint]:
    """Committed checkpoints (those with a manifest), oldest first; ``skip_quarantined``: without the
    step checkpoints listed in :data:`QUARANTINE` (found corrupt by a restore; never restored from).

    An entry that is unsafe (a symbolic link, a path that leaves the root) or cannot be examined is
    skipped with one warning naming it: one bad entry never stops a listing, a restore or a run.
    """
    out = []
    for name in storage.list_dir(CHECKPOINTS):
        m = DIR_RE.match(name)
        if not m or m.group(1) not in kinds:
            continue
        if _has_manifest(storage, name) is True:
            out.append(CommittedCheckpoint(name, m.group(1), int(m.group(2))))
    out.sort(key=lambda c: (c.step, c.kind))
    if skip_quarantined and out:
        quarantined = load_quarantine(storage)
        out = [c for c in out if not (c.kind == "step" and c.step in quarantined)]
    return out


def registered_steps(storage: Storage) -> set[int]:
    """The steps whose pointer directory (``registered/step_<n>``, :func:`.layout.pointer_dir`) is on
    storage: the checkpoints Ray Train lists. A name of another shape is not a pointer of cf_ray's."""
    return {int(m.group(2)) for m in map(DIR_RE.match, storage.list_dir(REGISTERED)) if m and m.group(1) == "step"}


def list_uncommitted(storage: Storage) -> list[tuple[str, int]]:
    """Checkpoint directories without a manifest: (name, step). Unsafe or unreadable entries are
    skipped as in :func:`list_committed` (and so never deleted through a link)."""
    out = []
    for name in storage.list_dir(CHECKPOINTS):
        m = DIR_RE.match(name)
        if m and _has_manifest(storage, name) is False:
            out.append((name, int(m.group(2))))
    return out


def _has_manifest(storage: Storage, name: str) -> bool | None:
    """Whether ``checkpoints/<name>`` holds a manifest; None (after a warning) when the entry is a
    symbolic link, leads out of the root, or cannot be examined."""
    directory = f"{CHECKPOINTS}/{name}"
    try:
        for path in (directory, f"{directory}/{MANIFEST}"):
            if storage.is_symlink(path):
                raise UnsafeCheckpointError(f"{path} is a symbolic link")
        return storage.exists(f"{directory}/{MANIFEST}")
    except (UnsafePathError, OSError) as e:
        _warn_skipped(storage, name, e)
        return None


#: Entries already reported by _warn_skipped: listings run after every commit, one warning is enough.
_WARNED: set[tuple[str, str]] = set()


def _warn_skipped(storage: Storage, name: str, error: Exception) -> None:
    where = _uri(storage, CHECKPOINTS)
    if (where, name) in _WARNED:
        return
    if len(_WARNED) > 10_000:
        _WARNED.clear()
    _WARNED.add((where, name))
    logger.warning(
        "cf_ray: skipped the entry %s/%s of the checkpoint listing, which is unsafe or unreadable "
        "(%s: %s); it is not used as a checkpoint and not deleted",
        where,
        name,
        type(error).__name__,
        error,
    )


def to_delete(committed: list[tuple[int, bool]], keep_last: int | None) -> list[int]:
    """Steps to delete under keep-last-N; milestones and the newest are never chosen.

    Args:
        committed: (step, milestone) of every committed checkpoint.
        keep_last: how many non-milestone checkpoints to keep; None keeps all.
    """
    if keep_last is None:
        return []
    ordinary = sorted(s for s, milestone in committed if not milestone)
    newest = max((s for s, _ in committed), default=None)
    doomed = ordinary[:-keep_last] if keep_last > 0 else ordinary
    return [s for s in doomed if s != newest]


# -- the run a path names ------------------------------------------------------------------------------
def open_run(source: Any, filesystem: Any = None) -> tuple[Storage, str | None]:
    """(storage at the run's cf_ray root, a checkpoint directory under it or None).

    ``source`` may be: a run directory (``<storage_path>/<name>``), its ``cf_ray`` root, one
    checkpoint's directory (``.../checkpoints/step_000000000120``), as a local path or a URI, or a
    ``ray.train.Checkpoint`` (``result.checkpoint``, or one of ``result.best_checkpoints``, which
    are pointers to checkpoints). The path is read by its names alone, so any backend that
    :func:`~cf_ray._engine.storage.backends.open_storage` opens serves: ``filesystem`` goes with it.

    Raises:
        TypeError: ``source`` is neither a string nor a ``ray.train.Checkpoint``.
    """
    if hasattr(source, "path") and hasattr(source, "filesystem"):  # ray.train.Checkpoint
        filesystem, source = source.filesystem, source.path
    if not isinstance(source, str):
        raise TypeError(f"expected a path, a URI or a ray.train.Checkpoint, got {type(source).__name__}")
    if filesystem is None and "://" not in source:
        source = os.path.abspath(os.path.expanduser(source))  # its names, whatever the working directory
    path = source.rstrip("/") or "/"
    base, parent = posixpath.basename(path), posixpath.basename(posixpath.dirname(path))
    if parent == REGISTERED:  # what was registered with Ray Train: a pointer
        pointer = open_storage(path, filesystem)
        if pointer.exists(POINTER):
            run = open_storage(posixpath.dirname(posixpath.dirname(path)), filesystem)
            return run, read_pointer(pointer.read_file(POINTER))
    if DIR_RE.match(base) and parent == CHECKPOINTS:
        return open_storage(posixpath.dirname(posixpath.dirname(path)), filesystem), f"{CHECKPOINTS}/{base}"
    run = open_storage(path, filesystem)
    if base != "cf_ray" and run.exists(f"cf_ray/{CHECKPOINTS}"):
        run = run.child("cf_ray")
    return run, None


def resumable_checkpoint(source: Any, filesystem: Any = None) -> tuple[Storage, str]:
    """(the run's storage, the full checkpoint's directory) that ``source`` names or points at: a
    run (its newest committed checkpoint), a checkpoint directory, a pointer registered with Ray
    Train, or a final model (``result.checkpoint``), followed to the full checkpoint its manifest
    names (written by ``Checkpointer.finish()``).

    Raises:
        CheckpointNotFoundError: no committed full checkpoint there (or the one a final model names
            is gone).
        CorruptCheckpointError: a damaged manifest or pointer.
    """
    run, directory = open_run(source, filesystem)
    if directory is None:
        committed = list_committed(run, skip_quarantined=True)
        if not committed:
            raise CheckpointNotFoundError(f"no committed cf_ray checkpoint under {run.uri()}")
        directory = committed[-1].path
    m = read_manifest(run, directory)
    if m.final_model:
        directory = full_checkpoint_of_final(run, directory, m)
        read_manifest(run, directory)  # it must still be there (CheckpointNotFoundError otherwise)
    return run, directory


def full_checkpoint_of_final(run: Storage, directory: str, m: Manifest) -> str:
    """The full checkpoint (``checkpoints/step_<n>``) that the final model at ``directory`` names.

    Raises:
        CheckpointNotFoundError: the final model names none.
        CorruptCheckpointError: it names something that is not a step checkpoint of this run.
    """
    target = m.extra.get(RESUME_KEY)
    if target is None:
        raise CheckpointNotFoundError(
            f"{run.uri(directory)} holds only the final model weights and names no full checkpoint of its run; "
            "resume from the run directory or a registered checkpoint instead"
        )
    name = target.removeprefix(f"{CHECKPOINTS}/") if isinstance(target, str) else ""
    match = DIR_RE.match(name)
    if not isinstance(target, str) or not target.startswith(f"{CHECKPOINTS}/") or not match or match.group(1) != "step":
        raise CorruptCheckpointError(
            f"the final model's manifest {run.uri(directory)} names {target!r} as its full "
            "checkpoint, which is not a checkpoint of this run"
        )
    return target
