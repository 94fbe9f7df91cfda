"""Durability (#16): a failed save never fails the job, and is never silent. The watchdog's episodes
alone (no Ray), the settings, ``wait()`` reporting what is not durable, and a Checkpointer against a
storage that hangs and one that fails every write for a while (``slow``: Ray actors in this process)."""

from __future__ import annotations

import logging
import re
import time

import pyarrow.fs as pafs
import pytest
import torch
from durability_fs import FlagHandler

import cf_ray
from cf_ray._engine.protocol.messages import Settled
from cf_ray._engine.worker.link.controller import ControllerLink
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.timing import Timing
from cf_ray._engine.worker.watchdog import DurabilitySettings, DurabilityWatchdog, Knowledge, LostReason
from cf_ray.config import DurabilityTimeout
from cf_ray.errors import DurabilityLostError

# -- the watchdog alone ----------------------------------------------------------------------------------


class _Clock:
    """Steps of 0.1 s, polls answered at once unless told otherwise."""

    def __init__(self, w: DurabilityWatchdog):
        self.w, self.now, self.step, self.committed = w, 0.0, 0, 0
        self.info: float | None = 0.0
        self.changes = []

    def run(
        self,
        seconds: float,
        *,
        take_every: int | None = None,
        commit: bool = False,
        fresh: bool = True,
        in_flight_s: float = 0.0,
        failures: int = 0,
    ):
        end = self.now + seconds
        while self.now < end:
            self.now += 0.1
            self.step += 1
            if take_every and self.step % take_every == 0:
                self.w.taken(self.step, self.now)
                if commit:
                    self.committed = self.step
            if fresh:
                self.info = self.now
            change = self.w.observe(
                Knowledge(
                    now=self.now,
                    step=self.step,
                    committed_step=self.committed,
                    info_time=self.info,
                    in_flight_s=in_flight_s,
                    poll_failures=failures,
                    interval_steps=take_every,
                )
            )
            if change is not None:
                self.changes.append(change)
        return self.changes


def _watchdog(**kw):
    w = DurabilityWatchdog(DurabilitySettings(**{"floor_s": 2.0, "factor": 3.0, **kw}))
    w.start_attempt(0, 0.0)
    return w, _Clock(w)


def test_nothing_taken_nothing_lost():
    w, c = _watchdog()
    assert c.run(30.0) == [] and not w.lost


def test_one_alarm_per_episode_and_the_episode_ends_with_a_newer_commit():
    w, c = _watchdog()
    c.run(5.0, take_every=5, commit=True)  # commits keep coming: no alarm
    assert c.changes == [] and w.limit_s(5)[0] == pytest.approx(2.0)  # the floor: 3 x (0.5 s + ~0 s) < 2 s
    c.run(10.0, take_every=5)  # storage stops: nothing commits from here
    (alarm,) = c.changes  # once, not once per step
    assert alarm.started and alarm.episode.reason is LostReason.NO_COMMIT and w.lost
    assert alarm.episode.committed_step == 50 and alarm.episode.since_step == 55
    assert (
        2.0 < alarm.episode.waited_s < 2.3 and "no checkpoint has committed since step 50" in alarm.episode.describe()
    )
    c.committed = 60  # a late commit of a checkpoint older than the alarm: the episode goes on
    c.run(1.0)
    assert len(c.changes) == 1 and w.lost
    c.run(2.0, take_every=5, commit=True)  # storage works again
    assert [ch.started for ch in c.changes] == [True, False] and not w.lost
    assert c.changes[1].committed_step >= alarm.episode.start_step
    c.run(10.0, take_every=5)  # a second episode
    assert [ch.started for ch in c.changes] == [True, False, True] and w.episodes == 2


def test_a_pause_of_the_training_loop_is_not_an_alarm():
    w, c = _watchdog()
    c.run(1.0, take_every=5, commit=True)
    w.taken(c.step + 1, c.now)
    c.now += 600.0  # an evaluation of ten minutes between two steps: the last reply is from before it
    c.run(0.1, fresh=False)
    assert c.changes == []


