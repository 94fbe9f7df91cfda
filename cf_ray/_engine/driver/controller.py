"""The driver-side controller: one Ray actor per run that schedules, commits and remembers.

How a run finds its controller: it is a *named, detached* actor, ``cf_ray.controller.<run key>`` in
the ``cf_ray`` namespace (``env.NAMESPACE``), where the run key is derived from the run's storage
location and name. Every worker's :class:`Checkpointer` gets it with ``get_if_exists=True``
(:func:`get_or_create_controller`), so the first worker of a run creates it and workers restarted
by Ray Train (same run) find the same one, with its schedule, its profile and its index of
in-memory snapshots intact. It uses ``num_cpus=0`` and never blocks a worker: workers poll it with
non-blocking calls and read the answers when they are ready.

When the driver restarts (a new ``trainer.fit()`` with the same ``RunConfig(name, storage_path)``),
a new controller is created and rebuilds what matters from storage: the committed checkpoints, the
generation counter and the saved profile (so the interval does not have to be profiled again from
scratch). It exits on its own ``CF_RAY_CONTROLLER_LINGER_S`` seconds after every rank has called
``Checkpointer.finish()``, after asking every holder to finish what it is writing and writing the
profile table to storage.

Lifetime (:mod:`.lifetime`): a controller of the same run key whose owner is gone is
never reused: :func:`get_or_create_controller` shuts it down (its holders drained and killed) and
creates a new one, with the new config, that starts from storage only and says so. A controller of
the same run (Ray Train restarting workers) is reused. It is placed on the head node with a *hard*
affinity (``num_cpus=0`` fits a 0-CPU head): the design (docs/ARCHITECTURE.md) draws it on the driver side, and a soft
affinity requested from a worker lands it on the worker's node, which may be lost.

Liveness and recovery (:mod:`.recovery`): the controller is created detached with
``max_restarts=-1``: when its process dies, Ray runs the constructor again, which rebuilds the state
from storage and from the holders of this run on every alive node. A controller that is gone for
good (killed) is created again by whoever needs it: the workers call :func:`resolve_controller` when
a call to it fails; the holders look it up by name again for every message they could not deliver
(:mod:`cf_ray._engine.node.sender`). Every holder message is idempotent there.

The actor's logic is :class:`~.facade.Controller`, a thin RPC facade over its parts (the table in
:mod:`.facade`); this module is the actor and how a run finds it. The messages it exchanges are the
typed, versioned ones of :mod:`cf_ray._engine.protocol.messages`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.driver.facade import Controller
from cf_ray._engine.driver.settings import ControllerSettings
from cf_ray._engine.protocol.actors import resolve_live
from cf_ray._engine.protocol.cluster import (
    Owner,
    current_owner,
    head_node_id,
    owner_gone,
    run_name_of,
    train_controller,
)
from cf_ray._engine.protocol.naming import controller_name, run_key
from cf_ray._engine.storage.base import Storage

logger = logging.getLogger("cf_ray")


# max_restarts=-1: Ray runs the constructor again after the process died; it rebuilds from storage
# and from the holders (see the module doc). Calls in flight when it died fail; callers retry.
ControllerActor = ray.remote(num_cpus=0, max_concurrency=32, max_restarts=-1)(Controller)  # pyright: ignore[reportCallIssue] - ray.remote's overloads do not list max_concurrency with a class


def get_or_create_controller(key: str, storage: Storage, settings: ControllerSettings):
    """The run's controller, created (detached: the creating process does not own it) if there is
    none. The arguments are used only when it is created.

    An existing controller of this run key is reused when it belongs to this run (the same driver
    job and Ray Train run: workers restarted by Ray Train) or when its owner is still alive. One whose
    owner is gone (the previous driver died, or its ``fit()`` ended) is shut down — its holders
    drained and killed — and a new one is created with ``settings`` (the new config), starting from
    storage only (:mod:`cf_ray._engine.protocol.cluster`).
    """
    owner = settings.owner or current_owner()
    settings = dataclasses.replace(settings, owner=owner)
    existing = get_controller(key)
    if existing is not None:
        theirs, reachable = _owner_of(existing)
        if not reachable or owner.same_run(theirs):
            if reachable and theirs is not None:
                _attach(existing, owner)
            return existing
        if owner_gone(theirs) is None:
            logger.warning(
                "cf_ray: the controller of run %s belongs to another live run (job %s); reusing it",
                run_name_of(key),
                theirs.job_id if theirs else "?",
            )
            return existing
        _retire(key, existing, theirs)
        settings = dataclasses.replace(settings, replaces_dead_run=True, recreated=False)
    created = _create(key, storage, settings)
    _attach(created, owner)
    return created


def _create(key: str, storage: Storage, settings: ControllerSettings):
    # On the head node, hard: the worker that creates it may be on a spot node that is about to go,
    # and the controller must outlive it (the design draws it on the driver side). Ray does not honour
    # a soft affinity requested from a worker node; num_cpus=0 fits a head with no CPUs.
    head = head_node_id()
    extra = {}
    if head is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        extra["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=head, soft=False)
    else:
        logger.warning(
            "cf_ray: no head node found in ray.nodes(); the controller of run %s is placed anywhere "
            "(it may land on a node that is lost)",
            run_name_of(key),
        )
    return ControllerActor.options(
        name=controller_name(key),
        namespace=_env.namespace(),
        lifetime="detached",
        get_if_exists=True,
        **extra,
    ).remote(key, storage, settings)


def _attach(handle, owner: Owner) -> None:
    """Tell the controller which ``fit()`` uses it now (its reaper then watches that one). Not
    waited for: it only decides when the actors of a ``fit()`` that is over may end, and a controller
    that does not get it keeps them until the driver's job ends."""
    try:
        handle.attach.remote(owner, train_controller())
    except Exception as e:  # noqa: BLE001
        logger.debug("cf_ray: could not attach to the controller: %r", e)


