"""A replacement worker process made ready before a failure needs it: each rank keeps one idle Ray
worker process on its node that the next attempt's Ray Train worker actor can start in, instead of
a new process (Python, ``import ray``, the core worker's connection to the raylet).

Why it works, and only this way. Ray Train 2.60 rebuilds the whole worker group after any failure:
one new actor per rank. The raylet gives a new actor an idle pool worker when one fits
(``src/ray/raylet/worker_pool.cc``, ``WorkerPool::WorkerFitsForTask``): same language and worker
type, same job (or root detached actor), the same ``runtime_env`` hash, the same dynamic options,
and the same "is actor worker" flag. A worker takes that flag from its first lease and keeps it
(``GrantLease``: ``SetIsActorWorker(IsActorCreationTask())``), and an actor's process ends with its
actor: a worker that ran a task never hosts an actor, whatever it imported. Only a worker that was
never leased fits an actor's creation. The raylet's ``PrestartWorkers`` RPC starts such a worker,
of a given job and ``runtime_env``, idle until a keep-alive passes (``HandlePrestartWorkers``).

So each rank, once restored, asks its node's raylet for one worker of its own job and its own
``runtime_env`` (the one Ray Train gives every worker actor of the run: the next group's actors have
the same hash), finds which process it got (an idle Ray worker, child of the same raylet, of the
same job, with the run's environment variables, started after the request) and claims it in a file
of the node's temp dir (``protocol/spares.py``: a claim names the run; a request, written before
the raylet is asked and removed once claimed, names it too, and the node's holder ends every spare
the run asked for on its node when the run ends, claimed or not: the raylet starts the process
whatever becomes of the rank that asked). The next attempt's rank looks itself up there:
:func:`arrival` says whether it runs in a spare, and why not when it does not (logged once; rank 0
sends it with the restart's ``restore`` event as ``spare``). The spare is made again before its keep-alive passes;
``finish()`` ends it, and the holder's drain whatever the rank did not end; one left by a run whose
holders did not drain ends with its keep-alive, or with the job. ``CF_RAY_RAY_TRAIN_DEFAULTS=0`` in the workers' environment turns it off.

What a spare does not save: the actor's own start in it (Ray Train's worker module), the process
group, and the user's imports and set-up, which run in the new actor as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time

from cf_ray._engine.protocol import spares as _files
from cf_ray._engine.worker.link import ray_train_fast

logger = logging.getLogger("cf_ray")

#: Seconds the raylet keeps a spare while it waits (its keep-alive); made again before it passes.
KEEP_ALIVE_S = 600
#: Seconds between two spares of one rank (the new one is claimed before the old one ends).
RENEW_S = 480.0
#: Seconds a rank looks for the process the raylet started for it.
FIND_TIMEOUT_S = 30.0
#: Seconds ``finish()`` waits for a spare being made, to end it.
END_WAIT_S = 5.0
#: Seconds after a rank's restore before its first spare is asked for: the new process's start
#: (Python and Ray, a second or two of CPU) competes with the training beside it, which a short run
#: or the first minute of an attempt (its tuning, its first persists) should not pay for.
FIRST_DELAY_S = 45.0
_start_ticks = _files.start_ticks
_idle_spare = _files.idle_spare


def enabled() -> bool:
    """Whether this process makes spares (``CF_RAY_RAY_TRAIN_DEFAULTS`` is not ``0`` here)."""
    return ray_train_fast.enabled()


def _in_ray_worker() -> bool:
    """A process the raylet started, connected to Ray (asking Ray's runtime context anywhere else
    would start a local Ray)."""
    import ray

    return bool(os.environ.get("RAY_RAYLET_PID")) and ray.is_initialized()


class _Me:
    """This process as the raylet sees it: its job, its raylet, its ``runtime_env``."""

    def __init__(self) -> None:
        import ray

        ctx = ray.get_runtime_context()
        self.job = ctx.get_job_id()
        self.runtime_env = ctx.get_runtime_env_string()
        self.env_vars = {
            str(k): str(v) for k, v in (json.loads(self.runtime_env or "{}").get("env_vars") or {}).items()
        }
        self.raylet = os.environ.get("RAY_RAYLET_PID", "")
        self.dir = _files.spares_dir(self.raylet, self.job)


def _prestart(me: _Me) -> None:
    """Ask this node's raylet for one idle worker of ``me``'s job and ``runtime_env`` (Ray 2.60's
    ``NodeManagerService.PrestartWorkers``, through Ray's own channel: its token when auth is on)."""
    from ray._private import worker as ray_worker
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc, runtime_environment_pb2

    node = ray_worker.global_worker.node
    if node is None:
        raise RuntimeError("not in a Ray worker process")
    channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
    request = node_manager_pb2.PrestartWorkersRequest(  # pyright: ignore[reportAttributeAccessIssue] - generated
        language=common_pb2.Language.PYTHON,  # pyright: ignore[reportAttributeAccessIssue] - generated
        job_id=bytes.fromhex(me.job),
        runtime_env_info=runtime_environment_pb2.RuntimeEnvInfo(  # pyright: ignore[reportAttributeAccessIssue] - generated
            serialized_runtime_env=me.runtime_env
        ),
        keep_alive_duration_secs=KEEP_ALIVE_S,
        num_workers=1,
    )
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


def _claim(me: _Me, since_ticks: int, rank: int, run: str = "") -> dict | None:
    """The idle worker the raylet started after ``since_ticks`` for ``me``, claimed (one file per
    spare, made exclusively: two ranks of a node never claim the same one); ``None`` until there is one."""
    me.dir.mkdir(parents=True, exist_ok=True)
    for ticks, pid in _files.idle_workers(me.job, me.raylet, me.env_vars, since_ticks):
        record = {
            "pid": pid,
            "start_ticks": ticks,
            "for_pid": os.getpid(),
            "rank": rank,
            "run": run,
            "unix": time.time(),
        }
        try:
            fd = os.open(me.dir / f"{pid}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue  # another rank's
        except FileNotFoundError:
            return None  # the directory went with another rank's finish(): made again at the next look
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return record
    return None


def _end(me: _Me, record: dict) -> None:
    """End a spare of ours that is still idle (never a process that took an actor or a task since)."""
    _files.end(me.dir, record, me.job, me.raylet, me.env_vars)


class Spare:
    """This rank's spare: made in a thread after :meth:`start`, made again every :data:`RENEW_S`,
    ended by :meth:`end`. Never raises: what fails is logged once."""

    def __init__(self, rank: int, run: str = ""):
        self.rank = rank
        self.run = run
        """The run's key, in each claim (the node's holder ends the run's spares left when the run ends)."""
        self.record: dict | None = None
        """The spare this rank holds now (pid, start ticks), ``None`` before it is found."""
        self.why_not = ""
        """Why this rank has no spare, when it has none."""
        self._me: _Me | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Spare:
        if enabled() and self._thread is None and _in_ray_worker():
            self._thread = threading.Thread(target=self._run, name="cf_ray-spare", daemon=True)
            self._thread.start()
        return self

    def wait_ready(self, timeout: float) -> bool:
        """Whether this rank's spare was found within ``timeout`` seconds."""
        return self._ready.wait(timeout) and self.record is not None

    def _run(self) -> None:
        try:
            if self._stop.wait(FIRST_DELAY_S):
                return
            self._me = _Me()
            while True:
                old, self.record = self.record, self._make()
                self._ready.set()
                if old is not None:
                    _end(self._me, old)
                if self._stop.is_set() and self.record is not None:  # found after end() gave up on it
                    _end(self._me, self.record)
                    self.record = None
                if self._stop.wait(RENEW_S if self.record is not None else KEEP_ALIVE_S):
                    return
        except Exception as e:  # noqa: BLE001 - without a spare a restart starts a new process, as before
            self.why_not = f"{type(e).__name__}: {e}"
            self._ready.set()
            logger.info("cf_ray: rank %d has no spare worker process (%s); a restart starts a new one", self.rank, e)

    def _make(self) -> dict | None:
        """One spare asked for and found (looked for until :data:`FIND_TIMEOUT_S`, even once
        :meth:`end` was called: the raylet starts the process whatever this rank does next)."""
        assert self._me is not None
        since = _now_ticks() - 1
        asked = {"run": self.run, "rank": self.rank, "for_pid": os.getpid(), "since_ticks": since}
        # Written before the raylet is asked: whatever becomes of this rank, the node's holder ends
        # the process the raylet starts for it when the run ends (``protocol/spares.py``).
        request = _files.request(self._me.dir, dict(asked, env_vars=self._me.env_vars, unix=time.time()))
        try:
            _prestart(self._me)
        except BaseException:
            _files.withdraw(request)  # nothing was started for it
            raise
        deadline = time.monotonic() + FIND_TIMEOUT_S
        while time.monotonic() < deadline:
            record = _claim(self._me, since, self.rank, self.run)
            if record is not None:
                _files.withdraw(request)
                return record
            time.sleep(0.2)
        self.why_not = f"the raylet's spare did not appear within {FIND_TIMEOUT_S:.0f} s"
        logger.info("cf_ray: rank %d has no spare worker process: %s", self.rank, self.why_not)
        return None

    def end(self) -> None:
        """Stop making spares and end this rank's (the run is over: no restart will need it). A
        spare being made is waited for a few seconds, then ended by the thread when it is found."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=END_WAIT_S)
        record, self.record = self.record, None
        if self._me is not None and record is not None:
            _end(self._me, record)
            with contextlib.suppress(OSError):  # the node's last spare of the job: no directory left
                self._me.dir.rmdir()


def _now_ticks() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


_arrival: str | None = None


def arrival(*, restart: bool) -> str | None:
    """Whether this process is a spare a previous attempt made (``"taken"``), and why not otherwise
    (``"not taken: ..."``, logged once); ``None`` on a run's first attempt without one, or turned off."""
    global _arrival
    if _arrival is not None or not enabled() or not _in_ray_worker():
        return _arrival
    try:
        me = _Me()
        records = []
        for path in me.dir.glob("*.json") if me.dir.is_dir() else ():
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        alive = []
        for r in records:  # a record whose process is gone is dropped (its rank was killed with it)
            if _start_ticks(int(r["pid"])) == r.get("start_ticks"):
                alive.append(r)
            else:
                (me.dir / f"{int(r['pid'])}.json").unlink(missing_ok=True)
        if any(r["pid"] == os.getpid() for r in alive):
            (me.dir / f"{os.getpid()}.json").unlink(missing_ok=True)  # taken: no longer a spare
            _arrival = "taken"
        elif restart:
            idle = [r for r in alive if _idle_spare(int(r["pid"]), me.job, me.raylet, me.env_vars)]
            _arrival = "not taken: " + (
                "no spare was ready on this node before the failure"
                if not records
                else f"{len(idle)} spare(s) idle on this node, but Ray started a new process (another runtime_env?)"
                if idle
                else "the spares made on this node were gone (taken by another task, or ended)"
            )
    except Exception as e:  # noqa: BLE001 - the restart goes on whatever this says
        _arrival = f"not taken: {type(e).__name__}: {e}" if restart else None
    if _arrival and _arrival != "taken":
        logger.info("cf_ray: fast path not taken: this rank runs in a new worker process (%s)", _arrival)
    return _arrival


__all__ = ["KEEP_ALIVE_S", "RENEW_S", "Spare", "arrival", "enabled"]
