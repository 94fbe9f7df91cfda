"""The manifest that commits a checkpoint, the pointers registered with Ray Train, and safe reading.

The layout of a run's root (directory and file names) is in :mod:`cf_ray._engine.format.layout`;
its names are re-exported here, so ``mf.SHARED``, ``mf.step_dir(...)`` and the like keep working.

A checkpoint exists only when its ``MANIFEST.json`` exists. The manifest lists every file with its
size and CRC-32; readers verify both before parsing a single byte of a file, and fall back to the
previous committed checkpoint on any mismatch. The manifest checks itself too (format version 2): it
carries a SHA-256 of its own canonical JSON, and a strict schema binds every file name to its section
and generation, so one damaged bit can never make rank 0 load rank 1's state; any damage raises
:class:`~cf_ray.errors.CorruptCheckpointError` naming the field and the location. File names carry the *generation* (one per start of
the worker group) so that a straggling writer of an earlier generation can never overwrite a file
that a newer manifest refers to.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import posixpath
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from cf_ray._engine.format.layout import (  # noqa: F401 - re-exported: callers use mf.SHARED, mf.step_dir, ...
    _DIR_RE,
    _FILE_RE,
    _SECTION_RE,
    CHECKPOINTS,
    COUNTERS,
    FINAL_MODEL_FILE,
    FINAL_SECTION,
    FORMAT,
    KINDS,
    LATEST,
    MANIFEST,
    MAX_WORLD_SIZE,
    OBJECTS,
    POINTER,
    REGISTERED,
    RNG,
    SHARED,
    STATE,
    VERSION,
    parse_step_dir,
    rank_section,
    section_files,
    section_rank,
    step_dir,
)
from cf_ray._engine.storage.base import FileInfo, Storage, chunked, crc32_of, is_symlink
from cf_ray.errors import CfRayError, CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError

if TYPE_CHECKING:
    # imports torch; the controller and holder processes never need it
    from cf_ray._engine.format import codec as _codec

logger = logging.getLogger("cf_ray")


class UnsafeCheckpointError(UnsafePathError, CorruptCheckpointError):
    """A manifest or pointer names a path that would leave the checkpoint, or a checkpoint's file is
    reached through a symbolic link: refused as unsafe (an :class:`UnsafePathError`) and, since such
    a checkpoint cannot be loaded, also a :class:`CorruptCheckpointError`, so that readers which skip
    or fall back on a damaged checkpoint do the same here."""


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
        """Compact, key-sorted JSON carrying ``checksum``: the SHA-256 of the canonical JSON of every
        other field, so that one flipped bit anywhere in the file is detected when it is read."""
        d = {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "generation": self.generation,
            "replicated": self.replicated,
            "kind": self.kind,
            "milestone": self.milestone,
            "sections": self.sections,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "created_unix": self.created_unix or time.time(),
            "extra": self.extra,
        }
        d = json.loads(json.dumps(d))  # as a reader will see it: int keys of ``extra`` become strings, ...
        d[_CHECKSUM] = _checksum_of(d)
        return _canonical(d).encode()

    @staticmethod
    def from_bytes(raw: bytes | np.ndarray, where: str = "") -> Manifest:
        """Parse and check a manifest: its own checksum (version 2), then a strict schema.

        Raises:
            CorruptCheckpointError: anything wrong, naming the field and ``where``; never a bare
                ``KeyError``/``TypeError``/``ValueError``/``UnicodeDecodeError``.
            UnsafeCheckpointError: a file name that is not a plain file name (an
                :class:`UnsafePathError` and a :class:`CorruptCheckpointError`).
        """
        where = where or "<unknown location>"
        try:
            return _parse_manifest(raw)
        except UnsafeCheckpointError as e:
            raise UnsafeCheckpointError(f"manifest {where}: {e}") from None
        except _Malformed as e:
            raise CorruptCheckpointError(f"manifest {where} is malformed: field {e.field!r}: {e.problem}") from None
        except CfRayError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
            # UnicodeDecodeError and json.JSONDecodeError are ValueErrors.
            raise CorruptCheckpointError(f"manifest {where} is malformed: {type(e).__name__}: {e}") from None


_CHECKSUM = "checksum"
_CHECKSUM_PREFIX = "sha256:"
#: The fields of a version-1 manifest; version 2 adds ``checksum``.
_FIELDS_V1 = frozenset(
    {
        "format",
        "version",
        "step",
        "epoch",
        "world_size",
        "generation",
        "replicated",
        "kind",
        "milestone",
        "sections",
        "files",
        "created_unix",
        "extra",
    }
)
_FIELDS_V2 = _FIELDS_V1 | {_CHECKSUM}


class _Malformed(Exception):
    """A schema violation found while parsing a manifest (turned into a CorruptCheckpointError)."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(field_name, problem)
        self.field = field_name
        self.problem = problem


