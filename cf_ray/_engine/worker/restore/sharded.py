"""Sharded model state (FSDP2's ``fully_shard``, or any module whose state holds DTensors): what a
snapshot takes of it and how a restore puts it back, through PyTorch's own
``torch.distributed.checkpoint.state_dict`` API (``get_model_state_dict`` /
``get_optimizer_state_dict`` to take, ``set_model_state_dict`` / ``set_optimizer_state_dict`` to
load: no key mangling of cf_ray's own).

Snapshot: the state dicts those functions return hold references to the live DTensors; the codec
(``format/codec.py``) stores each DTensor's *local shard* only (``to_local()``, sized by the shard)
and records in the section's index, per tensor, its global shape and the shard's offsets
(``TensorEntry.shard``, with the owner rank, whose section it is). Every rank's section holds only its
own shards, so with sharded state a run is per-rank (``replicated=False``) whatever the config says.
The optimizer's state is keyed by parameter FQN (``get_optimizer_state_dict``), so a checkpoint
does not depend on parameter order and ``cf-ray export --to dcp`` can name every tensor as DCP does.

Restore (same number of ranks): every rank reads its own section only. :meth:`ShardedState.decode`
turns the saved tree into one whose sharded leaves are :class:`SavedShard`; :meth:`ShardedState.check`
compares each with the live tensor (keys, global shape, dtype, this rank's offsets and local shape)
and raises :class:`~cf_ray.errors.CheckpointMismatchError` naming the tensor, before anything is
loaded; :meth:`ShardedState.to_live` wraps the saved shards in DTensors of the live mesh and
placements (``DTensor.from_local``, no communication), and :meth:`ShardedState.load` hands them to
``set_optimizer_state_dict`` / ``set_model_state_dict``.

Restore at another number of ranks (N -> M, 2 -> 1 and 1 -> 2 included): every rank reads every old
rank's index, and :meth:`ShardedState.reshard` assembles each of its new shards from the old shards
that overlap it, with the overlaps computed by DCP's own planner helper
(``create_read_items_for_chunk_list``); what is not a shard (Adam's step, the parameter groups)
comes from old rank 0. From storage, the old sections are read by range (``format/blocks.py``'s
``RangedData``): of each old shard only the rows that overlap this rank's new shard, every block
read checked against its CRC-32, one region at a time, so a rank's memory grows by its new shard
plus one tensor at most (tests/test_fsdp2.py asserts it). From memory the old sections are the
node's holder's slots (shared memory, read in place) or streamed from another node's. Not covered:
tensor parallelism beyond what DTensor placements describe (untested).
A checkpoint exported with ``cf-ray export RUN --to dcp`` loads at any world size with
``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.worker.restore.shards import (
    SavedShard,
    _assemble,
    _keyed_by,
    _param_fqns,
    decode,
    gather_whole,
)
from cf_ray.errors import CheckpointMismatchError, ConfigError, CorruptCheckpointError

#: Key of the description of the sharded objects in a rank section's tree (beside ``state``).
KEY = "sharded"


def is_sharded_module(module: Any) -> bool:
    """A module whose parameters or buffers are DTensors (FSDP2, tensor parallelism), or that is
    or holds an FSDP1 ``FullyShardedDataParallel`` module (its state dicts hold DTensors when it was
    given a ``device_mesh``; :meth:`ShardedState.of` refuses one without).

    Raises:
        ConfigError: an FSDP1 module without a device mesh.
    """
    if not isinstance(module, torch.nn.Module):
        return False
    if _fsdp1_modules(module):
        return True
    return any(_codec.is_dtensor(t) for t in module.parameters()) or any(_codec.is_dtensor(t) for t in module.buffers())


def _fsdp1_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return list(FSDP1.fsdp_modules(module)) if any(isinstance(m, FSDP1) for m in module.modules()) else []


def is_sharded_optimizer(opt: Any) -> bool:
    """An optimizer that steps DTensor parameters."""
    return isinstance(opt, torch.optim.Optimizer) and any(
        _codec.is_dtensor(p) for g in opt.param_groups for p in g["params"]
    )


def local_ptr(t: torch.Tensor) -> int:
    """The storage pointer of a tensor's bytes on this rank (a DTensor's local shard)."""
    if _codec.is_dtensor(t):
        return t.to_local().data_ptr()  # type: ignore[attr-defined]
    return t.data_ptr()


def _api():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


class ShardedState:
    """The tracked objects whose state is sharded: modules, and the optimizers that step them.

    Args:
        modules: tracked name -> sharded module.
        optimizers: tracked name -> (the tracked name of the module whose parameters it steps, optimizer).
    """

    def __init__(self, modules: dict[str, torch.nn.Module], optimizers: dict[str, tuple[str, torch.optim.Optimizer]]):
        self.modules = modules
        self.optimizers = optimizers

    @staticmethod
    def of(state: Mapping[str, Any]) -> ShardedState | None:
        """The sharded objects among the tracked ``state`` (``None`` when there are none).

        Raises:
            ConfigError: an optimizer steps DTensor parameters that no tracked module holds.
        """
        modules = {n: o for n, o in state.items() if is_sharded_module(o)}
        for name, mod in modules.items():
            for fsdp in _fsdp1_modules(mod):
                if getattr(fsdp, "_device_mesh", None) is None:
                    raise ConfigError(
                        f"module {name!r} is an FSDP1 FullyShardedDataParallel without a device mesh: its sharded "
                        "state dict would hold ShardedTensors, which cf_ray does not save. Pass "
                        "device_mesh=torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,)) "
                        "to FullyShardedDataParallel (with Ray: prepare_model(model, parallel_strategy='fsdp', "
                        "parallel_strategy_kwargs={'device_mesh': mesh})), or use FSDP2's fully_shard"
                    )
        optimizers: dict[str, tuple[str, torch.optim.Optimizer]] = {}
        for name, opt in state.items():
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            wanted = {id(p) for g in opt.param_groups for p in g["params"]}
            owner = next((m for m, mod in modules.items() if wanted <= {id(p) for p in mod.parameters()}), None)
            if owner is None and not is_sharded_optimizer(opt):
                continue  # an optimizer of unsharded parameters
            if owner is None:
                raise ConfigError(
                    f"optimizer {name!r} steps sharded (DTensor) parameters, but no tracked module holds them all: "
                    f"track the FSDP2 module too, e.g. Checkpointer({{'model': model, {name!r}: optimizer}})"
                )
            optimizers[name] = (owner, opt)
        if not modules and not optimizers:
            return None
        return ShardedState(modules, optimizers)

    @property
    def names(self) -> set[str]:
        return set(self.modules) | set(self.optimizers)

    def describe(self) -> dict[str, dict[str, str]]:
        """What a section records of the sharded objects (``KEY``): kind, an optimizer's module, and
        the wrapper (``"fsdp1"`` when FSDP1 modules are involved; recorded only then: an FSDP2 run's
        sections carry no wrapper, which reads as FSDP2)."""
        out: dict[str, dict[str, str]] = {n: {"kind": "module", **self._wrapper(n)} for n in self.modules}
        out.update({n: {"kind": "optimizer", "module": m, **self._wrapper(m)} for n, (m, _) in self.optimizers.items()})
        return out

    def _wrapper(self, module_name: str) -> dict[str, str]:
        return {"wrapper": "fsdp1"} if _fsdp1_modules(self.modules[module_name]) else {}

    def wrapper_changed(self, name: str, saved: dict) -> bool:
        """The object was saved under another wrapper (FSDP1 <-> FSDP2): the same tensors, but state
        dicts with other metadata, so the snapshot's fingerprints do not apply."""
        module_name = name if name in self.modules else self.optimizers[name][0]
        return saved.get("wrapper") != self._wrapper(module_name).get("wrapper")

    # -- snapshot ------------------------------------------------------------------------------------
    def state_dict(self, name: str) -> dict:
        """The state of one sharded object as PyTorch's state-dict API gives it (references to the
        live DTensors; optimizer state keyed by parameter FQN)."""
        dsd = _api()
        if name in self.modules:
            return dsd.get_model_state_dict(self.modules[name])
        owner, opt = self.optimizers[name]
        if opt.state:
            return dsd.get_optimizer_state_dict(self.modules[owner], opt)
        # No state yet (a checkpoint before the first step): get_optimizer_state_dict would create it
        # with an optimizer step at learning rate 0 (DCP's _init_optim_state), which changes Adam's step
        # count and so the run. A snapshot must not change what it takes: that step is skipped here.
        init, dsd._init_optim_state = dsd._init_optim_state, lambda _optim: None
        try:
            return dsd.get_optimizer_state_dict(self.modules[owner], opt)
        finally:
            dsd._init_optim_state = init

    def state_fns(self) -> dict[str, Callable[[], Any]]:
        """Name -> a function returning the object's state (what the fingerprints are taken of)."""
        return {n: (lambda n=n: self.state_dict(n)) for n in self.names}

    def guarded_ptrs(self) -> set[int]:
        """Local storage pointers of the sharded parameters and optimizer state (changed only by the
        optimizer step: copied in the background)."""
        ptrs = set()
        for mod in self.modules.values():
            ptrs.update(local_ptr(p) for p in mod.parameters())
        for _, opt in self.optimizers.values():
            for st in opt.state.values():
                ptrs.update(local_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    # -- restore -------------------------------------------------------------------------------------
    def decode(self, tree: Any, entries: list[_codec.TensorEntry], buf, *, copy: bool, whole: bool = False) -> Any:
        """A saved (encoded) object state, its sharded tensors as :class:`SavedShard` (see :func:`decode`)."""
        return decode(tree, entries, buf, copy=copy, whole=whole)

    def _live_model(self, module_name: str) -> dict[str, Any]:
        return _api().get_model_state_dict(self.modules[module_name])

    def check(self, name: str, saved: Any) -> None:
        """The saved state fits the live object: same keys, and per tensor the same global shape,
        dtype and this rank's shard (offsets and local shape). Touches nothing.

        Raises:
            CheckpointMismatchError: naming the object and the tensor.
            CorruptCheckpointError: the saved state is not a state dict of that kind.
        """
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"the saved state of {name!r} is not a mapping")
        if name in self.modules:
            live = self._live_model(name)
            check_module_keys(name, live, saved)
            for k, t in live.items():
                _check_tensor(f"module {name!r}: {k}", t, saved[k], check_dtype=True)
            return
        owner, opt = self.optimizers[name]
        params = {k: v for k, v in self._live_model(owner).items() if isinstance(v, torch.Tensor)}
        groups, state = check_optimizer_groups(name, saved, opt.param_groups)
        unknown = [p for g in groups for p in g["params"] if p not in params]
        unknown += [p for p in state if p not in params]
        if unknown:
            raise CheckpointMismatchError(
                f"optimizer {name!r}: the checkpoint has state for parameters {sorted(set(map(str, unknown)))[:10]} "
                f"that module {owner!r} does not have: the model changed since the checkpoint was saved"
            )
        for fqn, st in state.items():
            if not isinstance(st, dict):
                raise CorruptCheckpointError(f"optimizer {name!r}: the state of {fqn} is malformed")
            for k, v in st.items():
                if isinstance(v, SavedShard):
                    _check_tensor(f"optimizer {name!r}: state {fqn}.{k}", params[fqn], v, check_dtype=False)

    def to_live(self, name: str, saved: Any) -> Any:
        """The checked saved state with every :class:`SavedShard` a DTensor on the live mesh, with
        the live placements (no communication)."""
        from torch.distributed.tensor import DTensor

        module_name = name if name in self.modules else self.optimizers[name][0]
        live = self._live_model(module_name)

        def wrap(s: SavedShard, like: Any) -> Any:
            assert s.local is not None  # read: only a resharded load leaves shards unread, and it assembles them
            return DTensor.from_local(
                s.local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
            )

        if name in self.modules:
            return {k: wrap(v, live[k]) if isinstance(v, SavedShard) else v for k, v in saved.items()}
        out = dict(saved)
        out["state"] = {
            fqn: {k: wrap(v, live[fqn]) if isinstance(v, SavedShard) else v for k, v in st.items()}
            for fqn, st in saved["state"].items()
        }
        return out

    def reshard(self, name: str, per_rank: list[Any]) -> Any:
        """The state of ``name`` for this rank from a checkpoint saved by another number of ranks.

        ``per_rank`` is every old rank's decoded state (:meth:`decode`). The structure and every
        value that is not a shard come from old rank 0 (the optimizer's step counts and groups are
        the same on every rank); each sharded tensor becomes this rank's new shard, assembled from
        the old shards that overlap it: DCP's own planner helper
        (``planner_helpers.create_read_items_for_chunk_list``) computes the overlaps, as
        ``torch.distributed.checkpoint.load`` does. The result passes :meth:`check` when it fits.
        It holds no view of the old ranks' buffers (shards are assembled into new tensors, an
        optimizer's other tensors are copied).

        Raises:
            CheckpointMismatchError: a tensor sharded in the checkpoint is not a DTensor here, or its
                global shape differs (naming it).
            CorruptCheckpointError: the old ranks disagree on a tensor, or their shards do not cover
                this rank's.
        """
        module_name = name if name in self.modules else self.optimizers[name][0]
        live = self._live_model(module_name)
        kind = "module" if name in self.modules else "optimizer"

        def like_of(path: tuple) -> Any:
            if kind == "module":
                return live.get(path[0]) if len(path) == 1 else None
            return live.get(path[1]) if len(path) == 3 and path[0] == "state" else None

        def walk(path: tuple, v0: Any, others: list[Any]) -> Any:
            if isinstance(v0, SavedShard):
                what = f"{kind} {name!r}: {'.'.join(map(str, path))}"
                return _assemble(what, others, like_of(path))
            if isinstance(v0, dict):
                return {
                    k: walk(path + (k,), v, [o.get(k) if isinstance(o, dict) else None for o in others])
                    for k, v in v0.items()
                }
            if kind == "optimizer" and isinstance(v0, torch.Tensor):
                # A view of the section's buffer (Adam's step): the optimizer keeps what it is given and
                # steps it in place, and a memory snapshot's buffer is shared by every rank of the node.
                return v0.clone()
            return v0

        return walk((), per_rank[0], per_rank)

    def from_whole(self, name: str, saved: Any) -> Any:
        """The state of ``name`` for this rank from a checkpoint that saved it unsharded (DDP or a
        plain module; decoded with ``whole=True``): each tensor of a sharded parameter becomes this
        rank's shard of it (only the rows it spans are read when the section is read by range), an
        optimizer's state is keyed by FQN as DCP's API wants it. The result passes :meth:`check` when
        it fits.

        Raises:
            CheckpointMismatchError: shapes or groups differ (naming the tensor).
        """
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"the saved state of {name!r} is not a mapping")
        module_name = name if name in self.modules else self.optimizers[name][0]
        live = self._live_model(module_name)
        if name in self.modules:
            check_module_keys(name, live, saved)
            return {
                k: _assemble(f"module {name!r}: {k}", [v], live[k]) if isinstance(v, SavedShard) else v
                for k, v in saved.items()
            }
        owner, opt = self.optimizers[name]
        keyed = _keyed_by(saved, _param_fqns(self.modules[owner], opt), name, to_fqn=True)
        state = {}
        for fqn, st in keyed["state"].items():
            if not isinstance(st, dict):
                raise CorruptCheckpointError(f"optimizer {name!r}: the state of {fqn} is malformed")
            state[fqn] = {
                k: _assemble(f"optimizer {name!r}: state {fqn}.{k}", [v], live[fqn]) if isinstance(v, SavedShard) else v
                for k, v in st.items()
            }
        return {**keyed, "state": state}

    def load(self, states: dict[str, Any]) -> None:
        """Load the states (from :meth:`to_live`) with ``set_optimizer_state_dict`` then
        ``set_model_state_dict`` (an optimizer without state yet is initialised by a step with zero
        gradients and learning rate, which leaves the parameters as they are; the model is loaded last)."""
        dsd = _api()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, (owner, opt) in self.optimizers.items():
                if name in states:
                    dsd.set_optimizer_state_dict(self.modules[owner], opt, states[name])
            for name, mod in self.modules.items():
                if name in states:
                    dsd.set_model_state_dict(mod, states[name])


