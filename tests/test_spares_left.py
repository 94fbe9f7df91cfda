"""The spares a run leaves on a node (``cf_ray/_engine/protocol/spares.py``): a rank ends its own at
``finish()``, but a spare on a node where the run's last attempt ran no rank is ended by that node's
holder when the run ends (its ``drain``). Real processes titled as Ray's idle workers, no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from cf_ray._engine.protocol import spares


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _idle(job: str = "01000000", raylet: str = "4242", title: str = "ray::IDLE"):
    env = dict(os.environ, RAY_RAYLET_PID=raylet, RAY_JOB_ID=job)
    proc = subprocess.Popen([title, "-c", "import time; time.sleep(60)"], executable=sys.executable, env=env)
    deadline = time.time() + 10
    while spares.environ(proc.pid).get("RAY_JOB_ID") != job and time.time() < deadline:
        time.sleep(0.01)
    return proc


def _claim(proc, run: str, job: str = "01000000", raylet: str = "4242"):
    d = spares.spares_dir(raylet, job)
    d.mkdir(parents=True, exist_ok=True)
    rec = {"pid": proc.pid, "start_ticks": spares.start_ticks(proc.pid), "for_pid": 1, "rank": 0, "run": run}
    (d / f"{proc.pid}.json").write_text(json.dumps(rec))
    return d / f"{proc.pid}.json"


def test_the_holder_ends_the_idle_spares_its_run_left_on_its_node_and_nothing_else(tmp):
    left = _idle()  # the run's spare on this node: no rank of the last attempt here to end it
    other_run = _idle()  # another run's, on this node and job
    busy = _idle(title="ray::RayTrainWorker.__init__")  # claimed, then taken by an actor
    other_node = _idle(raylet="777")  # the run's, on another node
    procs = (left, other_run, busy, other_node)
    try:
        mine = [_claim(left, "r-1"), _claim(busy, "r-1"), _claim(other_node, "r-1", raylet="777")]
        theirs = _claim(other_run, "r-2")
        assert spares.end_run("4242", "r-1") == [left.pid]
        assert left.wait(10) == -15  # SIGTERM: ended as cf_ray ends a spare
        assert busy.poll() is None and other_run.poll() is None and other_node.poll() is None
        assert not mine[0].exists() and not mine[1].exists() and mine[2].exists() and theirs.exists()
        assert spares.end_run("4242", "r-2") == [other_run.pid]
        assert not theirs.parent.exists()  # the node's last claim of the job: no directory left
        assert spares.end_run("", "r-1") == []  # not in a Ray worker: nothing
    finally:
        for p in procs:
            p.kill()
            p.wait()
