"""End to end, for real: a local Ray cluster, TorchTrainer with 2 CPU workers (gloo), SIGKILLs,
storage on local disk and on an S3 server on loopback, a storage that fails, damaged checkpoints."""

from __future__ import annotations

import glob
import json
import os
import random
import threading
import time

import pyarrow.fs as pafs
import pytest
import torch

import cf_ray
from benchmarks.soak import probes
from cf_ray import demo
from cf_ray._engine.format.catalog import list_committed, list_uncommitted, registered_steps
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import CHECKPOINTS, LATEST, MANIFEST, SHARED, rank_section, step_dir
from cf_ray._engine.format.sections import verify_all
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.load import open_run, resumable_checkpoint

pytestmark = pytest.mark.slow

# 202 samples over 2 ranks, batches of 8: 13 steps per epoch, 26 in all; checkpoint every 5.
SMALL = {"samples": 202, "epochs": 2, "batch_size": 8, "hidden": 64, "depth": 2, "interval": 5}
STEPS_PER_EPOCH = 13


def lineage(out_dir) -> dict[tuple[int, int], tuple[int, list[int]]]:
    """(rank, step) -> (epoch, ids) of the attempts that count: a later generation replaces an earlier one."""
    rec = {}
    files = glob.glob(os.path.join(out_dir, "ids_rank*_gen*.jsonl"))
    for f in sorted(files, key=lambda p: int(p.rsplit("gen", 1)[1].split(".")[0])):
        rank = int(os.path.basename(f).split("_")[1].removeprefix("rank"))
        for line in open(f):
            r = json.loads(line)
            rec[(rank, r["step"])] = (r["epoch"], r["ids"])
    return rec


def resumes(out_dir, rank=0) -> list[dict]:
    files = glob.glob(os.path.join(out_dir, f"resume_rank{rank}_gen*.json"))
    return sorted((json.load(open(f)) for f in files), key=lambda r: r["time"])


def result_of(out_dir, *, final_durable: bool | None = True) -> dict:
    """Rank 0's ``result.json`` of a demo run, its end checked (:func:`assert_final`) unless
    ``final_durable`` is ``None``."""
    with open(os.path.join(out_dir, "result.json")) as f:
        result = json.load(f)
    if final_durable is not None:
        assert_final(result, durable=final_durable)
    return result


def assert_final(result: dict, *, durable: bool = True) -> None:
    """What every run's end promises: ``finish()`` committed the final step (``durable``) or said it
    did not (a ``final_not_durable`` event), and the final model names that step, or the older one
    the event names, for ``resume_from=result.checkpoint``."""
    steps = result["steps"]
    not_durable = [e for e in result["events"] if e.get("event") == "final_not_durable"]
    if durable:
        assert not not_durable and steps in result["committed_steps"], (not_durable, result["committed_steps"])
        resume = steps
    else:
        assert not_durable and not_durable[-1]["step"] == steps, not_durable
        resume = not_durable[-1]["resume_step"]
    final = result.get("final_path")
    if final and os.path.isdir(final):  # local storage (an S3 run's events say it)
        with open(os.path.join(final, MANIFEST)) as f:
            assert json.load(f)["extra"]["resume_step"] == resume


def assert_exactly_once(rec, samples, epochs):
    for epoch in range(epochs):
        ids = [i for (e, batch) in rec.values() if e == epoch for i in batch]
        assert sorted(ids) == list(range(samples)), f"epoch {epoch}: not every sample exactly once"


def assert_resumed_from_memory_bitwise(out, reference, step: int) -> None:
    """The second attempt restored ``step`` from memory and the run ended bitwise equal to the
    uninterrupted ``reference``, with the same samples at every step, each once per epoch."""
    first, second = resumes(out)
    assert first["source"] == "fresh"
    assert second["source"] == "memory" and second["step"] == step, second
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt")
    rec = lineage(out)
    assert rec == lineage(reference)
    assert_exactly_once(rec, SMALL["samples"], SMALL["epochs"])
    result_of(out)  # the run ended durable, the final model naming its last step


