"""A run's actors live as long as the run, and live on the driver side (issue #16).

One Ray cluster of our own on loopback — a head with no CPUs and one worker node with two,
started by a keeper process with ``ray.cluster_utils.Cluster`` (the tests' shared Ray lives in the
pytest process and a driver we can SIGKILL must be another process) — and three driver processes:

* driver 1 creates a run's controller and holder from a task on the worker node, commits a step,
  and is SIGKILLed: the controller's reaper ends both actors within seconds; the controller was
  placed on the head (hard affinity), not on the worker node it was created from;
* driver 2 does the same for another run with the reaper off, leaving a step in the holder's
  memory (its storage write stalls), and is SIGKILLed;
* driver 3 starts the second run again under the same run key: the dead run's controller is not
  reused (shut down, its holder drained and killed); the new controller belongs to driver 3's job,
  says it replaced a dead run, and its restore plan has no memory snapshot — only storage.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)

KEEPER = r"""
import sys, time
import ray._private.utils
from ray.cluster_utils import Cluster
ray._private.utils.write_ray_address = lambda *a, **k: None  # leave /tmp/ray/ray_current_cluster alone
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                       "node_ip_address": "127.0.0.1"})
cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
cluster.wait_for_nodes()
print("ADDRESS", cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""

DRIVER = r"""
import json, sys, time
import numpy as np
import pyarrow.fs as pafs
import ray

address, mode, key, root, reaper_s = sys.argv[1:6]
ray.init(address=address, runtime_env={"env_vars": {"CF_RAY_REAPER_INTERVAL_S": reaper_s}},
         logging_level="WARNING", _node_ip_address="127.0.0.1")  # the keeper's nodes are on loopback

from cf_ray._engine import env as _env
from cf_ray._engine.driver.controller import ControllerSettings, get_or_create_controller, get_controller
from cf_ray._engine.protocol.cluster import head_node_id
from cf_ray._engine.protocol.messages import CheckpointKind, Restored, RestoreSource, SnapshotMeta
from cf_ray._engine.protocol.naming import controller_name, holder_name
from cf_ray._engine.format.layout import rank_section
from cf_ray._engine.node.holder import resolve_holder
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.policy import FixedInterval

SEC = rank_section(0)
META = SnapshotMeta(rank=0, world_size=1, replicated=False, epoch=0, kind=CheckpointKind.SCHEDULED, interval=1)


def storage(slow):
    if slow:
        from faulty_fs import SlowHandler
        return FsStorage(pafs.PyFileSystem(SlowHandler(slow_from=2, slow_to=3, delay_s=120)), root)
    return FsStorage(pafs.LocalFileSystem(), root)


def settings(keep_last):
    return ControllerSettings(policy=FixedInterval(every=1), keep_last=keep_last, tiers=[],
                              upload_milestones_only=False)


def wait_for(fn, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    return None


@ray.remote(num_cpus=1)  # the head has no CPUs: this runs on the worker node
def start_run(slow):
    st = storage(slow)
    ctl = get_or_create_controller(key, st, settings(None))
    gen = ray.get(ctl.prepare_restore.remote(1), timeout=60).generation
    ray.get(ctl.restored.remote(Restored(source=RestoreSource.FRESH, step=0, epoch=0)), timeout=60)
    holder = resolve_holder(key, st, controller_name(key), _env.namespace())
    from slot_helpers import stage_bytes
    arena = np.arange(4096, dtype=np.uint8)
    index = b'{"entries":[],"tree":null}'
    stage_bytes(ray, holder, gen, 1, {SEC: (arena, index)}, META)
    ok = wait_for(lambda: ray.get(ctl.settled.remote(gen, [1]), timeout=30).committed == (1,), 60)
    if slow:  # step 2 stays in the holder's memory: its write stalls
        stage_bytes(ray, holder, gen, 2, {SEC: (arena, index)}, META)
    return {"task_node": ray.get_runtime_context().get_node_id(), "committed": bool(ok),
            "controller_id": ctl._actor_id.hex(), "holder": ray.get(holder.ping.remote(), timeout=30)}


def node_of(actor_id):
    from ray._private import state
    return state.actors(actor_id=actor_id)["Address"]["NodeID"]


if mode in ("reap", "leave"):
    out = ray.get(start_run.remote(mode == "leave"), timeout=120)
    out.update(head=head_node_id(), controller_node=node_of(out["controller_id"]),
               job=ray.get_runtime_context().get_job_id())
    print("READY", json.dumps(out), flush=True)
    time.sleep(600)
elif mode == "check":
    reaped_key, old = sys.argv[6], json.loads(sys.argv[7])
    out = {}
    t0 = time.monotonic()
    def gone(name):
        try:
            ray.get_actor(name, namespace=_env.namespace())
            return False
        except ValueError:
            return True
    out["reaped"] = bool(wait_for(lambda: gone(controller_name(reaped_key)) and gone(old["reap_holder"]), 30))
    out["reaped_after_s"] = time.monotonic() - t0
    out["left_alive"] = not gone(controller_name(key)) and not gone(old["leave_holder"])
    ctl = get_or_create_controller(key, storage(False), settings(3))
    out["lifetime"] = ray.get(ctl.lifetime.remote(), timeout=60)
    out["job"] = ray.get_runtime_context().get_job_id()
    out["new_controller"] = ctl._actor_id.hex() != old["leave_controller"]
    out["old_holder_gone"] = gone(old["leave_holder"])
    plan = ray.get(ctl.prepare_restore.remote(1), timeout=60)
    out["memory"] = None if plan.memory is None else plan.memory.step
    out["storage"] = list(plan.storage)
    try:
        ray.get(ctl.shutdown.remote(), timeout=60)
    except Exception:
        pass
    print("RESULT", json.dumps(out), flush=True)
"""


def loopback_env(**extra: str) -> dict[str, str]:
    """The environment of the keeper and the drivers: this repository and the tests importable, and
    everything on loopback. Ray turns a ``127.0.0.1`` address into the machine's own IP unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (then its idea of the node's IP is loopback), and a
    cluster on another IP than loopback is not ours to start here."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([REPO, TESTS_DIR]),
        RAY_DEDUP_LOGS="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        **extra,
    )
    env.pop("RAY_ADDRESS", None)
    return env


class Proc:
    """A subprocess whose output (stdout and stderr) a thread reads line by line, so that every wait
    for it has a deadline; on a missed deadline it is killed and the test fails with its output."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: str, stdin: bool = False):
        self.p = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.pid = self.p.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)  # end of output

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of its output."""
        return "".join(self.output[-n:])

    def line(self, prefix: str, timeout_s: float) -> str:
        """The rest of the next output line that starts with ``prefix``."""
        deadline = time.monotonic() + timeout_s
        while (left_s := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left_s)
            except queue.Empty:
                break
            if line is None:
                self.wait(10)
                raise AssertionError(f"no {prefix!r} line: the process ended (rc={self.p.returncode}):\n{self.tail()}")
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        self.kill()
        raise AssertionError(f"no {prefix!r} line within {timeout_s} s (killed):\n{self.tail()}")

    def wait(self, timeout_s: float) -> int:
        """Its exit status; killed (and the test failed) when it runs past ``timeout_s``."""
        try:
            return self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the process did not end within {timeout_s} s (killed):\n{self.tail()}") from None

    def kill(self) -> None:
        """SIGKILL to it and its process group (it dies without a word to Ray)."""
        if self.p.poll() is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            pass

    def stop_keeper(self) -> None:
        """End the keeper's cluster: close its stdin (it shuts the cluster down), else kill its group."""
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()