def _owner_of(handle) -> tuple[Owner | None, bool]:
    """``(owner, reachable)`` of an existing controller; an unreachable one (dying, or restarting
    past the timeout) is left to Ray and to :func:`resolve_controller`."""
    try:
        return ray.get(handle.owner.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)), True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None, False


def _retire(key: str, handle, theirs: Owner | None) -> None:
    """Shut down a controller whose run is over (holders drained and killed), then wait until its
    name is free or taken by another actor (a rank of the new run may have been quicker)."""
    logger.warning(
        "cf_ray: the controller of run %s belongs to a run whose driver is gone (job %s); shutting it "
        "down and starting from storage",
        run_name_of(key),
        theirs.job_id if theirs else "?",
    )
    timeout_s = 2 * _env.get_float(_env.DRAIN_TIMEOUT_S) + 60
    try:
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass  # it killed itself at the end of its shutdown
    except Exception as e:  # noqa: BLE001 - stuck: killed; the new controller retires its holders
        logger.warning("cf_ray: the old controller of run %s did not shut down (%r); killing it", run_name_of(key), e)
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    old = handle._actor_id
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = get_controller(key)
        if now is None or now._actor_id != old:
            return
        time.sleep(0.1)


def resolve_controller(key: str, storage: Storage, settings: ControllerSettings, timeout_s: float | None = None):
    """A live handle of the run's controller, made again if it is gone: what a worker calls when a
    call to the controller failed (``RayActorError``, ``ActorDiedError``, ``ActorUnavailableError``,
    a timeout). A controller that Ray is restarting is waited for; one that is gone for good (killed,
    or its node lost before Ray could restart it) is created again by the first caller — several
    ranks may call at once, Ray's ``get_if_exists`` makes one — with ``recreated=True`` (it numbers
    above the dead one's versions and rebuilds from storage and the holders). Tries with backoff for
    at most ``timeout_s`` (``CF_RAY_ACTOR_TIMEOUT_S``).

    Raises:
        TimeoutError: no live controller within the timeout (the last error is chained).
    """
    settings = dataclasses.replace(settings, recreated=True)
    return resolve_live(
        lambda: get_or_create_controller(key, storage, settings), f"cf_ray controller for run {key}", timeout_s
    )


def get_controller(key: str):
    """The live controller of a run, or ``None``."""
    try:
        return ray.get_actor(controller_name(key), namespace=_env.namespace())
    except ValueError:
        return None


__all__ = [
    "Controller",
    "ControllerActor",
    "ControllerSettings",
    "controller_name",
    "get_controller",
    "get_or_create_controller",
    "resolve_controller",
    "run_key",
]
