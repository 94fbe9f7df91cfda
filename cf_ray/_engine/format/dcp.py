"""A committed cf_ray checkpoint as a PyTorch Distributed Checkpoint (DCP) directory, for
``torch.distributed.checkpoint.load`` (``cf-ray export RUN --to dcp``).

Why the export writes data files and not only ``.metadata``: DCP's ``FileSystemReader`` reads every
tensor item with ``torch.load`` on its byte range (``filesystem.py``, ``read_data``), so an item
must be a ``torch.save`` stream; cf_ray's section data files are raw arenas (the bytes of each
tensor back to back, 64-byte aligned), which ``torch.load`` cannot read. So each tensor (or local
shard) is written once as ``torch.save`` into ``__<rank>_0.distcp`` (one file per saved rank, as
DCP names them) and the ``.metadata`` DCP expects is written last (a pickled
``torch.distributed.checkpoint.metadata.Metadata``: per key a ``TensorStorageMetadata`` with
global size, dtype and chunks, or ``BytesStorageMetadata``; ``storage_data`` maps each
``MetadataIndex(key, chunk offsets)`` to ``_StorageInfo(file, offset, length)``).

Keys are DCP's: the tracked objects by name at the top (``{"model": ..., "optimizer": ...}``), and
nested state flattened with dots the way DCP's default planner flattens a state dict (with
``traverse_state_dict``), so ``dcp.load({"model": get_model_state_dict(m), "optimizer":
get_optimizer_state_dict(m, opt)}, checkpoint_id=out)`` loads it at any number of ranks (DCP's
planner reshards), and ``dcp_to_torch_save`` consolidates it.

Without an export, :class:`CfRayReader` is a DCP ``StorageReader`` over the checkpoint itself:
``dcp.load(state_dict, storage_reader=CfRayReader(storage, "checkpoints/step_N"))`` builds the
same metadata from the sections' index files alone and reads each item's raw bytes straight from
the section data files, and only the rows a rank needs when a read is a range of whole rows (FSDP2's
``Shard(0)``): a load at another number of ranks reads the byte ranges that overlap its shards.
The index files are verified against the manifest; every block of a data file that a read touches
is checked against its CRC-32 (:class:`~cf_ray._engine.format.blocks.RangedData`; checkpoints written before block checksums
existed are read whole and verified whole).

Sharded tensors (FSDP2) contribute one chunk per rank (the rank's shard, at its global offsets;
empty shards and replicas at the same offsets are written once); whole tensors and other values
are taken from the first section that has them (replicated checkpoints: the ``shared`` section).
The export reads through :func:`manifest.load_section`, so every file is verified first.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.blocks import Blocks, RangedData, read_region
from cf_ray._engine.format.commit import Manifest, read_manifest
from cf_ray._engine.format.layout import OBJECTS, SHARED, STATE, rank_section
from cf_ray._engine.format.sections import load_section, parse_index_blocks, read_verified
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CfRayError, CorruptCheckpointError


@dataclass(frozen=True, slots=True)
class DcpExported:
    """What :func:`export_dcp` wrote."""

    path: str
    """The DCP directory."""
    step: int
    keys: int
    """Number of DCP keys (tensors and other values)."""
    chunks: int
    """Number of tensor chunks written."""
    size_bytes: int
    """Bytes of tensor data (before ``torch.save`` framing)."""


@dataclass(frozen=True, slots=True)
class _Shard:
    local: torch.Tensor
    shard: _codec.ShardInfo


@dataclass(frozen=True, slots=True)
class _Ref:
    """Where one saved tensor's bytes lie: a section data file and its entry."""

    file: str
    entry: _codec.TensorEntry


@dataclass(frozen=True, slots=True)
class _Bytes:
    """A non-tensor value, as the ``torch.save`` bytes DCP's planner loads."""

    raw: bytes


