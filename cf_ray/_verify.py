"""``cf-ray verify``: check a run's committed checkpoints on storage without loading a tensor.

Every checkpoint's manifest is read and checked (its own checksum and schema, and that it lies in
its own directory), then every file it lists is read and checked against it (size and CRC-32); the
tensor tables are parsed and every tensor must lie inside its data file; the final model's
safetensors header must describe its file. Nothing is unpickled and nothing is loaded into a model.
Files are read in chunks of :data:`CHUNK_BYTES`, checksummed as they stream by, so the memory needed
is one chunk, whatever the checkpoint's size; only a section's tensor table (its index, metadata) and
a safetensors header are kept whole, to be parsed.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cf_ray._engine.format import layout
from cf_ray._engine.format.commit import Manifest, read_manifest
from cf_ray._engine.format.sections import parse_index, read_verified
from cf_ray._engine.storage.base import Storage, _crc32
from cf_ray.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError

#: Bytes read at a time: the memory ``verify`` needs, beyond the tensor tables.
CHUNK_BYTES = 8 << 20


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
        m = layout.DIR_RE.match(name)
        if not m or (step is not None and int(m.group(2)) != step):
            continue
        path = f"{layout.CHECKPOINTS}/{name}"
        try:
            unsafe = storage.is_symlink(path) or storage.is_symlink(f"{path}/{layout.MANIFEST}")
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
        manifest = read_manifest(storage, path)
    except CheckpointNotFoundError:
        return CheckpointCheck(name, step, "?", vanished=True, problems=("deleted while it was checked",))
    except (CorruptCheckpointError, UnsafePathError) as e:
        return CheckpointCheck(name, step, "?", problems=(f"{layout.MANIFEST}: {short(e)}",))
    problems = []
    data_of_index = {names["index"]: names["data"] for names in manifest.sections.values() if "index" in names}
    for file_name in manifest.files:
        final = file_name == layout.FINAL_MODEL_FILE and manifest.final_model
        try:
            kept = _stream_verified(storage, path, manifest, file_name, keep=file_name in data_of_index)
            if final:
                kept = _safetensors_head(storage, f"{path}/{file_name}", manifest.files[file_name].size)
        except CorruptCheckpointError as e:  # UnsafeCheckpointError included
            problems.append(short(e))
            continue
        except UnsafePathError as e:  # a file of the checkpoint is a symbolic link
            problems.append(f"{file_name}: {short(e)}")
            continue
        if file_name in data_of_index:
            problems.extend(_check_index(kept, file_name, manifest.files[data_of_index[file_name]].size))
        elif final:
            problems.extend(_check_safetensors(kept, file_name, manifest.files[file_name].size))
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


def _stream_verified(storage: Storage, directory: str, manifest: Manifest, name: str, *, keep: bool) -> np.ndarray:
    """Check one file's size and CRC-32 against the manifest, reading it a chunk at a time; the
    file's bytes when ``keep`` (a tensor table, to be parsed), else an empty array.

    Raises:
        CorruptCheckpointError: the file is missing, not a file, truncated, extended or altered.
        UnsafePathError: it is a symbolic link.
    """
    info = manifest.files[name]
    where = f"{storage.uri(directory)}/{name}"
    if not storage.ranged_reads:  # the backend reads whole files anyway: one read
        return _check_whole(read_verified(storage, directory, manifest, name), keep)
    crc, size, parts = 0, 0, []
    try:
        while True:
            # One byte more than the manifest's size at most: enough to tell an extended file.
            want = min(CHUNK_BYTES, info.size + 1 - size)
            chunk = storage.read_range(f"{directory}/{name}", size, want) if want > 0 else np.empty(0, np.uint8)
            crc = _crc32(chunk.data, crc) if chunk.nbytes else crc
            size += chunk.nbytes
            if keep and chunk.nbytes:
                parts.append(np.array(chunk, copy=True))
            done = chunk.nbytes < want or want <= 0
            del chunk  # before the next read: one chunk in memory at a time
            if done:
                break
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where} is missing") from None
    except (IsADirectoryError, NotADirectoryError) as e:
        raise CorruptCheckpointError(f"{where} is not a file: {e}") from None
    if size != info.size:
        said, how = (f"more than {info.size}", "extended") if size > info.size else (str(size), "truncated")
        raise CorruptCheckpointError(f"{where} has {said} bytes, the manifest says {info.size} ({how} or altered)")
    if crc != info.crc32:
        raise CorruptCheckpointError(f"{where} fails its checksum (crc32 {crc:#x} != {info.crc32:#x})")
    return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def _check_whole(buf: np.ndarray, keep: bool) -> np.ndarray:
    return buf if keep else np.empty(0, np.uint8)


def _safetensors_head(storage: Storage, path: str, size: int) -> np.ndarray:
    """The 8-byte length and the JSON header of a safetensors file (already verified): what
    :func:`_check_safetensors` parses, without its tensors."""
    if not storage.ranged_reads:
        return storage.read_file(path)[: min(size, 8 + _MAX_HEADER)]
    head = storage.read_range(path, 0, 8)
    n = int.from_bytes(bytes(head[:8]), "little") if head.nbytes == 8 else 0
    return np.concatenate([head, storage.read_range(path, 8, min(max(n, 0), _MAX_HEADER, max(size - 8, 0)))])


#: A safetensors header longer than this is taken as damaged (safetensors' own limit is 100 MB).
_MAX_HEADER = 100_000_000


def _still_there(storage: Storage, path: str) -> bool:
    try:
        return storage.exists(f"{path}/{layout.MANIFEST}")
    except (UnsafePathError, OSError):
        return True


def _check_index(buf: np.ndarray, name: str, data_size: int) -> list[str]:
    """The tensor table parses and every tensor lies inside its data file (which passed its own check)."""
    try:
        _, entries = parse_index(buf, name)
    except CorruptCheckpointError as e:
        return [str(e)]
    return [
        f"{name}: tensor {e.name} lies beyond the end of its data file ({e.offset} + {e.nbytes} > {data_size})"
        for e in entries
        if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > data_size
    ][:1]


def _check_safetensors(buf: np.ndarray, name: str, file_size: int) -> list[str]:
    """The header of a safetensors file (``buf``: its first bytes, the header whole) parses and its
    tensors tile the rest of the file of ``file_size`` bytes."""
    try:
        n = int.from_bytes(bytes(buf[:8]), "little")
        if buf.nbytes < 8 or n <= 0 or 8 + n > buf.nbytes or 8 + n > file_size:
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
    if 8 + n + end != file_size:
        return [f"{name}: safetensors header describes {8 + n + end} bytes, the file has {file_size}"]
    return []