def assert_recovery_split(storage_path: str, name: str, out) -> None:
    """The run's one restart has its recovery split into parts (#46): rebuild (Ray Train's new
    group, to rank 0's new process), set-up (to ``restore()``), restore and first step, each measured,
    together no more than the whole; and Ray Train polled its workers at the driver's interval (the
    one ``import cf_ray`` sets there unless it is set), as the restarted rank 0 reports it."""
    from cf_ray import report

    (row,) = report.read_run_restarts(storage_path, name).to_dict("records")
    parts = [row["rebuild_s"], row["setup_s"], row["restore_s"], row["first_step_s"]]
    assert all(p == p and p >= 0 for p in parts), row  # none missing (NaN), none negative
    assert row["rebuild_s"] + row["setup_s"] + row["first_step_s"] <= row["recovery_s"] + 1e-6, row
    restores = [e for e in result_of(out)["events"] if e.get("event") == "restore"]
    assert restores[-1]["health_check_s"] == float(os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]), restores


# ``reference``, the uninterrupted run every fault test compares with, is in conftest.py (once per session).


# Restore from storage is run on S3 (the same FsStorage code as local disk, whose commit and load
# round trip tests/test_storage.py covers on both; a third TorchTrainer run here cost ~35 s of CI).
@pytest.mark.parametrize("where, restore_from", [("local", "memory"), ("s3", "storage")])
def test_worker_sigkilled_at_a_random_step_resumes_bitwise_identical(
    ray_cluster, reference, tmp_path, request, where, restore_from
):
    kill_at = random.randint(6, 2 * STEPS_PER_EPOCH - 2)
    kwargs = {}
    if where == "s3":
        fs, bucket = request.getfixturevalue("s3_bucket")
        kwargs = {"storage_path": f"{bucket}/runs", "storage_filesystem": fs}
    cfg = dict(SMALL, kill_at=kill_at, restore_from=restore_from, kill_after_handoff=True)
    result = demo.run("killed", str(tmp_path), cfg, **kwargs)
    out = tmp_path / "out" / "killed"
    assert json.load(open(out / "killed"))["step"] == kill_at
    first, second = resumes(out)
    assert first["source"] == "fresh"
    assert second["source"] == restore_from, f"killed at {kill_at}, resumed {second}"
    last_ckpt = kill_at // SMALL["interval"] * SMALL["interval"]
    if restore_from == "memory":
        assert second["step"] == last_ckpt  # the snapshot taken before the kill, straight from memory
        assert_recovery_split(str(tmp_path / "storage"), "killed", out)  # where the restart's seconds went
    else:
        assert last_ckpt - SMALL["interval"] <= second["step"] <= last_ckpt
    # Bitwise: model and optimizer state equal those of the uninterrupted run.
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt"), f"killed at {kill_at}"
    rec, ref = lineage(out), lineage(reference)
    assert rec == ref  # the same samples in the same order at every step, every rank
    assert_exactly_once(rec, SMALL["samples"], SMALL["epochs"])
    result_of(out)  # the run ended durable, the final model naming its last step
    # Ray Train knows the run's result: the consolidated model, readable without the optimizer.
    assert result.checkpoint is not None and "final_" in result.checkpoint.path
    model = demo.build_model(dict(demo.DEFAULTS, **SMALL))
    assert cf_ray.load_into(result.checkpoint, {"model": model})
    final = torch.load(out / "final_state.pt", weights_only=True)["model"]
    assert all(torch.equal(v, final["module." + k]) for k, v in model.state_dict().items())


