"""Every tunable environment variable of cf_ray, with its default, in one place.

Tests change them with ``monkeypatch.setenv``; code reads them through the helpers below at the
moment it needs them (never cached at import), so a change takes effect in the next object built.
"""

from __future__ import annotations

import os

#: Seconds between two non-blocking polls of the controller by a worker.
POLL_INTERVAL_S = "CF_RAY_POLL_INTERVAL_S"
#: Minimum seconds between two registrations of a committed checkpoint with Ray Train
#: (``ray.train.report`` is a barrier and, on Ray 2.60, throttled to one per health-check period).
REGISTER_INTERVAL_S = "CF_RAY_REGISTER_INTERVAL_S"
#: Seconds a worker waits for the controller or a holder in a blocking call (restore, close).
ACTOR_TIMEOUT_S = "CF_RAY_ACTOR_TIMEOUT_S"
#: Seconds between warnings while a blocking wait goes on (names the lagging ranks).
WARN_INTERVAL_S = "CF_RAY_WARN_INTERVAL_S"
#: Seconds the controller stays alive after every rank has finished, so the driver can read it.
LINGER_S = "CF_RAY_CONTROLLER_LINGER_S"
#: Bytes per write call when streaming a checkpoint file to storage.
WRITE_CHUNK_BYTES = "CF_RAY_WRITE_CHUNK_BYTES"
#: "0" turns off direct I/O (O_DIRECT) for large local writes; they then go through the page cache.
DIRECT_IO = "CF_RAY_DIRECT_IO"
#: "0" turns off the holder's shared-memory snapshot slots (#14): snapshots are then handed to the
#: holder by value (through the object store), with more copies on the host.
SHM_SLOTS = "CF_RAY_SHM_SLOTS"
#: "0" turns off the direct transfer of held sections to readers on other nodes (#12,
#: ``node/stream.py``): a restore on another node then gets them through Ray's object transfer.
PEER_STREAM = "CF_RAY_PEER_STREAM"
#: Fault injection for tests: ``"<step>@<rank>@<marker file>"`` SIGKILLs that rank's process in the
#: middle of its copy of that step's snapshot into a slot, once (the marker file records it). Unset
#: in normal use; the tests use it to show that a snapshot killed mid-copy is never restored.
FAULT_KILL_MID_COPY = "CF_RAY_FAULT_KILL_MID_COPY"
#: Namespace of cf_ray's named actors.
NAMESPACE = "CF_RAY_NAMESPACE"
#: Steps after a restore whose loss (``Checkpointer.step(..., loss=)``) is checked for NaN and
#: infinity (``worker/trust_gate.py``); a non-finite one rolls the run back past the restored step.
#: Only these steps read the loss's value (a GPU loss is synchronised there only); 0 turns it off.
TRUST_STEPS = "CF_RAY_TRUST_STEPS"
#: Seconds a snapshot waits for a free slot when the holder holds both slots of a section (one being
#: written, one pinned until written) before it is skipped and reported (``worker/snapshot.py``).
SLOT_WAIT_S = "CF_RAY_SLOT_WAIT_S"

