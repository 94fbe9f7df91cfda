"""CRC-32 arithmetic over a section's blocks (``format/blocks.py``'s ``BLOCK_BYTES``): the CRC-32 of a
whole buffer from its blocks' (zlib's ``crc32_combine``: isal's, in C, where it is installed, else in
pure Python, a few dozen operations per block, which for a section of thousands of blocks holds the
GIL for a noticeable part of every checkpoint), and
:class:`BlockCheck`, which checks each block of a buffer against the index's CRC-32s as the bytes
land (while they are in the CPU's cache: no second pass over memory)."""

from __future__ import annotations

from cf_ray._engine.storage.base import _crc32

try:
    from isal.isal_zlib import crc32_combine as _combine_c
except ImportError:  # pragma: no cover - isal is a dependency; the pure-Python form is the fallback
    _combine_c = None

_POLY = 0xEDB88320


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_SHIFT_CACHE: dict[int, list[int]] = {}


def _shift_operator(nbytes: int) -> list[int]:
    """The GF(2) operator that appends ``nbytes`` zero bytes to a CRC-32 (zlib's crc32_combine)."""
    op = _SHIFT_CACHE.get(nbytes)
    if op is not None:
        return op
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    result = [1 << n for n in range(32)]  # identity
    n = nbytes
    while n:
        even = _gf2_square(odd)
        if n & 1:
            result = [_gf2_times(even, result[k]) for k in range(32)]
        n >>= 1
        if not n:
            break
        odd = _gf2_square(even)
        if n & 1:
            result = [_gf2_times(odd, result[k]) for k in range(32)]
        n >>= 1
    if len(_SHIFT_CACHE) < 64:
        _SHIFT_CACHE[nbytes] = result
    return result


def _combine_py(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine`` in Python (the fallback, and what the tests hold isal's against)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_shift_operator(len2), crc1) ^ crc2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's algorithm)."""
    if len2 <= 0:
        return crc1
    return _combine_c(crc1, crc2, len2) if _combine_c is not None else _combine_py(crc1, crc2, len2)


def combine_blocks(crcs: list[int], block: int, total: int) -> int:
    """The CRC-32 of a whole buffer of ``total`` bytes from the CRC-32 of each ``block`` bytes of it."""
    combine = _combine_c if _combine_c is not None else _combine_py
    crc = 0
    for k, c in enumerate(crcs):
        crc = combine(crc, c, min(block, total - k * block))
    return crc


class BlockMismatch(ValueError):
    """A block's bytes are not those its index names (``where``: which block, which bytes)."""


class BlockCheck:
    """Checks ``buf`` block by block as it is filled front to back: call :meth:`landed` with how
    many bytes are in so far (each whole block is checksummed once, then), :meth:`finish` at the end.

    Args:
        buf: the buffer being filled (a writable memoryview of bytes).
        block: bytes per block.
        expected: the CRC-32 of each block (the index's), or ``None`` when the index has none: then
            only the whole buffer's ``crc32`` is checked, at the end.
        crc32: the CRC-32 of the whole buffer.
    """

    def __init__(self, buf: memoryview, block: int, expected: list[int] | None, crc32: int):
        self._buf = buf
        self._block = block
        self._expected = expected
        self._crc32 = crc32
        self._got: list[int] = []
        self._done = 0  # bytes checksummed so far (whole blocks)
        n = buf.nbytes
        if expected is not None and len(expected) != -(-n // block):
            raise BlockMismatch(f"the index names {len(expected)} blocks, the data has {-(-n // block)}")

    def landed(self, upto: int) -> None:
        """Bytes ``[0, upto)`` are in: checksum every whole block among them not yet checked."""
        n = self._buf.nbytes
        while self._done + self._block <= upto or (upto >= n and self._done < n):
            end = min(self._done + self._block, n)
            crc = _crc32(self._buf[self._done : end])
            k = len(self._got)
            if self._expected is not None and crc != self._expected[k]:
                raise BlockMismatch(
                    f"block {k} (bytes {self._done}-{end}) has CRC-32 {crc:#010x}, its index says "
                    f"{self._expected[k]:#010x}"
                )
            self._got.append(crc)
            self._done = end

    def finish(self) -> None:
        """Every byte is in: check what is left and the whole buffer's CRC-32."""
        self.landed(self._buf.nbytes)
        whole = combine_blocks(self._got, self._block, self._buf.nbytes)
        if whole != self._crc32:
            raise BlockMismatch(f"the data has CRC-32 {whole:#010x}, expected {self._crc32:#010x}")


__all__ = ["BlockCheck", "BlockMismatch", "combine_blocks", "crc32_combine"]
