"""State trees to (JSON tree, tensor table) and back, with no pickle anywhere.

A ``state_dict`` is a tree of dicts, lists, tuples, scalars, tensors and numpy arrays (optimizer
state has int keys, RNG states are tuples and arrays). Checkpoints must never run code when they
are loaded, so cf_ray stores the tree as JSON with tagged nodes for the few non-JSON types it
supports, and every tensor or array as raw bytes in one flat buffer (the *arena*) described by a
table of ``TensorEntry``. Anything else is refused at save time with the path of the offending
value, which is far better than a checkpoint that cannot be loaded.
"""

from __future__ import annotations

import base64
import contextlib
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cf_ray.errors import CfRayError, CorruptCheckpointError

#: Arena offsets are multiples of this, so every dtype view of a slice is aligned.
ALIGN = 64

_TENSOR = "__cf_tensor__"
_NDARRAY = "__cf_ndarray__"
_TUPLE = "__cf_tuple__"
_DICT = "__cf_dict__"
_NPSCALAR = "__cf_npscalar__"
_DTYPE = "__cf_dtype__"
_DEVICE = "__cf_device__"
_BYTES = "__cf_bytes__"
_FLOAT = "__cf_float__"
_STATEDICT = "__cf_state_dict__"  # a module's state_dict: an OrderedDict with a _metadata attribute
_TAGS = (_TENSOR, _NDARRAY, _TUPLE, _DICT, _NPSCALAR, _DTYPE, _DEVICE, _BYTES, _FLOAT, _STATEDICT)

# Only these dtypes are accepted from a file: a name read from disk is looked up here, never with
# getattr on a module.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TORCH_DTYPES[_name] = getattr(torch, _name)

