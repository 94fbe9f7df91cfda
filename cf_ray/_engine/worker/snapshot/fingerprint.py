"""Fingerprints of tracked objects: what a snapshot records of each one, and what a restore checks
against the object's live state once it is loaded (``restore/restorer.py``).

A fingerprint is cheap by design, since the snapshot side runs on every checkpoint: it covers the
object's whole *structure* (every key, every non-tensor value, each tensor's dtype, shape and kind)
and a *sample* of each tensor's bytes: all of them up to :data:`FULL_BYTES`, else
:data:`WINDOWS` windows of :data:`WINDOW_BYTES` spread over it (start, middle parts, end). So an
object that was not restored (a fresh module, an optimizer without state, a scheduler at epoch 0,
a sampler at position 0), or whose ``load_state_dict`` ignores part of what it is given, is caught;
a change of a few bytes in the middle of a large tensor may not be (the files' CRC-32 catches
damage on storage; this is about the *load*).

The snapshot side (:func:`section_fingerprints`) runs on the snapshot's background thread, on the
copied bytes in the arena, after the copy: never on the training thread. The restore side
(:func:`object_fingerprint`) flattens the live ``state_dict()`` and samples the same bytes (a few
small device-to-host copies per tensor on GPU).

Both walk the encoded tree of :mod:`cf_ray._engine.format.codec` in a canonical order (dict keys
sorted, int-keyed dicts by key), so the order in which an object lists its keys does not matter.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format import layout as _layout

#: Tensors up to this many bytes are hashed whole.
FULL_BYTES = 4096
#: Larger ones: this many windows ...
WINDOWS = 4
#: ... of this many bytes each.
WINDOW_BYTES = 1024
#: Key of the fingerprints in a section's state tree (beside ``objects``, ``rng``, ...).
KEY = "fingerprints"
#: The tree paths whose objects are fingerprinted: replicated (``objects`` of the shared section,
#: or data ``objects`` of a rank section) and per-rank model state (``state``).
PATHS = (_layout.OBJECTS, _layout.STATE)

_REFS = ("__cf_tensor__", "__cf_ndarray__")
_DICT = "__cf_dict__"


def windows(nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges of a tensor of ``nbytes`` that are hashed."""
    if nbytes <= FULL_BYTES:
        return [(0, nbytes)]
    last = nbytes - WINDOW_BYTES
    starts = sorted({round(i * last / (WINDOWS - 1)) for i in range(WINDOWS)})
    return [(s, s + WINDOW_BYTES) for s in starts]


def _fingerprint(tree: Any, entries: list[_codec.TensorEntry], sample: Callable[[int], int]) -> str:
    """sha1 over the canonical structure; ``sample(i)`` is the CRC-32 of entry ``i``'s windows."""

    def canon(v: Any) -> Any:
        if isinstance(v, list):
            return [canon(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1:
            ((k, x),) = v.items()
            if k in _REFS and isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(entries):
                e = entries[x]
                return ["T", e.kind, e.dtype, list(e.shape), sample(x)]
            if k == _DICT and isinstance(x, list):
                pairs = [[canon(a), canon(b)] for a, b in x]
                return {_DICT: sorted(pairs, key=lambda p: json.dumps(p[0], sort_keys=True))}
        return {str(k): canon(x) for k, x in v.items()}

    body = json.dumps(canon(tree), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(body.encode()).hexdigest()


def _crc_windows(raw: np.ndarray) -> int:
    """CRC-32 of the windows in order (chained: the same as the CRC-32 of their concatenation)."""
    crc = 0
    for a, b in windows(raw.nbytes):
        crc = zlib.crc32(raw[a:b].data, crc)
    return crc


def section_fingerprints(
    tree: Mapping[str, Any], entries: list[_codec.TensorEntry], arena: np.ndarray
) -> dict[str, dict[str, str]]:
    """The fingerprints of the objects of one snapshot section, from its encoded tree and the
    bytes in its arena: ``{path: {object name: fingerprint}}`` for each of :data:`PATHS` present."""

    def sample(i: int) -> int:
        e = entries[i]
        return _crc_windows(arena[e.offset : e.offset + e.nbytes])

    out: dict[str, dict[str, str]] = {}
    for path in PATHS:
        objs = tree.get(path)
        if isinstance(objs, dict):
            out[path] = {name: _fingerprint(sub, entries, sample) for name, sub in objs.items()}
    return out


def _leaf_bytes(leaf: torch.Tensor | np.ndarray, nbytes: int) -> np.ndarray:
    """The sampled windows of one live tensor or array, as host bytes, concatenated."""
    if isinstance(leaf, np.ndarray):
        raw = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
        return np.concatenate([raw[a:b] for a, b in windows(nbytes)]) if nbytes else raw
    flat = leaf.detach().contiguous().reshape(-1)
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    parts = torch.cat([raw[a:b] for a, b in windows(nbytes)])
    return parts.cpu().numpy()


def object_fingerprint(state: Any) -> str:
    """The fingerprint of a live object's ``state_dict()`` (what :func:`section_fingerprints`
    recorded for it when the state was the same)."""
    flat = _codec.flatten(state)

    def sample(i: int) -> int:
        e = flat.entries[i]
        return zlib.crc32(np.ascontiguousarray(_leaf_bytes(flat.leaves[i], e.nbytes)).data)

    return _fingerprint(flat.tree, flat.entries, sample)


__all__ = [
    "FULL_BYTES",
    "KEY",
    "PATHS",
    "WINDOWS",
    "WINDOW_BYTES",
    "object_fingerprint",
    "section_fingerprints",
    "windows",
]
