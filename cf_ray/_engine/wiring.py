"""The run's actors as a rank finds them: the controller (one per run) and this node's holder,
got or made at the start, and made again when a rank finds one gone (``resolve_*``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from cf_ray._engine import env as _env
from cf_ray._engine.driver import controller as _controller
from cf_ray._engine.driver.controller import ControllerSettings, get_or_create_controller
from cf_ray._engine.node.holder import get_or_create_holder
from cf_ray._engine.protocol.naming import controller_name
from cf_ray._engine.worker.context import WorkerContext
from cf_ray.config import CheckpointConfig


@dataclass(frozen=True, slots=True)
class RunActors:
    controller: Any
    holder: Any
    resolve_controller: Callable[[], Any]
    """A live handle of the run's controller, made again when it is gone (may block)."""
    resolve_holder: Callable[[], Any]
    """This node's holder, made again when it is gone."""


def connect(ctx: WorkerContext, config: CheckpointConfig) -> RunActors:
    """Get (or create) the run's controller and this node's holder (Ray is started if it is not)."""
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True)
    settings = ControllerSettings(
        policy=config.policy,
        keep_last=config.keep_last,
        tiers=list(ctx.tiers),
        upload_milestones_only=config.upload == "milestones",
        release_after_fit_s=float(config.release_after_fit_s),
    )

    def holder():
        return get_or_create_holder(ctx.key, ctx.storage, controller_name(ctx.key), _env.namespace())

    def resolve():
        # SEAM (driver side): resolve_controller() waits for a live controller and makes it
        # again when it is gone for good; without it, the same get-or-create as at the start.
        resolve_controller = getattr(_controller, "resolve_controller", None)
        if resolve_controller is not None:
            return resolve_controller(ctx.key, ctx.storage, settings)
        return get_or_create_controller(ctx.key, ctx.storage, settings)

    return RunActors(get_or_create_controller(ctx.key, ctx.storage, settings), holder(), resolve, holder)


__all__ = ["RunActors", "connect"]