def test_a_worker_killed_mid_copy_resumes_from_the_previous_snapshot_in_memory_bitwise(
    ray_cluster, reference, tmp_path, monkeypatch
):
    """Rank 0 is SIGKILLed in the middle of copying step 10's snapshot into its slot: that
    slot (the model and optimizer, rank 0 saves them) reads as being filled and step 10 is never restored; the previous snapshot (step 5) is
    still whole in the other slots of the node's holder, and the run resumes from it, in place from
    memory, bitwise equal to the uninterrupted run, every sample once."""
    # The soak's mid-copy probe, installed in each worker before demo's loop starts, armed to
    # SIGKILL its own process after the first tensor of rank 0's copy of step 10 landed, once.
    import trust_faults

    control = str(tmp_path / "control")
    probes.arm(control, "mid_copy", {"fault": "midcopy", "rank": 0, "step": 10, "kill": True})
    monkeypatch.setattr(demo, "train_loop_per_worker", trust_faults.soak_probes_loop)
    cfg = dict(SMALL, restore_from="memory", env={probes.CONTROL_ENV: control})
    demo.run("midcopy", str(tmp_path), cfg)
    out = tmp_path / "out" / "midcopy"
    fired = probes.fired(control, "midcopy")
    assert fired is not None, "the mid-copy probe never fired"
    assert (fired["rank"], fired["step"]) == (0, 10), fired  # killed inside rank 0's copy of step 10
    assert fired["point"] == "after the first tensor of the deferred copy landed"
    assert_resumed_from_memory_bitwise(out, reference, 5)


def test_snapshots_held_in_memory_only_restore_bitwise_and_finish_persists_the_last_one(
    ray_cluster, reference, tmp_path
):
    """``FixedInterval(2, persist_every=3)``: of every three scheduled checkpoints one is written
    (the first of each attempt), the others are held in memory only. A SIGKILL after the memory-only
    snapshot of step 10 resumes from it (storage's newest is step 8), bitwise; the last checkpoint
    (step 26, memory-only) is taken again by ``finish()``, persisted, so the run ends durable."""
    cfg = dict(SMALL, interval=2, persist_every=3, kill_at=11, kill_after_handoff=True, keep_last=None)
    demo.run("memonly", str(tmp_path), cfg)
    out = tmp_path / "out" / "memonly"
    assert_resumed_from_memory_bitwise(out, reference, 10)
    result = result_of(out)
    # Attempt 1 persisted 2 and 8, attempt 2 12 (its first), 18, 24 and finish()'s 26; never a
    # memory-only one.
    storage = FsStorage(pafs.LocalFileSystem(), str(tmp_path / "storage" / "memonly" / "cf_ray"))
    committed = {c.step for c in list_committed(storage)}
    assert {2, 8, 12, 18, 24, 26} <= committed and not committed & {4, 6, 10, 16, 20, 22}, committed
    held = [r for r in result["profile"] if r.get("where") == "memory-only"]
    assert {r["step"] for r in held} >= {4, 6, 10, 14, 16, 20, 22}
    assert all(not r.get("error") for r in held)  # held by the schedule, not a failure
    assert result["failures"] == []


def test_fixed_interval_measures_which_snapshots_to_write_and_the_run_ends_durable(ray_cluster, tmp_path):
    """``FixedInterval(1)`` with the default ``persist_every=None``: every snapshot is written until
    the controller has measured two persists and the steps; a write here takes longer than 10 % of
    a step, so it then publishes a cadence above 1 (an ``interval`` event, explained as measured) and
    the ranks hold the snapshots in between in memory only (profile rows ``memory-only``, no error).
    ``finish()`` writes the last step, so the run ends durable. The ranks' step times reach the
    controller once a second (their polls), so the cadence is published about a second into the run:
    16 epochs (~5 s) leave most of the run after it."""
    cfg = dict(SMALL, epochs=16, interval=1, persist_every=None, step_sleep=0.02, keep_last=None)
    demo.run("measured", str(tmp_path), cfg)
    result = result_of(tmp_path / "out" / "measured")
    last = 16 * STEPS_PER_EPOCH
    assert result["steps"] == last and result["failures"] == []
    cadence = [e for e in result["events"] if e.get("event") == "interval" and (e.get("persist_every") or 1) > 1]
    assert cadence, [e for e in result["events"] if e.get("event") == "interval"]
    assert cadence[0]["why"]["persist"]["binding"] == "measured"
    held = {r["step"] for r in result["profile"] if r.get("where") == "memory-only" and not r.get("error")}
    storage = FsStorage(pafs.LocalFileSystem(), str(tmp_path / "storage" / "measured" / "cf_ray"))
    committed = {c.step for c in list_committed(storage)}
    assert held and not held & committed - {last}, (held, committed)
    assert last in committed and len(committed) < last / 2, committed
    # every snapshot before the cadence was measured was written
    assert {1, 2} <= committed


