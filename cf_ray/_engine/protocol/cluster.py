"""Every query of the Ray cluster that cf_ray makes, and who a run's actors belong to.

Nodes: :func:`alive_nodes`, :func:`draining_nodes`, :func:`head_node_id`. Ownership and liveness
(below): :class:`Owner`, :func:`current_owner`, :func:`owner_gone`, :func:`job_alive`,
:func:`actor_alive`, :func:`fit_over`. Worker, node and driver rooms all use this module.

A run's actors live as long as the run.

The controller and the holders are *detached* (a worker that Ray Train restarts must find them
again, and a non-detached actor dies with the worker that created it), so Ray does not end them
when the run ends. What does:

* every actor records its :class:`Owner`: the Ray job of the driver that runs the training (a Ray
  Train worker's job id is its driver's) and, under Ray Train v2, the id of the run's
  ``TrainController`` actor (one per ``fit()``; gone when ``fit()`` returned or the driver died);
* the controller's reaper (:meth:`~cf_ray._engine.driver.lifetime.Lifetime.reaper`) checks every
  ``CF_RAY_REAPER_INTERVAL_S`` whether the run is over, and then drains the holders, saves the
  profile, kills the holders and exits (:meth:`~cf_ray._engine.driver.lifetime.Lifetime.run_over`):

  - the driver's job is dead (driver killed, the script exited after Ctrl-C or ``max_failures``):
    at once;
  - the ``fit()`` ended without ``finish()`` — its ``TrainController`` is dead or in a terminal
    state (Ctrl-C, ``max_failures`` exhausted, an error) — while the driver lives on (a notebook, a
    script that calls ``fit()`` again): after ``CheckpointConfig.release_after_fit_s`` (120 s) unless
    a ``fit()`` of the same run attached meanwhile (:meth:`Controller.attach`, called by every worker
    that gets the controller). A ``fit()`` that comes back in time resumes with them, from memory
    when the snapshots allow it, as a restart of the worker group would; one that comes later
    resumes from storage. (Ending them the moment a ``fit()`` ends would break the runs that resume
    with a second ``fit()`` in the same process — the elastic segments, the notebook's interrupted
    cell.)
    Ray Train keeps a finished ``fit()``'s ``TrainController`` alive (the driver's SIGINT handler
    holds its handle until the next ``fit()``), so its state is asked, not only its liveness;
  - every rank called ``finish()``: the controller's linger (``CF_RAY_CONTROLLER_LINGER_S``) ends it;
* a new run with the same run key never reuses the actors of a dead one (:func:`get_or_create_controller`
  and ``get_or_create_holder`` ask an existing actor for its owner): they are drained and killed,
  and the new controller starts from storage only — the dead run's in-memory snapshots are not
  taken (storage is the truth), and the new run's ``CheckpointConfig`` applies.

Checks read the GCS directly (the job table filtered to one job, one actor's entry): no dashboard
needed, one small GCS call each. When a check cannot tell (GCS unreachable), the owner counts as
alive: nothing is ever ended on a guess. No torch here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
import ray.exceptions

logger = logging.getLogger("cf_ray")

#: The resource only the head node has.
HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a run's actors belong to."""

    job_id: str = ""
    """Hex id of the Ray job of the driver that runs the training (``""``: unknown)."""
    train_run: str | None = None
    """Hex id of the Ray Train v2 ``TrainController`` actor of this ``fit()`` (``None``: not under
    Ray Train v2, e.g. an actor made by a test or a script)."""

    def same_run(self, other: Owner | None) -> bool:
        """Whether ``other`` belongs to this run's driver (the same job; a later ``fit()`` in the
        same job continues the run); an unknown owner matches anything (it cannot be told apart)."""
        if other is None or not other.job_id or not self.job_id:
            return True
        return other.job_id == self.job_id


def current_owner() -> Owner:
    """The owner of what this process creates: its job, and the Ray Train run it belongs to."""
    try:
        job_id = ray.get_runtime_context().get_job_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        job_id = ""
    return Owner(job_id=job_id or "", train_run=_train_controller_id())


def _train_controller_id() -> str | None:
    """The ``TrainController`` actor of the Ray Train v2 run this worker belongs to, if any."""
    handle = train_controller()
    return handle._actor_id.hex() if handle is not None else None


