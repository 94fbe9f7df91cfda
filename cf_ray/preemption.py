"""Preemption notices: a just-in-time checkpoint ahead of the schedule when a worker is about to go.

Every rank watches three sources; one notice on one rank is enough:

* **Ray Train's own signal.** Ray 2.60 starts a ``PreemptionWatcher`` actor per worker group that
  polls Ray Core's drain state (a node drained with reason *preemption*: the autoscaler, KubeRay,
  ``ray drain-node``) and calls ``mark_preempt(PreemptionInfo)`` on every worker;
  ``ray.train.get_preemption_info()`` returns it. That call is a barrier (rank 0's value is
  broadcast, so every rank must call it as often). cf_ray instead reads the worker's own copy
  after every step, which costs nothing, and lets its per-step all-reduce
  (``cf_ray/_engine/worker/control.py``) make the ranks agree; where that copy is not reachable (another Ray version) it falls back to the
  public call every ``ray_poll_every`` steps, the same steps on every rank. Ray then keeps the
  group running until the deadline (``PreemptionInfo.deadline_ms``, or 120 s after detection when
  Ray Core reports none) plus ``FailureConfig.preemption_grace_s``, and restarts it from the latest
  registered checkpoint (counted against ``FailureConfig.max_preemption_failures``).
* **SIGTERM** to a worker process (Kubernetes, a spot agent). ``signal.signal`` works only in the
  main thread, and Ray Train runs ``train_loop_per_worker`` in a thread of its own; the worker
  actor's methods, however, run on the main thread, so cf_ray installs its handler there through
  the actor (``__ray_call__``), together with ``signal.set_wakeup_fd``: the C-level handler writes
  the signal number to a pipe at once, and a thread of cf_ray reads it (a Python-level handler
  would only run when the main thread next executes Python, which can be seconds later). Outside
  Ray Train, from the main thread, a plain handler is used. Where neither is possible, SIGTERM is
  not watched (a warning says so) and Ray's signal still is. The deadline of a SIGTERM is not
  known to the process: ``sigterm_deadline_s`` (Kubernetes' default grace period is 30 s).
  cf_ray defers SIGTERM, it does not swallow it: once the checkpoint is durable (or the deadline
  has passed) the previous handler runs (Ray's ends the worker process, so Ray Train restarts
  the group at once instead of waiting for the SIGKILL). Not every SIGTERM is a notice: Ray Train
  v2 stops a worker group (a worker failed or raised, the run ended, a restart or a resize) by
  calling each worker actor's ``shutdown()``, whose worker callbacks run before the process is
  killed, and a SIGTERM reaches the worker on the way; cf_ray adds a callback there, and a SIGTERM
  after it is passed on at once. So is one before the rank's first training step (``restore()``
  raised or has not returned): the rank holds nothing its restore did not load.
* **The user**: ``Checkpointer.request_checkpoint(preemption=True, deadline_s=...)`` on one rank,
  from any thread (a metadata-endpoint poller), or :func:`notify_preemption` from the driver or
  any process of the cluster (it goes through the run's controller, which rings every rank's
  doorbell: each rank hears of it at its next step; a rank outside a Ray actor, at its next poll).

What happens then, on every rank: the notice is posted in the next exchange, and all ranks take a
checkpoint at the step after (the exchange at step *s* is read at step *s+1*), marked ``preempt``;
the node's holder persists it before anything else queued. Once every section is staged, the
checkpoint is safe at the first of: committed on storage, or every section on a draining node
(every section when none is known to drain) has a copy on another node — a peer's memory, from
which the restarted group restores it; storage goes on (``cf_ray._engine.driver.jit``: derived
from what happened, nothing predicted). A rank that knows the deadline then waits until the
checkpoint is safe (at most until the deadline) and holds until the deadline
(``hold``): a step taken after the checkpoint would be lost with the node anyway, and the other
ranks stop with it at their next collective. So the work lost is at most the step in flight, plus
the restart. If the deadline passes and the process is still alive, training goes on (the notice
was a false alarm, or the grace was longer) and a new notice triggers a new checkpoint.

Deadlines and what a user sees: the controller's profile row of a just-in-time checkpoint has
``notice_unix``, ``notice_source``, ``deadline_unix``, ``jit_left_s`` and ``jit_needs_copy`` (when
its last section was staged), ``actual_peer_s`` and ``actual_storage_s`` (until each happened) and
``made_deadline`` (safe — a peer's copy of every section on a draining node, or the manifest
durable — before the deadline; ``safe_tier`` says which came first). A checkpoint that cannot be made durable in time is never
visible: the manifest is written only when every part is durable, so the previous committed
checkpoint stays the latest, and the orphan files are deleted by clean-up once a newer checkpoint
is committed. A checkpoint that becomes durable *after* its deadline (the node outlived it) is
still complete and verified; it is committed and used (``made_deadline=False``), because it loses
less work than the previous one. It is never committed after the next attempt has restored from
something else (the controller abandons the previous attempt's pending checkpoints then).

Elastic groups (``ScalingConfig(num_workers=(min, max))``): Ray Train 2.60 never changes the size
of a running group in place. After a lost node (a failure), or when its elastic policy sees more
or fewer reserved nodes (a check every ``elastic_resize_monitor_interval_s``, default 60 s, on a
view refreshed every 20 s), it shuts the whole group down and starts a new one of the new size;
the training function starts again. cf_ray resumes it from the newest checkpoint (memory or
storage): replicated state (DDP model, optimizer, schedulers, scaler; ``replicated=True``) loads on
any number of workers, DDP wrappers are tracked through the wrapped module so a checkpoint of 2
workers loads into 1 (where ``prepare_model`` does not wrap) and back; each data source's position
is re-split over the new ranks (``load_elastic_state``: the epoch stays exactly once); the
controller re-profiles the new group (fresh timing samples, a fresh copy of the policy). What does
not reshard is refused with :class:`~cf_ray.ElasticResumeError` before anything is loaded:
per-rank model or optimizer state (``replicated=False``, e.g. FSDP/ZeRO shards saved as they are)
and data objects without ``load_elastic_state``. Resume those with the saved number of workers.
A resize of a healthy group would lose the work since the last checkpoint; with
:class:`CheckpointBeforeResize` in ``RunConfig(callbacks=...)`` Ray's controller first waits for a
just-in-time checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, cast

import ray

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.messages import CheckpointRequest
from cf_ray.config import PreemptionConfig
from cf_ray.errors import CfRayError

logger = logging.getLogger("cf_ray")


# -- from the driver (or any process of the cluster) ------------------------------------------------------


def controller_of(storage_path: str, run_name: str, storage_filesystem=None):
    """The live cf_ray controller of a run, or ``None``.

    Args:
        storage_path: the run's storage, as given to ``RunConfig(storage_path=...)`` (or
            ``CheckpointConfig(storage_path=...)`` when that was set).
        run_name: the run's name (``RunConfig(name=...)``).
        storage_filesystem: the ``pyarrow.fs`` filesystem given with it, if any.
    """
    from cf_ray._engine.driver.controller import get_controller
    from cf_ray._engine.protocol.naming import run_key
    from cf_ray._engine.storage.backends import open_storage

    storage = open_storage(storage_path, storage_filesystem).child(f"{run_name}/cf_ray")
    return get_controller(run_key(storage.uri(), run_name))


def notify_preemption(
    storage_path: str,
    run_name: str,
    *,
    deadline_s: float | None = None,
    deadline_unix: float | None = None,
    detail: str = "",
    storage_filesystem=None,
) -> dict:
    """Tell every rank of a running job that it is about to be preempted (or resized).

    For clusters that learn of preemption outside the workers (a cloud provider's event, a
    scheduler that is about to shrink or grow the group): the controller rings every rank's
    doorbell, so each rank hears of it at its next step (a rank outside a Ray actor, at its next
    poll, ``env.POLL_INTERVAL_S``); they take the just-in-time checkpoint together and hold until
    the deadline (see the module doc).

    Args:
        storage_path: the run's storage, as in :func:`controller_of`.
        run_name: the run's name, as in :func:`controller_of`.
        storage_filesystem: the ``pyarrow.fs`` filesystem given with it, if any.
        deadline_s: seconds from now until the workers are expected to be gone.
        deadline_unix: the same as a UNIX time (wins over ``deadline_s``).
        detail: free text kept with the notice.

    Returns:
        The request as the controller recorded it (``seq``, ``deadline_unix``, ``detail``, ``time``,
        ``generation``).

    Raises:
        CfRayError: no live controller for this run (the job is not running).
    """
    ctl = controller_of(storage_path, run_name, storage_filesystem)
    if ctl is None:
        raise CfRayError(
            f"no running cf_ray job named {run_name!r} under {storage_path!r}; give the same "
            "storage_path and name as the job's RunConfig"
        )
    if deadline_unix is None and deadline_s is not None:
        deadline_unix = time.time() + float(deadline_s)
    req = cast(
        CheckpointRequest,
        ray.get(ctl.request_checkpoint.remote(deadline_unix, detail), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)),
    )
    return {
        "seq": req.seq,
        "deadline_unix": req.deadline_unix,
        "detail": req.detail,
        "time": req.time_unix,
        "generation": req.generation,
    }


if TYPE_CHECKING:
    _ControllerCallback = object
else:
    try:  # Ray Train v2's controller callbacks (a DeveloperAPI; RunConfig(callbacks=...) accepts them)
        from ray.train.v2._internal.execution.callback import ControllerCallback as _ControllerCallback
    except Exception:  # noqa: BLE001 - another Ray version: the callback below is then inert
        _ControllerCallback = object


class CheckpointBeforeResize(_ControllerCallback):
    """Ray Train controller callback: a just-in-time checkpoint before an elastic resize.

    With ``ScalingConfig(num_workers=(min, max))``, Ray Train 2.60 grows (or shrinks) a *healthy*
    group by shutting every worker down and starting a new group (``RESIZING``), without telling
    the training function: the work since the last checkpoint would be lost. This callback runs in
    Ray Train's controller when it enters that state, asks cf_ray for a just-in-time checkpoint
    (as :func:`notify_preemption` does) and waits until it is committed, at most ``timeout_s``;
    then Ray restarts the group, which resumes from it. Restarts after a failure are not delayed.

    Use: ``RunConfig(callbacks=[cf_ray.preemption.CheckpointBeforeResize()])``.

    Args:
        timeout_s: longest wait for the checkpoint (the resize goes ahead after it regardless).
        storage_path: the cf_ray run's storage when ``CheckpointConfig`` set its own
            ``storage_path``; by default the run's ``RunConfig(storage_path=...)``.
        run_name: the cf_ray run's name when ``CheckpointConfig`` set its own ``run_name``; by
            default the run's ``RunConfig(name=...)``.
        storage_filesystem: the ``pyarrow.fs`` filesystem of ``storage_path``, if any.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        storage_path: str | None = None,
        run_name: str | None = None,
        storage_filesystem=None,
    ):
        self.timeout_s = float(timeout_s)
        self.storage_path = storage_path
        self.run_name = run_name
        self.storage_filesystem = storage_filesystem
        self.outcomes: list[dict] = []

    def after_controller_start(self, train_run_context) -> None:
        rc = train_run_context.run_config
        if self.storage_path is None:
            self.storage_path = rc.storage_path
            self.storage_filesystem = self.storage_filesystem or getattr(rc, "storage_filesystem", None)
        if self.run_name is None:
            self.run_name = rc.name

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if type(current_state).__name__ != "ResizingState" or self.storage_path is None or self.run_name is None:
            return
        self.outcomes.append(
            self.checkpoint_now(detail=f"Ray Train resizes the group ({type(previous_state).__name__} -> RESIZING)")
        )

    def checkpoint_now(self, detail: str = "resize") -> dict:
        """Ask for a just-in-time checkpoint and wait until it is committed (or ``timeout_s``)."""
        t0 = time.time()
        out = {"time": t0, "step": None, "committed": False, "seconds": None}
        try:
            if self.storage_path is None or self.run_name is None:
                return out
            ctl = controller_of(self.storage_path, self.run_name, self.storage_filesystem)
            if ctl is None:
                return out
            ray.get(ctl.request_checkpoint.remote(t0 + self.timeout_s, detail), timeout=10)
            while time.time() - t0 < self.timeout_s:
                rows = ray.get(ctl.profile_rows.remote(), timeout=10)
                row = next(
                    (
                        r
                        for r in rows
                        if r.get("kind") == "preempt"
                        and r.get("notice_source") == "driver"
                        and (r.get("notice_unix") or 0) >= t0 - 1e-3
                        and r.get("committed")
                    ),
                    None,
                )
                if row is not None:
                    out.update(step=row["step"], committed=True, seconds=time.time() - t0)
                    break
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - never block a resize for cf_ray's sake
            logger.warning("cf_ray: checkpoint before resize failed: %r", e)
        if not out["committed"]:
            logger.warning(
                "cf_ray: no just-in-time checkpoint committed within %.0f s before the resize; the "
                "new group resumes from the latest one",
                self.timeout_s,
            )
        return out


__all__ = ["CheckpointBeforeResize", "PreemptionConfig", "controller_of", "notify_preemption"]
