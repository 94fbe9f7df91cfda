"""The committed index: the checkpoints on storage that a restore may read, as the controller knows
them (rebuilt from storage when a controller starts), and what a commit job writes and gets back.

Not thread-safe on its own: the controller changes it under its lock (the maintenance thread reads
it under the same lock); storage I/O (:func:`load_committed`, :func:`files_present`) is done without it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from cf_ray._engine.format.catalog import list_committed, load_quarantine
from cf_ray._engine.format.commit import Manifest, read_manifest
from cf_ray._engine.storage.fs import FileInfo, Storage

logger = logging.getLogger("cf_ray")


@dataclass(frozen=True, slots=True)
class Committed:
    """One entry of the committed index."""

    path: str
    """The checkpoint's directory, relative to the run's storage."""
    milestone: bool
    generation: int
    epoch: int
    resume_point: bool = False
    """A final model names it for ``resume_from=result.checkpoint`` (``Checkpointer.finish()``,
    :func:`resume_points`)."""

    @property
    def kept(self) -> bool:
        """Never deleted by keep-last: a milestone, or the resume point of a final model."""
        return self.milestone or self.resume_point


@dataclass(frozen=True, slots=True)
class CommitJob:
    """A complete step whose manifest is to be written, outside the controller's lock."""

    generation: int
    step: int
    manifest: Manifest
    directory: str
    verify_files: bool


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What writing a :class:`CommitJob` did."""

    commit_s: float = 0.0
    error: str | None = None
    """Why the manifest could not be written (the step fails)."""
    missing: bool = False
    """A resync-derived step whose files are gone (deleted by keep-last): abandoned, not failed."""


class CommittedIndex:
    """step -> :class:`Committed`, and the newest step.

    Args:
        committed: the index to start from (:func:`load_committed`).
    """

    def __init__(self, committed: dict[int, Committed]):
        self.entries = committed
        self._newest: int | None = max(committed) if committed else None

    def __contains__(self, step: int) -> bool:
        return step in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, step: int) -> Committed | None:
        return self.entries.get(step)

    def add(self, step: int, entry: Committed) -> None:
        self.entries[step] = entry
        if self._newest is None or step > self._newest:
            self._newest = step

    def remove(self, step: int) -> None:
        self.entries.pop(step, None)
        if step == self._newest:
            self._newest = max(self.entries) if self.entries else None

    def newest(self) -> int | None:
        return self._newest

    def keep_resume_point(self, step: int) -> int | None:
        """The final model is about to name ``step`` as the run's resume point: keep-last never deletes
        it (:attr:`Committed.resume_point`). When keep-last took ``step`` out already, the newest
        committed step is kept and named instead. Returns the step kept (``None``: none is committed)."""
        if step not in self.entries:
            if self._newest is None:
                return None
            step = self._newest
        self.entries[step] = dataclasses.replace(self.entries[step], resume_point=True)
        return step

    def steps(self, *, newest_first: bool = False) -> list[int]:
        return sorted(self.entries, reverse=newest_first)


def load_committed(storage: Storage) -> tuple[dict[int, Committed], int]:
    """The committed checkpoints on storage (step -> entry) and the newest generation among them
    (0 when there is none): what a controller that starts again rebuilds from storage. Quarantined
    steps (``quarantine.json``) are left out."""
    committed: dict[int, Committed] = {}
    gens = [0]
    quarantined = load_quarantine(storage)
    for c in list_committed(storage):
        if c.step in quarantined:
            continue
        try:
            m = read_manifest(storage, c.path)
        except Exception as e:  # noqa: BLE001 - a bad manifest is skipped, readers verify again
            logger.warning("cf_ray: ignoring %s: %s", c.path, e)
            continue
        committed[c.step] = Committed(path=c.path, milestone=m.milestone, generation=m.generation, epoch=m.epoch)
        gens.append(m.generation)
    for step in resume_points(storage):
        if step in committed:
            committed[step] = dataclasses.replace(committed[step], resume_point=True)
    return committed, max(gens)


def resume_points(storage: Storage) -> set[int]:
    """The steps the run's final models name as their resume point (the manifest's ``resume_step``,
    written by ``Checkpointer.finish()``); a final model that cannot be read names none."""
    out = set()
    for c in list_committed(storage, kinds=("final",)):
        try:
            step = read_manifest(storage, c.path).extra.get("resume_step")
        except Exception as e:  # noqa: BLE001 - a bad manifest names nothing, readers verify again
            logger.warning("cf_ray: ignoring %s: %s", c.path, e)
            continue
        if isinstance(step, int):
            out.add(step)
    return out


def files_present(storage: Storage, directory: str, files: dict[str, FileInfo]) -> bool:
    """Whether every file is on storage with its size (its content is verified by readers)."""
    fs = getattr(storage, "fs", None)
    fs_path = getattr(storage, "fs_path", None)
    for name, info in files.items():
        path = f"{directory}/{name}"
        if fs is not None and callable(fs_path):
            got = fs.get_file_info(fs_path(path))
            if got.size is None or got.size != info.size:
                return False
        elif not storage.exists(path):
            return False
    return True


__all__ = [
    "CommitJob",
    "CommitResult",
    "Committed",
    "CommittedIndex",
    "files_present",
    "load_committed",
    "resume_points",
]
