"""Recovery time (issue #46): where a restart's seconds go (the restart rows' parts, in process),
cf_ray's Ray Train settings in the driver, and the breakdown benchmark's arithmetic."""

from __future__ import annotations

import json
import os
import time

import pytest

from cf_ray import report
from cf_ray._engine.observe.goodput import Badput, Goodput
from cf_ray._engine.worker.link import ray_train_fast
from cf_ray._engine.worker.restore.restorer import process_start_unix


def test_a_restart_row_splits_its_recovery_into_rebuild_setup_restore_and_first_step():
    g = Goodput()
    g.on_restore(generation=1, source="fresh", step=0, restore_s=0.0, now_unix=100.0)
    for step in range(5, 35, 5):
        g.on_sample(step, 0.1, 5, 100.0 + step / 5)  # the last sign of life at 106.0
    r = g.on_restore(
        generation=2,
        source="memory",
        step=30,
        restore_s=0.3,
        now_unix=114.0,
        process_start_unix=109.5,  # rank 0's new process
        restore_begin_unix=113.6,  # its call of restore()
    )
    assert r.rebuild_s == pytest.approx(3.5) and r.setup_s == pytest.approx(4.1)
    assert r.first_step_s is None  # not resumed yet
    g.on_sample(31, 0.1, 1, 114.2)
    assert r.first_step_s == pytest.approx(0.2) and r.recovery_s == pytest.approx(8.2)
    # The parts add up to the recovery (the restore is timed on the worker, its report on arrival).
    assert r.rebuild_s + r.setup_s + (114.0 - 113.6) + r.first_step_s == pytest.approx(r.recovery_s)
    df = report.restarts_frame(g.rows())
    assert df[["rebuild_s", "setup_s", "first_step_s"]].iloc[0].tolist() == pytest.approx([3.5, 4.1, 0.2])


def test_a_restart_whose_rank_0_process_was_not_replaced_has_no_rebuild_part():
    """A process older than the failure (an elastic resize that kept rank 0, a process Ray reused)
    says nothing of the rebuild: the parts stay unknown rather than negative."""
    g = Goodput()
    g.on_restore(generation=1, source="fresh", step=0, restore_s=0.0, now_unix=100.0)
    g.on_sample(5, 0.1, 5, 101.0)
    r = g.on_restore(generation=2, source="memory", step=5, restore_s=0.1, now_unix=105.0, process_start_unix=90.0)
    assert r.rebuild_s is None and r.setup_s is None
    r2 = g.on_restore(generation=3, source="memory", step=5, restore_s=0.1, now_unix=110.0)
    assert r2.rebuild_s is None  # an older worker that sent no times


def test_a_restart_in_a_process_started_before_the_failure_splits_at_rank_0s_load_of_cf_ray():
    """Ray may give the new rank 0 a process it started before the failure: the recovery then splits
    where the training function loaded cf_ray in it, never left unknown for that."""
    g = Goodput()
    g.on_restore(generation=1, source="fresh", step=0, restore_s=0.0, now_unix=100.0)
    g.on_sample(5, 0.1, 5, 101.0)
    r = g.on_restore(
        generation=2, source="memory", step=5, restore_s=0.1, now_unix=108.0,
        process_start_unix=90.0, code_start_unix=103.0, restore_begin_unix=107.5,
    )  # fmt: skip
    assert (r.rebuild_s, r.setup_s) == pytest.approx((2.0, 4.5))


def test_badput_sums_the_recovery_parts_over_the_restarts():
    g, b = Goodput(), Badput(started_unix=99.0)
    g.on_restore(generation=1, source="fresh", step=0, restore_s=0.5, now_unix=100.0)
    g.on_sample(10, 0.1, 10, 102.0)
    g.on_restore(
        generation=2, source="memory", step=10, restore_s=0.2, now_unix=108.0,
        process_start_unix=104.0, restore_begin_unix=107.7,
    )  # fmt: skip
    g.on_sample(11, 0.1, 1, 108.1)
    g.on_restore(generation=3, source="storage", step=11, restore_s=1.0, now_unix=120.0)
    parts = b.breakdown(g)["recovery_parts_s"]
    assert parts["rebuild_s"] == pytest.approx(2.0) and parts["rebuild_count"] == 1
    assert parts["setup_s"] == pytest.approx(3.7) and parts["restore_s"] == pytest.approx(1.2)
    assert parts["restore_count"] == 2 and parts["first_step_s"] == pytest.approx(0.1)


def test_the_process_start_is_this_process_s():
    start = process_start_unix()
    assert start is not None and start <= time.time()
    import psutil

    assert start == pytest.approx(psutil.Process(os.getpid()).create_time(), abs=0.05)


