"""Smoke test of ``cf-ray bench``: the smallest configuration end to end, in one TorchTrainer run."""

import json

import pytest

from benchmarks import bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_smoke(tmp_path, capsys):
    import ray

    if ray.is_initialized():  # the bench starts its own local Ray with its own settings
        ray.shutdown()
    out = tmp_path / "bench"
    rc = bench.main(
        [
            "--quick",
            "--width",
            "64",
            "--layers",
            "2",
            "--batch",
            "4",
            "--iters",
            "6",
            "--warmup",
            "1",
            "--ks",
            "3",
            "--workers",
            "1",
            "--variants",
            "none,ray_sync,cf_fixed,cf_auto,floor_copy",
            "--no-recovery",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| variant | k |" in printed and "Machine limits" in printed and "Targets" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == bench.SCHEMA
    for key in ("meta", "config", "limits", "settings", "variants", "skipped", "recovery", "targets"):
        assert key in results
    assert len(results["meta"]["loadavg_start"]) == 3 and len(results["meta"]["loadavg_end"]) == 3
    assert results["limits"]["memcpy_gbps"] > 0 and results["limits"]["storage_write_fsync_gbps"] > 0
    auto = next(v for v in results["variants"] if v["variant"] == "cf_auto")
    k = auto["chosen_interval"]
    assert k >= 1
    # FixedInterval at Adaptive's k and k - 1 (none when k == 1), measured over whole periods.
    probes = {v["probe"]: v for v in results["variants"] if v.get("probe") is not None}
    assert probes[0]["k"] == k and (k == 1) == (-1 not in probes)
    assert probes[0]["iterations"] % k == 0 and probes[0]["checkpoints_taken"] >= 2
    assert {t["id"] for t in results["targets"]} >= {"auto_within_budget"} | ({"auto_shortest"} if k > 1 else set())
    ids = {v["id"] for v in results["variants"] if v.get("probe") is None}
    assert ids == {"w1/none", "w1/ray_sync/k3", "w1/cf_fixed/k3", "w1/cf_auto", "w1/floor_copy/k3"}, ids
    # The floor (#14): one copy of the state per checkpoint and nothing else, measured beside the others.
    floor = next(v for v in results["variants"] if v["variant"] == "floor_copy")
    assert floor["checkpoints_taken"] == 2 and floor["checkpoints_committed"] == 0 and floor["bytes_written"] == 0
    for v in results["variants"]:
        for key in (
            "iter_median_s",
            "iter_min_s",
            "iter_max_s",
            "overhead_pct",
            "stall_per_ckpt_s",
            "checkpoints_taken",
            "checkpoints_committed",
            "peak_rss_mb_per_worker",
            "bytes_written",
        ):
            assert key in v, (v["id"], key)
        if v.get("probe") is None:
            assert v["iterations"] == 6 * v["rounds"]
    cf = next(v for v in results["variants"] if v["variant"] == "cf_fixed")
    assert cf["checkpoints_taken"] == 2 and cf["checkpoints_committed"] >= 1 and cf["bytes_written"] > 0
    # #14: the copies are counted, not estimated: one copy of the state (into the holder's slot), no
    # second read to checksum, and the holder's memory for snapshots is its two slots.
    assert 0.95 <= cf["host_copied_x"] <= 1.2 and cf["host_crc_reread_x"] == 0, cf
    assert 0 < cf["held_bytes"] <= 2 * cf["state_bytes"] + (1 << 20), cf
    assert {"host_passes", "held", "memory"} <= {t["id"] for t in results["targets"]}
    ray_sync = next(v for v in results["variants"] if v["variant"] == "ray_sync")
    assert ray_sync["checkpoints_committed"] == 2 and ray_sync["stall_per_ckpt_s"] > 0
    assert (out / "results.md").exists()
    assert results["meta"]["plot"] is None or (out / "overhead.png").exists()
    assert bench.main(["--render-readme", str(out / "results.json")]) == 0
    assert "## Performance" in capsys.readouterr().out


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
    common += ["--iters", "4", "--warmup", "1", "--ks", "2", "--workers", "2", "--out", str(out)]
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
    assert cf["checkpoints_taken"] == 2 and cf["checkpoints_committed"] >= 1 and cf["bytes_written"] > 0
    assert dcp["checkpoints_committed"] == 2 and dcp["bytes_written"] > 0
    assert all(isinstance(v["overhead_pct"], float) for v in (cf, dcp))
    # Each of the 2 workers holds half of the sharded state (plus Adam's replicated step counters).
    assert cf["state_bytes"] / 2 <= cf["rank_state_bytes"] < 0.6 * cf["state_bytes"]
    (stall,) = [t for t in results["targets"] if t["id"] == "stall"]
    assert "state per worker" in stall["target"]
    (vs_dcp,) = [t for t in results["targets"] if t["id"] == "vs_dcp_async"]
    assert vs_dcp["target"].startswith("FSDP2: k=2:")


@pytest.mark.slow
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