def test_an_unreachable_controller_is_an_episode():
    w, c = _watchdog()
    c.run(1.0, failures=3)
    (alarm,) = c.changes
    assert alarm.episode.reason is LostReason.CONTROLLER_UNREACHABLE
    _, c2 = _watchdog()
    c2.run(1.0, fresh=False, in_flight_s=2.5)  # a poll that never returns
    assert c2.changes[0].episode.reason is LostReason.CONTROLLER_UNREACHABLE
    assert "the controller has not answered" in c2.changes[0].episode.describe()


def test_the_limit_follows_the_schedule_and_a_fixed_timeout_wins():
    w, c = _watchdog(floor_s=0.5)
    c.run(10.0, take_every=20, commit=True)  # 2 s between checkpoints, commits seen at once
    limit, expected = w.limit_s(20)
    assert expected == pytest.approx(2.0, abs=0.1) and limit == pytest.approx(3 * expected)
    w2, _ = _watchdog(timeout_s=42.0)
    assert w2.limit_s(20)[0] == 42.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"on_durability_lost": "crash"}, "on_durability_lost"),
        ({"durability_timeout": 0}, "durability_timeout"),
        ({"durability_timeout": "soon"}, "durability_timeout"),
        ({"allow_mismatch": ("missing", "yes")}, "allow_mismatch"),
        ({"release_after_fit_s": -1}, "release_after_fit_s"),
        ({"release_after_fit_s": False}, "release_after_fit_s"),
        ({"release_after_fit_s": float("inf")}, "release_after_fit_s"),
    ],
)
def test_the_settings_are_checked(kwargs, field):
    with pytest.raises(cf_ray.ConfigError, match=f"CheckpointConfig.{field}"):
        cf_ray.CheckpointConfig(**kwargs)


# -- wait(): every checkpoint taken is settled, or reported --------------------------------------------------


class _Handle:
    """A controller handle no call reaches: the tests replace ``ControllerLink.call``."""

    def __getattr__(self, name):
        raise AssertionError(f"unexpected call {name}")


class _Unheard:
    """A controller that has committed every step up to ``committed`` and heard of no later one."""

    def __init__(self, committed: int):
        self.committed = committed

    def call(self, method, generation, steps, **_):
        assert method == "settled", method
        return Settled(
            generation=generation,
            committed=tuple(s for s in steps if s <= self.committed),
            unknown=tuple(s for s in steps if s > self.committed),
            newest_committed=self.committed,
        )


def test_wait_treats_a_step_the_controller_has_not_heard_of_as_not_settled_and_reports_a_timeout(monkeypatch):
    link = ControllerLink(_Handle(), 0, Timing(), Scheduler(cf_ray.CheckpointConfig()), lambda r: None)
    ctl = _Unheard(committed=15)
    monkeypatch.setattr(link, "call", ctl.call)
    monkeypatch.setattr(link, "poll", lambda *a, **k: None)
    monkeypatch.setattr(link, "poll_blocking", lambda *a, **k: None)
    link.start_attempt(1, 10)
    for s in (15, 20, 25):
        link.track(s)
    link.known_committed = 15
    link.failures.append({"step": 20, "section": "rank_00000", "rank": 0, "error": "disk full", "generation": 1})
    left = link.wait_durable(time.monotonic() + 0.2, 25, {})
    assert left == [25]  # nothing pending at the controller, yet step 25 is neither committed nor failed
    assert link.failures[-1] == {
        "step": 25,
        "section": "timeout",
        "rank": 0,
        "error": "not durable after 0 s",
        "generation": 1,
    }
    assert link.taken == []
    link.track(30)
    ctl.committed = 30
    assert link.wait_durable(time.monotonic() + 5, 30, {}) == []  # committed: settled at once


