"""Goodput (issue #15): the arithmetic of the profile book (no Ray), the restarts table and the
profile parts on read, and one real run whose goodput is read back from Ray's metrics endpoint."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from cf_ray import report
from cf_ray._engine.observe.goodput import Goodput
from cf_ray._engine.observe.profile_book import ProfileBook
from cf_ray._engine.observe.profile_files import ProfileParts
from cf_ray._engine.observe.profile_frames import coerce, read_parquet
from cf_ray._engine.protocol.messages import CheckpointKind, SnapshotMeta
from cf_ray._engine.storage.fs import FsStorage


def test_goodput_of_a_run_with_one_restart():
    g = Goodput()
    assert g.on_restore(generation=1, source="fresh", step=0, restore_s=0.0, now_unix=100.0) is None  # the start
    for step in range(5, 35, 5):  # 5 iterations of 0.1 s per sample, one sample a second
        assert g.on_sample(step, 0.1, 5, 100.0 + step / 5) is None
    assert g.progress_steps() == 30 and g.mean_iter_s() == pytest.approx(0.1)
    assert g.wall_s() == pytest.approx(6.0 - 0.5)  # from the first iteration's start to the newest sample
    r = g.on_restore(generation=2, source="memory", step=20, restore_s=0.4, now_unix=110.0)
    assert (r.lost_steps, r.source, r.restored_step, r.failure_unix) == (10, "memory", 20, 106.0)
    assert r.lost_s == pytest.approx(1.0) and g.lost_steps_total == 10
    assert g.on_sample(20, 0.0, 0, 110.5) is None  # not past the restored step: not resumed yet
    resumed = g.on_sample(25, 0.1, 5, 111.0)
    assert resumed is r and r.resumed_unix == pytest.approx(111.0 - 0.4) and r.recovery_s == pytest.approx(4.6)
    # Useful: 25 steps of 0.1 s (the 10 redone steps count once) over 10.5 s of wall time (100.5 to 111).
    assert g.progress_steps() == 25 and g.effective_ratio() == pytest.approx(2.5 / 10.5)
    assert [row["lost_steps"] for row in g.rows()] == [10]


def test_goodput_edge_cases():
    g = Goodput()
    assert g.effective_ratio() is None and g.rows() == []
    g.on_sample(10, 0.5, 10, 5.0)  # a run started without a restore event: it started where the samples began
    assert g.progress_steps() == 10 and g.effective_ratio() == pytest.approx(1.0)  # clipped to [0, 1]
    r = g.on_restore(generation=3, source="storage", step=15, restore_s=1.0, now_unix=6.0)
    assert r.lost_steps == 0  # restored past what was reported: nothing lost
    r2 = g.on_restore(generation=4, source="storage", step=15, restore_s=1.0, now_unix=7.0)
    # Nothing came from attempt 3 but its restore (at 6.0): the failure came after that.
    assert r2.lost_steps == 0 and r2.failure_unix == 6.0 and g.lost_steps_total == 0


def test_a_restart_before_the_first_sample_is_counted():
    """The first attempt fails before its first sync (a short interval, a fast kill): no sample of
    it ever reaches the controller. Its restart is still one, not the run's start (the cause of the
    endpoint test's empty restarts table); the staged snapshots say how far it got."""
    g = Goodput()
    assert g.on_restore(generation=1, source="fresh", step=0, restore_s=1.0, now_unix=100.0) is None
    g.on_progress(1, 5, 101.0)
    g.on_progress(1, 10, 102.0)  # the snapshot of step 10 staged; then the kill, before any sample
    r = g.on_restore(generation=2, source="memory", step=10, restore_s=0.1, now_unix=110.0)
    assert r is not None and (r.generation, r.source, r.restored_step, r.lost_steps) == (2, "memory", 10, 0)
    assert r.failure_unix == 102.0 and r.lost_s is None  # no iteration time known yet
    g.on_progress(1, 15, 110.5)  # late news of the ended timeline: ignored
    assert g.progress_steps() == 10
    assert g.on_sample(10, 0.0, 0, 111.0) is None  # not past the restored step
    assert g.on_sample(20, 0.5, 10, 115.0) is r and r.recovery_s == pytest.approx(115.0 - 4.5 - 102.0)
    # Wall time starts at the first attempt's restore (its iterations were never timed).
    assert g.progress_steps() == 20 and g.wall_s() == pytest.approx(15.0)
    assert g.effective_ratio() == pytest.approx(20 * 0.5 / 15.0)
    assert [row["generation"] for row in g.rows()] == [2]
    # Without any sign of life from an attempt, its restore is the best failure time there is.
    r3 = g.on_restore(generation=3, source="storage", step=20, restore_s=0.1, now_unix=130.0)
    r4 = g.on_restore(generation=4, source="storage", step=20, restore_s=0.1, now_unix=140.0)
    assert r3.failure_unix == 115.0 and r4.failure_unix == 130.0 and len(g.rows()) == 3


