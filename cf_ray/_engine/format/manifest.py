"""The manifest that commits a checkpoint, the pointers registered with Ray Train, and safe reading.

The layout of a run's root (directory and file names) is in :mod:`cf_ray._engine.format.layout`;
its names are re-exported here, so ``mf.SHARED``, ``mf.step_dir(...)`` and the like keep working.

A checkpoint exists only when its ``MANIFEST.json`` exists. The manifest lists every file with its
size and CRC-32; readers verify both before parsing a single byte of a file, and fall back to the
previous committed checkpoint on any mismatch. File names carry the *generation* (one per start of
the worker group) so that a straggling writer of an earlier generation can never overwrite a file
that a newer manifest refers to.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cf_ray._engine.format.layout import (  # noqa: F401 - re-exported: callers use mf.SHARED, mf.step_dir, ...
    _DIR_RE,
    _FILE_RE,
    _SECTION_RE,
    CHECKPOINTS,
    FORMAT,
    LATEST,
    MANIFEST,
    POINTER,
    REGISTERED,
    SHARED,
    VERSION,
    rank_section,
    section_files,
    section_rank,
    step_dir,
)
from cf_ray._engine.storage.base import FileInfo, Storage, chunked, crc32_of
from cf_ray.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError

if TYPE_CHECKING:
    from cf_ray._engine.format import codec as _codec  # imports torch; the controller and holder processes never need it

logger = logging.getLogger("cf_ray")


@dataclass(kw_only=True, slots=True)
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    """Optimizer steps taken when the snapshot was taken."""
    epoch: int
    """Epoch counter at that moment."""
    world_size: int
    """Number of ranks that wrote per-rank sections."""
    generation: int
    """Worker-group generation that wrote the files."""
    replicated: bool
    """True when model/optimizer state was written once (``shared`` section) for all ranks."""
    kind: str = "scheduled"
    """Why it was taken: scheduled, epoch, manual, preempt, final."""
    milestone: bool = False
    """Milestones are never deleted by keep-last clean-up."""
    sections: dict[str, dict[str, str]] = field(default_factory=dict)
    """Section name -> {"data": file, "index": file}."""
    files: dict[str, FileInfo] = field(default_factory=dict)
    """File name -> size and CRC-32."""
    created_unix: float = 0.0
    """Wall-clock time of the commit (``time.time()`` when 0 at :meth:`to_bytes`)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-able details stored with the manifest."""

    def to_bytes(self) -> bytes:
        d = {
            "format": FORMAT, "version": VERSION, "step": self.step, "epoch": self.epoch,
            "world_size": self.world_size, "generation": self.generation, "replicated": self.replicated,
            "kind": self.kind, "milestone": self.milestone, "sections": self.sections,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "created_unix": self.created_unix or time.time(), "extra": self.extra,
        }
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @staticmethod
    def from_bytes(raw: bytes | np.ndarray, where: str = "") -> "Manifest":
        try:
            d = json.loads(bytes(raw))
            if d.get("format") != FORMAT:
                raise ValueError(f"not a cf_ray manifest (format={d.get('format')!r})")
            if int(d["version"]) > VERSION:
                raise ValueError(f"manifest version {d['version']} is newer than this cf_ray ({VERSION}); upgrade cf_ray")
            files = {}
            for name, info in d["files"].items():
                _check_file_name(name)
                files[name] = FileInfo(int(info["size"]), int(info["crc32"]))
            sections = {}
            for sec, names in d["sections"].items():
                if not _SECTION_RE.match(sec) and sec != "model":
                    raise ValueError(f"bad section name {sec!r}")
                for f in names.values():
                    _check_file_name(f)
                    if f not in files:
                        raise ValueError(f"section {sec!r} names {f!r}, which the manifest does not list")
                sections[sec] = dict(names)
            return Manifest(
                step=int(d["step"]), epoch=int(d["epoch"]), world_size=int(d["world_size"]),
                generation=int(d["generation"]), replicated=bool(d["replicated"]), kind=str(d["kind"]),
                milestone=bool(d.get("milestone", False)), sections=sections, files=files,
                created_unix=float(d.get("created_unix", 0.0)), extra=dict(d.get("extra", {})),
            )
        except UnsafePathError:
            raise
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"manifest {where} is malformed: {e}") from None


def _check_file_name(name: str) -> None:
    if not isinstance(name, str) or not _FILE_RE.match(name) or ".." in name:
        raise UnsafePathError(f"file name {name!r} in a manifest is not a plain file name; refusing it")


# -- writing ------------------------------------------------------------------------------------

def encode_index(flat: _codec.Flat) -> bytes:
    return json.dumps({"entries": [e.to_json() for e in flat.entries], "tree": flat.tree},
                      separators=(",", ":")).encode()


def write_section(storage: Storage, directory: str, generation: int, section: str,
                  arena: np.ndarray, index: bytes) -> dict[str, FileInfo]:
    """Phase 2 of one section: stream the arena, then its index. Returns what the manifest needs."""
    data_name, index_name = section_files(generation, section)
    info_data = storage.write_file(f"{directory}/{data_name}", chunked(arena))
    info_index = storage.write_file(f"{directory}/{index_name}", [index])
    return {data_name: info_data, index_name: info_index}


def commit(storage: Storage, directory: str, manifest: Manifest) -> None:
    """Write the manifest (the commit point), then the ``latest`` hint."""
    storage.write_file(f"{directory}/{MANIFEST}", [manifest.to_bytes()])
    try:
        storage.write_file(LATEST, [directory.rsplit("/", 1)[-1].encode()])
    except Exception as e:  # noqa: BLE001 - the hint is optional; the manifest is the truth
        logger.warning("cf_ray: could not update the 'latest' hint (%s); the checkpoint is committed", e)


def write_pointer(storage: Storage, step: int) -> str:
    """A directory ``registered/step_<step>`` holding only a pointer to ``checkpoints/step_<step>``:
    what is registered with Ray Train, so that cf_ray's keep-last never deletes what Ray remembers."""
    directory = f"{REGISTERED}/step_{step:012d}"
    body = json.dumps({"format": "cf_ray-pointer", "version": VERSION, "checkpoint": step_dir(step), "step": step})
    storage.write_file(f"{directory}/{POINTER}", [body.encode()])
    return directory