_NUMPY_DTYPES = {
    np.dtype(n).str: np.dtype(n)
    for n in ("f8", "f4", "f2", "i8", "i4", "i2", "i1", "u8", "u4", "u2", "u1", "b1", "c8", "c16")
}


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """Where a saved local shard of a sharded tensor (a DTensor, e.g. FSDP2's) lies in the whole.

    The entry's own ``shape`` is the local shard's; ``global_shape`` is the whole tensor's and
    ``offsets`` the shard's first element in it (per dimension).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placements: str = ""
    """How the tensor was laid out, for messages only (``"(Shard(dim=0),)"``)."""
    owner: int = -1
    """The global rank that held the shard (``-1``: not known); its section is ``rank_<owner>``."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives in an arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    kind: str  # "torch" or "numpy"
    shard: ShardInfo | None = None
    """Set when the tensor is the local shard of a sharded tensor (``shape`` is the shard's)."""

    def to_json(self) -> dict:
        d = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "kind": self.kind,
        }
        if self.shard is not None:
            d["global_shape"] = list(self.shard.global_shape)
            d["global_offsets"] = list(self.shard.offsets)
            d["placements"] = self.shard.placements
            d["owner"] = self.shard.owner
        return d

    @staticmethod
    def from_json(d: dict) -> TensorEntry:
        try:
            entry = TensorEntry(
                str(d["name"]),
                str(d["dtype"]),
                tuple(int(s) for s in d["shape"]),
                int(d["offset"]),
                int(d["nbytes"]),
                str(d["kind"]),
                _shard_from_json(d),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed tensor entry {d!r}: {e}") from None
        if (
            entry.kind not in ("torch", "numpy")
            or entry.offset < 0
            or entry.nbytes < 0
            or any(s < 0 for s in entry.shape)
        ):
            raise ValueError(f"malformed tensor entry {d!r}")
        if entry.kind == "torch" and entry.dtype not in _TORCH_DTYPES:
            raise ValueError(f"unsupported tensor dtype {entry.dtype!r} in entry {entry.name!r}")
        if entry.kind == "numpy" and entry.dtype not in _NUMPY_DTYPES:
            raise ValueError(f"unsupported array dtype {entry.dtype!r} in entry {entry.name!r}")
        expected = math.prod(entry.shape) * element_size(entry)
        if expected != entry.nbytes:
            raise ValueError(
                f"entry {entry.name!r}: shape {entry.shape} needs {expected} bytes, table says {entry.nbytes}"
            )
        shard = entry.shard
        if shard is not None and (
            entry.kind != "torch"
            or len(shard.global_shape) != len(entry.shape)
            or len(shard.offsets) != len(entry.shape)
            or any(o < 0 or g < 0 or o + n > g for o, n, g in zip(shard.offsets, entry.shape, shard.global_shape))
        ):
            raise ValueError(f"entry {entry.name!r}: shard {shard} does not fit its shape {entry.shape}")
        return entry


def _shard_from_json(d: dict) -> ShardInfo | None:
    if "global_shape" not in d:
        return None
    return ShardInfo(
        tuple(int(s) for s in d["global_shape"]),
        tuple(int(s) for s in d["global_offsets"]),
        str(d.get("placements", "")),
        int(d.get("owner", -1)),
    )


def element_size(entry: TensorEntry) -> int:
    if entry.kind == "torch":
        return torch.empty((), dtype=_TORCH_DTYPES[entry.dtype]).element_size()
    return _NUMPY_DTYPES[entry.dtype].itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(slots=True)
class Flat:
    """A flattened state tree: JSON-able ``tree`` and the leaves that hold bytes."""

    tree: Any
    entries: list[TensorEntry]
    leaves: list[torch.Tensor | np.ndarray]

    @property
    def nbytes(self) -> int:
        return self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0

    def layout_key(self) -> tuple:
        """Equal keys mean the same arena layout can be reused."""
        return tuple((e.name, e.dtype, e.shape, e.kind) for e in self.entries)


def flatten(tree: Any, *, offset: int = 0, prefix: str = "") -> Flat:
    """Split ``tree`` into a JSON tree and a table of byte leaves laid out from ``offset``.

    Raises:
        TypeError: a value of a type cf_ray cannot store safely; the message gives its path.
    """
    entries: list[TensorEntry] = []
    leaves: list[Any] = []
    cursor = [_align(offset)]

    def leaf(value, path: str, kind: str, shard: ShardInfo | None = None) -> dict:
        if kind == "torch":
            if value.is_sparse or value.layout != torch.strided:
                raise TypeError(
                    f"cannot checkpoint {path}: sparse or non-strided tensors are not supported; "
                    "convert it with .to_dense() in state_dict()"
                )
            dtype = str(value.dtype).removeprefix("torch.")
            if dtype not in _TORCH_DTYPES:
                raise TypeError(f"cannot checkpoint {path}: dtype {value.dtype} is not supported")
            nbytes = value.numel() * value.element_size()
            shape = tuple(value.shape)
        else:
            if value.dtype.str not in _NUMPY_DTYPES:
                raise TypeError(
                    f"cannot checkpoint {path}: numpy dtype {value.dtype} is not supported; store numbers, not objects"
                )
            dtype, nbytes, shape = value.dtype.str, value.nbytes, tuple(value.shape)
        entry = TensorEntry(path, dtype, shape, cursor[0], nbytes, kind, shard)
        cursor[0] = _align(cursor[0] + nbytes)
        entries.append(entry)
        leaves.append(value)
        return {(_TENSOR if kind == "torch" else _NDARRAY): len(entries) - 1}

    def enc(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {_FLOAT: repr(v)}
        if isinstance(v, torch.Tensor):
            if is_dtensor(v):
                local, shard = dtensor_shard(v, path)
                return leaf(local, path, "torch", shard)
            return leaf(v.detach(), path, "torch")
        if isinstance(v, np.ndarray):
            return leaf(v, path, "numpy")
        if isinstance(v, np.generic):
            if v.dtype.str not in _NUMPY_DTYPES:
                raise TypeError(f"cannot checkpoint {path}: numpy scalar of dtype {v.dtype}")
            return {_NPSCALAR: v.dtype.str, "v": enc(v.item(), path)}
        if isinstance(v, torch.dtype):
            return {_DTYPE: str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {_DEVICE: str(v)}
        if isinstance(v, (bytes, bytearray)):
            return {_BYTES: base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, tuple):  # torch.Size included
            return {_TUPLE: list(v) if _all_ints(v) else [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return list(v) if _all_ints(v) else [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            meta = getattr(v, "_metadata", None)
            if isinstance(meta, dict):
                # Keep the per-module versions that load_state_dict uses for old formats.
                return {_STATEDICT: enc(dict(v), path), "meta": enc(dict(meta), f"{path}._metadata")}
            if all(isinstance(k, str) and k not in _TAGS for k in v):
                return {k: enc(x, f"{path}.{k}" if path else k) for k, x in v.items()}
            return {_DICT: [[enc(k, f"{path}<key>"), enc(x, f"{path}[{k!r}]")] for k, x in v.items()]}
        raise TypeError(
            f"cannot checkpoint {path or '<root>'}: values of type {type(v).__module__}.{type(v).__qualname__} "
            "are not stored (cf_ray never pickles). Return tensors, numpy arrays, numbers, strings, "
            "lists, tuples and dicts from state_dict()."
        )

    return Flat(enc(tree, prefix), entries, leaves)


def _all_ints(v: tuple | list) -> bool:
    """Whether every item is a plain ``int`` (each encodes as itself): Python's RNG state is a tuple of
    625 of them, which item by item took most of a snapshot's flattening on the training thread."""
    return all(type(x) is int for x in v)


def is_dtensor(v: Any) -> bool:
    """Whether ``v`` is a ``torch.distributed.tensor.DTensor`` (no import when none can exist)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(v, cls)


def dtensor_shard(v: Any, path: str) -> tuple[torch.Tensor, ShardInfo]:
    """The local shard of a DTensor (a view, detached) and where it lies in the whole tensor.

    Raises:
        TypeError: the DTensor has a ``Partial`` placement (pending reductions are not state), or
            more than one local chunk.
    """
    try:
        chunks = v.__create_chunk_list__()  # DCP's protocol: the local shard's offsets and sizes
    except Exception as e:  # noqa: BLE001 - a Partial placement raises here
        raise TypeError(f"cannot checkpoint {path}: DTensor with placements {v.placements}: {e}") from None
    if len(chunks) != 1:
        raise TypeError(f"cannot checkpoint {path}: a DTensor with {len(chunks)} local chunks is not supported")
    local = v.to_local().detach()
    if tuple(chunks[0].sizes) != tuple(local.shape):
        raise TypeError(f"cannot checkpoint {path}: local shard {tuple(local.shape)} != chunk {tuple(chunks[0].sizes)}")
    owner = -1
    with contextlib.suppress(Exception):  # no default process group: unknown
        import torch.distributed as dist

        owner = dist.get_rank() if dist.is_initialized() else -1
    return local, ShardInfo(tuple(v.shape), tuple(int(o) for o in chunks[0].offsets), str(tuple(v.placements)), owner)


def unflatten(tree: Any, get: Callable[[int, TensorEntry], Any], entries: list[TensorEntry]) -> Any:
    """Rebuild a state tree; ``get(i, entry)`` returns the tensor or array of entry ``i``.

    Raises:
        CorruptCheckpointError: ``tree`` (read from a file) is not a tree that :func:`flatten` writes:
            a bad tag, a reference out of range, an unhashable key, bad base64, ... Never a bare
            ``KeyError``/``TypeError``/``ValueError``.
    """
    try:
        return _decode(tree, get, entries)
    except CfRayError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError, RuntimeError) as e:
        # binascii.Error is a ValueError, RecursionError a RuntimeError (and so are torch's errors).
        raise CorruptCheckpointError(f"malformed state tree: {type(e).__name__}: {e}") from None


def _decode(tree: Any, get: Callable[[int, TensorEntry], Any], entries: list[TensorEntry]) -> Any:
    """:func:`unflatten` without the translation of errors."""

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1:
            ((k, x),) = v.items()
            if k in (_TENSOR, _NDARRAY):
                if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < len(entries):
                    raise ValueError(f"tensor reference {x!r} is out of range")
                return get(x, entries[x])
            if k == _TUPLE:
                return tuple(dec(y) for y in x)
            if k == _DICT:
                return {_hashable(dec(a)): dec(b) for a, b in x}
            if k == _DTYPE:
                if x not in _TORCH_DTYPES:
                    raise ValueError(f"unsupported dtype {x!r}")
                return _TORCH_DTYPES[x]
            if k == _DEVICE:
                return torch.device(str(x))
            if k == _BYTES:
                return base64.b64decode(x, validate=True)
            if k == _FLOAT:
                if x not in ("nan", "inf", "-inf"):
                    raise ValueError(f"unsupported float literal {x!r}")
                return float(x)
        if _STATEDICT in v:
            import collections

            out = collections.OrderedDict(dec(v[_STATEDICT]))
            meta = dec(v.get("meta", {}))
            if not isinstance(meta, dict):
                raise ValueError(f"state_dict metadata must be a dict, found {type(meta).__name__}")
            out._metadata = meta  # type: ignore[attr-defined]
            return out
        if _NPSCALAR in v:
            dt = v[_NPSCALAR]
            if dt not in _NUMPY_DTYPES:
                raise ValueError(f"unsupported numpy scalar dtype {dt!r}")
            return _NUMPY_DTYPES[dt].type(dec(v["v"]))
        return {k: dec(x) for k, x in v.items()}

    return dec(tree)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def view(buf: Any, entry: TensorEntry, *, copy: bool, readonly_ok: bool = False) -> torch.Tensor | np.ndarray:
    """The tensor or array of ``entry`` inside the uint8 buffer ``buf`` (a copy if ``copy``): an
    array, or what slices to one (:class:`~cf_ray._engine.format.blocks.RangedData` reads the slice from storage).

    A read-only ``buf`` (an object-store buffer) is copied unless ``readonly_ok``: the caller then
    promises only to read the tensor (``nn.Module.load_state_dict`` copies out of it).
    """
    if entry.offset + entry.nbytes > buf.nbytes:
        raise ValueError(f"entry {entry.name!r} ends at {entry.offset + entry.nbytes}, buffer has {buf.nbytes} bytes")
    raw = buf[entry.offset : entry.offset + entry.nbytes]
    if entry.kind == "numpy":
        arr = raw.view(_NUMPY_DTYPES[entry.dtype]).reshape(entry.shape)
        return arr.copy() if copy else arr
    dtype = _TORCH_DTYPES[entry.dtype]
    if copy or (not raw.flags.writeable and not readonly_ok):
        raw = raw.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        t = torch.from_numpy(raw)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return t.view(dtype).reshape(entry.shape)


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def select_keys(tree: Any, keys: set[str]) -> Any:
    """Keep only ``keys`` of an encoded top-level dict (a module state_dict included)."""
    if isinstance(tree, dict) and _STATEDICT in tree:
        return {_STATEDICT: select_keys(tree[_STATEDICT], keys), "meta": tree.get("meta", {})}
    if isinstance(tree, dict) and not any(k in _TAGS for k in tree):
        return {k: v for k, v in tree.items() if k in keys}
    return tree
