"""Block checksums of a section's data file: the block size, the CRC-32 of every block, how an index
carries them, checking bytes against them (:func:`verify_blocks`, :class:`BlockMismatchError`), and
reading a data file by range with every block it touches checked (:class:`RangedData`,
:func:`read_region`). The worker's copy engine asks here where blocks begin and end
(:func:`windows`, :func:`blocks_of`) instead of computing block layouts itself.

No torch at import (:func:`read_region` imports it when called): the holder calls these.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cf_ray._engine.storage.base import Storage, crc32_of
from cf_ray.errors import CorruptCheckpointError

if TYPE_CHECKING:
    # imports torch; the controller and holder processes never need it
    from cf_ray._engine.format import codec as _codec


#: Bytes per checksummed block of a section's data file: a ranged read (a restore at another number
#: of ranks reading only the shards it needs, DCP reading through ``CfRayReader``) checks the CRC-32
#: of every block it touches, so it never reads more than one block beyond each range it needs.
BLOCK_BYTES = 1 << 18


def block_crcs(buf: np.ndarray, block: int = BLOCK_BYTES) -> list[int]:
    """CRC-32 of every ``block`` bytes of ``buf`` (the last block may be shorter)."""
    return [crc32_of(buf[i : i + block]) for i in range(0, buf.nbytes, block)]


def windows(nbytes: int, blocks: int = 32) -> Iterator[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of ``blocks`` whole blocks each (the last one shorter) that cover
    ``nbytes`` bytes: the :func:`block_crcs` of each range, in order, are the CRC-32s of every block
    (what a copy checksummed window by window, while the bytes are in the CPU's cache, gives)."""
    step = blocks * BLOCK_BYTES
    for start in range(0, nbytes, step):
        yield start, min(nbytes, start + step)


def blocks_of(offset: int, nbytes: int) -> range:
    """The indices of the blocks that bytes ``[offset, offset + nbytes)`` lie in (an empty range of
    bytes: the block of ``offset``)."""
    return range(offset // BLOCK_BYTES, (offset + max(nbytes, 1) - 1) // BLOCK_BYTES + 1)


def block_crc(buf: np.ndarray, k: int) -> int:
    """The CRC-32 of block ``k`` of ``buf`` (taken again after bytes of it changed)."""
    return crc32_of(buf[k * BLOCK_BYTES : (k + 1) * BLOCK_BYTES])


def data_crc32(crcs: list[int], nbytes: int) -> int:
    """The CRC-32 of a section's ``nbytes`` of data from the CRC-32s of its blocks (no pass over the
    bytes: zlib's ``crc32_combine``, ``memory/crc.py``)."""
    from cf_ray._engine.memory.crc import combine_blocks

    return combine_blocks(crcs, BLOCK_BYTES, nbytes)


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


@dataclass(frozen=True, slots=True)
class Blocks:
    """The block checksums of a section's data file (absent from checkpoints of before them)."""

    size: int
    """Bytes per block."""
    crc32: tuple[int, ...]


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
            raw = self.storage.read_range(self.path, lo, hi - lo)
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