def read_pointer(raw: bytes | np.ndarray) -> str:
    """The checkpoint directory (relative to the run's root) that a pointer names."""
    try:
        d = json.loads(bytes(raw))
        target = str(d["checkpoint"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"malformed checkpoint pointer: {e}") from None
    if d.get("format") != "cf_ray-pointer" or not _DIR_RE.match(target.removeprefix(f"{CHECKPOINTS}/")) \
            or not target.startswith(f"{CHECKPOINTS}/"):
        raise UnsafePathError(f"checkpoint pointer names {target!r}, which is not a checkpoint of this run")
    return target


# -- reading ------------------------------------------------------------------------------------

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


def list_committed(storage: Storage, *, kinds: tuple[str, ...] = ("step",)) -> list[CommittedCheckpoint]:
    """Committed checkpoints (those with a manifest), oldest first."""
    out = []
    for name in storage.list_dir(CHECKPOINTS):
        m = _DIR_RE.match(name)
        if not m or m.group(1) not in kinds:
            continue
        if storage.exists(f"{CHECKPOINTS}/{name}/{MANIFEST}"):
            out.append(CommittedCheckpoint(name, m.group(1), int(m.group(2))))
    out.sort(key=lambda c: (c.step, c.kind))
    return out


def list_uncommitted(storage: Storage) -> list[tuple[str, int]]:
    """Checkpoint directories without a manifest: (name, step)."""
    out = []
    for name in storage.list_dir(CHECKPOINTS):
        m = _DIR_RE.match(name)
        if m and not storage.exists(f"{CHECKPOINTS}/{name}/{MANIFEST}"):
            out.append((name, int(m.group(2))))
    return out


def read_manifest(storage: Storage, directory: str) -> Manifest:
    try:
        raw = storage.read_file(f"{directory}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no committed checkpoint at {storage.uri(directory)}") from None
    return Manifest.from_bytes(raw, storage.uri(f"{directory}/{MANIFEST}"))


def read_verified(storage: Storage, directory: str, manifest: Manifest, name: str) -> np.ndarray:
    """Read one file and check its size and CRC-32 against the manifest *before* anyone parses it.

    Raises:
        CorruptCheckpointError: missing, truncated, extended or altered file.
    """
    info = manifest.files.get(name)
    if info is None:
        raise CorruptCheckpointError(f"{name} is not listed in the manifest of {storage.uri(directory)}")
    try:
        buf = storage.read_file(f"{directory}/{name}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.uri(directory)}/{name} is missing") from None
    if buf.nbytes != info.size:
        raise CorruptCheckpointError(
            f"{storage.uri(directory)}/{name} has {buf.nbytes} bytes, the manifest says {info.size} (truncated or altered)")
    crc = crc32_of(buf)
    if crc != info.crc32:
        raise CorruptCheckpointError(f"{storage.uri(directory)}/{name} fails its checksum (crc32 {crc:#x} != {info.crc32:#x})")
    return buf


@dataclass(slots=True)
class Section:
    """One loaded section: its JSON tree, tensor table and byte buffer."""

    tree: Any
    """The JSON tree of the state, tensors replaced by references into ``entries``."""
    entries: list[_codec.TensorEntry]
    """The tensor table: where each tensor lies in ``buf``."""
    buf: np.ndarray
    """The verified bytes of the section's data file."""

    def materialize(self, *, copy: bool = False) -> Any:
        """The state tree with tensors (views into ``buf`` unless ``copy``)."""
        from cf_ray._engine.format import codec as _codec

        return _codec.unflatten(self.tree, lambda i, e: _codec.view(self.buf, e, copy=copy), self.entries)


def parse_index(raw: bytes | np.ndarray, where: str) -> tuple[Any, list[_codec.TensorEntry]]:
    from cf_ray._engine.format import codec as _codec

    try:
        d = json.loads(bytes(raw))
        entries = [_codec.TensorEntry.from_json(e) for e in d["entries"]]
        return d["tree"], entries
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"index {where} is malformed: {e}") from None


def load_section(storage: Storage, directory: str, manifest: Manifest, section: str) -> Section:
    names = manifest.sections.get(section)
    if names is None:
        raise CorruptCheckpointError(f"checkpoint {storage.uri(directory)} has no section {section!r}")
    index = read_verified(storage, directory, manifest, names["index"])
    tree, entries = parse_index(index, storage.uri(f"{directory}/{names['index']}"))
    buf = read_verified(storage, directory, manifest, names["data"])
    for e in entries:
        if e.offset + e.nbytes > buf.nbytes:
            raise CorruptCheckpointError(f"entry {e.name} lies beyond the end of {names['data']}")
    return Section(tree, entries, buf)


def verify_all(storage: Storage, directory: str, manifest: Manifest) -> None:
    """Check every file of a checkpoint (sizes and checksums)."""
    for name in manifest.files:
        read_verified(storage, directory, manifest, name)


# -- retention ------------------------------------------------------------------------------------

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
