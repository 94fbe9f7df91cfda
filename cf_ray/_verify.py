"""``cf-ray verify``: check a run's committed checkpoints on storage without loading a tensor.

Every checkpoint's manifest is read and checked (its own checksum and schema, and that it lies in
its own directory), then every file it lists is read and checked against it (size and CRC-32); the
tensor tables are parsed and every tensor must lie inside its data file; the final model's
safetensors header must describe its file. Nothing is unpickled and nothing is loaded into a model.
Files are read one at a time, so the memory needed is that of the largest file.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cf_ray._engine.format import layout
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.storage.base import Storage, is_symlink
from cf_ray.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError


@dataclass(frozen=True, slots=True)
class CheckpointCheck:
    """What :func:`verify_run` found in one checkpoint directory."""

    name: str
    """The directory under ``checkpoints/``, e.g. ``step_000000000120``."""
    step: int
    """The step in the directory's name."""
    kind: str
    """The manifest's kind (``scheduled``, ``epoch``, ``manual``, ``preempt``, ``final``); ``?``
    when the manifest cannot be read."""
    files: int = 0
    """Files the manifest lists."""
    size_bytes: int = 0
    """Their total size according to the manifest."""
    problems: tuple[str, ...] = field(default_factory=tuple)
    """What is damaged (one entry per file or manifest); empty when the checkpoint is intact."""
    vanished: bool = False
    """The checkpoint was deleted while it was checked (keep-last of a live run): not damage."""

    @property
    def ok(self) -> bool:
        return not self.problems or self.vanished


def verify_run(storage: Storage, directory: str | None = None, *, step: int | None = None) -> list[CheckpointCheck]:
    """Check the committed checkpoints of a run, oldest first (or only ``directory``, or only ``step``).

    Args:
        storage: the run's cf_ray root (``cf_ray.load.open_run``).
        directory: one checkpoint directory under it (``checkpoints/step_...``) to check alone.
        step: check only the checkpoints of this step (a resumable one and the final model can share it).

    Raises:
        CheckpointNotFoundError: nothing committed to check (at ``step``, when given).
    """
    if directory is not None:
        names = [posixpath.basename(directory.rstrip("/"))]
    else:
        try:
            names = storage.list_dir(layout.CHECKPOINTS)
        except FileNotFoundError:
            names = []
    found = []
    for name in names:
        m = layout._DIR_RE.match(name)
        if not m or (step is not None and int(m.group(2)) != step):
            continue
        path = f"{layout.CHECKPOINTS}/{name}"
        try:
            unsafe = is_symlink(storage, path) or is_symlink(storage, f"{path}/{layout.MANIFEST}")
            committed = unsafe or storage.exists(f"{path}/{layout.MANIFEST}")
        except (UnsafePathError, OSError) as e:
            found.append(CheckpointCheck(name, int(m.group(2)), "?", problems=(f"cannot be examined: {e}",)))
            continue
        if unsafe:
            found.append(
                CheckpointCheck(name, int(m.group(2)), "?", problems=("is or holds a symbolic link: refused",))
            )
        elif committed:  # a directory without a manifest is a checkpoint being written, or one abandoned
            found.append(_check(storage, path, name, int(m.group(2))))
    if not found:
        at = "" if step is None else f" at step {step}"
        raise CheckpointNotFoundError(f"no committed checkpoint{at} under {storage.uri(directory or '')}")
    found.sort(key=lambda c: (c.step, c.kind == "final"))
    return found


def _check(storage: Storage, path: str, name: str, step: int) -> CheckpointCheck:
    prefix = storage.uri(path) + "/"

    def short(e: Exception) -> str:
        return str(e).replace(prefix, "")

    try:
        manifest = mf.read_manifest(storage, path)
    except CheckpointNotFoundError:
        return CheckpointCheck(name, step, "?", vanished=True, problems=("deleted while it was checked",))
    except (CorruptCheckpointError, UnsafePathError) as e:
        return CheckpointCheck(name, step, "?", problems=(f"{layout.MANIFEST}: {short(e)}",))
    problems = []
    data_of_index = {names["index"]: names["data"] for names in manifest.sections.values() if "index" in names}
    for file_name in manifest.files:
        try:
            buf = mf.read_verified(storage, path, manifest, file_name)
        except CorruptCheckpointError as e:  # UnsafeCheckpointError included
            problems.append(short(e))
            continue
        if file_name in data_of_index:
            problems.extend(_check_index(buf, file_name, manifest.files[data_of_index[file_name]].size))
        elif file_name == layout.FINAL_MODEL_FILE and manifest.kind == "final":
            problems.extend(_check_safetensors(buf, file_name))
        del buf
    vanished = bool(problems) and not _still_there(storage, path)
    return CheckpointCheck(
        name,
        step,
        manifest.kind,
        files=len(manifest.files),
        size_bytes=sum(i.size for i in manifest.files.values()),
        problems=("deleted while it was checked",) if vanished else tuple(problems),
        vanished=vanished,
    )


def _still_there(storage: Storage, path: str) -> bool:
    try:
        return storage.exists(f"{path}/{layout.MANIFEST}")
    except (UnsafePathError, OSError):
        return True


def _check_index(buf: np.ndarray, name: str, data_size: int) -> list[str]:
    """The tensor table parses and every tensor lies inside its data file (which passed its own check)."""
    try:
        _, entries = mf.parse_index(buf, name)
    except CorruptCheckpointError as e:
        return [str(e)]
    return [
        f"{name}: tensor {e.name} lies beyond the end of its data file ({e.offset} + {e.nbytes} > {data_size})"
        for e in entries
        if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > data_size
    ][:1]


def _check_safetensors(buf: np.ndarray, name: str) -> list[str]:
    """The header of a safetensors file parses and its tensors tile the rest of the file."""
    try:
        n = int.from_bytes(bytes(buf[:8]), "little")
        if buf.nbytes < 8 or n <= 0 or 8 + n > buf.nbytes:
            raise ValueError("bad header length")
        header: dict[str, Any] = json.loads(bytes(buf[8 : 8 + n]))
        spans = sorted(tuple(int(x) for x in spec["data_offsets"]) for k, spec in header.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        return [f"{name}: malformed safetensors header: {type(e).__name__}: {e}"]
    end = 0
    for begin, stop in spans:
        if begin != end or stop < begin:
            return [f"{name}: safetensors tensors do not tile the file (a tensor at [{begin}, {stop}) after {end})"]
        end = stop
    if 8 + n + end != buf.nbytes:
        return [f"{name}: safetensors header describes {8 + n + end} bytes, the file has {buf.nbytes}"]
    return []
