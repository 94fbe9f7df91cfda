"""cf_ray's tunables, in one place: the nine environment variables a user may set, and the module
constants that only tests change.

**Environment variables** (documented in ``docs/guides/configuration.md``; the names below are
their spellings). They are read at the moment they are needed, never cached at import, so a change
takes effect in the next object built; a Ray process reads the environment it was started with
(set them before ``ray.init``, or in the ``runtime_env``):

==============================  =======  =====================================================
``CF_RAY_ACTOR_TIMEOUT_S``      120      seconds a blocking call to the controller or a holder
                                         waits (restore, ``wait()``, ``finish()``, a resync)
``CF_RAY_CONTROLLER_LINGER_S``  120      seconds the controller outlives ``finish()`` of every
                                         rank, so that the driver can still read it
``CF_RAY_DRAIN_TIMEOUT_S``      300      seconds the end of a run waits for each holder to finish
                                         writing (and for the queued uploads)
``CF_RAY_REAPER_INTERVAL_S``    5        seconds between two checks that the run's driver and
                                         ``fit()`` are still there
``CF_RAY_REGISTER_INTERVAL_S``  10       least seconds between two registrations of a committed
                                         checkpoint with Ray Train (``ray.train.report``)
``CF_RAY_DIRECT_IO``            1        ``0``: large local writes go through the page cache
                                         instead of ``O_DIRECT``
``CF_RAY_CRC_THREADS``          auto     threads that checksum what a GPU copied into host memory
                                         (the cores over ``LOCAL_WORLD_SIZE``, at most 8)
``CF_RAY_ALLOW_UNTESTED_RAY``   unset    ``1``: import cf_ray with a Ray it was not tested with
``CF_RAY_RAY_TRAIN_DEFAULTS``   1        ``0``: ``import cf_ray`` in the driver leaves Ray Train's
                                         health-check interval at Ray's default (2 s); in a
                                         worker, no spare worker process is made
==============================  =======  =====================================================

**Module constants** (below, plain values): not read from the environment. Code reads them at the
moment it needs them (``_env.UPLOAD_QUEUE``, not a copy taken at import), so a test
changes one with ``monkeypatch.setattr(env, "UPLOAD_QUEUE", 2)`` (in the test's process: a Ray
actor's process imports its own copy). They are not settings: their values are the ones cf_ray is
tested with, and an environment variable of the same name is not read.

No fault injection is read here: tests inject their faults from outside cf_ray's code (the soak's
probes, ``benchmarks/soak/probes.py``, also serve the end-to-end tests).
"""

from __future__ import annotations

import os

# -- the environment variables (nine, each documented) ----------------------------------------
#: Seconds a worker waits for the controller or a holder in a blocking call (restore, wait, close).
ACTOR_TIMEOUT_S = "CF_RAY_ACTOR_TIMEOUT_S"
#: Seconds the controller stays alive after every rank has finished, so the driver can read it.
LINGER_S = "CF_RAY_CONTROLLER_LINGER_S"
#: Seconds the controller's shutdown waits for each holder to finish what it is writing (and for
#: the queued uploads) before it kills it; what is left is logged.
DRAIN_TIMEOUT_S = "CF_RAY_DRAIN_TIMEOUT_S"
#: Seconds between two checks by the controller's reaper that the run's driver (its Ray job) and its
#: Ray Train run are still there; when they are gone the run's actors end (``driver/lifetime.py``).
REAPER_INTERVAL_S = "CF_RAY_REAPER_INTERVAL_S"
#: Minimum seconds between two registrations of a committed checkpoint with Ray Train
#: (``ray.train.report`` is a barrier and, on Ray 2.60, throttled to one per health-check period).
REGISTER_INTERVAL_S = "CF_RAY_REGISTER_INTERVAL_S"
#: "0" turns off direct I/O (O_DIRECT) for large local writes; they then go through the page cache.
DIRECT_IO = "CF_RAY_DIRECT_IO"
#: Threads that checksum a snapshot's bytes after a GPU copied them into host memory by DMA
#: (``worker/snapshot/copy_engine.py``'s ``crc_threads``; unset or 0: the cores over ``LOCAL_WORLD_SIZE``, at most 8).
CRC_THREADS = "CF_RAY_CRC_THREADS"
#: "1" lets cf_ray import with a Ray version it was not tested with (``cf_ray._version``).
ALLOW_UNTESTED_RAY = "CF_RAY_ALLOW_UNTESTED_RAY"
#: "0" keeps Ray Train's own defaults for the settings cf_ray gives it in the driver when imported
#: there (its health-check interval: ``cf_ray/_engine/worker/link/ray_train_fast.py``) and, in a
#: worker's environment, makes no spare worker process (``link/ray_train_spare.py``).
RAY_TRAIN_DEFAULTS = "CF_RAY_RAY_TRAIN_DEFAULTS"