def test_profile_book_records_restarts_and_saves_them(tmp_path):
    from cf_ray._engine.driver.schedule import ScheduleBook
    from cf_ray.policy import FixedInterval

    storage = FsStorage.from_uri(str(tmp_path))
    book = ProfileBook("run", storage, ScheduleBook(FixedInterval(every=5), storage))
    book.add_event({"event": "restore", "source": "fresh", "step": 0, "seconds": 0.0, "generation": 1, "time": 1.0})
    for step in (5, 10, 15):
        book.add_iteration(0, step, 0.01, 5)
    book.add_event({"event": "restore", "source": "memory", "step": 10, "seconds": 0.2, "generation": 2})
    book.add_iteration(0, 15, 0.01, 5)
    (row,) = book.restart_rows()
    assert row["lost_steps"] == 5 and row["source"] == "memory" and row["recovery_s"] >= 0
    # A staged snapshot is progress too (an attempt that fails before it sends a sample).
    meta = SnapshotMeta(rank=0, world_size=1, replicated=False, epoch=0, kind=CheckpointKind.SCHEDULED)
    book.note_staged(2, 20, meta)
    book.add_event({"event": "restore", "source": "storage", "step": 20, "seconds": 0.2, "generation": 3})
    assert [r["source"] for r in book.restart_rows()] == ["memory", "storage"]
    assert book.restart_rows()[1]["lost_steps"] == 0 and book.goodput.progress_steps() == 20
    import threading

    book.save(threading.RLock())
    df = report.load_restarts(storage)
    assert df["lost_steps"].tolist() == [5, 0] and df["source"].tolist() == ["memory", "storage"]
    assert list(df.columns) == list(report.RESTART_COLUMNS)
    assert len(report.load_restarts(FsStorage.from_uri(str(tmp_path / "none")))) == 0


def test_the_books_feed_the_runs_failures_to_the_policy_and_split_the_wall_time(tmp_path):
    """The controller's books (no Ray): the run's start, a restart, its recovery and a driver's notice
    reach the policy's failure-rate estimate (one ``failure_rate`` event per failure counted), and the
    wall time splits into productive time and badput categories that add up to it."""
    import threading

    from cf_ray._engine.driver.schedule import ScheduleBook
    from cf_ray.policy import Adaptive

    storage = FsStorage.from_uri(str(tmp_path))
    schedule = ScheduleBook(Adaptive(budget_pct=5.0, mtbf_s=3600.0), storage)
    book = ProfileBook("run", storage, schedule)
    t0 = book.badput.started_unix
    book.add_event({"event": "restore", "source": "fresh", "step": 0, "seconds": 0.5, "generation": 1, "time": t0 + 2})
    for step in (5, 10, 15):
        book.add_iteration(0, step, 0.01, 5)
        book.add_rank_timings(1, 0, {"step": step, "stall_s": 0.02, "guard_s": 0.01})
        book.add_rank_timings(1, 1, {"step": step, "stall_s": 0.01})  # the slowest rank's stall counts
    book.add_event({"event": "restore", "source": "memory", "step": 10, "seconds": 0.2, "generation": 2})
    book.add_iteration(0, 20, 0.01, 5)  # resumed: the recovery is measured
    hazard = schedule.hazard()
    assert hazard["failures"] == 1 and hazard["measured_recoveries"] == 1 and "memory" in hazard["recovery_by_source"]
    book.add_event({"event": "notice", "seq": 1, "generation": 2, "time": time.time(), "detail": ""})
    book.add_event({"event": "notice", "seq": 2, "generation": 2, "time": time.time(), "detail": ""})  # same attempt
    rates = [e for e in book.log.plain_events() if e["event"] == "failure_rate"]
    assert [(e["why"], e["failures"]) for e in rates] == [("restart", 1), ("notice", 2)]
    assert rates[-1]["mtbf_s"] < 3600.0  # two failures within seconds: a much higher rate than the prior
    b = book.breakdown()
    assert b["badput_s"]["checkpoint_save"] == pytest.approx(3 * 0.03)
    assert b["badput_s"]["checkpoint_restore"] == pytest.approx(0.5 + 0.2)
    assert b["badput_s"]["wasted_progress"] == pytest.approx(5 * 0.01)
    assert b["badput_s"]["startup"] >= 0 and b["restarts"] == 1
    book.save(threading.RLock())
    assert report.load_goodput(storage)["badput_s"] == pytest.approx(b["badput_s"], abs=0.5)
    assert report.load_goodput(FsStorage.from_uri(str(tmp_path / "none"))) is None


