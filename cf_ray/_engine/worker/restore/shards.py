"""Saved shards of sharded state (FSDP2/DTensor) as a restore sees them: :class:`SavedShard`,
:func:`decode` (a saved tree with its shards as :class:`SavedShard`, read by range where the section
is), and the assembly of a new shard from the old ranks' shards that overlap it (DCP's own planner
helper, ``create_read_items_for_chunk_list``: N -> M ranks, or a whole tensor for a script that does
not shard it, :func:`gather_whole`), with an optimizer's state keyed by FQN or by integer id.
:class:`~cf_ray._engine.worker.restore.sharded.ShardedState` (``sharded.py``) drives them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.blocks import RangedData, read_region
from cf_ray.errors import CheckpointMismatchError, ConfigError, CorruptCheckpointError


@dataclass(frozen=True, slots=True)
class SavedShard:
    """A saved local shard, as a restore decodes it (before it becomes a DTensor again)."""

    local: torch.Tensor | None
    """Its values; ``None`` while they lie unread in a section read by range (``data``)."""
    shard: _codec.ShardInfo
    name: str
    """The entry's path in the section (for messages)."""
    entry: _codec.TensorEntry | None = None
    data: RangedData | None = None
    """Where its bytes are when ``local`` is ``None``."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.local.shape) if self.local is not None else tuple(self.entry.shape)  # type: ignore[union-attr]

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype if self.local is not None else _codec.torch_dtype(self.entry.dtype)  # type: ignore[union-attr]

    def region(self, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """The part of this shard at ``offsets`` (in the shard) of size ``lengths``; read from storage
        (only the rows it spans) when the shard was not read."""
        from torch.distributed._shard._utils import narrow_tensor_by_index

        if self.local is not None:
            return narrow_tensor_by_index(self.local, offsets, lengths)
        assert self.entry is not None and self.data is not None
        return read_region(self.data, self.entry, offsets, lengths)


def decode(tree: Any, entries: list[_codec.TensorEntry], buf: Any, *, copy: bool, whole: bool = False) -> Any:
    """A saved (encoded) state with its sharded tensors as :class:`SavedShard`.

    Args:
        buf: the section's bytes; a shard in a section read by range (``format/blocks.py``'s ``RangedData``) is
            left unread (``local=None``): :func:`_assemble` reads the parts it needs.
        copy: other tensors are private copies (else views of ``buf`` where it allows).
        whole: the state was saved unsharded (DDP): its tensors of one or more dimensions become
            :class:`SavedShard` too, each the one shard of itself (to be split into this rank's shard).
    """

    def get(_i: int, e: _codec.TensorEntry) -> Any:
        shard = e.shard
        if shard is None and whole and e.kind == "torch" and len(e.shape) >= 1:
            shard = _codec.ShardInfo(tuple(e.shape), (0,) * len(e.shape), "whole")
        if shard is not None and e.kind == "torch" and isinstance(buf, RangedData):
            return SavedShard(None, shard, e.name, e, buf)  # read where it is assembled, the parts needed
        t = _codec.view(buf, e, copy=copy, readonly_ok=not copy)
        return SavedShard(t, shard, e.name) if shard is not None and isinstance(t, torch.Tensor) else t

    return _codec.unflatten(tree, get, entries)


def _param_fqns(module: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    """The FQN of every parameter of every group of ``opt`` (the module's names, without DDP's prefix)."""
    names = {id(p): n for n, p in module.named_parameters()}
    try:
        return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    except KeyError:
        raise ConfigError("an optimizer steps parameters that its module does not hold") from None


def _keyed_by(saved: dict, fqns: list[list[str]], name: str, *, to_fqn: bool) -> dict:
    """An optimizer state with its parameters renamed by position in the groups: integer ids (as
    ``Optimizer.state_dict`` keys them) to FQNs (as DCP's ``get_optimizer_state_dict`` does), or back."""
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise CorruptCheckpointError(f"the saved state of optimizer {name!r} is malformed")
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise CorruptCheckpointError(f"the saved state of optimizer {name!r} is malformed")
    got, live = [len(g["params"]) for g in groups], [len(f) for f in fqns]
    if got != live:
        raise CheckpointMismatchError(
            f"optimizer {name!r}: parameter groups of sizes {got} in the checkpoint, "
            f"{live} in this script: the model or its groups changed"
        )
    rename: dict[Any, Any] = {}
    base = 0  # Optimizer.state_dict numbers the parameters across the groups, in order
    for g, names in zip(groups, fqns, strict=True):
        for i, (old, fqn) in enumerate(zip(g["params"], names, strict=True)):
            rename[old] = fqn if to_fqn else base + i
        base += len(names)
    unknown = [k for k in state if k not in rename]
    if unknown:
        raise CorruptCheckpointError(f"optimizer {name!r}: state for parameters {unknown[:5]} that no group lists")
    return {
        **saved,
        "state": {rename[k]: v for k, v in state.items()},
        "param_groups": [{**g, "params": [rename[p] for p in g["params"]]} for g in groups],
    }


def gather_whole(kind: str, name: str, per_rank: list[Any], obj: Any, module: torch.nn.Module | None) -> Any:
    """The state of an object that was sharded when saved (FSDP2) and is not here (DDP, or no
    wrapper): every sharded tensor whole, assembled from every old rank's shard (the target placement
    needs whole tensors), the rest from old rank 0; an optimizer's state keyed back from FQNs to the
    integer ids of ``obj``'s groups (``module`` is the module it steps).

    Raises:
        CheckpointMismatchError: the groups differ; CorruptCheckpointError: shards missing.
    """

    def walk(path: tuple, v0: Any, others: list[Any]) -> Any:
        if isinstance(v0, SavedShard):
            what = f"{kind} {name!r}: {'.'.join(map(str, path))}"
            shape = tuple(v0.shard.global_shape)
            return _assemble_into(what, others, (0,) * len(shape), shape).local
        if isinstance(v0, dict):
            return {
                k: walk(path + (k,), v, [o.get(k) if isinstance(o, dict) else None for o in others])
                for k, v in v0.items()
            }
        return v0.clone() if isinstance(v0, torch.Tensor) else v0

    whole = walk((), per_rank[0], per_rank)
    if kind == "optimizer":
        if module is None:
            raise CheckpointMismatchError(
                f"optimizer {name!r} was saved for a sharded module that this script does not track"
            )
        whole = _keyed_by(whole, _param_fqns(module, obj), name, to_fqn=False)
    return whole


def _assemble(what: str, shards: list[Any], like: Any) -> SavedShard:
    """This rank's shard of one tensor (shaped like the live DTensor ``like``), from old shards."""
    if like is None or not _codec.is_dtensor(like):
        raise CheckpointMismatchError(
            f"{what} is sharded in the checkpoint and not a DTensor in this script, within an object "
            "that is sharded here: the model changed since it was saved"
        )
    mine = like.__create_chunk_list__()[0]
    got = _assemble_into(what, shards, tuple(mine.offsets), tuple(mine.sizes), tuple(like.shape))
    return SavedShard(got.local, dataclasses.replace(got.shard, placements=str(like.placements)), got.name)


def _assemble_into(
    what: str,
    shards: list[Any],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    global_shape: tuple[int, ...] | None = None,
) -> SavedShard:
    """The part of one tensor at ``offsets`` of size ``sizes``, assembled from saved shards (only
    the parts of them that overlap it are read)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    if not all(isinstance(s, SavedShard) for s in shards):
        raise CorruptCheckpointError(f"{what}: not every old rank saved a shard of it")
    first = shards[0]
    if any(s.shard.global_shape != first.shard.global_shape or s.dtype != first.dtype for s in shards):
        raise CorruptCheckpointError(f"{what}: the old ranks disagree on its global shape or dtype")
    if global_shape is not None and global_shape != tuple(first.shard.global_shape):
        raise CheckpointMismatchError(
            f"{what} is {global_shape} in this script and {tuple(first.shard.global_shape)} in the "
            "checkpoint: the model changed since it was saved"
        )
    mine = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    dest = torch.empty(tuple(mine.sizes), dtype=first.dtype)
    chunks: dict[tuple[int, ...], SavedShard] = {}
    for s in shards:  # replicas (the same offsets) once; empty shards never
        if math.prod(s.shape):
            chunks.setdefault(tuple(s.shard.offsets), s)
    saved = list(chunks.values())
    md = TensorStorageMetadata(
        TensorProperties(dtype=first.dtype),
        torch.Size(first.shard.global_shape),
        [ChunkStorageMetadata(torch.Size(s.shard.offsets), torch.Size(s.shape)) for s in saved],
    )
    filled = 0
    for item in create_read_items_for_chunk_list(what, md, [mine]):
        src = saved[int(item.storage_index.index)]  # type: ignore[arg-type]
        # Only the overlap is read (the rows it spans) when the old shard lies unread on storage.
        narrow_tensor_by_index(dest, item.dest_offsets, item.lengths).copy_(
            src.region(list(item.storage_offsets), list(item.lengths))
        )
        filled += math.prod(item.lengths)
    if filled != dest.numel():
        raise CorruptCheckpointError(
            f"{what}: the saved shards cover {filled} of the {dest.numel()} elements of this rank's shard"
        )
    shard = _codec.ShardInfo(tuple(first.shard.global_shape), tuple(int(o) for o in offsets))
    return SavedShard(dest, shard, first.name)
