"""The Checkpointer's lifecycle (``close()``, ``with``) and the worker parts it drives, one by one.

The parts alone need no Ray; the lifecycle tests build a Checkpointer outside Ray Train (its
controller and holder actors on the shared local cluster), a few steps each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import test_spot

import cf_ray
from cf_ray._engine.protocol.messages import CheckpointKind, RequestLevel, Schedule
from cf_ray._engine.worker import preemption_watcher
from cf_ray._engine.worker.control import Agreement, ControlPlane
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.timing import Timing
from cf_ray.checkpointer import _Lifecycle
from cf_ray.config import PreemptionConfig

# -- the parts alone (no Ray) ----------------------------------------------------------------------------


def _agreement(version=0, request=RequestLevel.NONE, committed=0, register=False):
    return Agreement(schedule_version=version, save_request=request, committed_step=committed, register=register)


def test_one_rank_agrees_with_itself_at_once():
    cp = ControlPlane(0, 1)
    got = cp.exchange(schedule_version=3, save_request=RequestLevel.MANUAL, committed_step=7, register=True)
    assert got == _agreement(3, RequestLevel.MANUAL, 7, True)
    assert got.save_request is RequestLevel.MANUAL
    cp.close()
    cp.close()  # nothing in flight: nothing to forget


def test_scheduler_turns_requests_milestones_and_the_policy_into_a_kind():
    s = Scheduler(cf_ray.CheckpointConfig(policy=cf_ray.FixedInterval(every=5), milestone_every=4))
    assert s.decide(1, 0, None) == (None, False)
    assert s.decide(4, 0, None) == (CheckpointKind.SCHEDULED, True)  # a milestone, whatever the policy says
    s.want(RequestLevel.PREEMPT)
    s.want(RequestLevel.MANUAL)  # the stronger request stays
    assert s.local_request is RequestLevel.PREEMPT
    assert s.decide(6, 0, _agreement(request=RequestLevel.PREEMPT)) == (CheckpointKind.PREEMPT, False)
    assert s.local_request is RequestLevel.NONE  # agreed on: not posted again
    assert s.decide(7, 0, _agreement(request=RequestLevel.MANUAL))[0] is CheckpointKind.MANUAL
    # A schedule version is adopted only once every rank has it (the agreement says so).
    first = s.interval
    s.receive([Schedule(schedule_version=1, interval=2)])
    assert s.received == 1 and s.interval == first
    s.decide(8, 0, _agreement(version=1))
    assert s.interval == 2


def test_the_schedules_persist_every_keeps_scheduled_snapshots_in_memory_the_same_way_on_every_rank():
    """``Schedule.persist_every``: one scheduled snapshot in N is persisted, counted from the first
    of the attempt; any other kind is always persisted and restarts the count. Adopted with the
    interval, once every rank has the version."""
    ranks = [Scheduler(cf_ray.CheckpointConfig(policy=cf_ray.FixedInterval(every=2))) for _ in range(2)]
    for s in ranks:
        s.start_attempt([Schedule(schedule_version=0, interval=2)])
        assert [s.persist_due(CheckpointKind.SCHEDULED, False) for _ in range(2)] == [True, True]
        s.receive([Schedule(schedule_version=1, interval=2, persist_every=3)])
        assert s.persist_every == 1  # not adopted before the agreement says every rank has it
        s.decide(4, 0, _agreement(version=1))
        assert s.persist_every == 3
    got = [[s.persist_due(CheckpointKind.SCHEDULED, False) for _ in range(7)] for s in ranks]
    assert got[0] == got[1] == [False, False, True, False, False, True, False]
    s = ranks[0]
    assert not s.last_persisted  # what finish() looks at: the last one is taken again, persisted
    assert s.persist_due(CheckpointKind.MANUAL, False) and s.last_persisted
    assert [s.persist_due(CheckpointKind.SCHEDULED, False) for _ in range(3)] == [False, False, True]
    assert s.persist_due(CheckpointKind.SCHEDULED, True)  # a milestone always reaches storage
    s.start_attempt([Schedule(schedule_version=1, interval=2, persist_every=3)])  # a restart
    assert s.persist_due(CheckpointKind.SCHEDULED, False)  # the first of an attempt is persisted


def test_timing_reports_each_checkpoint_once_and_skips_iterations_that_prepared_buffers():
    t = Timing()
    t.end_iteration(0.0, preparing=False)
    t.step_end()
    t.end_iteration(0.0, preparing=True)  # overlapped the fault-in of the buffers: not timed
    t.step_end()
    t.end_iteration(0.0, preparing=False)  # the one after it is not timed either
    t.step_end()
    t.end_iteration(0.0, preparing=False)
    t.snapshot_taken(4, sync_s=0.01, stall_s=0.02, last_begin={"wait_s": 0.0, "nbytes": 100.0})
    t.guarded(0.5)  # the next step's guard waits for this snapshot's copy: part of its cost
    samples, stats = t.drain(0, 4, {"step": 4, "copy_s": 0.3})
    (sample,) = samples
    assert sample["iters"] == 1 and sample["ckpt_step"] == 4 and sample["copy_s"] == 0.3
    assert sample["stall_s"] == pytest.approx(0.52) and sample["wait_s"] is None and sample["nbytes"] == 100
    assert [s["step"] for s in stats] == [4, 4] and stats[1]["guard_s"] == 0.5
    assert t.checkpoints_taken == 1 and t.stall_s_total == pytest.approx(0.52)
    assert t.drain(0, 4, {}) == ([], [])


def test_timing_reports_the_checkpointers_own_work_at_every_step_apart_from_the_stall():
    # What the checkpointer does after the update (agree, decide, report) is outside the iteration
    # time and, but for a checkpoint's stall, outside the stall too: the job pays it at every step,
    # and measured_overhead_pct counts it from step_s.
    t = Timing()
    t.end_iteration(0.0, preparing=False)
    time.sleep(0.02)  # the per-step work
    t.step_end()
    t.end_iteration(0.0, preparing=False)
    time.sleep(0.03)
    t.snapshot_taken(2, sync_s=0.01, stall_s=0.025, last_begin={"wait_s": 0.0, "nbytes": 1.0})
    t.step_end()  # 0.03 s after the update, 0.025 s of it the checkpoint's stall
    (sample,), _ = t.drain(0, 2, {})
    assert 0.0125 <= sample["step_s"] < 0.0125 + 0.02
    t.end_iteration(0.0, preparing=False)
    (sample,), _ = t.drain(0, 3, {})
    assert "step_s" not in sample  # no step ended since the last drain: not measured


@pytest.mark.skipif(
    not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"), reason="Linux scheduler statistics"
)
def test_timing_reports_the_training_threads_wait_for_a_cpu_and_the_idle_cores_per_iteration():
    # Sample.queue_s: the seconds per iteration the training thread was runnable but not running.
    # Four busy processes per core beside a training thread that computes: it waits for a core; a
    # training thread that sleeps waits for none.
    def iteration(busy: bool) -> None:
        procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(4 * (os.cpu_count() or 1) if busy else 0)
        ]
        try:
            end = time.perf_counter() + 0.6
            while time.perf_counter() < end:
                if not busy:
                    time.sleep(0.01)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        t.end_iteration(0.0, preparing=False)
        t.step_end()

    t = Timing()
    t.end_iteration(0.0, preparing=False)  # the thread whose wait is measured: this one
    t.step_end()
    t.drain(0, 1, {})  # the wait is counted from here
    iteration(busy=True)
    iteration(busy=True)
    (busy,), _ = t.drain(0, 3, {})
    iteration(busy=False)
    iteration(busy=False)
    (quiet,), _ = t.drain(0, 5, {})
    assert busy["queue_s"] > 0.1, busy  # of 0.6 s per iteration, with four processes per core
    assert quiet["queue_s"] < busy["queue_s"] / 3, (quiet, busy)
    # Sample.idle_cpus, over the same polls: the busy processes left no core idle; with the training
    # thread asleep most cores were (one rank outside Ray Train: the machine's idle cores).
    assert busy["idle_cpus"] < 0.5, busy
    assert quiet["idle_cpus"] > busy["idle_cpus"] + 0.5 * (os.cpu_count() or 1), (quiet, busy)


# -- the lifecycle (Ray actors, no TorchTrainer) -------------------------------------------------------


def _tiny(tmp_path, run_name, **cfg):
    """test_spot's tiny Checkpointer outside Ray Train, checkpointing every 2 steps, SIGTERM watched."""
    cfg.setdefault("policy", cf_ray.FixedInterval(every=2))
    cfg.setdefault("preemption", PreemptionConfig(ray_signal="off", sigterm=True))
    return test_spot._tiny(tmp_path, run_name, **cfg)


