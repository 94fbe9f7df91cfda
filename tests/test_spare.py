"""The spare worker process (``cf_ray/_engine/worker/link/ray_train_spare.py``), for real: a local
Ray cluster, TorchTrainer with 2 CPU workers, a SIGKILL; Ray Train's new worker actors start in the
idle processes the failed attempt's ranks had made ready, and the run is bitwise the uninterrupted one."""

from __future__ import annotations

import json
import os
import time

import pytest
import spare_loop
from test_engine_e2e import SMALL, assert_resumed_from_memory_bitwise, result_of

from cf_ray import demo
from cf_ray._engine.worker.link import ray_train_spare

pytestmark = pytest.mark.slow


def _pids(out, gen: int) -> dict[int, int]:
    """rank -> process id of attempt ``gen``."""
    return {
        r: json.load(open(out / f"pid_rank{r}_gen{gen}.json"))["pid"]
        for r in range(2)
        if (out / f"pid_rank{r}_gen{gen}.json").exists()
    }


def _alive(record: dict) -> bool:
    return ray_train_spare._start_ticks(int(record["pid"])) == record["start_ticks"]


def test_the_restarted_ranks_run_in_the_spares_their_predecessors_made_and_resume_bitwise(
    ray_cluster, reference, tmp_path, monkeypatch
):
    monkeypatch.setattr(demo, "train_loop_per_worker", spare_loop.loop)
    cfg = dict(SMALL, kill_at=12, restore_from="memory", kill_after_handoff=True)
    demo.run("spare", str(tmp_path), cfg)
    out = tmp_path / "out" / "spare"
    first, second = _pids(out, 1), _pids(out, 2)
    spares = json.load(open(out / "spares.json"))
    made = {s["for_pid"]: s["pid"] for s in spares}
    # Each rank of the failed attempt had made one spare; each new rank runs in one of them.
    assert set(made) == set(first.values()), (made, first)
    assert sorted(second.values()) == sorted(made.values()), (second, made)
    restores = [e for e in result_of(out)["events"] if e.get("event") == "restore"]
    assert restores[-1].get("spare") == "taken", restores
    assert "spare" not in restores[0], restores  # the run's start: no spare to take
    # The run is the uninterrupted one, bitwise, every sample once.
    assert_resumed_from_memory_bitwise(out, reference, 10)
    # finish() ended the spares the last attempt's ranks held: none is left waiting.
    at_finish = [json.load(open(out / f"spare_rank{r}_at_finish.json")) for r in range(2)]
    held = [a["record"] for a in at_finish]
    assert all(h is not None for h in held), held  # each rank had made its spare again
    deadline = time.monotonic() + 30
    while any(_alive(h) for h in held) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(h) for h in held), held
    assert not any(os.path.exists(os.path.join(a["dir"], f"{a['record']['pid']}.json")) for a in at_finish)