def test_cf_ray_shortens_ray_trains_health_check_unless_the_user_set_it_or_turned_it_off(monkeypatch):
    env: dict[str, str] = {}
    monkeypatch.setattr(ray_train_fast, "_set_by_cf_ray", {})
    assert ray_train_fast.apply_driver_defaults(env) == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.25"
    # Turned off: what cf_ray set is taken back, so Ray Train's default applies to the next fit().
    env["CF_RAY_RAY_TRAIN_DEFAULTS"] = "0"
    assert ray_train_fast.apply_driver_defaults(env) == {} and "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in env
    # The user's own value is never changed, nor taken back.
    user = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "3"}
    assert ray_train_fast.apply_driver_defaults(user) == {} and user["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3"
    user.pop("CF_RAY_RAY_TRAIN_DEFAULTS", None)
    user["CF_RAY_RAY_TRAIN_DEFAULTS"] = "0"
    ray_train_fast.apply_driver_defaults(user)
    assert user["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3"


def test_a_worker_says_once_when_ray_trains_default_health_check_applies(monkeypatch, caplog):
    monkeypatch.setattr(ray_train_fast, "_said", False)
    caplog.set_level("INFO", logger="cf_ray")
    assert ray_train_fast.health_check_s({"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}) == 0.25
    assert not caplog.records  # cf_ray's value reached Ray Train: nothing to say
    assert ray_train_fast.health_check_s({}) == 2.0 and ray_train_fast.health_check_s({}) == 2.0
    (rec,) = caplog.records
    assert "every 2 s" in rec.getMessage() and "CF_RAY_RAY_TRAIN_DEFAULTS=0" in rec.getMessage()


def test_ray_train_reads_the_health_check_variable_cf_ray_sets():
    """The pinned Ray Train: the controller polls at this variable's interval, and passes it on."""
    from ray.train.v2._internal import constants

    (name,) = ray_train_fast.DEFAULTS
    assert name == constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR and name in constants.ENV_VARS_TO_PROPAGATE


def test_the_breakdown_cuts_a_recovery_at_each_observed_time():
    from benchmarks.recovery_breakdown import PARTS, breakdown

    timeline = [
        {"ev": "state", "prev": "RunningState", "next": "RunningState", "t": 9.0},  # before the kill
        {"ev": "state", "prev": "RunningState", "next": "RunningState", "t": 10.2},  # a poll: all well yet
        {"ev": "state", "prev": "RunningState", "next": "RestartingState", "t": 10.5},
        {"ev": "group_shutdown_begin", "t": 10.6},
        {"ev": "group_shutdown_done", "t": 10.8},
        {"ev": "group_start_begin", "t": 11.0},
        {"ev": "actors_ready", "t": 14.0},
        {"ev": "group_started", "t": 15.0},
    ]
    kills = [{"t": 10.0, "step": 15, "gen": 1}]
    attempt = {"gen": 2, "source": "memory", "step": 15, "phases": {"read": 0.1}}
    attempt.update(restore_begin=17.0, restore_end=17.3, first_step=17.4)
    attempts = [
        dict(attempt, rank=0, proc_start=12.0, fn=15.2, imported=15.9, model=16.5),
        dict(attempt, rank=1, proc_start=12.5, fn=15.3, imported=15.8, model=16.4),
    ]
    (row,) = breakdown(timeline, kills, attempts)
    want = [0.5, 0.3, 0.2, 1.5, 1.5, 1.0, 0.2, 0.7, 0.6, 0.5, 0.3, 0.1]
    assert [row[p] for p in PARTS] == pytest.approx(want)
    assert row["total"] == pytest.approx(sum(want)) and row["source"] == "memory"
    assert not row["processes_reused"]
    # A kill whose recovery never came (the run ended) is marked, not guessed.
    (late,) = breakdown(timeline, [{"t": 20.0, "step": 30, "gen": 2}], attempts)
    assert late["incomplete"]


def test_the_breakdown_callback_is_one_ray_train_runs_in_its_controller(tmp_path):
    """The pinned Ray Train takes the benchmark's callback in ``RunConfig`` and calls it as a
    controller and worker-group callback; each call appends a timed line."""
    import ray.train
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    from benchmarks.recovery_breakdown import Timeline

    cb = Timeline(str(tmp_path / "timeline.jsonl"))
    ray.train.RunConfig(name="t", storage_path=str(tmp_path), callbacks=[cb])  # accepted, not refused
    assert isinstance(cb, ControllerCallback) and isinstance(cb, WorkerGroupCallback)
    cb.after_controller_state_update(object(), object())
    assert cb.before_init_train_context([]) == {}
    events = (tmp_path / "timeline.jsonl").read_text().splitlines()
    assert [json.loads(e)["ev"] for e in events] == ["state", "actors_ready"]
