"""Where a rank's step path meets the run's actors: the one module that imports the actor rooms
(``worker/``, ``node/``, ``driver/``) together, so that none of them imports another.

It finds or makes the run's controller (one per run, on the driver side) and this node's holder,
and hands their handles, with the callables that make them again when a rank finds one gone, to the
step path it builds (:class:`~cf_ray._engine.worker.step_path.StepPath`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from cf_ray._engine import env as _env
from cf_ray._engine.driver.controller import ControllerSettings, get_or_create_controller, resolve_controller
from cf_ray._engine.node.holder import get_or_create_holder
from cf_ray._engine.protocol.messages import CheckpointRequest
from cf_ray._engine.protocol.naming import controller_name
from cf_ray._engine.worker.context import WorkerContext
from cf_ray._engine.worker.restore.sharded import ShardedState
from cf_ray._engine.worker.step_path import RunActors, StepPath
from cf_ray.config import CheckpointConfig


def connect(ctx: WorkerContext, config: CheckpointConfig) -> RunActors:
    """Get (or create) the run's controller and this node's holder (Ray is started if it is not).

    The controller is re-resolved with :func:`~cf_ray._engine.driver.controller.resolve_controller`
    (waits for one Ray restarts, makes one gone for good again); the holder with the same
    get-or-create as at the start.
    """
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
        return resolve_controller(ctx.key, ctx.storage, settings)

    return RunActors(get_or_create_controller(ctx.key, ctx.storage, settings), holder(), resolve, holder)


def step_path(
    ctx: WorkerContext,
    config: CheckpointConfig,
    state: dict[str, Any],
    data: dict[str, Any],
    sharded: ShardedState | None,
    on_request: Callable[[CheckpointRequest], None],
) -> StepPath:
    """This rank's step path, wired to the run's actors (:func:`connect`)."""
    return StepPath(ctx, config, state, data, sharded, on_request, connect(ctx, config))


__all__ = ["connect", "step_path"]