def test_failed_persist_never_fails_training(ray_cluster, tmp_path):
    from faulty_fs import FaultyHandler

    ckpts = tmp_path / "ckpts"
    fs = pafs.PyFileSystem(FaultyHandler(from_step=15))
    cfg = dict(SMALL, keep_last=None, storage_path=str(ckpts), storage_filesystem=fs)
    demo.run("faulty", str(tmp_path), cfg)
    out = tmp_path / "out" / "faulty"
    result = result_of(out, final_durable=False)  # the final model names step 10 (its own write fails too)
    assert result["steps"] == 2 * STEPS_PER_EPOCH  # training finished
    failed = [(f["step"], f["section"]) for f in result["failures"]]
    assert failed and len(failed) == len(set(failed))  # surfaced, each failure once
    assert {s for s, _ in failed} >= {15, 20, 25}
    storage = FsStorage(pafs.LocalFileSystem(), str(ckpts / "faulty" / "cf_ray"))
    assert [c.step for c in list_committed(storage)] == [5, 10]  # the previous checkpoint stays the latest
    assert bytes(storage.read_file(LATEST)).decode() == "step_000000000010"
    assert cf_ray.load_state(str(ckpts / "faulty"), objects=["model"])["model"]


def test_damaged_newest_checkpoints_are_skipped_on_restore(ray_cluster, tmp_path):
    cfg = dict(SMALL, keep_last=None, step_sleep=0.05)
    demo.run("damaged", str(tmp_path), cfg)
    root = tmp_path / "storage" / "damaged" / "cf_ray"
    storage = FsStorage(pafs.LocalFileSystem(), str(root))
    committed = [c.step for c in list_committed(storage)]
    # Snapshots that storage could not keep up with may be skipped; the newest one never is: the
    # final state's, which finish() takes at step 26 (#16: result.checkpoint resumes from it).
    assert len(committed) >= 3 and committed[-1] == 26 and 25 in committed, committed
    newest, second, third = committed[-1], committed[-2], committed[-3]
    m1, m2 = read_manifest(storage, step_dir(newest)), read_manifest(storage, step_dir(second))
    path = root / step_dir(newest) / m1.sections[SHARED]["data"]
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40  # one flipped bit
    path.write_bytes(bytes(data))
    path = root / step_dir(second) / m2.sections[rank_section(1)]["index"]
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    demo.run("damaged", str(tmp_path), dict(cfg, epochs=3, restore_from="storage"))
    out = tmp_path / "out" / "damaged"
    for rank in (0, 1):
        latest = resumes(out, rank)[-1]
        assert (latest["source"], latest["step"]) == ("storage", third)
    fallbacks = [e for e in result_of(out)["events"] if e["event"] == "restore_fallback"]
    assert [e["where"].split("/")[-1] for e in fallbacks] == [f"step_{newest:012d}", f"step_{second:012d}"]


def test_keep_last_and_milestones_while_training(ray_cluster, tmp_path):
    storage = FsStorage(pafs.LocalFileSystem(), str(tmp_path / "storage" / "keep" / "cf_ray"))
    seen: list[list[int]] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                seen.append([c.step for c in list_committed(storage)])
            except Exception:  # noqa: BLE001 - the directory may not exist yet
                pass
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        demo.run("keep", str(tmp_path), dict(SMALL, interval=1, keep_last=2, milestone_every=10))
    finally:
        done.set()
        t.join()
    first = next(i for i, s in enumerate(seen) if s)
    assert all(seen[first:]), "there was a moment with no committed checkpoint"
    final = [c.step for c in list_committed(storage)]
    assert {10, 20} <= set(final)  # milestones are never deleted
    listed = registered_steps(storage)  # registered with Ray Train (at most every 10 s): spared while listed
    ordinary = [s for s in final if s not in (10, 20) and s not in listed]
    assert len(ordinary) <= 2 and max(final) == 2 * STEPS_PER_EPOCH
    assert not list_uncommitted(storage) or all(s > max(final) for _, s in list_uncommitted(storage))


