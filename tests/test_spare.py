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

from cf_ray import demo, report
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
    (row,) = report.read_run_restarts(str(tmp_path / "storage"), "spare").to_dict("records")
    assert row["spare"] == "taken", row  # the restarts table says it too
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


def test_a_spare_asked_for_and_not_claimed_when_the_run_ends_is_ended_and_no_file_of_the_run_is_left(
    ray_cluster, tmp_path, monkeypatch
):
    """The raylet starts the process a rank asked for whatever the rank does next: when the run ends
    before the rank claimed it, the node's holder ends it at the run's end (its request says what to
    look for), and neither a claim nor a request of the run is left."""
    from cf_ray._engine.protocol import spares

    monkeypatch.setattr(demo, "train_loop_per_worker", spare_loop.loop_ends_while_made)
    cfg = dict(SMALL, epochs=1)
    demo.run("spare_end", str(tmp_path), cfg)
    out = tmp_path / "out" / "spare_end"
    made = json.load(open(out / "made_rank0.json"))  # rank 0 asked, and the raylet started it
    assert made["start_ticks"] is not None, made

    def left() -> list[int]:
        """Idle workers of the job and raylet with the run's environment started since the ask."""
        return [
            int(n)
            for n in os.listdir("/proc")
            if n.isdigit()
            and (spares.start_ticks(int(n)) or -1) >= made["start_ticks"]
            and spares.idle_spare(int(n), made["job"], made["raylet"], made["env_vars"])
        ]

    def files() -> list[str]:
        """The claims and requests of rank 0 left in the node's spares directory."""
        d, mine = made["dir"], []
        for n in os.listdir(d) if os.path.isdir(d) else []:
            try:
                if json.load(open(os.path.join(d, n))).get("for_pid") == made["for_pid"]:
                    mine.append(n)
            except (OSError, ValueError):
                continue
        return mine

    deadline = time.monotonic() + 60  # the controller lingers, then drains the holders
    while (left() or files()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left(), (left(), made)
    assert not files(), files()


class _Here:
    """This process as ``ray_train_spare`` sees a Ray worker, with its spares' directory under ``tmp``."""

    def __init__(self, tmp):
        self.job, self.raylet, self.env_vars, self.dir = "01000000", "1", {}, tmp


def _record(pid: int) -> dict:
    return {"pid": pid, "start_ticks": ray_train_spare._start_ticks(pid), "for_pid": 1, "rank": 0, "unix": 0.0}


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_train_spare, "_Me", lambda: _Here(tmp_path))
    monkeypatch.setattr(ray_train_spare, "_in_ray_worker", lambda: True)
    monkeypatch.setattr(ray_train_spare, "_arrival", None)
    monkeypatch.delenv("CF_RAY_RAY_TRAIN_DEFAULTS", raising=False)
    return tmp_path


def test_a_process_a_previous_attempt_made_its_spare_is_taken_and_no_longer_listed(here):
    (here / f"{os.getpid()}.json").write_text(json.dumps(_record(os.getpid())))
    assert ray_train_spare.arrival(restart=True) == "taken"
    assert not list(here.glob("*.json"))


def test_a_restart_in_a_new_process_says_why_once(here, caplog):
    with caplog.at_level("INFO", logger="cf_ray"):
        why = ray_train_spare.arrival(restart=True)
        assert ray_train_spare.arrival(restart=True) == why
    assert why == "not taken: no spare was ready on this node before the failure", why
    assert [r.getMessage() for r in caplog.records if "fast path not taken" in r.getMessage()] == [
        f"cf_ray: fast path not taken: this rank runs in a new worker process ({why})"
    ]


def test_a_spare_that_ended_is_said_gone_and_its_record_dropped(here):
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    (here / f"{gone.pid}.json").write_text(json.dumps(dict(_record(os.getpid()), pid=gone.pid)))
    why = ray_train_spare.arrival(restart=True)
    assert why == "not taken: the spares made on this node were gone (taken by another task, or ended)", why
    assert not list(here.glob("*.json"))


def test_the_run_s_first_attempt_says_nothing_and_the_switch_turns_it_off(here, monkeypatch):
    assert ray_train_spare.arrival(restart=False) is None
    monkeypatch.setenv("CF_RAY_RAY_TRAIN_DEFAULTS", "0")
    assert ray_train_spare.arrival(restart=True) is None
    assert ray_train_spare.Spare(0).start()._thread is None  # no spare is made


def test_outside_a_ray_worker_nothing_is_asked_of_ray(monkeypatch):
    """The driver, or a Checkpointer used in a test's own process: no spare, no restart said, and
    Ray is not started by the asking (its runtime context would start a local Ray)."""
    import ray

    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    monkeypatch.setattr(ray_train_spare, "_arrival", None)
    was = ray.is_initialized()
    assert ray_train_spare.arrival(restart=True) is None
    assert ray_train_spare.Spare(0).start()._thread is None
    assert ray.is_initialized() == was