def _flatten(tree: dict) -> dict[str, tuple[tuple, Any]]:
    """``{dcp key: (path, leaf)}`` as DCP's default planner flattens a state dict."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    out: dict[str, tuple[tuple, Any]] = {}

    def visit(path: tuple, value: Any) -> None:
        key = ".".join(map(str, path))
        if key in out:
            raise CfRayError(f"two values flatten to the DCP key {key!r}")
        out[key] = (path, value)

    traverse_state_dict(tree, visit, keep_traversing=lambda v: isinstance(v, (torch.Tensor, _Shard, _Ref)))
    return out


class _Chunks:
    """The tensors and values of a checkpoint as DCP's ``Metadata`` describes them, built section by
    section: one entry per key, one chunk per distinct saved shard (what :func:`export_dcp` writes and
    :class:`CfRayReader` offers)."""

    def __init__(self, where: str):
        self.where = where
        """The checkpoint, for messages."""
        self.md: dict[str, Any] = {}
        self.storage_data: dict[Any, Any] = {}
        self.planner_data: dict[str, tuple] = {}
        self._covered: dict[str, int] = {}

    def add_tensor(self, key: str, path: tuple, dtype: torch.dtype, gshape, offsets, shape) -> bool:
        """Record a saved shard of tensor ``key``; ``False`` when it adds nothing to read (a replica of
        a chunk already recorded, or an empty shard: FSDP2 pads uneven dims)."""
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        have = self.md.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(gshape), []))
        if not isinstance(have, TensorStorageMetadata) or (
            tuple(have.size) != tuple(gshape) or have.properties.dtype != dtype
        ):
            raise CfRayError(f"{key}: the sections of {self.where} disagree on this tensor")
        self.planner_data[key] = path
        if any(tuple(c.offsets) == tuple(offsets) for c in have.chunks):
            return False
        if math.prod(shape) == 0 and math.prod(gshape) != 0:
            return False
        have.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape)))
        self._covered[key] = self._covered.get(key, 0) + math.prod(shape)
        return True

    def add_value(self, key: str, path: tuple) -> bool:
        """Record a value that is not a tensor (DCP's bytes); ``False`` when the key is known already."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        self.planner_data[key] = path
        if key not in self.md:
            self.md[key] = BytesStorageMetadata()
            return True
        if not isinstance(self.md[key], BytesStorageMetadata):
            raise CfRayError(f"{key}: the sections of {self.where} disagree on this value")
        return False

    def check_covered(self) -> None:
        """Every tensor's saved shards cover it whole.

        Raises:
            CorruptCheckpointError: naming the tensor and how much of it is covered.
        """
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for key, m in self.md.items():
            if isinstance(m, TensorStorageMetadata) and self._covered.get(key, 0) != math.prod(m.size):
                raise CorruptCheckpointError(
                    f"{key}: the saved shards cover {self._covered.get(key, 0)} of its {math.prod(m.size)} elements"
                )


def export_dcp(storage: Storage, directory: str, out_dir: str, *, objects: list[str] | None = None) -> DcpExported:
    """Write the tracked objects of one committed checkpoint as a DCP checkpoint in ``out_dir``.

    Args:
        storage: the run's cf_ray root; directory: the checkpoint (``checkpoints/step_N``).
        out_dir: a local directory (created; files in it with DCP's names are replaced).
        objects: tracked object names to export (default: all).

    Raises:
        CorruptCheckpointError: a file fails verification, or the shards do not cover a tensor.
        CfRayError: a final model (not a full checkpoint), or sections that disagree on a tensor.
    """
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

    manifest = read_manifest(storage, directory)
    sections, where = _sections_of(manifest, storage.uri(directory))
    os.makedirs(out_dir, exist_ok=True)
    layout = _Chunks(storage.uri(directory))
    chunks = size = 0
    wanted = None if objects is None else set(objects)
    for r, name in enumerate(sections):
        sec = load_section(storage, directory, manifest, name)
        tree = sec.tree.get(where) if isinstance(sec.tree, dict) else None
        if not isinstance(tree, dict):
            raise CorruptCheckpointError(f"section {name} of {storage.uri(directory)} has no {where!r}")
        tree = {k: v for k, v in tree.items() if wanted is None or k in wanted}

        def get(_i: int, e: _codec.TensorEntry, buf=sec.buf) -> Any:
            t = _codec.view(buf, e, copy=False, readonly_ok=True)
            return _Shard(t, e.shard) if e.shard is not None and isinstance(t, torch.Tensor) else t

        state = {k: _codec.unflatten(v, get, sec.entries) for k, v in tree.items()}
        file_name = f"__{r}_0.distcp"
        with open(os.path.join(out_dir, file_name), "wb") as f:
            for key, (path, value) in _flatten(state).items():
                if isinstance(value, (_Shard, torch.Tensor)):
                    if isinstance(value, _Shard):
                        local, gshape, offsets = value.local, value.shard.global_shape, value.shard.offsets
                    else:
                        local, gshape, offsets = value, tuple(value.shape), (0,) * value.dim()
                    if not layout.add_tensor(key, path, local.dtype, gshape, offsets, tuple(local.shape)):
                        continue  # a replica (or a whole tensor every rank holds): written once
                    start = f.tell()
                    torch.save(local.clone(), f)  # clone: a view would save its whole buffer
                    layout.storage_data[MetadataIndex(key, offsets)] = _StorageInfo(file_name, start, f.tell() - start)
                    chunks += 1
                    size += local.numel() * local.element_size()
                elif layout.add_value(key, path):
                    buf = io.BytesIO()
                    torch.save(value, buf)
                    start = f.tell()
                    f.write(buf.getbuffer())
                    layout.storage_data[MetadataIndex(key)] = _StorageInfo(file_name, start, f.tell() - start)
            f.flush()
            os.fsync(f.fileno())
    layout.check_covered()
    metadata = Metadata(
        state_dict_metadata=layout.md,
        planner_data=layout.planner_data,
        storage_data=layout.storage_data,
        storage_meta=StorageMeta(checkpoint_id=out_dir),
        version=CURRENT_DCP_VERSION,
    )
    tmp = os.path.join(out_dir, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out_dir, ".metadata"))
    return DcpExported(path=out_dir, step=manifest.step, keys=len(layout.md), chunks=chunks, size_bytes=size)