# -- the control plane (issue #16): liveness, recovery, bounded controller, uploads -------------
#: Messages a holder keeps queued for the controller (part_staged, part_durable, ...) while it is
#: unreachable; past this the oldest are dropped with a warning (the controller's watch recovers them).
SEND_QUEUE = "CF_RAY_SEND_QUEUE"
#: Seconds between two checks by the controller of the holders that hold its pending sections
#: (a dead or restarted holder's sections fail instead of staying pending forever).
WATCH_INTERVAL_S = "CF_RAY_WATCH_INTERVAL_S"
#: Seconds the controller's shutdown waits for each holder to finish what it is writing (and for
#: the queued uploads) before it kills it; what is left is logged.
DRAIN_TIMEOUT_S = "CF_RAY_DRAIN_TIMEOUT_S"
#: Seconds a restore plan waits for a restarted controller to re-learn from the holders what they hold.
RESYNC_TIMEOUT_S = "CF_RAY_RESYNC_TIMEOUT_S"
#: Uploads to the tiers queued at most; when full the oldest non-milestone one is dropped (logged).
UPLOAD_QUEUE = "CF_RAY_UPLOAD_QUEUE"
#: Tries of one upload on a transient error (OSError), with exponential backoff.
UPLOAD_RETRIES = "CF_RAY_UPLOAD_RETRIES"
#: Seconds before the first retry of an upload (doubled each time, at most 60 s).
UPLOAD_BACKOFF_S = "CF_RAY_UPLOAD_BACKOFF_S"
#: Profile rows the controller keeps in memory; older ones go to storage in Parquet parts.
PROFILE_WINDOW_ROWS = "CF_RAY_PROFILE_WINDOW_ROWS"
#: Events (and failures) the controller keeps in memory, newest.
EVENTS_WINDOW = "CF_RAY_EVENTS_WINDOW"
#: Seconds between two saves of the policy's learnt state during a run (so that a restarted
#: controller does not profile again from scratch).
POLICY_SAVE_INTERVAL_S = "CF_RAY_POLICY_SAVE_INTERVAL_S"
#: Seconds between two checks by the controller's reaper that the run's driver (its Ray job) and its
#: Ray Train run are still there; when they are gone the run's actors end (``protocol/cluster.py``).
REAPER_INTERVAL_S = "CF_RAY_REAPER_INTERVAL_S"
#: Tests only, unset by default: ``"STEP:SECONDS"`` makes a holder wait SECONDS after a peer asked
#: it to keep a copy of a section of step STEP and before it pulls the bytes, so that a test can
#: remove the peer's node while that copy is in flight (tests/test_multinode.py). Read by the
#: holder's process, so it must be in the environment of the node's raylet.
TEST_REPLICA_PULL_DELAY = "CF_RAY_TEST_REPLICA_PULL_DELAY"

_DEFAULTS = {
    POLL_INTERVAL_S: 0.25,
    REGISTER_INTERVAL_S: 10.0,
    ACTOR_TIMEOUT_S: 120.0,
    WARN_INTERVAL_S: 15.0,
    LINGER_S: 120.0,
    WRITE_CHUNK_BYTES: 16 * 1024 * 1024,
    DIRECT_IO: 1,
    SHM_SLOTS: 1,
    PEER_STREAM: 1,
    SEND_QUEUE: 4096,
    WATCH_INTERVAL_S: 5.0,
    DRAIN_TIMEOUT_S: 300.0,
    RESYNC_TIMEOUT_S: 10.0,
    UPLOAD_QUEUE: 16,
    UPLOAD_RETRIES: 5,
    UPLOAD_BACKOFF_S: 1.0,
    PROFILE_WINDOW_ROWS: 1000,
    EVENTS_WINDOW: 1000,
    POLICY_SAVE_INTERVAL_S: 60.0,
    REAPER_INTERVAL_S: 5.0,
    TRUST_STEPS: 3,
    SLOT_WAIT_S: 60.0,
}


def get_float(name: str) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return float(_DEFAULTS[name])
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number; unset it or give a number") from None


def get_int(name: str) -> int:
    return int(get_float(name))


def namespace() -> str:
    return os.environ.get(NAMESPACE, "cf_ray")


def replica_pull_delay_s(step: int) -> float:
    """Seconds ``TEST_REPLICA_PULL_DELAY`` holds the pull of a copy of ``step`` (0 when unset)."""
    raw = os.environ.get(TEST_REPLICA_PULL_DELAY, "")
    if not raw:
        return 0.0
    try:
        at, seconds = raw.split(":")
        return float(seconds) if int(at) == step else 0.0
    except ValueError:
        raise ValueError(
            f"environment variable {TEST_REPLICA_PULL_DELAY}={raw!r} is not STEP:SECONDS; unset it"
        ) from None