def _canonical(d: dict) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _checksum_of(d: dict) -> str:
    body = _canonical({k: v for k, v in d.items() if k != _CHECKSUM})
    return _CHECKSUM_PREFIX + hashlib.sha256(body.encode("ascii")).hexdigest()


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Malformed(dup, "the key appears more than once in one object")
    return d


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(d: dict, name: str, minimum: int, maximum: int | None = None, *, label: str = "") -> int:
    v = d[name]
    label = label or name
    if not _is_int(v):
        raise _Malformed(label, f"expected an integer, found {v!r}")
    if v < minimum or (maximum is not None and v > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise _Malformed(label, f"must be {bound}, found {v}")
    return v


def _typed_field(d: dict, name: str, types: type | tuple[type, ...]) -> Any:
    v = d[name]
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
        names = "/".join(t.__name__ for t in allowed)
        raise _Malformed(name, f"expected {names}, found {type(v).__name__}")
    return v


def _check_names_are_plain(d: dict) -> None:
    """Refuse any file name that could leave the checkpoint, first: a manifest that names ``../x``
    is reported as unsafe whether or not its checksum matches."""
    files = d.get("files")
    if isinstance(files, dict):
        for name in files:
            _check_file_name(name)
    sections = d.get("sections")
    if isinstance(sections, dict):
        for names in sections.values():
            if isinstance(names, dict):
                for f in names.values():
                    _check_file_name(f)


def _parse_manifest(raw: bytes | np.ndarray) -> Manifest:
    raw = bytes(raw)
    d = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    if not isinstance(d, dict):
        raise _Malformed("<root>", f"expected a JSON object, found {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise _Malformed("format", f"not a cf_ray manifest (format={d.get('format')!r})")
    version = d.get("version")
    if not _is_int(version) or version < 1:
        raise _Malformed("version", f"expected an integer >= 1, found {version!r}")
    if version > VERSION:
        raise _Malformed("version", f"manifest version {version} is newer than this cf_ray ({VERSION}); upgrade cf_ray")
    _check_names_are_plain(d)
    if version == 1:
        # Version 1 manifests carry no checksum of their own: accepted for checkpoints written before
        # the checksum was added (their files are still verified by size and CRC-32, and the schema
        # below binds every file to its section).
        expected_fields = _FIELDS_V1
    else:
        expected_fields = _FIELDS_V2
        stored = d.get(_CHECKSUM)
        if not isinstance(stored, str):
            raise _Malformed(_CHECKSUM, f"expected a string, found {stored!r}")
        actual = _checksum_of(d)
        if stored != actual:
            raise _Malformed(
                _CHECKSUM,
                f"the manifest fails its own checksum ({stored!r} != {actual!r}): "
                "it was altered or damaged after it was written",
            )
        if _canonical(d).encode() != raw:
            # Every byte counts: e.g. a damaged 17th digit of created_unix that parses to the same float.
            raise _Malformed("<encoding>", "not the canonical JSON that cf_ray writes: altered after it was written")
    if set(d) != expected_fields:
        missing, unknown = sorted(expected_fields - set(d)), sorted(set(d) - expected_fields)
        raise _Malformed(",".join(missing + unknown), f"missing fields {missing}, unknown fields {unknown}")
    step = _int_field(d, "step", 0)
    epoch = _int_field(d, "epoch", 0)
    world_size = _int_field(d, "world_size", 1, MAX_WORLD_SIZE)
    generation = _int_field(d, "generation", 0)
    replicated = _typed_field(d, "replicated", bool)
    milestone = _typed_field(d, "milestone", bool)
    kind = _typed_field(d, "kind", str)
    if kind not in KINDS:
        raise _Malformed("kind", f"expected one of {list(KINDS)}, found {kind!r}")
    created_unix = _typed_field(d, "created_unix", (int, float))
    if not math.isfinite(created_unix) or created_unix < 0:
        raise _Malformed("created_unix", f"expected a finite time >= 0, found {created_unix!r}")
    extra = _typed_field(d, "extra", dict)
    files = _parse_files(_typed_field(d, "files", dict))
    raw_sections = _typed_field(d, "sections", dict)
    if kind == "final":
        sections = _final_sections(raw_sections, world_size)
    else:
        sections = _step_sections(raw_sections, world_size, replicated, generation)
    named = {f for names in sections.values() for f in names.values()}
    if set(files) != named:
        raise _Malformed(
            "files",
            f"lists {sorted(set(files) - named)} that no section names "
            f"and misses {sorted(named - set(files))} that a section names",
        )
    return Manifest(
        step=step,
        epoch=epoch,
        world_size=world_size,
        generation=generation,
        replicated=replicated,
        kind=kind,
        milestone=milestone,
        sections=sections,
        files=files,
        created_unix=float(created_unix),
        extra=extra,
    )


def _parse_files(raw: dict) -> dict[str, FileInfo]:
    files = {}
    for name, info in raw.items():
        label = f"files.{name}"
        if not isinstance(info, dict) or set(info) != {"size", "crc32"}:
            raise _Malformed(label, f"expected {{'size': int, 'crc32': int}}, found {info!r}")
        size = _int_field(info, "size", 0, label=f"{label}.size")
        crc = _int_field(info, "crc32", 0, 2**32 - 1, label=f"{label}.crc32")
        files[name] = FileInfo(size, crc)
    return files


def _final_sections(raw: dict, world_size: int) -> dict[str, dict[str, str]]:
    """The final model's manifest (``write_final_model``) names exactly one section, ``model``, with
    one data file, ``model.safetensors``, written by one rank."""
    want = {FINAL_SECTION: {"data": FINAL_MODEL_FILE}}
    if raw != want:
        raise _Malformed("sections", f"a final model's manifest has exactly {want}, found {raw!r}")
    if world_size != 1:
        raise _Malformed("world_size", f"a final model's manifest has world_size 1, found {world_size}")
    return {FINAL_SECTION: {"data": FINAL_MODEL_FILE}}


def _step_sections(raw: dict, world_size: int, replicated: bool, generation: int) -> dict[str, dict[str, str]]:
    """A resumable checkpoint has rank_00000 .. rank_<world_size-1>, plus ``shared`` iff replicated,
    and each section's files are named for that section and this generation: no file name can move
    to another section (rank 0 reading rank 1's state) without the manifest noticing."""
    for sec in raw:
        if not _SECTION_RE.match(sec):
            raise _Malformed("sections", f"bad section name {sec!r}")
    if len(raw) != world_size + int(replicated):
        raise _Malformed(
            "sections",
            f"world_size {world_size} (replicated={replicated}) implies "
            f"{world_size + int(replicated)} sections, found {len(raw)}: {sorted(raw)}",
        )
    expected = {rank_section(r) for r in range(world_size)} | ({SHARED} if replicated else set())
    if set(raw) != expected:
        raise _Malformed(
            "sections",
            f"world_size {world_size} (replicated={replicated}) implies sections "
            f"{sorted(expected)}, found {sorted(raw)}",
        )
    sections = {}
    for sec, names in raw.items():
        data, index = section_files(generation, sec)
        if names != {"data": data, "index": index}:
            raise _Malformed(
                f"sections.{sec}",
                f"expected {{'data': {data!r}, 'index': {index!r}}} "
                f"(section {sec}, generation {generation}), found {names!r}",
            )
        sections[sec] = {"data": data, "index": index}
    return sections


def _check_file_name(name: str) -> None:
    if not isinstance(name, str) or not _FILE_RE.match(name) or ".." in name:
        raise UnsafeCheckpointError(f"file name {name!r} in a manifest is not a plain file name; refusing it")


# -- writing ------------------------------------------------------------------------------------


def encode_index(flat: _codec.Flat) -> bytes:
    return json.dumps(
        {"entries": [e.to_json() for e in flat.entries], "tree": flat.tree}, separators=(",", ":")
    ).encode()


#: Bytes per checksummed block of a section's data file: a ranged read (a restore at another number
#: of ranks reading only the shards it needs, DCP reading through ``CfRayReader``) checks the CRC-32
#: of every block it touches, so it never reads more than one block beyond each range it needs.
BLOCK_BYTES = 1 << 18


def block_crcs(buf: np.ndarray, block: int = BLOCK_BYTES) -> list[int]:
    """CRC-32 of every ``block`` bytes of ``buf`` (the last block may be shorter)."""
    return [crc32_of(buf[i : i + block]) for i in range(0, buf.nbytes, block)]


def write_section(
    storage: Storage, directory: str, generation: int, section: str, arena: np.ndarray, index: bytes
) -> dict[str, FileInfo]:
    """Phase 2 of one section: stream the arena, then its index with the CRC-32 of every block of
    the arena (``BLOCK_BYTES``; for ranged reads). An index that carries block checksums already
    (the worker's, taken as it copied) is checked against the arena first: bytes that changed in
    memory since are never written as a checkpoint. Returns what the manifest needs.

    Raises:
        CorruptCheckpointError: the arena no longer matches the block checksums its index carries.
    """
    data_name, index_name = section_files(generation, section)
    crcs = block_crcs(arena)
    index, known = split_blocks(index)
    if known is not None and list(known) != crcs:
        bad = [i for i, (a, b) in enumerate(zip(known, crcs)) if a != b] or list(range(len(crcs)))
        raise BlockMismatchError(
            f"section {section}: the snapshot's bytes changed in memory after they were checksummed "
            f"(blocks {bad[:BLOCKS_NAMED]})",
            blocks=bad,
            block_bytes=BLOCK_BYTES,
        )
    info_data = storage.write_file(f"{directory}/{data_name}", chunked(arena))
    index = with_blocks(index, crcs)
    info_index = storage.write_file(f"{directory}/{index_name}", [index])
    return {data_name: info_data, index_name: info_index}


def write_section_slot(
    storage: Storage, directory: str, generation: int, section: str, data: memoryview, index: bytes, crc32: int
) -> tuple[dict[str, FileInfo], int]:
    """Phase 2 of one section held in a snapshot slot (``node/shm.py``): ``index`` already carries
    the block checksums and ``crc32`` is the data's, both computed by the worker as it copied, so the
    data is written straight from the slot and not read again. A storage without ``write_buffer``
    streams it (and checksums it again: the two must agree). Returns the manifest's file infos and
    the bytes copied on the host by the write."""
    data_name, index_name = section_files(generation, section)
    write_buffer = getattr(storage, "write_buffer", None)
    if callable(write_buffer):
        written: tuple[FileInfo, int] = write_buffer(f"{directory}/{data_name}", data, crc32)  # pyright: ignore[reportAssignmentType] - FsStorage.write_buffer
        info_data, copied = written
    else:
        info_data, copied = storage.write_file(f"{directory}/{data_name}", chunked(data)), data.nbytes
        if info_data.crc32 != crc32:
            raise CorruptCheckpointError(
                f"section {section}: the snapshot's bytes changed in memory after they were checksummed "
                f"(CRC-32 {info_data.crc32:#010x}, expected {crc32:#010x})"
            )
    info_index = storage.write_file(f"{directory}/{index_name}", [index])
    return {data_name: info_data, index_name: info_index}, copied


def split_blocks(index: bytes) -> tuple[bytes, tuple[int, ...] | None]:
    """An encoded index without the block checksums :func:`with_blocks` appended, and those
    checksums (``None`` when it has none). No torch: the holder calls it."""
    raw = bytes(index).rstrip()
    at = raw.rfind(b',"blocks":{')
    if at < 0 or not raw.endswith(b"}}"):
        return raw, None
    try:
        b = json.loads(raw[at + len(b',"blocks":') : -1])
        crcs = tuple(int(c) for c in b["crc32"]) if b.get("bytes") == BLOCK_BYTES else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return raw, None
    return (raw[:at] + b"}", crcs) if crcs is not None else (raw, None)


def with_blocks(index: bytes, crcs: list[int], block: int = BLOCK_BYTES) -> bytes:
    """An encoded index (a JSON object) with the block checksums of its data file added."""
    raw = bytes(index).rstrip()
    if not raw.endswith(b"}"):
        raise ValueError("an index is a JSON object")
    blocks = json.dumps({"bytes": block, "crc32": crcs}, separators=(",", ":")).encode()
    return raw[:-1] + b',"blocks":' + blocks + b"}"


def commit(storage: Storage, directory: str, manifest: Manifest) -> None:
    """Write the manifest (the commit point), then the ``latest`` hint."""
    storage.write_file(f"{directory}/{MANIFEST}", [manifest.to_bytes()])
    try:
        storage.write_file(LATEST, [directory.rsplit("/", 1)[-1].encode()])
    except Exception as e:  # noqa: BLE001 - the hint is optional; the manifest is the truth
        logger.warning("cf_ray: could not update the 'latest' hint (%s); the checkpoint is committed", e)


#: The pointer's own format version; it has not changed since version 1 of the layout.
POINTER_VERSION = 1


def write_pointer(storage: Storage, step: int) -> str:
    """A directory ``registered/step_<step>`` holding only a pointer to ``checkpoints/step_<step>``:
    what is registered with Ray Train, so that cf_ray's keep-last never deletes what Ray remembers."""
    directory = f"{REGISTERED}/step_{step:012d}"
    body = json.dumps(
        {"format": "cf_ray-pointer", "version": POINTER_VERSION, "checkpoint": step_dir(step), "step": step}
    )
    storage.write_file(f"{directory}/{POINTER}", [body.encode()])
    return directory


def read_pointer(raw: bytes | np.ndarray) -> str:
    """The checkpoint directory (relative to the run's root) that a pointer names.

    Raises:
        CorruptCheckpointError: the pointer is not valid JSON of the pointer's shape, or its
            ``checkpoint`` and ``step`` disagree (one damaged digit would name another checkpoint).
        UnsafeCheckpointError: it names something that is not a checkpoint of this run.
    """
    try:
        d = json.loads(bytes(raw))
    except (ValueError, TypeError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError included
        raise CorruptCheckpointError(f"malformed checkpoint pointer: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict) or not isinstance(d.get("checkpoint"), str):
        raise CorruptCheckpointError(
            f"malformed checkpoint pointer: expected an object with a 'checkpoint' string, found {str(d)[:200]!r}"
        )
    target = d["checkpoint"]
    if (
        d.get("format") != "cf_ray-pointer"
        or not _DIR_RE.match(target.removeprefix(f"{CHECKPOINTS}/"))
        or not target.startswith(f"{CHECKPOINTS}/")
    ):
        raise UnsafeCheckpointError(f"checkpoint pointer names {target!r}, which is not a checkpoint of this run")
    version, step = d.get("version"), d.get("step")
    if not _is_int(version) or not 1 <= version <= VERSION:
        raise CorruptCheckpointError(f"malformed checkpoint pointer: version {version!r}")
    if not _is_int(step) or step < 0 or target != step_dir(step):
        raise CorruptCheckpointError(f"malformed checkpoint pointer: it names {target!r} for step {step!r}")
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


#: Committed checkpoints that a restore found corrupt: ``{"version": 1, "steps": {"<step>": "<why>"}}``
#: at the run's root. They stay on storage for inspection, are never restored from again, never
#: count toward keep-last, and are never deleted by it.
QUARANTINE = "quarantine.json"


def load_quarantine(storage: Storage) -> dict[int, str]:
    """The quarantined steps and why (empty when there is no file; a damaged file is reported)."""
    try:
        if not storage.exists(QUARANTINE):
            return {}
        raw = json.loads(bytes(storage.read_file(QUARANTINE)))
        return {int(k): str(v) for k, v in raw["steps"].items()}
    except Exception as e:  # noqa: BLE001 - a damaged list quarantines nothing; say so
        logger.warning("cf_ray: cannot read %s (%s); no checkpoint is quarantined", storage.uri(QUARANTINE), e)
        return {}


def write_quarantine(storage: Storage, steps: dict[int, str]) -> None:
    """Write the quarantine list (storage I/O: never under the controller's lock)."""
    raw = json.dumps({"version": 1, "steps": {str(k): v for k, v in sorted(steps.items())}}).encode()
    storage.write_file(QUARANTINE, [raw])


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
        m = _DIR_RE.match(name)
        if not m or m.group(1) not in kinds:
            continue
        if _has_manifest(storage, name) is True:
            out.append(CommittedCheckpoint(name, m.group(1), int(m.group(2))))
    out.sort(key=lambda c: (c.step, c.kind))
    if skip_quarantined and out:
        quarantined = load_quarantine(storage)
        out = [c for c in out if not (c.kind == "step" and c.step in quarantined)]
    return out


def list_uncommitted(storage: Storage) -> list[tuple[str, int]]:
    """Checkpoint directories without a manifest: (name, step). Unsafe or unreadable entries are
    skipped as in :func:`list_committed` (and so never deleted through a link)."""
    out = []
    for name in storage.list_dir(CHECKPOINTS):
        m = _DIR_RE.match(name)
        if m and _has_manifest(storage, name) is False:
            out.append((name, int(m.group(2))))
    return out


def _has_manifest(storage: Storage, name: str) -> bool | None:
    """Whether ``checkpoints/<name>`` holds a manifest; None (after a warning) when the entry is a
    symbolic link, leads out of the root, or cannot be examined."""
    directory = f"{CHECKPOINTS}/{name}"
    try:
        for path in (directory, f"{directory}/{MANIFEST}"):
            if is_symlink(storage, path):
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


def _uri(storage: Storage, path: str) -> str:
    """``storage.uri(path)``, or the bare path when that path is itself refused (for messages)."""
    try:
        return storage.uri(path)
    except (UnsafePathError, OSError):
        return path


def read_manifest(storage: Storage, directory: str) -> Manifest:
    """Read and check the manifest of ``directory``: its checksum and schema, and that it is the
    manifest of that directory (``step_<n>``/``final_<n>``: its step is n, final iff ``final_``).

    Raises:
        CheckpointNotFoundError: no manifest there.
        CorruptCheckpointError: a damaged manifest, or one in the wrong directory.
        UnsafeCheckpointError: the directory or manifest is a symbolic link, or the manifest names an
            unsafe file (an :class:`UnsafePathError` and a :class:`CorruptCheckpointError`).
    """
    path = f"{directory}/{MANIFEST}"
    try:
        for p in (directory, path):
            if is_symlink(storage, p):
                raise UnsafeCheckpointError(f"refusing {_uri(storage, p)}: it is a symbolic link")
        raw = storage.read_file(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no committed checkpoint at {_uri(storage, directory)}") from None
    except UnsafeCheckpointError:
        raise
    except UnsafePathError as e:
        raise UnsafeCheckpointError(str(e)) from None
    except (IsADirectoryError, NotADirectoryError) as e:
        raise CorruptCheckpointError(f"manifest {_uri(storage, path)} is not a file: {e}") from None
    where = _uri(storage, path)
    m = Manifest.from_bytes(raw, where)
    dm = _DIR_RE.match(posixpath.basename(directory.rstrip("/")))
    if dm and (int(dm.group(2)) != m.step or (dm.group(1) == "final") != (m.kind == "final")):
        raise CorruptCheckpointError(
            f"manifest {where} is malformed: field 'step'/'kind': it says step {m.step} "
            f"kind {m.kind!r}, but lies in {dm.group(0)}"
        )
    return m


def read_verified(
    storage: Storage, directory: str, manifest: Manifest, name: str, *, blocks: Blocks | None = None
) -> np.ndarray:
    """Read one file and check its size and CRC-32 against the manifest *before* anyone parses it.

    Args:
        blocks: the file's block checksums (a section's data file), used only when the file fails
            its checksum, to say which blocks differ.

    Raises:
        CorruptCheckpointError: missing, truncated, extended or altered file (:class:`BlockMismatchError`
            naming the blocks when ``blocks`` are given).
    """
    info = manifest.files.get(name)
    if info is None:
        raise CorruptCheckpointError(f"{name} is not listed in the manifest of {storage.uri(directory)}")
    try:
        buf = storage.read_file(f"{directory}/{name}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.uri(directory)}/{name} is missing") from None
    except UnsafeCheckpointError:
        raise
    except UnsafePathError as e:  # a file of the checkpoint is a symbolic link
        raise UnsafeCheckpointError(str(e)) from None
    except (IsADirectoryError, NotADirectoryError) as e:
        raise CorruptCheckpointError(f"{storage.uri(directory)}/{name} is not a file: {e}") from None
    if buf.nbytes != info.size:
        raise CorruptCheckpointError(
            f"{storage.uri(directory)}/{name} has {buf.nbytes} bytes, the manifest says {info.size} (truncated or altered)"
        )
    crc = crc32_of(buf)
    if crc != info.crc32:
        what = f"{storage.uri(directory)}/{name} fails its checksum (crc32 {crc:#x} != {info.crc32:#x})"
        bad = bad_blocks(buf, blocks) if blocks is not None else []
        if bad:  # the failure path only: a second pass, to say where
            raise BlockMismatchError(what, blocks=bad, block_bytes=blocks.size if blocks else 0)
        raise CorruptCheckpointError(what)
    return buf


@dataclass(slots=True)
class Section:
    """One loaded section: its JSON tree, tensor table and byte buffer."""

    tree: Any
    """The JSON tree of the state, tensors replaced by references into ``entries``."""
    entries: list[_codec.TensorEntry]
    """The tensor table: where each tensor lies in ``buf``."""
    buf: np.ndarray | RangedData
    """The verified bytes of the section's data file (read by range, block by block verified, when
    the section was loaded ``ranged``)."""
    private: bool = False
    """``buf`` is memory of this process that nothing else uses (a section streamed from another
    node): the restore keeps views into it instead of copying what it keeps (optimizer state)."""
    blocks: Blocks | None = None
    """The CRC-32 of every block of ``buf`` (from the index; ``None`` for checkpoints written before
    them): what :func:`verify_blocks` checks bytes that came from memory against."""

    def materialize(self, *, copy: bool = False) -> Any:
        """The state tree with tensors (views into ``buf`` unless ``copy``)."""
        from cf_ray._engine.format import codec as _codec

        return _codec.unflatten(self.tree, lambda _i, e: _codec.view(self.buf, e, copy=copy), self.entries)


@dataclass(frozen=True, slots=True)
class Blocks:
    """The block checksums of a section's data file (absent from checkpoints of before them)."""

    size: int
    """Bytes per block."""
    crc32: tuple[int, ...]


def parse_index(raw: bytes | np.ndarray, where: str) -> tuple[Any, list[_codec.TensorEntry]]:
    tree, entries, _ = parse_index_blocks(raw, where)
    return tree, entries


def parse_index_blocks(raw: bytes | np.ndarray, where: str) -> tuple[Any, list[_codec.TensorEntry], Blocks | None]:
    """An index's tree, tensor table and block checksums (``None`` when it has none)."""
    from cf_ray._engine.format import codec as _codec

    try:
        d = json.loads(bytes(raw))
        if not isinstance(d, dict) or not isinstance(d.get("entries"), list) or "tree" not in d:
            raise ValueError("expected an object with an 'entries' list and a 'tree'")
        entries = [_codec.TensorEntry.from_json(e) for e in d["entries"]]
        blocks = None
        if "blocks" in d:
            b = d["blocks"]
            if (
                not isinstance(b, dict)
                or not _is_int(b.get("bytes"))
                or b["bytes"] < 1
                or not isinstance(b.get("crc32"), list)
                or not all(_is_int(c) and 0 <= c < 2**32 for c in b["crc32"])
            ):
                raise ValueError("'blocks' is not {'bytes': int >= 1, 'crc32': [int, ...]}")
            blocks = Blocks(b["bytes"], tuple(b["crc32"]))
        return d["tree"], entries, blocks
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        # UnicodeDecodeError and json.JSONDecodeError are ValueErrors.
        raise CorruptCheckpointError(f"index {where} is malformed: {type(e).__name__}: {e}") from None


class BlockMismatchError(CorruptCheckpointError):
    """Bytes of a section that fail the CRC-32 of their blocks (``Blocks``): ``blocks`` are the
    indices of the blocks that differ (the first :data:`BLOCKS_NAMED`), each ``block_bytes`` long."""

    def __init__(self, message: str, *, blocks: list[int] | tuple[int, ...] = (), block_bytes: int = 0):
        super().__init__(message)
        self.blocks = list(blocks)
        self.block_bytes = int(block_bytes)

    def __reduce__(self):
        return (_block_mismatch, (self.args[0] if self.args else "", self.blocks, self.block_bytes))


def _block_mismatch(message: str, blocks: list[int], block_bytes: int) -> BlockMismatchError:
    return BlockMismatchError(message, blocks=blocks, block_bytes=block_bytes)


#: Blocks a :class:`BlockMismatchError` names at most (the count of the others is said).
BLOCKS_NAMED = 8


def bad_blocks(buf: np.ndarray, blocks: Blocks) -> list[int]:
    """The indices of the blocks of ``buf`` whose CRC-32 differs from ``blocks`` (all of them when
    the number of blocks does not fit ``buf``'s size)."""
    n = math.ceil(buf.nbytes / blocks.size)
    if len(blocks.crc32) != n:
        return list(range(max(n, len(blocks.crc32))))
    b = blocks.size
    return [i for i in range(n) if crc32_of(buf[i * b : (i + 1) * b]) != blocks.crc32[i]]


def verify_blocks(buf: np.ndarray, blocks: Blocks | None, where: str) -> None:
    """Check every byte of ``buf`` against the CRC-32 of its block before anything uses it: what a
    restore does with a section that came from memory (a slot mapped in place, a stream from another
    node, an object-store copy), whatever the path. Fails closed: bytes without block checksums
    cannot be verified and are refused.

    Raises:
        BlockMismatchError: naming the blocks that differ and their byte ranges.
        CorruptCheckpointError: ``blocks`` is ``None``, or does not fit the size of ``buf``.
    """
    if blocks is None:
        raise CorruptCheckpointError(f"{where}: its index carries no block checksums, so its bytes cannot be verified")
    if len(blocks.crc32) != math.ceil(buf.nbytes / blocks.size):
        raise CorruptCheckpointError(
            f"{where}: its index has {len(blocks.crc32)} block checksums for {buf.nbytes} bytes in blocks of {blocks.size}"
        )
    bad = bad_blocks(buf, blocks)
    if bad:
        b = blocks.size
        named = ", ".join(f"{i} (bytes {i * b}..{min((i + 1) * b, buf.nbytes) - 1})" for i in bad[:BLOCKS_NAMED])
        more = f" and {len(bad) - BLOCKS_NAMED} more" if len(bad) > BLOCKS_NAMED else ""
        raise BlockMismatchError(
            f"{where}: block{'s' if len(bad) > 1 else ''} {named}{more} of {len(blocks.crc32)} fail"
            f"{'' if len(bad) > 1 else 's'} its CRC-32 (blocks of {b} bytes)",
            blocks=bad,
            block_bytes=b,
        )


class RangedData:
    """A section's data file on storage, read by byte range: the blocks a read touches are read and
    checked against their CRC-32 (``Blocks``) before any byte of them is used. Stands in for the
    whole file's buffer where a reader needs only parts of it (``buf[a:b]`` reads those bytes).

    Args:
        storage, path: the file (relative to the storage's root).
        size: its size as the manifest records it.
        blocks: its block checksums, from the section's index.
    """

    def __init__(self, storage: Storage, path: str, size: int, blocks: Blocks):
        if len(blocks.crc32) != math.ceil(size / blocks.size):
            raise CorruptCheckpointError(
                f"{storage.uri(path)}: its index has {len(blocks.crc32)} block checksums for "
                f"{size} bytes in blocks of {blocks.size}"
            )
        self.storage = storage
        self.path = path
        self.nbytes = size
        self.blocks = blocks
        self.bytes_read = 0
        """Bytes read so far (whole blocks)."""
        self._last: tuple[int, np.ndarray] | None = None
        """The last block read (verified): the next small entry usually lies in it too."""

    def read(self, start: int, nbytes: int) -> np.ndarray:
        """Bytes ``[start, start + nbytes)`` of the file, every block they touch verified.

        Raises:
            CorruptCheckpointError: a block fails its checksum, or the file is shorter than recorded.
        """
        if start < 0 or nbytes < 0 or start + nbytes > self.nbytes:
            raise CorruptCheckpointError(
                f"{self.storage.uri(self.path)}: bytes {start}..{start + nbytes} lie beyond its {self.nbytes} bytes"
            )
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        b = self.blocks.size
        first, last = start // b, (start + nbytes - 1) // b
        lo, hi = first * b, min((last + 1) * b, self.nbytes)
        if first == last and self._last is not None and self._last[0] == first:
            return self._last[1][start - lo : start - lo + nbytes].copy()  # small entries side by side
        try:
            raw = self.storage.read_range(self.path, lo, hi - lo)  # type: ignore[attr-defined]
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.storage.uri(self.path)} is missing") from None
        if raw.nbytes != hi - lo:
            raise CorruptCheckpointError(
                f"{self.storage.uri(self.path)}: read {raw.nbytes} of the {hi - lo} bytes at {lo} (truncated)"
            )
        for i in range(first, last + 1):
            crc = crc32_of(raw[(i - first) * b : (i - first + 1) * b])
            if crc != self.blocks.crc32[i]:
                raise BlockMismatchError(
                    f"{self.storage.uri(self.path)}: block {i} (bytes {i * b}..) fails its checksum "
                    f"(crc32 {crc:#x} != {self.blocks.crc32[i]:#x})",
                    blocks=[i],
                    block_bytes=b,
                )
        self.bytes_read += raw.nbytes
        self._last = (last, raw[(last - first) * b :].copy())
        out = raw[start - lo : start - lo + nbytes]
        # A small part of a large read is copied out, so that holding it does not hold whole blocks.
        return out.copy() if nbytes * 2 < raw.nbytes else out

    def __getitem__(self, s: slice) -> np.ndarray:
        if not isinstance(s, slice) or s.step not in (None, 1) or s.start is None or s.stop is None:
            raise TypeError("RangedData reads contiguous byte ranges: data[start:stop]")
        return self.read(s.start, s.stop - s.start)


def read_region(
    data: np.ndarray | RangedData, entry: _codec.TensorEntry, offsets: list[int], lengths: list[int]
) -> Any:
    """The part of the tensor ``entry`` at ``offsets`` of size ``lengths`` (a ``torch.Tensor``),
    reading from ``data`` only the rows of its first dimension that the part spans (only the part
    itself when it is whole rows). A view of ``data`` when that is an array, a new tensor otherwise."""
    import warnings

    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index

    from cf_ray._engine.format import codec as _codec

    dtype = _codec.torch_dtype(entry.dtype)
    shape = list(entry.shape)
    if not shape or math.prod(lengths) == 0:
        t = _codec.view(data, entry, copy=False, readonly_ok=True)
        assert isinstance(t, torch.Tensor)
        return narrow_tensor_by_index(t, offsets, lengths) if shape else t
    row = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
    raw = data[entry.offset + offsets[0] * row : entry.offset + (offsets[0] + lengths[0]) * row]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        rows = torch.from_numpy(raw).view(dtype).reshape([lengths[0], *shape[1:]])
    return narrow_tensor_by_index(rows, [0, *offsets[1:]], lengths)


def load_section(
    storage: Storage, directory: str, manifest: Manifest, section: str, *, ranged: bool = False
) -> Section:
    """One section of a committed checkpoint, every file verified before it is parsed.

    Args:
        ranged: read the data file only where it is used (its ``buf`` is a :class:`RangedData`),
            when its index has block checksums; the whole file otherwise.
    """
    names = manifest.sections.get(section)
    if names is None or "index" not in names or "data" not in names:
        raise CorruptCheckpointError(f"checkpoint {storage.uri(directory)} has no section {section!r}")
    index = read_verified(storage, directory, manifest, names["index"])
    tree, entries, blocks = parse_index_blocks(index, storage.uri(f"{directory}/{names['index']}"))
    info = manifest.files.get(names["data"])
    buf: np.ndarray | RangedData
    if ranged and blocks is not None and info is not None and callable(getattr(storage, "read_range", None)):
        if is_symlink(storage, f"{directory}/{names['data']}"):
            raise UnsafeCheckpointError(f"{storage.uri(directory)}/{names['data']} is a symbolic link")
        buf = RangedData(storage, f"{directory}/{names['data']}", info.size, blocks)
    else:
        buf = read_verified(storage, directory, manifest, names["data"], blocks=blocks)
    for e in entries:
        if e.offset + e.nbytes > buf.nbytes:
            raise CorruptCheckpointError(f"entry {e.name} lies beyond the end of {names['data']}")
    return Section(tree, entries, buf, blocks=blocks)


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