def test_badput_categories_add_up_to_the_wall_time():
    """A timeline whose times agree with each other: 20 steps of 0.5 s and one stall of 0.2 s, a
    failure, 10 steps lost, a recovery of 21.8 s with a 2 s restore, 5 steps more."""
    from cf_ray._engine.observe.goodput import CATEGORIES, Badput

    g, b = Goodput(), Badput(started_unix=90.0)  # the controller started at 90
    g.on_restore(generation=1, source="fresh", step=0, restore_s=1.0, now_unix=100.0)  # the run's start
    g.on_sample(10, 0.5, 10, 106.0)  # the first iteration started at 101
    b.note_stall(1, 0, {"step": 10, "stall_s": 0.15, "guard_s": 0.05})
    b.note_stall(1, 1, {"step": 10, "stall_s": 0.1})  # the slowest rank's stall counts
    g.on_sample(20, 0.5, 10, 111.2)
    r = g.on_restore(generation=2, source="memory", step=10, restore_s=2.0, now_unix=130.0)
    assert r is not None and r.failure_unix == 111.2
    g.on_sample(15, 0.5, 5, 135.0)  # the first resumed iteration ended at 133
    out = b.breakdown(g)
    bad = out["badput_s"]
    assert out["wall_s"] == pytest.approx(45.0) and out["productive_s"] == pytest.approx(7.5)
    assert bad == pytest.approx(
        {
            "checkpoint_save": 0.2,
            "checkpoint_restore": 3.0,
            "wasted_progress": 5.0,
            "recovery": 19.3,
            "startup": 10.0,
            "other": 0.0,
        }
    )
    frame = report.badput_frame(out)
    assert frame["category"].tolist() == ["productive", *CATEGORIES]
    assert frame["seconds"].sum() == pytest.approx(out["wall_s"]) and frame["share"].sum() == pytest.approx(1.0)
    import matplotlib

    matplotlib.use("Agg")
    fig = report.plot_badput({"cf_ray": out, "another": out})
    assert len(fig.axes[0].patches) == 2 * len(frame)


def _row(gen, step, **kw):
    return {"step": step, "generation": gen, "committed": True, "where": "x", **kw}


def test_load_profile_merges_the_parts_of_a_controller_that_died(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path))
    parts = ProfileParts(storage, "00000000000000000001")
    parts.write([_row(1, 5, persist_s=1.0), _row(1, 10)])
    parts.write([{"step": 10, "generation": 1, "persist_s": 2.0}])  # a late fragment of a row already in a part
    # No profile.parquet (the controller never ended): the parts are the profile.
    df = report.load_profile(storage)[0]
    assert df["step"].tolist() == [5, 10] and df["persist_s"].tolist() == [1.0, 2.0]
    assert df["committed"].tolist() == [True, True]
    # A clean end wrote the whole table: it wins for its rows; rows only in a part are added.
    report.save_profile(storage, [_row(1, 10, persist_s=3.0), _row(2, 15)])
    df = report.load_profile(storage)[0]
    assert list(zip(df["generation"], df["step"], df["persist_s"])) == [(1, 5, 1.0), (1, 10, 3.0), (2, 15, None)] or (
        df["step"].tolist() == [5, 10, 15] and df["persist_s"].tolist()[:2] == [1.0, 3.0]
    )


def test_load_profile_of_a_clean_run_is_the_saved_table(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path))
    ProfileParts(storage, "00000000000000000001").write([_row(1, 5, persist_s=1.0)])
    report.save_profile(storage, [_row(1, 5, persist_s=1.0), _row(1, 10, sync_s=0.1)], [])
    saved = coerce(read_parquet(storage, report.PROFILE_FILE), report.PROFILE_COLUMNS)
    assert report.load_profile(storage)[0].equals(saved)
    with pytest.raises(FileNotFoundError):
        report.load_profile(FsStorage.from_uri(str(tmp_path / "empty")))


def test_goodput_metrics_is_a_no_op_outside_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    m = report.GoodputMetrics(run="r")
    m.record_restart("memory", 3, 0.3, 0.1)
    m.record_recovery(1.0)
    m.record_ratio(0.5)
    m.record_badput({"productive_s": 1.0, "badput_s": {"checkpoint_save": 0.1}})
    assert m.enabled in (None, False)


# -- for real: Ray's metrics endpoint -----------------------------------------------------------------