def test_registered_with_ray_and_a_new_run_resumes_from_one_of_them(ray_cluster, tmp_path):
    """``keep_last=1`` and a registration at every chance: every checkpoint Ray Train hands back in
    ``result.best_checkpoints`` loads, although keep-last keeps one ordinary checkpoint (a step
    registered during the loop used to be deleted by it, its pointer naming a checkpoint that was
    gone), and a new run resumes from the oldest of them."""
    cfg = dict(SMALL, step_sleep=0.05, keep_last=1, env={"CF_RAY_REGISTER_INTERVAL_S": "0"})
    result = demo.run("registered", str(tmp_path), cfg)
    assert result.checkpoint.path.endswith("final_000000000026")
    registered = [c for c, _ in result.best_checkpoints if "/registered/step_" in c.path]
    assert registered, "no intermediate checkpoint was registered with Ray Train"
    for listed in registered:  # each one Ray lists loads: its manifest and every file, verified
        storage, directory = open_run(listed)
        verify_all(storage, directory, read_manifest(storage, directory))
    chosen = registered[0]  # older than finish()'s step 26, the one ordinary checkpoint keep_last=1 keeps
    storage, directory = open_run(chosen)
    step = int(directory.rsplit("_", 1)[1])
    assert step < 2 * STEPS_PER_EPOCH
    # Ray Train v2 refuses TorchTrainer(resume_from_checkpoint=...); the checkpoint goes in the config.
    demo.run("continued", str(tmp_path), dict(SMALL, epochs=3, resume_from=chosen))
    first = resumes(tmp_path / "out" / "continued")[0]
    assert (first["source"], first["step"]) == ("storage", step)


def test_upload_tier_serves_the_restore_when_the_primary_is_lost(ray_cluster, tmp_path, s3_bucket):
    fs, bucket = s3_bucket
    cfg = dict(SMALL, epochs=1, step_sleep=0.05, upload_path=f"{bucket}/archive", upload_filesystem=fs)
    demo.run("tiered", str(tmp_path), cfg)
    primary = FsStorage(pafs.LocalFileSystem(), str(tmp_path / "storage" / "tiered" / "cf_ray"))
    tier = FsStorage(fs, f"{bucket}/archive/tiered/cf_ray")
    in_tier = [c.step for c in list_committed(tier)]
    assert in_tier and in_tier == [c.step for c in list_committed(primary)]  # every commit is mirrored
    for c in list_committed(tier):
        verify_all(tier, c.path, read_manifest(tier, c.path))  # with its own manifest, verified
    import shutil

    for d in (tmp_path / "storage" / "tiered" / "cf_ray" / CHECKPOINTS).glob("step_*"):
        shutil.rmtree(d)  # the local copies are lost
    demo.run("tiered", str(tmp_path), dict(cfg, epochs=2, restore_from="storage"))
    latest = resumes(tmp_path / "out" / "tiered")[-1]
    assert (latest["source"], latest["step"]) == ("storage", in_tier[-1])


def test_resume_from_the_result_checkpoint_continues_bitwise_and_a_bad_one_raises_before_training(
    ray_cluster, reference, tmp_path
):
    first = demo.run("first", str(tmp_path), dict(SMALL, epochs=1))
    assert first.checkpoint.path.endswith(f"final_{STEPS_PER_EPOCH:012d}")  # the final model ...
    _, directory = resumable_checkpoint(first.checkpoint)  # ... names the full checkpoint
    assert directory == step_dir(STEPS_PER_EPOCH)
    # A new run from the first one's result goes on with epoch 1 as if it had never stopped.
    demo.run("second", str(tmp_path), dict(SMALL, resume_from=first.checkpoint))
    out = tmp_path / "out" / "second"
    (resumed,) = resumes(out)
    assert (resumed["source"], resumed["step"], resumed["epoch"]) == ("storage", STEPS_PER_EPOCH, 1)
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt")  # model and optimizer, bitwise
    assert {**lineage(tmp_path / "out" / "first"), **lineage(out)} == lineage(reference)
    bad = str(tmp_path / "no_such_run")
    with pytest.raises(Exception, match="no_such_run.*holds no cf_ray checkpoint"):
        demo.run("bad", str(tmp_path), dict(SMALL, resume_from=bad), max_failures=0)
    assert not glob.glob(str(tmp_path / "out" / "bad" / "ids_*"))  # raised before training
