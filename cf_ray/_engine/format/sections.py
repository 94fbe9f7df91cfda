"""A section's two files: the index (its tree and tensor table, with the block checksums) and the
data, written (phase 2, from an arena or straight from a snapshot slot), read with every byte
verified against the manifest before it is parsed (:func:`read_verified`, :func:`load_section`),
and checked whole (:func:`verify_all`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cf_ray._engine.format.blocks import (
    BLOCK_BYTES,
    BLOCKS_NAMED,
    BlockMismatchError,
    Blocks,
    RangedData,
    bad_blocks,
    block_crcs,
    split_blocks,
    with_blocks,
)
from cf_ray._engine.format.commit import Manifest, UnsafeCheckpointError, _is_int
from cf_ray._engine.format.layout import section_files
from cf_ray._engine.storage.base import FileInfo, Storage, chunked, crc32_of
from cf_ray.errors import CorruptCheckpointError, UnsafePathError

if TYPE_CHECKING:
    # imports torch; the controller and holder processes never need it
    from cf_ray._engine.format import codec as _codec


def encode_index(flat: _codec.Flat, blocks: list[int] | None = None) -> bytes:
    """A section's index: its tensor table and tree as JSON, with the CRC-32 of every block of its
    data (:data:`~cf_ray._engine.format.blocks.BLOCK_BYTES`) when ``blocks`` are given."""
    index = json.dumps(
        {"entries": [e.to_json() for e in flat.entries], "tree": flat.tree}, separators=(",", ":")
    ).encode()
    return index if blocks is None else with_blocks(index, blocks)


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
    """Phase 2 of one section held in a snapshot slot (``memory/slots.py``): ``index`` already carries
    the block checksums and ``crc32`` is the data's, both computed by the worker as it copied, so the
    data is written straight from the slot and not read again where the backend can
    (``Storage.write_buffer``); a backend that checksums what it writes reports that CRC-32, which
    must agree with the worker's. Returns the manifest's file infos and the bytes copied on the host
    by the write."""
    data_name, index_name = section_files(generation, section)
    info_data, copied = storage.write_buffer(f"{directory}/{data_name}", data, crc32)
    if info_data.crc32 != crc32:
        raise CorruptCheckpointError(
            f"section {section}: the snapshot's bytes changed in memory after they were checksummed "
            f"(CRC-32 {info_data.crc32:#010x}, expected {crc32:#010x})"
        )
    info_index = storage.write_file(f"{directory}/{index_name}", [index])
    return {data_name: info_data, index_name: info_index}, copied


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
        return d["tree"], entries, _blocks_of(d)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        # UnicodeDecodeError and json.JSONDecodeError are ValueErrors.
        raise CorruptCheckpointError(f"index {where} is malformed: {type(e).__name__}: {e}") from None


def index_blocks(raw: bytes | np.ndarray, where: str) -> Blocks | None:
    """Only an index's block checksums (``None`` when it has none): what a holder checks bytes
    against. Parses no tensor entry (an entry's dtype may name a torch type: a holder never imports
    torch — that import, on the writer's thread, held a just-in-time checkpoint past its deadline)."""
    try:
        d = json.loads(bytes(raw))
        if not isinstance(d, dict):
            raise ValueError("expected an object")
        return _blocks_of(d)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"index {where} is malformed: {type(e).__name__}: {e}") from None


def _blocks_of(d: dict) -> Blocks | None:
    if "blocks" not in d:
        return None
    b = d["blocks"]
    if (
        not isinstance(b, dict)
        or not _is_int(b.get("bytes"))
        or b["bytes"] < 1
        or not isinstance(b.get("crc32"), list)
        or not all(_is_int(c) and 0 <= c < 2**32 for c in b["crc32"])
    ):
        raise ValueError("'blocks' is not {'bytes': int >= 1, 'crc32': [int, ...]}")
    return Blocks(b["bytes"], tuple(b["crc32"]))


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
    if ranged and blocks is not None and info is not None and storage.ranged_reads:
        if storage.is_symlink(f"{directory}/{names['data']}"):
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