def test_close_releases_the_handler_the_thread_and_the_buffers_and_is_idempotent(ray_cluster, tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    ck, step = _tiny(tmp_path, "close")
    assert ck.preemption.sources["sigterm"] == "main"
    assert signal.getsignal(signal.SIGTERM) is preemption_watcher._python_sigterm
    for _ in range(3):
        step()
    thread = ck._phase1._snap._thread
    ck.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert not thread.is_alive() and ck._phase1._snap.arenas.sections() == []
    assert ck._lifecycle is _Lifecycle.CLOSED
    ck.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="after close"):
        ck.finish()


def test_a_with_block_finishes_on_a_normal_exit(ray_cluster, tmp_path):
    ck, step = _tiny(tmp_path, "with_ok")
    with ck as same:
        assert same is ck
        for _ in range(4):
            step()
    assert ck._lifecycle is _Lifecycle.FINISHED
    assert [c.step for c in cf_ray.list_checkpoints(str(tmp_path / "with_ok"))] == [2, 4]  # finish() waited
    with pytest.raises(RuntimeError, match="already called"):
        ck.finish()
    ck.close()  # after finish(): nothing left to release


def test_a_with_block_closes_and_reraises_on_an_exception(ray_cluster, tmp_path, monkeypatch):
    previous = signal.getsignal(signal.SIGTERM)
    ck, step = _tiny(tmp_path, "with_error")
    finished = []
    monkeypatch.setattr(ck, "finish", lambda: finished.append(True))
    with pytest.raises(ValueError, match="diverged"):
        with ck:
            step()
            raise ValueError("loss diverged")
    assert finished == []  # closed, not finished: nothing waits for storage on the way out
    assert ck._lifecycle is _Lifecycle.CLOSED
    assert signal.getsignal(signal.SIGTERM) is previous
    assert not ck._phase1._snap._thread.is_alive()