def _link_on(ctl, monkeypatch) -> ControllerLink:
    """A rank's link to the in-process controller ``ctl``: its calls go to ``ctl``, and each poll brings
    the failures ``ctl`` logged since the last one (what a ``SyncReply`` carries)."""
    link = ControllerLink(_Handle(), 0, Timing(), Scheduler(cf_ray.CheckpointConfig()), lambda r: None)
    seen: set[int] = set()

    def poll(*a, **k):
        for f in ctl.summary()["failures"]:
            if f["seq"] not in seen:
                seen.add(f["seq"])
                link.failures.append(f)

    monkeypatch.setattr(link, "poll", poll)
    monkeypatch.setattr(link, "poll_blocking", poll)
    monkeypatch.setattr(link, "call", lambda method, *a, **k: getattr(ctl, method)(*a))
    link.start_attempt(ctl.generation, 0)
    return link


def test_wait_reports_the_failures_of_one_steps_sections_together(controller, monkeypatch):
    """Step 6's ``shared`` section fails first and the rank hears of it; its holder is still writing
    ``rank_00000``, which fails half a second later. ``wait()`` used to end at the first failure and
    report ``rank_00000``'s in the next call; it reports both at once."""
    import threading

    from cf_ray._engine.format.layout import SHARED, rank_section, section_rank
    from cf_ray._engine.protocol.messages import PartFailed

    from controller_harness import durable, meta, staged

    ctl = controller()
    link = _link_on(ctl, monkeypatch)
    sections = [SHARED, rank_section(0), rank_section(1)]
    for sec in sections:
        ctl.part_staged(staged(ctl.generation, 6, sec, m=meta(section_rank(sec), 2, replicated=True)))
    link.track(6)
    ctl.part_failed(PartFailed(generation=ctl.generation, step=6, section=SHARED, error="EIO", holder="h"))
    ctl.part_durable(durable(ctl.storage, ctl.generation, 6, rank_section(1)))
    link.poll(6, {})

    def later():
        ctl.part_failed(PartFailed(generation=ctl.generation, step=6, section=rank_section(0), error="EIO", holder="h"))

    timer = threading.Timer(0.5, later)
    timer.start()
    try:
        assert link.wait_durable(time.monotonic() + 10, 6, {}) == []
    finally:
        timer.join()
    got = link.new_failures(False)
    assert sorted((f["step"], f["section"]) for f in got) == [(6, rank_section(0)), (6, SHARED)]


def test_finish_waits_for_a_held_final_step_it_takes_again_from_the_first_poll(controller, monkeypatch):
    """The loop's last step (8) was held in memory only, settled as superseded, and the rank heard
    that a skip failed it on another rank. ``finish()`` says it takes the step again before its
    snapshot: the rank's first poll, which comes before any holder said a word of the new snapshot,
    finds it pending, and the wait ends only when it commits; the old skip is not this one's."""
    from cf_ray._engine.format.layout import rank_section, section_rank
    from cf_ray._engine.protocol.messages import PartFailed

    from controller_harness import durable, meta, staged

    ctl = controller()
    link = _link_on(ctl, monkeypatch)
    ctl.part_staged(staged(ctl.generation, 8, rank_section(0), m=meta(0, 2, persist=False)))
    ctl.part_failed(PartFailed(generation=ctl.generation, step=8, section=rank_section(1), error="no slot"))
    link.track(8)
    link.poll(8, {})
    link.reopen_final(8, 1)  # rank 0, before its snapshot
    ctl.reopen_final(ctl.generation, 8, 1, 1)  # rank 1, before its own
    assert link.wait_durable(time.monotonic() + 0.3, 8, {}, report_timeout=False) == [8]  # not settled
    for sec in (rank_section(0), rank_section(1)):
        ctl.part_staged(staged(ctl.generation, 8, sec, m=meta(section_rank(sec), 2)))
        ctl.part_durable(durable(ctl.storage, ctl.generation, 8, sec))
    assert link.wait_durable(time.monotonic() + 5, 8, {}) == []
    assert link.known_committed == 8 and not link.final_failed(8)


# -- a Checkpointer against a storage that misbehaves (Ray actors in this process) -----------------------------