def start_cluster(tmp_path, env: dict[str, str]) -> tuple[Proc, str]:
    """The keeper of a cluster of our own on loopback, and the cluster's address."""
    (tmp_path / "keeper.py").write_text(KEEPER)
    keeper = Proc([sys.executable, str(tmp_path / "keeper.py")], env, str(tmp_path), stdin=True)
    try:
        return keeper, keeper.line("ADDRESS", 120)
    except BaseException:
        keeper.stop_keeper()
        raise


@pytest.mark.slow
def test_a_dead_drivers_actors_are_reaped_and_never_reused(tmp_path):
    env = loopback_env(CF_RAY_DRAIN_TIMEOUT_S="3", CF_RAY_ACTOR_TIMEOUT_S="30")
    (tmp_path / "driver.py").write_text(DRIVER)
    keeper, address = start_cluster(tmp_path, env)
    drivers: list[Proc] = []
    try:

        def driver(*args):
            p = Proc([sys.executable, str(tmp_path / "driver.py"), address, *args], env, str(tmp_path))
            drivers.append(p)
            return p

        reap = driver("reap", "reaped-run", str(tmp_path / "reaped"), "0.5")
        leave = driver("leave", "left-run", str(tmp_path / "left"), "3600")
        got_reap = json.loads(reap.line("READY", 180))
        got_leave = json.loads(leave.line("READY", 180))
        assert got_reap["committed"] and got_leave["committed"]
        # created from a task on the worker node, the controller lives on the 0-CPU head
        assert got_reap["task_node"] != got_reap["head"]
        assert got_reap["controller_node"] == got_reap["head"]
        for p in (reap, leave):
            p.kill()  # SIGKILL: the driver dies without a word to Ray
        old = {
            "reap_holder": got_reap["holder"],
            "leave_holder": got_leave["holder"],
            "leave_controller": got_leave["controller_id"],
        }
        check = driver("check", "left-run", str(tmp_path / "left"), "3600", "reaped-run", json.dumps(old))
        out = json.loads(check.line("RESULT", 240))
        check.wait(60)
    finally:
        for p in drivers:
            p.kill()
        keeper.stop_keeper()
    # driver 1's actors: reaped within seconds of its death
    assert out["reaped"], out
    assert out["reaped_after_s"] < 30
    # driver 2's actors outlived it (reaper off), and were not reused by driver 3
    assert out["left_alive"], out
    assert out["new_controller"] and out["old_holder_gone"], out
    assert out["lifetime"]["replaced_dead_run"] and out["lifetime"]["owner_job"] == out["job"], out
    # from storage only: step 1 committed; step 2, in the dead run's holder's memory, is not taken
    assert out["memory"] is None and out["storage"] == [1], out
