"""Where a rank runs: its rank and world size, the run's name and storage, Ray Train's own storage
(when checkpoints may be registered with it), and the checks on what the user asks to track."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cf_ray._engine.protocol.naming import run_key
from cf_ray._engine.storage.backends import open_storage
from cf_ray._engine.storage.base import Storage
from cf_ray.config import CheckpointConfig
from cf_ray.errors import ConfigError


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """One rank's place in the run, resolved once when its ``Checkpointer`` is built."""

    rank: int
    """This worker's rank."""
    world_size: int
    """Number of ranks of this attempt."""
    run_name: str
    """The run's name (``CheckpointConfig.run_name`` or Ray Train's experiment name)."""
    storage: Storage
    """The run's cf_ray root on the primary storage (checked writable)."""
    ray_storage: Any | None
    """Ray Train's ``StorageContext`` when checkpoints live in its run directory, else ``None``."""
    tiers: tuple[Storage, ...] = ()
    """Upload destinations (``CheckpointConfig.upload_path``), checked writable."""

    @property
    def key(self) -> str:
        """The run's key: names its controller and holder actors."""
        return run_key(self.storage.uri(), self.run_name)

    @classmethod
    def resolve(cls, config: CheckpointConfig) -> WorkerContext:
        """Rank, storage and tiers for ``config``; inside Ray Train, from its context.

        Raises:
            ConfigError: outside Ray Train without ``run_name``/``storage_path``, or unwritable storage.
        """
        rank, world, run_name, storage, ray_storage = _context(config)
        storage.check_writable()
        tiers = []
        if config.upload_path:
            tier = open_storage(config.upload_path, config.upload_filesystem).child(f"{_safe_name(run_name)}/cf_ray")
            tier.check_writable()
            tiers.append(tier)
        return cls(
            rank=rank, world_size=world, run_name=run_name, storage=storage, ray_storage=ray_storage, tiers=tuple(tiers)
        )


def unwrap_ddp(obj):
    """The module a ``DistributedDataParallel`` wraps (the object itself otherwise)."""
    while isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        obj = obj.module
    return obj


def check_tracked(objs, what: str, allow_empty: bool = False) -> dict:
    """``objs`` as a dict, once every entry is a named object with ``state_dict``/``load_state_dict``."""
    if not isinstance(objs, Mapping):
        raise ConfigError(
            f"Checkpointer({what}=...) must be a mapping of name -> object with state_dict(), "
            f"got {type(objs).__name__}; e.g. {{'model': model, 'optimizer': optimizer}}"
        )
    if not objs and not allow_empty:
        raise ConfigError(
            "Checkpointer needs at least one tracked object, e.g. "
            "Checkpointer({'model': model, 'optimizer': optimizer})"
        )
    for name, obj in objs.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"tracked object name {name!r} must be a non-empty string without '/'")
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise ConfigError(
                f"tracked object {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict(); "
                "track the object that owns the state (a module, an optimizer, a sampler) or wrap it"
            )
    return dict(objs)


def _safe_name(name: str) -> str:
    mf_name = str(name)
    if not mf_name or "/" in mf_name or mf_name in (".", ".."):
        raise ConfigError(f"run name {name!r} must be a plain directory name")
    return mf_name


def _context(config: CheckpointConfig):
    """(rank, world_size, run name, storage, Ray's StorageContext or None)."""
    ray_ctx = None
    try:
        import ray.train

        ray_ctx = ray.train.get_context()
        rank, world = ray_ctx.get_world_rank(), ray_ctx.get_world_size()
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        ray_ctx = None
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
    ray_storage = None
    if ray_ctx is not None:
        try:
            ray_storage = ray_ctx.get_storage()
        except Exception:  # noqa: BLE001
            ray_storage = None
    run_name = config.run_name or (ray_ctx.get_experiment_name() if ray_ctx is not None else None)
    if run_name is None:
        raise ConfigError("outside Ray Train, CheckpointConfig(run_name=...) is required")
    run_name = _safe_name(run_name)
    if config.storage_path is not None:
        storage = open_storage(config.storage_path, config.storage_filesystem).child(f"{run_name}/cf_ray")
        if ray_storage is not None and not _inside_ray_run(storage, ray_storage):
            if config.register_with_ray:
                warnings.warn(
                    "CheckpointConfig.storage_path is outside Ray Train's run directory, so checkpoints "
                    "are not registered with Ray Train (register_with_ray is ignored)",
                    stacklevel=4,
                )
            ray_storage = None
    elif ray_storage is not None:
        storage = open_storage(f"{ray_storage.experiment_fs_path}/cf_ray", ray_storage.storage_filesystem)
    else:
        raise ConfigError("outside Ray Train, CheckpointConfig(storage_path=...) is required")
    return rank, world, run_name, storage, ray_storage


def _inside_ray_run(storage: Storage, ray_storage: Any) -> bool:
    """Whether ``storage`` lies in Ray Train's run directory, on the same file system: only there
    can a checkpoint be registered with Ray Train (it takes a ``pyarrow`` file system and a path)."""
    where = storage.pyarrow_location()
    return (
        where is not None
        and where[1].startswith(ray_storage.experiment_fs_path + "/")
        and where[0].equals(ray_storage.storage_filesystem)
    )
