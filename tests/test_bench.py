"""Smoke test of ``cf-ray bench``: the smallest configuration end to end, in one TorchTrainer run."""

import json

import pytest

from benchmarks import bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_smoke(tmp_path, capsys):
    """The smallest interleaved run: two rounds of every variant, each against the baseline of its time,
    each overhead with its interval, cf_ray's per-checkpoint breakdown and its actors' CPU, verdicts."""
    import ray

    if ray.is_initialized():  # the bench starts its own local Ray with its own settings
        ray.shutdown()
    out = tmp_path / "bench"
    args = ["--quick", "--width", "64", "--layers", "2", "--batch", "4", "--iters", "6", "--warmup", "1"]
    args += ["--warmup-s", "0", "--ks", "3", "--workers", "1", "--rounds", "2", "--no-recovery", "--out", str(out)]
    rc = bench.main([*args, "--variants", "none,ray_sync,cf_fixed,floor_copy"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| variant | k |" in printed and "Machine limits" in printed and "Targets" in printed
    assert "**drift**" in printed and "time per checkpoint" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == bench.SCHEMA
    for key in ("meta", "config", "limits", "settings", "variants", "skipped", "recovery", "targets"):
        assert key in results
    assert len(results["meta"]["loadavg_start"]) == 3 and len(results["meta"]["loadavg_end"]) == 3
    assert results["limits"]["memcpy_gbps"] > 0 and results["limits"]["storage_write_fsync_gbps"] > 0
    assert results["limits"]["memcpy_gbps_during_direct_write"] > 0  # what the holder's O_DIRECT writes leave
    (setting,) = results["settings"]
    # A baseline opens each round and one closes the run: three of them, their drift reported.
    assert len(setting["baseline_segment_means_s"]) == 3 and setting["baseline_drift_pct"] is not None
    assert setting["baseline_noise_pct"] is not None
    by = {v["id"]: v for v in results["variants"]}
    assert set(by) == {"w1/none", "w1/ray_sync/k3", "w1/cf_fixed/k3", "w1/floor_copy/k3"}, set(by)
    for v in by.values():
        for key in ("iter_mean_s", "overhead_pct", "stall_per_ckpt_s", "checkpoints_taken", "peak_rss_mb_per_worker"):
            assert key in v, (v["id"], key)
        if v["variant"] == "none":
            continue
        # One overhead per round, and their interval; windows of whole periods after a lead-in.
        assert set(v["overhead_pct_per_round"]) == {"0", "1"}, v["id"]
        iv = v["overhead_interval"]
        assert iv["n"] == 2 and iv["lo"] <= v["overhead_pct"] <= iv["hi"] and iv["method"] == "t95"
        # The lead-in takes two checkpoints, so that the window never fills a snapshot slot for the first time.
        assert v["iterations"] == 2 * 6 and v["checkpoints_window"] == 2 * 2 and v["lead_iterations"] == 6, v
    # The floor (#14): one copy of the state per checkpoint and nothing else, measured beside the others.
    floor = by["w1/floor_copy/k3"]
    assert floor["checkpoints_committed"] == 0 and floor["bytes_written"] == 0
    cf = by["w1/cf_fixed/k3"]
    # Each segment's Checkpointer: 2 checkpoints in the lead-in, 2 in the window.
    assert cf["checkpoints_taken"] == 2 * 4 and cf["checkpoints_committed"] >= 2 and cf["bytes_written"] > 0
    # #14: the copies are counted, not estimated: one copy of the state (into the holder's slot), one
    # read of it in the holder to check the bytes it wrote against the worker's block CRCs (#23: a bit
    # that changed in its memory is never committed), and the holder's memory is its two slots.
    assert 0.95 <= cf["host_copied_x"] <= 1.2 and 0.95 <= cf["host_crc_reread_x"] <= 1.2, cf
    assert 0 < cf["held_bytes"] <= 2 * cf["state_bytes"] + (1 << 20), cf
    # #25: where each checkpoint's CPU goes, on the worker's two threads, and in the holder and controller.
    parts = cf["cpu_breakdown"]
    for part in ("copy", "crc", "handoff", "index", "agreement", "policy", "begin", "poll", "timing"):
        assert parts[part]["cpu_ms_per_ckpt"] >= 0 and parts[part]["wall_ms_per_ckpt"] >= 0, (part, parts)
    assert parts["copy"]["thread"] == "snapshot" and parts["begin"]["thread"] == "training"
    assert parts["total"]["cpu_ms_per_ckpt"] > 0
    assert cf["holder_cpu_ms_per_ckpt"] > 0 and cf["controller_cpu_ms_per_ckpt"] > 0
    assert cf["holder_cpu_ms_per_iter"] >= 0 and cf["cf_actors_cpu_ms_per_iter"] >= 0
    ray_sync = by["w1/ray_sync/k3"]
    assert ray_sync["checkpoints_committed"] == 2 * 4 and ray_sync["stall_per_ckpt_s"] > 0
    ids = {t["id"] for t in results["targets"]}
    assert {"drift", "vs_ray_sync", "host_passes", "held", "memory"} <= ids, ids
    assert all(t["verdict"] in ("met", "missed", "within noise", "n/a") for t in results["targets"])
    # Two snapshots in the holder's slots, with their header pages, meet the bound of two snapshots.
    assert [t["verdict"] for t in results["targets"] if t["id"] == "held"] == ["met"], results["targets"]
    assert (out / "results.md").exists()
    assert results["meta"]["plot"] is None or (out / "overhead.png").exists()
    assert bench.main(["--render-readme", str(out / "results.json")]) == 0
    assert "## Performance" in capsys.readouterr().out


@pytest.mark.nightly
@pytest.mark.timeout(600)
def test_bench_adaptive_and_its_probes(tmp_path):
    """cf_auto and the FixedInterval probes at the interval Adaptive chose and one less (one variant
    each over rounds, whatever k each round's Adaptive chose), judged against the budget."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "bench"
    args = ["--quick", "--width", "64", "--layers", "2", "--batch", "4", "--iters", "6", "--warmup", "1"]
    args += ["--warmup-s", "0", "--ks", "3", "--workers", "1", "--rounds", "2", "--no-recovery", "--out", str(out)]
    assert bench.main([*args, "--variants", "none,cf_auto"]) == 0
    results = json.loads((out / "results.json").read_text())
    by = {v["id"]: v for v in results["variants"]}
    auto = by["w1/cf_auto"]
    k = auto["chosen_interval"]
    assert k >= 1 and len(auto["chosen_intervals"]) == 2
    probes = {v["probe"]: v for v in results["variants"] if v.get("probe") is not None}
    assert probes[0]["k"] == k and (k == 1) == (-1 not in probes)
    assert set(probes[0]["k_per_round"]) == {"0", "1"}
    assert probes[0]["checkpoints_window"] >= 2
    ids = {t["id"] for t in results["targets"]}
    assert {"auto_overhead", "auto_within_budget"} | ({"auto_shortest"} if k > 1 else set()) <= ids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_user_loop(tmp_path, capsys):
    """``--user-loop``: one TorchTrainer fit per variant and round, each round's overhead against
    that round's baseline fit and their interval; cf_ray's breakdown and its actors' CPU."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "bench"
    args = ["--user-loop", "--quick", "--width", "64", "--layers", "2", "--batch", "4", "--iters", "10"]
    args += ["--ks", "2", "--workers", "1", "--rounds", "2", "--variants", "none,cf_fixed,cf_held,floor_copy"]
    assert bench.main([*args, "--out", str(out), "--held-persist-every", "1"]) == 0
    assert "| per round (against that round's baseline) | 95 % interval" in capsys.readouterr().out
    res = json.loads((out / "results-user-loop.json").read_text())
    assert [r["error"] for r in res["runs"]] == [None] * 8
    rows = {r["variant"]: r for r in res["table"]}
    assert set(rows) == {"none", "cf_fixed", "cf_held", "floor_copy"}
    assert len(rows["floor_copy"]["overhead_pct_rounds"]) == 2  # the floor, in the same loop and rounds
    assert all(0 < r["train_thread_cpu_ms_per_iter"] <= r["worker_cpu_ms_per_iter"] for r in rows.values())
    for v in ("cf_fixed", "cf_held"):
        r = rows[v]
        assert len(r["overhead_pct_rounds"]) == 2 and r["overhead_interval"]["method"] == "t95"
        assert r["holder_cpu_ms_per_iter"] > 0 and r["budget_wall_ms_per_iter"]["copy"] > 0
    assert rows["cf_held"]["persist_every_last"] == [1, 1]  # --held-persist-every 1: every snapshot written
    # A cadence set by hand is never published again; the measured one is recorded as published (if ever).
    assert all(x["persist_every"] == [] for x in res["runs"] if x["variant"] == "cf_held")
    assert all(isinstance(x["persist_every"], list) for x in res["runs"] if x["variant"] == "cf_fixed")
    cf_runs = [x for x in res["runs"] if x["variant"].startswith("cf_")]
    assert all(x["checkpoints_taken"] == 5 and x["save_failures"] == 0 and x["committed_steps"] for x in cf_runs)
    assert not list((out / "work").glob("user-*/cf_ray/step_*"))  # each fit's checkpoints removed after it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_fsdp2_job(tmp_path, capsys):
    """The FSDP2 reference job (#13): cf_ray against DCP async_save on the same sharded model, in one
    run; Ray's own (DDP) variants are refused for it, saying so."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "bench"
    common = ["--quick", "--parallel", "fsdp2", "--width", "64", "--layers", "2", "--batch", "4"]
    common += ["--iters", "4", "--warmup", "1", "--warmup-s", "0", "--ks", "2", "--workers", "2", "--rounds", "1"]
    common += ["--out", str(out)]
    with pytest.raises(SystemExit, match="drop them from --variants"):
        bench.main([*common, "--variants", "none,ray_sync,cf_fixed"])
    assert bench.main([*common, "--variants", "none,dcp_async,cf_fixed"]) == 0
    printed = capsys.readouterr().out
    assert "Model (FSDP2" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["parallel"] == "fsdp2"
    by = {v["id"]: v for v in results["variants"]}
    assert set(by) == {"w2/none", "w2/dcp_async/k2", "w2/cf_fixed/k2"}, set(by)
    cf, dcp = by["w2/cf_fixed/k2"], by["w2/dcp_async/k2"]
    # The lead-in (4 iterations at k=2: 2 checkpoints) and the window (4 iterations: 2 more).
    assert cf["checkpoints_taken"] == 4 and cf["checkpoints_committed"] >= 1 and cf["bytes_written"] > 0
    assert cf["checkpoints_window"] == 2 and cf["cpu_breakdown"]["copy"]["cpu_ms_per_ckpt"] >= 0
    assert dcp["checkpoints_committed"] == 4 and dcp["bytes_written"] > 0
    assert all(isinstance(v["overhead_pct"], float) for v in (cf, dcp))
    # Each of the 2 workers holds half of the sharded state (plus Adam's replicated step counters).
    assert cf["state_bytes"] / 2 <= cf["rank_state_bytes"] < 0.6 * cf["state_bytes"]
    (stall,) = [t for t in results["targets"] if t["id"] == "stall"]
    assert "state per worker" in stall["target"]
    (vs_dcp,) = [t for t in results["targets"] if t["id"] == "vs_dcp_async"]
    assert vs_dcp["target"].startswith("FSDP2: k=2:")


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.timeout(900)
def test_bench_cluster_jobs(tmp_path, capsys):
    """``cf-ray bench --cluster`` (#12) at the smallest sizes, on its own test cluster (a 0-CPU head
    and two 1-CPU nodes): the node loss restores from a peer's memory with ``replicas=1`` and from
    storage with ``replicas=0``, both at the newest checkpoint; a real drain (reason preemption) costs
    Ray's periodic checkpointing the steps since its last checkpoint and cf_ray none; replicas=1
    copies bytes to the other node and replicas=0 none. Ray's JIT arm runs in the full benchmark."""
    import ray

    if ray.is_initialized():  # the bench starts its own cluster, with its own settings
        ray.shutdown()
    out = tmp_path / "bench"
    args = ["--cluster", "--quick", "--large-width", "128", "--large-layers", "2", "--rec-every", "4"]
    args += ["--width", "32", "--layers", "2", "--batch", "4", "--iters", "6", "--interval", "3"]
    args += ["--preemptions", "1", "--preempt-interval", "10", "--grace", "5", "--step-s", "0.1"]
    args += ["--arms", "ray_periodic,cf_ray", "--out", str(out)]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "Node loss" in printed and "Preemptions with notices" in printed and "cost of replication" in printed
    res = json.loads((out / "results-cluster.json").read_text())
    assert res["schema"] == "cf_ray.bench.cluster/1"

    rec = res["recovery"]
    for arm, source in (("memory", "memory"), ("storage", "storage")):
        r = rec[arm]
        assert "error" not in r, r
        assert r["resume_source"] == [source], r
        assert r["resume_step"] == r["checkpoint_step"] == 8 and r["iterations_lost"] == 2, r
        assert 0 < r["restore_s"] < r["kill_to_first_iteration_s"], r
    assert rec["restore_speedup"] > 0
    # Each loss is cut into its parts (the controller's callback and the ranks' timestamps), in order.
    assert rec["parts"][0] == "detect" and len(rec["losses"]) == 2, rec
    for loss in rec["losses"]:
        parts = loss["parts"]
        assert parts and set(parts) == set(rec["parts"]) and parts["detect"] > 0, loss
        assert sum(parts.values()) == pytest.approx(loss["kill_to_first_iteration_s"], abs=0.05), loss
    # The rank restarted on the replacement node streamed its bytes from the surviving node's holder.
    assert any((b or {}).get("direct") for b in rec["memory"]["read_bytes_by_rank"].values()), rec["memory"]
    assert all(set(b or {}) == {"storage"} for b in rec["storage"]["read_bytes_by_rank"].values()), rec["storage"]
    assert rec["transfer"]["transfer_gbps"] > 0, rec["transfer"]  # Ray's own node-to-node transfer, for reference

    pre = res["preemption"]
    (at,) = pre["notice_steps"]
    periodic, cf = pre["arms"]["ray_periodic"], pre["arms"]["cf_ray"]
    for r in (periodic, cf):
        assert r["completed"] and r["num_attempts"] == 2 and r["executed_steps"] >= pre["target_steps"], r
    # Ray's periodic way resumes from its last periodic checkpoint, whatever it trained since is redone.
    assert periodic["resumed_from_steps"][0] == 0 and periodic["resumed_from_steps"][1] % 10 == 0, periodic
    (jit_step,) = cf["jit_checkpoints"]
    assert cf["jit_made_deadline"] == [True] and cf["resumed_from_steps"] == [0, jit_step] and jit_step >= at, cf
    assert cf["wasted_steps"] <= min(1, periodic["wasted_steps"]), (cf, periodic)
    assert {t["id"] for t in res["targets"]} >= {"node_loss_restore_speedup", "preempt_cf_ray_vs_periodic"}

    segs = {s["segment"]: s for s in res["replication"]["segments"]}
    assert set(segs) == {"none-a", "cf-replicas0", "cf-replicas1", "cf-replicas1-every4", "none-b"}
    assert segs["cf-replicas1"]["replica_bytes"] > 0 and segs["cf-replicas0"]["replica_bytes"] == 0
    assert segs["cf-replicas1"]["checkpoints_committed"] >= 1