_DRIVER = textwrap.dedent("""
    import json, sys, threading, time, urllib.request
    import ray
    from cf_ray import demo, report
    port, root, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             _metrics_export_port=port)
    # Ray's metrics agent drops a process's series once the process is gone, and the controller
    # exits after the run (CF_RAY_CONTROLLER_LINGER_S): scrape during the run and after it, and keep
    # the newest line of every cf_ray series seen.
    seen, done = {}, threading.Event()
    wanted = ("cf_ray_recovery_seconds", "cf_ray_effective_training_ratio", "cf_ray_restart_lost_steps",
              "cf_ray_restore_seconds", "cf_ray_restarts", "cf_ray_badput_seconds", "cf_ray_productive_seconds",
              "cf_ray_failure_mtbf_seconds")
    def scrape():
        while not done.is_set():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError as e:
                seen["unreachable"] = f"# unreachable: {e}"
                text = ""
            for ln in text.splitlines():
                if "cf_ray_" in ln and not ln.startswith("#"):
                    seen[ln.rsplit(" ", 1)[0]] = ln
            done.wait(1.0)
    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    cfg = {"samples": 202, "epochs": 2, "batch_size": 8, "hidden": 32, "depth": 1, "interval": 5,
           "kill_at": 12, "restore_from": "memory", "kill_after_handoff": True}
    demo.run("goodput", root, cfg)
    deadline = time.time() + 60
    while time.time() < deadline and not all(any(w in k for k in seen) for w in wanted):
        time.sleep(1)
    done.set()
    thread.join()
    restarts = report.read_run_restarts(f"{root}/storage", "goodput").to_dict("records")
    json.dump({"metrics": sorted(seen.values()), "restarts": restarts,
               "events": json.load(open(f"{root}/out/goodput/result.json"))["events"]}, open(out, "w"), default=str)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _values(lines: list[str], name: str) -> list[float]:
    pat = re.compile(rf"^(?:ray_)?{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$")
    return [float(m.group(1)) for m in map(pat.match, lines) if m]


@pytest.mark.slow
def test_goodput_is_exported_to_rays_metrics_endpoint(tmp_path):
    """Ray's metrics agent runs in the dashboard agent, which needs ``ray[default]``'s packages (the
    ``test`` extra installs them). Without them Ray starts a minimal agent with no endpoint: a failure
    here, not a skip, so that CI cannot pass without reading the metrics back."""
    try:  # the import by which Ray decides between its full and its minimal agent
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as e:
        pytest.fail(f"Ray's Prometheus endpoint needs ray[default] (pip install -e '.[test]'): {e}")
    port, out = _free_port(), tmp_path / "goodput.json"
    # The controller lingers long enough after the run for Ray to export what it recorded last.
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p),
        CF_RAY_CONTROLLER_LINGER_S="30",
    )
    subprocess.run(
        [sys.executable, "-c", _DRIVER, str(port), str(tmp_path), str(out)], check=True, timeout=400, env=env
    )
    got = json.load(open(out))
    lines = got["metrics"]
    restores = [e for e in got["events"] if e.get("event") == "restore"]
    assert [e["source"] for e in restores] == ["fresh", "memory"], got["events"]  # the start, then one restart
    (restart,) = got["restarts"]
    assert restart["generation"] == restores[1]["generation"]
    assert restart["source"] == "memory" and restart["restored_step"] == 10
    lost = _values(lines, "cf_ray_restart_lost_steps")
    assert lost and lost[0] >= 0 and lost[0] == int(restart["lost_steps"]), lines
    assert _values(lines, "cf_ray_lost_seconds") == [] or _values(lines, "cf_ray_lost_seconds")[0] >= 0
    recovery = _values(lines, "cf_ray_recovery_seconds")
    assert recovery and recovery[0] > 0, lines
    ratio = _values(lines, "cf_ray_effective_training_ratio")
    assert ratio and 0 < ratio[0] <= 1, lines
    assert _values(lines, "cf_ray_restore_seconds") and _values(lines, "cf_ray_restarts"), lines
    assert any('source="memory"' in ln for ln in lines if "cf_ray_restore_seconds" in ln), lines
    # Where the wall time went (#26), and the failure rate the controller estimated from the restart.
    assert _values(lines, "cf_ray_productive_seconds")[0] > 0, lines
    restore_badput = [ln for ln in lines if "cf_ray_badput_seconds" in ln and 'category="checkpoint_restore"' in ln]
    assert restore_badput and float(restore_badput[0].rsplit(" ", 1)[1]) > 0, lines
    (rate,) = [e for e in got["events"] if e.get("event") == "failure_rate"]
    assert rate["failures"] == 1 and rate["why"] == "restart" and rate["mtbf_s"] > 0
    assert _values(lines, "cf_ray_failure_mtbf_seconds")[0] == pytest.approx(rate["mtbf_s"], rel=1e-6), lines
