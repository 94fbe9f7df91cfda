"""The manifest that commits a checkpoint (its self-checksum and strict schema), the commit, the
pointers registered with Ray Train, and reading a manifest back.

A checkpoint exists only when its ``MANIFEST.json`` exists. The manifest lists every file with its
size and CRC-32; readers verify both before parsing a single byte of a file, and fall back to the
previous committed checkpoint on any mismatch. The manifest checks itself too (format version 2): it
carries a SHA-256 of its own canonical JSON, and a strict schema binds every file name to its section
and generation, so one damaged bit can never make rank 0 load rank 1's state; any damage raises
:class:`~cf_ray.errors.CorruptCheckpointError` naming the field and the location. File names carry the *generation* (one per start of
the worker group) so that a straggling writer of an earlier generation can never overwrite a file
that a newer manifest refers to.

No torch: the controller writes and reads manifests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from cf_ray._engine.format.layout import (
    CHECKPOINTS,
    DIR_RE,
    FILE_RE,
    FINAL_MODEL_FILE,
    FINAL_SECTION,
    FORMAT,
    KINDS,
    LATEST,
    MANIFEST,
    MAX_WORLD_SIZE,
    POINTER,
    SECTION_RE,
    SHARED,
    VERSION,
    pointer_dir,
    rank_section,
    section_files,
    step_dir,
)
from cf_ray._engine.storage.base import FileInfo, Storage
from cf_ray.errors import CfRayError, CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError

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
    """Why it was taken: scheduled, epoch, manual, preempt, final. ``final`` is the kind of both what
    ``finish()`` writes: the full checkpoint of the final state (``step_<n>/``, resumable) and the
    consolidated model (``final_<n>/``, :attr:`final_model`)."""
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

    @property
    def final_model(self) -> bool:
        """Whether this is a final model's manifest (``final_<n>/``: one ``model`` section, no state to
        resume from), not a full checkpoint. Told by the section, never by ``kind`` alone: the full
        checkpoint ``finish()`` takes of the final state is of kind ``final`` too."""
        return self.kind == "final" and FINAL_SECTION in self.sections

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
    if kind == "final" and FINAL_SECTION in raw_sections:  # a final model; a full final checkpoint has no "model"
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
        if not SECTION_RE.match(sec):
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
    if not isinstance(name, str) or not FILE_RE.match(name) or ".." in name:
        raise UnsafeCheckpointError(f"file name {name!r} in a manifest is not a plain file name; refusing it")


def commit(storage: Storage, directory: str, manifest: Manifest) -> None:
    """Write the manifest (the commit point), then the ``latest`` hint."""
    storage.write_file(f"{directory}/{MANIFEST}", [manifest.to_bytes()])
    try:
        storage.write_file(LATEST, [directory.rsplit("/", 1)[-1].encode()])
    except Exception as e:  # noqa: BLE001 - the hint is optional; the manifest is the truth
        logger.warning("cf_ray: could not update the 'latest' hint (%s); the checkpoint is committed", e)


#: The format version written into every pointer.
POINTER_VERSION = 1


def write_pointer(storage: Storage, step: int) -> str:
    """A directory ``registered/step_<step>`` holding only a pointer to ``checkpoints/step_<step>``:
    what is registered with Ray Train. Ray Train refuses to start a run again when a directory it
    lists is gone, so cf_ray never deletes a pointer; keep-last keeps the checkpoint a pointer names
    while the pointer is there (Ray's ``num_to_keep`` deletes pointers), so what Ray lists loads."""
    directory = pointer_dir(step)
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
        or not DIR_RE.match(target.removeprefix(f"{CHECKPOINTS}/"))
        or not target.startswith(f"{CHECKPOINTS}/")
    ):
        raise UnsafeCheckpointError(f"checkpoint pointer names {target!r}, which is not a checkpoint of this run")
    version, step = d.get("version"), d.get("step")
    if not _is_int(version) or not 1 <= version <= VERSION:
        raise CorruptCheckpointError(f"malformed checkpoint pointer: version {version!r}")
    if not _is_int(step) or step < 0 or target != step_dir(step):
        raise CorruptCheckpointError(f"malformed checkpoint pointer: it names {target!r} for step {step!r}")
    return target


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
            if storage.is_symlink(p):
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
    dm = DIR_RE.match(posixpath.basename(directory.rstrip("/")))
    if dm and (int(dm.group(2)) != m.step or (dm.group(1) == "final") != m.final_model):
        raise CorruptCheckpointError(
            f"manifest {where} is malformed: field 'step'/'kind': it says step {m.step}, "
            f"{'a final model' if m.final_model else 'a full checkpoint'} of kind {m.kind!r}, but lies in {dm.group(0)}"
        )
    return m