def check_module_keys(name: str, live: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """The saved state of module ``name`` has exactly the live model's keys (a sharded module's here,
    a plain one's in ``checks.py``, which imports this module: one message for both).

    Raises:
        CheckpointMismatchError: naming the keys missing and unexpected (at most 10 each).
    """
    missing, unexpected = [k for k in live if k not in saved], [k for k in saved if k not in live]
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"module {name!r}: the checkpoint lacks keys {missing[:10]} and has keys {unexpected[:10]} the model "
            "does not have: the model changed since the checkpoint was saved"
        )


def check_optimizer_groups(name: str, saved: Any, live_groups: list[dict[str, Any]]) -> tuple[list[dict], dict]:
    """The saved state of optimizer ``name`` is a state dict whose parameter groups have the sizes of
    the live ``param_groups`` (a sharded optimizer's here, a plain one's in ``checks.py``: one message
    for both). Returns the saved ``(param_groups, state)``.

    Raises:
        CorruptCheckpointError: the saved state is not an optimizer state dict.
        CheckpointMismatchError: the group sizes differ (the model or its groups changed).
    """
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    state = saved.get("state") if isinstance(saved, dict) else None
    if (
        not isinstance(groups, list)
        or not isinstance(state, dict)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise CorruptCheckpointError(f"the saved state of optimizer {name!r} is malformed")
    live = [len(g["params"]) for g in live_groups]
    got = [len(g["params"]) for g in groups]
    if live != got:
        raise CheckpointMismatchError(
            f"optimizer {name!r}: parameter groups of sizes {got} in the checkpoint, "
            f"{live} in this script: the model or its groups changed"
        )
    return groups, state


def _check_tensor(what: str, live: Any, saved: Any, *, check_dtype: bool) -> None:
    """One saved tensor against the live one it loads into (a DTensor: its shard on this rank)."""
    if not isinstance(live, torch.Tensor):
        return
    if _codec.is_dtensor(live):
        if not isinstance(saved, SavedShard):
            got = f"a whole {tuple(saved.shape)} tensor" if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointMismatchError(
                f"{what} is sharded (DTensor {tuple(live.shape)}) in this script and {got} in the checkpoint, "
                "where the object it belongs to was saved sharded: the model changed since it was saved"
            )
        chunk = live.__create_chunk_list__()[0]  # type: ignore[attr-defined]
        placements = getattr(live, "placements", None)
        if tuple(saved.shard.global_shape) != tuple(live.shape) or (check_dtype and saved.dtype != live.dtype):
            raise CheckpointMismatchError(
                f"{what} is {tuple(live.shape)} {_dtype(live)} in this script and "
                f"{tuple(saved.shard.global_shape)} {_dtype(saved.dtype)} in the checkpoint: "
                "the model changed since it was saved"
            )
        if tuple(saved.shard.offsets) != tuple(chunk.offsets) or saved.shape != tuple(chunk.sizes):
            raise CheckpointMismatchError(
                f"{what}: this rank's shard is at {tuple(chunk.offsets)} size {tuple(chunk.sizes)} "
                f"({placements}), the checkpoint's at {saved.shard.offsets} size {saved.shape} "
                f"({saved.shard.placements}): the sharding changed at the same number of ranks (another mesh "
                "or placement), which cf_ray does not reshard; keep the mesh, or load it with "
                "torch.distributed.checkpoint through `cf-ray export --to dcp`"
            )
        return
    if isinstance(saved, SavedShard):
        raise CheckpointMismatchError(
            f"{what} is a whole tensor in this script and a shard ({saved.shard.placements}) in the checkpoint"
        )
    if isinstance(saved, torch.Tensor) and check_dtype and (saved.shape != live.shape or saved.dtype != live.dtype):
        raise CheckpointMismatchError(
            f"{what} is {tuple(live.shape)} {live.dtype} in this script and {tuple(saved.shape)} {saved.dtype} "
            "in the checkpoint: the model changed since it was saved"
        )


def _dtype(t: torch.Tensor | torch.dtype) -> str:
    return str(t if isinstance(t, torch.dtype) else t.dtype).removeprefix("torch.")


__all__ = [
    "KEY",
    "SavedShard",
    "ShardedState",
    "decode",
    "gather_whole",
    "is_sharded_module",
    "is_sharded_optimizer",
    "local_ptr",
]