def _ckpt(tmp_path, name, mode, **cfg):
    flag = tmp_path / f"{name}.flag"
    cfg.setdefault("durability_timeout", DurabilityTimeout(floor_s=1.0))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        config=cf_ray.CheckpointConfig(
            storage_path=str(tmp_path),
            run_name=name,
            register_with_ray=False,
            final_model=None,
            preemption=False,
            policy=cf_ray.FixedInterval(every=2),
            storage_filesystem=pafs.PyFileSystem(FlagHandler(str(flag), mode)),
            **cfg,
        ),
    )
    ck.restore()

    def step():
        model(torch.randn(2, 4)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
        time.sleep(0.03)

    return ck, step, flag


def _events(ck, name, n, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        got = [e for e in ck.events() if e["event"] == name]
        if len(got) >= n or time.time() > deadline:
            return got
        time.sleep(0.1)


def _lost_logs(caplog):
    return [r for r in caplog.records if "durability lost" in r.getMessage()]


@pytest.mark.slow
def test_a_storage_that_hangs_is_one_alarm_per_episode(ray_cluster, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="cf_ray")
    ck, step, flag = _ckpt(tmp_path, "hang", "hang")
    try:
        for _ in range(6):
            step()
        ck.wait()
        assert ck._link.known_committed == 6
        for episode in (1, 2):
            flag.touch()  # from here the storage never returns
            t0 = time.time()
            while ck._durability.watchdog.episodes < episode and time.time() - t0 < 30:
                step()
            assert ck._durability.watchdog.episodes == episode, "no alarm"
            for _ in range(20):  # training goes on; the alarm is not repeated
                step()
            assert len(_lost_logs(caplog)) == episode and ck._durability.watchdog.lost
            flag.unlink()  # the storage is back
            t0 = time.time()
            while ck._durability.watchdog.lost and time.time() - t0 < 30:
                step()
            assert not ck._durability.watchdog.lost, "the episode did not end"
        for _ in range(4):  # checkpoints after the all-clear (the loop above stops at the commit that ends it)
            step()
        ck.wait()
        lost, restored = _events(ck, "durability_lost", 2), _events(ck, "durability_restored", 2)
        assert len(lost) == 2 and len(restored) == 2
        assert lost[0]["reason"] == "no_commit" and lost[0]["committed_step"] >= 6 and lost[0]["action"] == "warn"
        assert "failures reported" not in lost[0]
        # The profile table says which checkpoints were taken while durability was lost.
        rows = {r["step"]: r for r in ck.profile_rows()}
        assert any(s <= 6 for s in rows) and not any(r["durability_lost"] for s, r in rows.items() if s <= 6), sorted(
            rows
        )
        flagged = sorted(s for s, r in rows.items() if r["durability_lost"])
        assert flagged and flagged[0] >= lost[0]["since_step"] > 6, (flagged, lost[0])
        assert flagged[-1] < max(rows), "the checkpoints after the all-clear are not flagged"
    finally:
        flag.unlink(missing_ok=True)
        ck.finish()


@pytest.mark.slow
def test_a_storage_that_fails_every_write_with_raise_fails_the_attempt_saying_what_happened(ray_cluster, tmp_path):
    ck, step, flag = _ckpt(tmp_path, "failing", "fail", on_durability_lost="raise")
    try:
        for _ in range(4):
            step()
        ck.wait()
        flag.touch()  # every write fails from here
        t0 = time.time()
        with pytest.raises(DurabilityLostError) as info:
            while time.time() - t0 < 30:
                step()
        msg = str(info.value)
        assert "no checkpoint has committed since step 4" in msg
        assert "injected fault" in msg  # the last failures, as reported
        assert "durability_timeout" in msg and "on_durability_lost" in msg  # what to change
        (event,) = _events(ck, "durability_lost", 1)
        assert event["action"] == "raise" and event["failures"]
        assert cf_ray.list_checkpoints(str(tmp_path / "failing"))[-1].step == 4
    finally:
        flag.unlink(missing_ok=True)
        ck.close()


@pytest.mark.slow
def test_a_dead_holder_is_made_again_and_the_next_snapshot_goes_to_it(ray_cluster, tmp_path, caplog):
    import ray

    caplog.set_level(logging.WARNING, logger="cf_ray")
    ck, step, _ = _ckpt(tmp_path, "holder", "fail", durability_timeout=DurabilityTimeout(floor_s=60.0))
    for _ in range(2):
        step()
    ck.wait()
    old = ck.holder
    ray.kill(old, no_restart=True)
    for _ in range(2):
        step()
    assert ck.wait() == []
    assert ck.holder is not old and "holder cannot take the snapshot of step 4: it is gone" in caplog.text
    assert [c.step for c in cf_ray.list_checkpoints(str(tmp_path / "holder"))][-1] == 4
    ck.finish()


@pytest.mark.slow
def test_a_dead_controller_is_resolved_again_and_training_goes_on(ray_cluster, tmp_path, caplog):
    import ray

    caplog.set_level(logging.WARNING, logger="cf_ray")
    ck, step, _ = _ckpt(
        tmp_path, "ctl", "fail", durability_timeout=DurabilityTimeout(floor_s=60.0)
    )  # a re-resolve is not an episode
    for _ in range(2):
        step()
    ck.wait()
    old = ck.controller
    ray.kill(old, no_restart=True)
    t0 = time.time()
    while ck.controller is old and time.time() - t0 < 30:
        step()  # the polls fail; the link re-resolves the controller on a thread of its own
    assert ck.controller is not old and "a call to the controller failed" in caplog.text
    for _ in range(4):
        step()
    assert ck.wait() == []  # the new controller commits what is taken from here
    assert ck._link.known_committed >= 4 and not ck._durability.watchdog.lost
    ck.finish()


@pytest.mark.slow
def test_a_pinned_milestone_on_a_hung_storage_never_stops_training_silently(ray_cluster, tmp_path, caplog):
    """Storage stops answering after a commit; two milestones a step later are pinned until written
    (one in the spare slot), so the next scheduled snapshot finds every slot of its sections held (one
    being written, two pinned). The training thread says so
    while it waits, the watchdog speaks during the wait, the snapshot is skipped (reported), and
    on_durability_lost="raise" fails the attempt: never a silent stop."""
    import threading

    caplog.set_level(logging.WARNING, logger="cf_ray")
    ck, step, flag = _ckpt(tmp_path, "pinned", "hang", on_durability_lost="raise", durability_timeout=4.0)
    released = threading.Timer(90.0, lambda: flag.unlink(missing_ok=True))  # a hang on main ends some day
    released.daemon = True
    try:
        for _ in range(4):
            step()
        ck.wait()
        assert ck._link.known_committed == 4
        flag.touch()  # from here the storage never returns
        released.start()
        step()
        step()  # step 6: the holder starts writing it, and hangs
        ck.wait_snapshot()
        time.sleep(1.0)
        step()
        ck.save(milestone=True)  # step 7: pinned until written
        ck.wait_snapshot()
        step()
        ck.save(milestone=True)  # step 8: pinned too, in the spare slot
        ck.wait_snapshot()
        t0 = time.time()
        with pytest.raises(DurabilityLostError, match="no checkpoint has committed since step 4"):
            while time.time() - t0 < 60:
                step()  # the next scheduled snapshot finds every slot held
        elapsed = time.time() - t0
        assert elapsed < 30, f"training stopped for {elapsed:.0f} s"
        text = caplog.text
        waited = text.index("has waited 1 s for a free slot")
        found = re.search(r"the checkpoint of step (\d+) is skipped: no free snapshot slot", text)
        assert found is not None, text
        at = int(found.group(1))
        assert at > 8
        lost = text.index(f"durability lost at step {at}")
        assert waited < lost < found.start()  # said while it waited, then the way out, then the raise
        assert _failures_reported(ck, at), "the skipped snapshot is a reported failure"
    finally:
        released.cancel()
        flag.unlink(missing_ok=True)
        ck.close()


def _failures_reported(ck, step, timeout=15.0):
    """The controller's failures of ``step`` (the skipped snapshot reaches every rank through it)."""
    deadline = time.time() + timeout
    while True:
        got = [f for f in ck._link.call("summary")["failures"] if f["step"] == step]
        if got or time.time() > deadline:
            return got
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("final_slower", [False, True], ids=["slow_storage", "slower_final_persist"])
def test_finish_waits_for_the_final_checkpoint_by_the_runs_persist_times_or_says_it_did_not(
    ray_cluster, tmp_path, caplog, monkeypatch, final_slower
):
    """The RPC timeout scaled down to 2 s: with every persist slow (~3 s), finish() waits for the
    final checkpoint (its bound comes from the persist times it measured) and the final model names
    the final step; with a final persist much slower than those measured, finish() says so and the
    summary names the step the final model resumes from (never silently an older one)."""
    from faulty_fs import SlowHandler

    caplog.set_level(logging.WARNING, logger="cf_ray")
    slow = SlowHandler(slow_from=6, slow_to=7, delay_s=30.0) if final_slower else SlowHandler(0, 10**6, 3.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        config=cf_ray.CheckpointConfig(
            storage_path=str(tmp_path),
            run_name="final",
            register_with_ray=False,
            preemption=False,
            policy=cf_ray.FixedInterval(every=2),
            durability_timeout=DurabilityTimeout(floor_s=1.0),
            storage_filesystem=pafs.PyFileSystem(slow),
        ),
    )
    ck.restore()
    monkeypatch.setenv("CF_RAY_ACTOR_TIMEOUT_S", "2")  # the RPC timeout, scaled down from 120 s
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
        time.sleep(0.05)
    t0 = time.time()
    while ck._durability.watchdog.slowest_persist_s is None and time.time() - t0 < 60:
        ck._link.poll(ck.step_count, {}, force=True)  # a commit seen: a persist time measured
        time.sleep(0.2)
        ck._durability.observe(ck.step_count, 2)
    model(torch.randn(2, 4)).sum().backward()
    ck.step(opt)  # step 6, the final step: finish() takes no other checkpoint
    summary = ck.finish()
    assert summary.final_step == 6
    if not final_slower:
        assert summary.final_durable and summary.resume_step == 6 and 6 in summary.committed_steps
        assert "was not committed within finish()'s wait" not in caplog.text
    else:
        assert not summary.final_durable and summary.resume_step == 4, summary
        assert "the final state (step 6) was not committed within finish()'s wait" in caplog.text
        assert "names step 4, the newest committed one" in caplog.text and "finish_timeout_s" in caplog.text


def _final_run(tmp_path, name, **cfg):
    """One rank's Checkpointer, no Ray Train, and a step function (the model is the final model)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        config=cf_ray.CheckpointConfig(
            storage_path=str(tmp_path), run_name=name, register_with_ray=False, preemption=False, **cfg
        ),
    )
    ck.restore()

    def step():
        model(torch.randn(2, 4)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
        time.sleep(0.03)

    return ck, step


@pytest.mark.slow
def test_finish_waits_for_the_held_last_step_it_persists_again_and_lists_it_once(ray_cluster, tmp_path, caplog):
    """``FixedInterval(every=2, persist_every=3)``, the loop ending on step 10, held in memory only and
    settled as superseded before ``finish()`` (a short pause). ``finish()`` takes step 10 again,
    persisted; its holder tells the controller 2 s late. ``finish()`` used to end its wait at the
    rank's first poll (step 10 superseded), ``final_durable=False`` and a resume step of 8, with a
    warning of a 60 s wait that never happened; it waits for the commit. The run's end is listed
    once, as the final model, and nothing is a milestone."""
    import holder_hooks
    import ray

    caplog.set_level(logging.WARNING, logger="cf_ray")
    ck, step = _final_run(tmp_path, "held", policy=cf_ray.FixedInterval(every=2, persist_every=3))
    for _ in range(10):
        step()  # 2 and 8 persisted, 4, 6 and 10 held in memory only
    ck.wait_snapshot()
    time.sleep(0.6)  # the holder tells the controller of a held snapshot within 0.2 s
    ray.get(ck.holder.__ray_call__.remote(holder_hooks.delay_persisted_staging, 10, 2.0), timeout=60)
    t0 = time.monotonic()
    summary = ck.finish()
    assert (summary.final_step, summary.final_durable, summary.resume_step) == (10, True, 10), summary
    assert time.monotonic() - t0 >= 2.0 and summary.failures == []
    assert "not committed within" not in caplog.text
    listed = [(c.step, c.kind, c.milestone) for c in cf_ray.list_checkpoints(str(tmp_path / "held"))]
    assert listed == [(2, "scheduled", False), (8, "scheduled", False), (10, "final", False)]
    # finish()'s full checkpoint is of kind final (it was "manual", a kind the user never asked for).
    from cf_ray._engine.format.commit import read_manifest
    from cf_ray._engine.format.layout import step_dir

    assert read_manifest(ck.storage, step_dir(10)).kind == "final"
    _, directory = resumable_checkpoint_of(summary.final_path)
    assert directory.endswith("step_000000000010")


@pytest.mark.slow
def test_the_resume_point_finish_names_survives_the_final_steps_late_commit(ray_cluster, tmp_path, caplog):
    """``keep_last=1`` and a final persist slower than ``finish_timeout_s``: the final model names step
    4, an ordinary checkpoint, and step 6 commits after ``finish()`` returned. Keep-last used to delete
    step 4 then, and ``resume_from=result.checkpoint`` raised ``CheckpointNotFoundError``; the resume
    point is kept. The warning says how long ``finish()`` really waited."""
    from faulty_fs import SlowHandler

    caplog.set_level(logging.WARNING, logger="cf_ray")
    ck, step = _final_run(
        tmp_path,
        "kept",
        policy=cf_ray.FixedInterval(every=2),
        keep_last=1,
        finish_timeout_s=1.0,
        storage_filesystem=pafs.PyFileSystem(SlowHandler(slow_from=6, slow_to=7, delay_s=4.0)),
    )
    for _ in range(4):
        step()
    assert ck.wait() == []  # steps 2 and 4 committed
    step()
    step()  # step 6, slow to write: finish() takes no other checkpoint
    controller = ck.controller
    summary = ck.finish()
    assert (summary.final_durable, summary.resume_step) == (False, 4), summary
    assert "was not committed within finish()'s wait of 1 s" in caplog.text
    root = tmp_path / "kept"
    deadline = time.time() + 60
    while (
        not (root / "cf_ray" / "checkpoints" / "step_000000000006" / "MANIFEST.json").exists()
        and time.time() < deadline
    ):
        time.sleep(0.2)
    try:  # keep-last after step 6's commit is done (or the controller, lingering, drained and went)
        while (
            not ray_cluster.get(controller.__ray_call__.remote(lambda c: c._maintenance.idle()), timeout=60)
            and time.time() < deadline
        ):
            time.sleep(0.2)
    except ray_cluster.exceptions.RayActorError:
        pass
    assert (root / "cf_ray" / "checkpoints" / "step_000000000006" / "MANIFEST.json").exists()
    _, directory = resumable_checkpoint_of(str(root / "cf_ray" / "checkpoints" / "final_000000000006"))
    assert directory.endswith("step_000000000004")
    assert [c.step for c in cf_ray.list_checkpoints(str(root))] == [4, 6, 6]  # the final model names 4


@pytest.mark.slow
def test_a_final_checkpoint_whose_write_fails_is_taken_again_and_commits(ray_cluster, tmp_path):
    """The final step's write fails once (a storage error for a moment). ``finish()`` used to leave it
    failed (``final_durable=False``, the final model naming step 4); it takes it again, and the run
    ends durable, the failure of the try before made good (not listed)."""
    ck, step, flag = _ckpt(tmp_path, "retry", "fail_once", finish_timeout_s=60.0)
    for _ in range(4):
        step()
    assert ck.wait() == []  # steps 2 and 4 committed
    flag.touch()  # the next write of a section fails
    step()
    step()  # step 6, the final step: finish() takes no other checkpoint first
    summary = ck.finish()
    assert not flag.exists()  # the write did fail
    assert (summary.final_durable, summary.resume_step, summary.failures) == (True, 6, []), summary


def resumable_checkpoint_of(final_path):
    from cf_ray.load import resumable_checkpoint

    return resumable_checkpoint(final_path)