VARIABLES: dict[str, float] = {
    ACTOR_TIMEOUT_S: 120.0,
    LINGER_S: 120.0,
    DRAIN_TIMEOUT_S: 300.0,
    REAPER_INTERVAL_S: 5.0,
    REGISTER_INTERVAL_S: 10.0,
    DIRECT_IO: 1,
    CRC_THREADS: 0,
    ALLOW_UNTESTED_RAY: 0,
    RAY_TRAIN_DEFAULTS: 1,
}
"""Every environment variable cf_ray reads, with its default."""


# -- module constants (not read from the environment; tests monkeypatch them) ---------------------------
#: Seconds between two non-blocking polls of the controller by a worker whose doorbell the controller
#: does not have (outside a Ray actor; ``protocol/doorbell.py``).
POLL_INTERVAL_S: float = 0.25
#: Seconds between warnings while a blocking wait goes on (names the lagging ranks).
WARN_INTERVAL_S: float = 15.0
#: Bytes per write call when streaming a checkpoint file to storage (and per read of an upload).
WRITE_CHUNK_BYTES: int = 16 * 1024 * 1024
#: Namespace of cf_ray's named actors.
NAMESPACE: str = "cf_ray"
#: Messages a holder keeps queued for the controller (part_staged, part_durable, ...) while it is
#: unreachable; past this the oldest are dropped with a warning (the controller's watch recovers them).
SEND_QUEUE: int = 4096
#: Seconds between two checks by the controller of the holders that hold its pending sections
#: (a dead or restarted holder's sections fail instead of staying pending forever).
WATCH_INTERVAL_S: float = 5.0
#: Seconds a restore plan waits for a restarted controller to re-learn from the holders what they hold.
RESYNC_TIMEOUT_S: float = 10.0
#: Uploads to the tiers queued at most; when full the oldest non-milestone one is dropped (logged).
UPLOAD_QUEUE: int = 16
#: Tries of one upload on a transient error (OSError), with exponential backoff.
UPLOAD_RETRIES: int = 5
#: Seconds before the first retry of an upload (doubled each time, at most 60 s).
UPLOAD_BACKOFF_S: float = 1.0
#: Profile rows the controller keeps in memory; older ones go to storage in Parquet parts.
PROFILE_WINDOW_ROWS: int = 1000
#: Events (and failures) the controller keeps in memory, newest.
EVENTS_WINDOW: int = 1000
#: Seconds between two saves of the policy's learnt state during a run (so that a restarted
#: controller does not profile again from scratch).
POLICY_SAVE_INTERVAL_S: float = 60.0
#: Seconds between two saves of the profile's rows still in the controller's memory and its events
#: (after a commit or an event), so that a controller Ray starts again lists what its predecessor
#: had not written.
WINDOW_SAVE_INTERVAL_S: float = 5.0
#: Seconds between two non-blocking polls of the controller by a worker whose doorbell the controller
#: has (a Ray Train worker): a checkpoint request and a new schedule version ring it, so the poll only
#: carries the timing samples, commits and failures, none of which needs a quarter of a second (each
#: poll costs the training thread and the controller's CPU a call). The step times reach the policy
#: up to this much later.
BELL_POLL_INTERVAL_S: float = 1.0

#: Steps after a restore whose loss (``Checkpointer.step(..., loss=)``) is read and checked for NaN and
#: infinity (``worker/restore/trust_gate.py``); a non-finite one rolls the run back past the restored step.
#: Only these steps read the loss's value (a GPU loss is synchronised there only).
TRUST_STEPS: int = 3
#: Seconds a snapshot may hold the training thread waiting — for the previous hand-off, a free slot of
#: each section when the holder holds every one (one being written, one pinned until written, the
#: spare), the holder's slots of a new layout — in all, before it is skipped and reported
#: (``worker/snapshot/snapshotter.py``): one bound per snapshot, not per section.
SLOT_WAIT_S: float = 60.0


def get_float(name: str) -> float:
    """The value of environment variable ``name`` of :data:`VARIABLES` (its default when unset or
    empty), read now, so that a process reads the environment it runs in.

    Raises:
        ValueError: the variable is set to something that is not a number (naming it).
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return float(VARIABLES[name])
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number; unset it or give a number") from None


def get_int(name: str) -> int:
    """:func:`get_float`, as an int."""
    return int(get_float(name))


def namespace() -> str:
    return NAMESPACE