def train_controller():
    """The handle of the Ray Train v2 ``TrainController`` of the ``fit()`` this worker runs in, or
    ``None`` (not in a Ray Train v2 worker)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().controller_actor
    except Exception:  # noqa: BLE001 - not in a Ray Train v2 worker
        return None


def fit_over(handle, train_run: str) -> bool | None:
    """Whether the ``fit()`` whose ``TrainController`` is ``handle`` (id ``train_run``) is over: the
    actor is dead, or it is in a terminal state (finished, errored, aborted by Ctrl-C). Ray Train
    keeps the actor alive after ``fit()`` returns or raises — the driver's SIGINT handler holds its
    handle until the next ``fit()`` — so its death alone does not say it. ``None``: cannot tell."""
    alive = actor_alive(train_run)
    if alive is False:
        return True
    if handle is None:
        return None
    try:
        state = ray.get(handle.get_state.remote(), timeout=10)
        return bool(state.is_terminal())  # pyright: ignore[reportAttributeAccessIssue] - ray.get of one ref is typed as a list
    except ray.exceptions.RayActorError:
        return True
    except Exception as e:  # noqa: BLE001 - a Ray Train without get_state(), a timeout: cannot tell
        logger.debug("cf_ray: cannot read the state of Ray Train run %s: %r", train_run, e)
        return None


def job_alive(job_id: str) -> bool | None:
    """Whether the Ray job ``job_id`` (hex) is alive; ``None`` when it cannot be told."""
    if not job_id:
        return None
    try:
        gcs = ray._private.worker.global_worker.gcs_client  # pyright: ignore[reportPrivateImportUsage, reportAttributeAccessIssue] - no public per-job query in Ray 2.60
        jobs = gcs.get_all_job_info(
            job_or_submission_id=job_id, skip_submission_job_info_field=True, skip_is_running_tasks_field=True
        )
        for info in jobs.values():
            if info.job_id.hex() == job_id:
                return not info.is_dead
        return False  # the GCS does not know it (any more)
    except Exception as e:  # noqa: BLE001
        logger.debug("cf_ray: cannot read the state of job %s: %r", job_id, e)
        return None


def actor_alive(actor_id: str) -> bool | None:
    """Whether the actor ``actor_id`` (hex) is alive or restarting; ``None`` when it cannot be told."""
    try:
        from ray._private import state

        info = state.actors(actor_id=actor_id)
        return bool(info) and info.get("State") != "DEAD"
    except Exception as e:  # noqa: BLE001
        logger.debug("cf_ray: cannot read the state of actor %s: %r", actor_id, e)
        return None


def owner_gone(owner: Owner | None) -> str | None:
    """Why ``owner``'s run is over (``"job"``: its driver's job ended), or ``None`` while the job is
    alive or when that cannot be told. The end of one ``fit()`` alone is not the end of the run
    (module doc); ``train_run`` is recorded for the record only."""
    if owner is None or not owner.job_id:
        return None
    if job_alive(owner.job_id) is False:
        return "job"
    return None


def alive_nodes() -> list[dict]:
    """The cluster's alive nodes, as ``ray.nodes()`` describes them (``NodeID``, ``Resources``,
    ``Labels``, ...), sorted by id.

    Raises:
        Exception: whatever Ray raises when the GCS cannot be asked (callers decide what that means).
    """
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def alive_node_ids() -> set[str] | None:
    """The ids of the cluster's alive nodes (``None`` when Ray cannot say)."""
    try:
        return {n["NodeID"] for n in alive_nodes()}
    except Exception:  # noqa: BLE001 - the GCS cannot be asked: the caller treats every node as possible
        return None


def draining_nodes() -> set[str]:
    """The ids of the nodes Ray is draining (a preemption or scale-down notice; the GCS's list).
    An older GCS without the call, or one that cannot be asked: none known."""
    try:
        from ray._private import state as _state

        return set(_state.state.get_draining_nodes())
    except Exception:  # noqa: BLE001 - no draining nodes known
        return set()


def head_node_id() -> str | None:
    """The id of the cluster's head node (alive), or ``None``."""
    try:
        for n in ray.nodes():
            if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {}):
                return n["NodeID"]
    except Exception:  # noqa: BLE001
        pass
    return None


def run_name_of(key: str) -> str:
    """The run's name as it appears in its key (``naming.run_key``: ``<name>-<digest>``)."""
    return key.rsplit("-", 1)[0] if "-" in key else key


__all__ = [
    "HEAD_RESOURCE",
    "Owner",
    "actor_alive",
    "alive_node_ids",
    "alive_nodes",
    "draining_nodes",
    "current_owner",
    "fit_over",
    "head_node_id",
    "job_alive",
    "owner_gone",
    "run_name_of",
    "train_controller",
]