def _sections_of(manifest: Manifest, where: str) -> tuple[list[str], str]:
    """The sections that hold a checkpoint's tracked objects, and the key of those in their trees."""
    if manifest.final_model:
        raise CfRayError(f"{where} holds only the final model's weights; DCP needs a full checkpoint")
    if manifest.replicated:
        return [SHARED], OBJECTS
    return [rank_section(r) for r in range(manifest.world_size)], STATE


class CfRayReader(StorageReader):
    """A ``torch.distributed.checkpoint`` storage reader over a committed cf_ray checkpoint (module doc).

    Args:
        storage: the run's cf_ray root (``cf_ray.load.open_run``); directory: ``checkpoints/step_N``.
        objects: tracked object names to offer (default: all).
    """

    def __init__(self, storage: Any, directory: str, *, objects: list[str] | None = None):
        super().__init__()
        self.storage = storage
        self.directory = directory
        self.objects = objects
        self.storage_data: dict[Any, Any] = {}
        self._manifest: Manifest | None = None
        self._blocks: dict[str, Blocks | None] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:  # noqa: ARG002 - DCP's interface
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:  # noqa: ARG003
        return False  # never chosen by a bare checkpoint_id: pass storage_reader=CfRayReader(...)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002 - DCP's interface
        from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

        manifest = self._manifest = read_manifest(self.storage, self.directory)
        sections, where = _sections_of(manifest, self.storage.uri(self.directory))
        layout = _Chunks(self.storage.uri(self.directory))
        for name in sections:
            files = manifest.sections[name]
            index = read_verified(self.storage, self.directory, manifest, files["index"])
            tree, entries, blocks = parse_index_blocks(index, self.storage.uri(f"{self.directory}/{files['index']}"))
            self._blocks[files["data"]] = blocks
            held = tree.get(where) if isinstance(tree, dict) else None
            if not isinstance(held, dict):
                raise CorruptCheckpointError(f"section {name} of {self.storage.uri(self.directory)} has no {where!r}")
            held = {k: v for k, v in held.items() if self.objects is None or k in self.objects}
            state = {
                k: _codec.unflatten(v, lambda _i, e, f=files["data"]: _Ref(f, e), entries) for k, v in held.items()
            }
            for key, (path, value) in _flatten(state).items():
                if not isinstance(value, _Ref):
                    if layout.add_value(key, path):
                        buf = io.BytesIO()
                        torch.save(value, buf)
                        layout.storage_data[MetadataIndex(key)] = _Bytes(buf.getvalue())
                    continue
                e = value.entry
                if e.kind != "torch":
                    raise CfRayError(f"{key}: numpy arrays are not offered to DCP")
                gshape, offsets = (e.shard.global_shape, e.shard.offsets) if e.shard else (e.shape, (0,) * len(e.shape))
                if layout.add_tensor(key, path, _codec.torch_dtype(e.dtype), gshape, offsets, tuple(e.shape)):
                    layout.storage_data[MetadataIndex(key, offsets)] = value
        layout.check_covered()
        return Metadata(
            state_dict_metadata=layout.md,
            planner_data=layout.planner_data,
            storage_data=layout.storage_data,
            storage_meta=StorageMeta(checkpoint_id=self.storage.uri(self.directory)),
        )

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:  # noqa: ARG002
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future[None]:

        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if isinstance(info, _Bytes):
                planner.load_bytes(req, io.BytesIO(info.raw))
            else:
                per_file.setdefault(info.file, []).append(req)
        manifest = self._manifest or read_manifest(self.storage, self.directory)
        for file, reqs in per_file.items():
            blocks, info = self._blocks.get(file), manifest.files[file]
            data: np.ndarray | RangedData
            if blocks is not None and self.storage.ranged_reads:
                data = RangedData(self.storage, f"{self.directory}/{file}", info.size, blocks)
            else:
                data = read_verified(self.storage, self.directory, manifest, file)
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].entry.offset):
                e = self.storage_data[req.storage_index].entry
                t = read_region(data, e, list(req.storage_offsets), list(req.lengths))
                target = planner.resolve_tensor(req).detach()
                if target.size() != t.size():
                    raise CorruptCheckpointError(
                        f"{req.storage_index.fqn}: read {tuple(t.shape)}, wanted {tuple(target.shape)}"
                    )
                target.copy_(t)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


__all__ = ["CfRayReader", "DcpExported", "export_dcp"]
