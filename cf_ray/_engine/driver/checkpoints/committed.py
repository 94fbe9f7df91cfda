"""The committed index: the checkpoints on storage that a restore may read, as the controller knows
them (rebuilt from storage when a controller starts), and what a commit job writes and gets back.

Not thread-safe on its own: the controller changes it under its lock (the maintenance thread reads
it under the same lock); storage I/O (:func:`load_committed`, :func:`files_present`) is done without it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from cf_ray._engine.format.catalog import list_committed, load_quarantine, registered_steps
from cf_ray._engine.format.commit import Manifest, read_manifest
from cf_ray._engine.storage.base import FileInfo, Storage

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
    registered: bool = False
    """Registered with Ray Train: a pointer directory (``registered/step_<n>``) names it, and a
    checkpoint Ray Train hands back (``result.best_checkpoints``, ``get_checkpoint()``) must load.
    Keep-last spares it while the pointer is there; Ray's ``num_to_keep`` deletes pointers
    (``retention.py``)."""

    @property
    def kept(self) -> bool:
        """Never deleted by keep-last, and not counted by it: a milestone, or the resume point of a
        final model."""
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

    def keep_registered(self, step: int) -> int | None:
        """A rank is about to register ``step`` with Ray Train: keep-last keeps it from now on, while
        its pointer is there (:attr:`Committed.registered`). When keep-last took ``step`` out already
        (the ranks agree on a step some iterations after it committed, and a small ``keep_last`` moves
        on meanwhile), the newest committed step, which keep-last never deletes, is kept and registered
        instead: Ray only ever lists a checkpoint that loads. Returns the step kept (``None``: none
        newer is committed; nothing is registered)."""
        if step not in self.entries:
            if self._newest is None or self._newest < step:
                return None
            step = self._newest
        self.entries[step] = dataclasses.replace(self.entries[step], registered=True)
        return step

    def unregister(self, step: int) -> None:
        """Ray Train no longer lists ``step`` (its pointer is gone): an ordinary checkpoint again."""
        if step in self.entries:
            self.entries[step] = dataclasses.replace(self.entries[step], registered=False)

    def steps(self, *, newest_first: bool = False) -> list[int]:
        return sorted(self.entries, reverse=newest_first)


def load_committed(storage: Storage) -> tuple[dict[int, Committed], int]:
    """The committed checkpoints on storage (step -> entry) and the newest generation among them
    (0 when there is none): what a controller that starts again rebuilds from storage. Quarantined
    steps (``quarantine.json``) are left out; the steps a final model names and those Ray Train lists
    (a pointer directory) are marked kept, as the controller before had them."""
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
    for step in registered_steps(storage):
        if step in committed:
            committed[step] = dataclasses.replace(committed[step], registered=True)
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
    return all(storage.file_size(f"{directory}/{name}") == info.size for name, info in files.items())


__all__ = [
    "CommitJob",
    "CommitResult",
    "Committed",
    "CommittedIndex",
    "files_present",
    "load_committed",
    "resume_points",
]
