"""``cf-ray bench --budgets`` (issue #45): the verdicts from the runs' figures, in process, and the
smallest run end to end."""

import json

import pytest

from benchmarks import bench, budget_run


def _run(shape, arm, budget, rnd, times, interval=None, measured=None, profile=None, **kw):
    rec = {"shape": shape, "arm": arm, "budget": budget, "round": rnd, "iter_s": times, "warmup": 2, **kw}
    if interval is not None:
        rec["explain"] = {"interval": interval, "measured_overhead_pct": measured, "iter_s": times[-1]}
        rec["profile_overhead_pct"] = profile
    return rec


def test_the_verdicts_judge_every_run():
    opts = {"shapes": ["mlp5"], "budgets": [5.0, 20.0]}
    base = [0.1] * 20
    runs = []
    for r, (k5, k20) in enumerate([(20, 4), (24, 5)]):
        runs.append(_run("mlp5", "none", None, r, base))
        runs.append(_run("mlp5", "b5", 5.0, r, [0.104] * 20, k5, 4.0, 4.0))
        runs.append(_run("mlp5", "b20", 20.0, r, [0.115] * 20, k20, 15.0, 15.0))
        runs.append(_run("mlp5", "prior", 5.0, r, [0.104] * 20, 60, 4.0, 4.0, prior=True, kills=False))
        runs.append(_run("mlp5", "prior_kills", 5.0, r, [0.104] * 5, 30 + r * 40, 4.0, 4.0, prior=True, kills=True))
    # cf_ray attached without a checkpoint: its overhead against the round's baseline, beside the
    # verdicts and in none of them (round 0 +3 %, round 1 +5 %).
    runs += [_run("mlp5", "idle", None, r, [0.1 + 0.003 + 0.002 * r] * 20, idle=True) for r in range(2)]
    res = budget_run.judge(runs, opts)
    assert res["attached_no_checkpoint"]["mlp5"]["after_warmup_pct"] == pytest.approx([3.0, 5.0])
    assert res["attached_no_checkpoint"]["mlp5"]["mean_pct"] == pytest.approx(4.0)
    assert all(t["arm"] != "idle" for t in res["table"])
    assert "without a checkpoint, mlp5: +4.0 %" in budget_run.render({**res, "workers": 2, "rounds": 2, "cpu": []})
    # Against the attached fit instead (the checkpoints' own cost): budget 5 at +1.0 and -1.0 %,
    # budget 20 at +11.7 and +9.5 %, all within budget x 1.2; the reported 4 and 15 % are more than
    # 3 points off all four (3.03, 3.35, 4.95, 5.48): missed.
    v = res["verdicts"]["against_attached_no_checkpoint"]
    assert v["of"] == 4 and v["within_budget_x1.2"] == 4 and v["reported_within_3_points"] == 0 and not v["met"]
    expected = [100 * (a / b - 1) for b in (0.103, 0.105) for a in (0.104, 0.115)]
    assert [r[3] for r in v["runs"]] == pytest.approx(expected)
    v = res["verdicts"]
    assert v["overhead_within_budget_x1.2"]["met"]
    assert v["interval_monotone_in_budget"]["met"]
    assert v["interval_spread_within_x1.5"]["met"]
    assert v["reported_overhead_within_3_points"]["met"]
    # Round 1's kills left the interval longer (70 > 60): missed, and the rounds say which.
    assert not v["interval_shorter_after_kills"]["met"]
    assert [x[5] for x in v["interval_shorter_after_kills"]["rounds"]] == [True, False]
    # One run over budget x 1.2, or an interval not monotone, is a miss.
    runs[2]["iter_s"] = [0.125] * 20  # round 0, budget 20: +25 %
    runs[1]["explain"]["interval"] = 3  # round 0: budget 5 shorter than budget 20
    v = budget_run.judge(runs, opts)["verdicts"]
    assert not v["overhead_within_budget_x1.2"]["met"] and not v["interval_monotone_in_budget"]["met"]
    assert not v["interval_spread_within_x1.5"]["met"]  # 3 against 24


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_budgets_smoke(tmp_path, capsys):
    """The smallest run: one round, one budget and cf_ray attached without a checkpoint, the small
    shape, no kills."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "bench"
    args = ["--quick", "--budgets", "--budget-rounds", "1", "--budget-list", "20", "--budget-no-kills"]
    assert bench.main([*args, "--budget-idle-arm", "--iters", "80", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "The automatic interval against its budget" in printed and "overhead_within_budget_x1.2" in printed
    res = json.loads((out / "results-budgets.json").read_text())
    assert not res["errors"], res["errors"]
    assert res["complete"] and res["fits_done"] == 3
    # Attached without a checkpoint: cf_ray's actors ran, no checkpoint was taken, and its overhead
    # against the round's baseline is reported beside the verdicts.
    idle = next(x for x in res["runs"] if x["arm"] == "idle")
    assert idle["checkpoints_taken"] == 0 and "ray::Controller" in idle["cpu_s_by_process"]
    assert res["attached_no_checkpoint"]["mlp5"]["mean_pct"] is not None
    assert "cf_ray attached without a checkpoint, mlp5" in printed
    # The CPU each fit's processes used: the training workers', and cf_ray's actors only where
    # cf_ray ran (every iteration pays for CPU taken from the cores that train).
    none, b20 = (next(c for c in res["cpu"] if c["fit"].endswith(arm)) for arm in ("-none", "-b20"))
    assert none["training_cpu_s"] > 0 and b20["training_cpu_s"] > 0
    assert "ray::Controller" in b20["cpu_s_by_process"] and "ray::Controller" not in none["cpu_s_by_process"]
    assert b20["cf_ray_actors_pct_of_core"] > 0 and none["cf_ray_actors_pct_of_core"] == 0
    # Every checkpoint's profile row is kept with the fit (its step and timings, checkpoint by
    # checkpoint). On a busy machine a rank may skip a snapshot (no free slot in time): its step
    # still has a row (failed), so only the committed rows are bounded by what rank 0 took.
    b20_run = next(x for x in res["runs"] if x["arm"] == "b20")
    rows = b20_run["profile_rows"]
    assert rows and all("step" in r for r in rows)
    assert 0 < sum(bool(r["committed"]) for r in rows) <= b20_run["checkpoints_taken"]
    (row,) = res["table"]
    assert row["shape"] == "mlp5" and row["budget"] == 20.0 and row["interval"] >= 1
    # 80 iterations may end before the policy has timed a clean sample: the figure may be missing
    # (None), never made up.
    assert row["overhead_run_pct"] is not None and "measured_overhead_pct" in row
    assert set(res["verdicts"]) >= {"overhead_within_budget_x1.2", "reported_overhead_within_3_points"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_stopped_part_way_keeps_the_fits_it_measured(tmp_path, monkeypatch):
    """A benchmark of many minutes stopped by a time limit (here: interrupted at its second fit)
    leaves its JSON with what the fits before measured, marked incomplete."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    real, calls = bench._fit, []

    def fit(*a, **kw):
        calls.append(a[3])
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a time limit's SIGINT raises in the driver
        return real(*a, **kw)

    monkeypatch.setattr(bench, "_fit", fit)
    out = tmp_path / "bench"
    args = ["--quick", "--budgets", "--budget-rounds", "1", "--budget-list", "20", "--budget-no-kills"]
    with pytest.raises(KeyboardInterrupt):
        bench.main([*args, "--iters", "60", "--out", str(out)])
    res = json.loads((out / "results-budgets.json").read_text())
    assert not res["complete"] and res["fits_done"] == 1 and calls == ["budget-r0-mlp5-none", "budget-r0-mlp5-b20"]
    assert res["meta"]["argv"][:2] == ["--quick", "--budgets"]
