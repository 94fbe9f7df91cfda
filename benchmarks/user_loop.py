"""``cf-ray bench --user-loop``: the cross-check of issue #25, a user's loop measured as a new user
would, beside the benchmark's interleaved segments.

Each (variant, k) is its own ``TorchTrainer.fit()`` in one Ray session (one variant per fit, the
order rotated over ``--rounds``): ``6 x Linear(2048)`` + Adam (302 MB of state), one torch thread per
worker, 80 iterations of which the first 5 are dropped, the mean iteration time of the loop,
``finish()`` not counted, ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.05``. Variants:

  ``none``       no checkpointing;
  ``ray_sync``   rank 0 ``torch.save`` + ``ray.train.report`` (SYNC), as the benchmark's;
  ``ray_async``  the same with ``CheckpointUploadMode.ASYNC``;
  ``cf_fixed``   ``Checkpointer(..., CheckpointConfig(policy=FixedInterval(k)))``: every other field
                 at its default (keep_last=3, register_with_ray=True, final_model="model"; the persist
                 cadence measured, ``persist_every=None``);
  ``cf_bench``   the same with the benchmark's settings (keep_last=2, register_with_ray=False,
                 final_model=None): what the segments measure;
  ``cf_held``    ``cf_fixed`` with ``FixedInterval(k, persist_every=--held-persist-every)``: one
                 snapshot in that many written, the others held in memory only (1: every one).
  ``floor_copy`` every k iterations one copy of the state into a host buffer on a thread, waited for
                 before the next optimizer step, and nothing else (``savers._CopyFloor``, set up
                 after the first iteration, when Adam's state exists): the floor of any checkpoint
                 that snapshots to host memory, in the same loop.

Beside the issue's figure (the mean of iterations 6-80) it reports the mean of the *second half*
(iterations 41-80, after the start-up transients) and of iterations 6-20, each iteration's time, the
holder's and controller's CPU over the loop, and the worker's checkpoint-path budget: so where a
difference between the two measurements comes from shows.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import stats
from benchmarks.savers import _barrier, _CopyFloor, _RaySave, _seeded_job, _write_json

VARIANTS = ("none", "ray_sync", "ray_async", "cf_fixed", "cf_bench", "cf_held", "floor_copy")


def _loop(cfg: dict) -> None:
    """``train_loop_per_worker`` of one fit: the user's loop, timed."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    import cf_ray

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    model, opt, x, y = _seeded_job(cfg, rank)
    variant, k = cfg["variant"], cfg["k"]
    ckpt = saver = floor = None
    t_setup = time.perf_counter()
    if variant in ("cf_fixed", "cf_bench", "cf_held"):
        policy = cf_ray.FixedInterval(
            every=k, persist_every=cfg["held_persist_every"] if variant == "cf_held" else None
        )
        conf = (
            cf_ray.CheckpointConfig(policy=policy, keep_last=2, register_with_ray=False, final_model=None)
            if variant == "cf_bench"
            else cf_ray.CheckpointConfig(policy=policy)
        )
        ckpt = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=conf)
        ckpt.restore()
    elif variant in ("ray_sync", "ray_async"):
        saver = _RaySave(variant.split("_")[1], k, model, opt, rank, cfg["name"])
    setup_s = time.perf_counter() - t_setup

    def actors() -> dict | None:
        if ckpt is None or rank != 0:
            return None
        import ray

        from benchmarks.savers import _actor_cpu

        try:
            h, c = ray.get([a.__ray_call__.remote(_actor_cpu) for a in (ckpt.holder, ckpt.controller)], timeout=60)
            return {"holder": h, "controller": c}
        except Exception:  # noqa: BLE001 - a figure we can live without
            return None

    a0 = actors()
    times = []
    cpu0, thread0 = time.process_time(), time.thread_time()
    t_loop = time.perf_counter()
    for i in range(1, cfg["iters"] + 1):
        t0 = time.perf_counter()
        F.mse_loss(model(x), y).backward()
        if ckpt is not None:
            ckpt.step(opt)
        else:
            if floor is not None:
                floor.guard()
            opt.step()
        opt.zero_grad()
        if saver is not None and saver.due(i):
            saver.save(i)
        if variant == "floor_copy" and floor is None:  # iteration 1 (dropped): Adam's state exists now
            floor = saver = _CopyFloor(k, model, opt)
        times.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_loop
    cpu_s, thread_s = time.process_time() - cpu0, time.thread_time() - thread0
    a1 = actors()
    rec: dict[str, Any] = {
        "variant": variant,
        "k": k,
        "rank": rank,
        "iter_s": times,
        "loop_s": loop_s,
        "cpu_s": cpu_s,
        "train_thread_cpu_s": thread_s,
        "setup_s": setup_s,
    }
    if a0 and a1:
        rec["actors_cpu_s"] = {w: a1[w] - a0[w] for w in a0}
        # CPU the holder and controller processes used before the loop: their start (Ray worker, imports).
        rec["actors_cpu_before_loop_s"] = a0
    if ckpt is not None:
        rec["budget"] = ckpt.cpu_budget
        rec["checkpoints_taken"] = ckpt.checkpoints_taken
        t_fin = time.perf_counter()
        summary = ckpt.finish()  # not counted (as in the loop)
        rec["finish_s"] = time.perf_counter() - t_fin
        # A persist that failed (a full disk) costs less than one that wrote: the row says so.
        rec["save_failures"] = len(summary.failures)
        rec["committed_steps"] = len(summary.committed_steps or ())
        # The persist cadences the controller published (one snapshot in N written), in order.
        rec["persist_every"] = [e["persist_every"] for e in ckpt.events() if e.get("persist_every") is not None]
    elif saver is not None:
        saver.drain()
    _barrier()
    _write_json(os.path.join(cfg["out_dir"], f"{cfg['name']}.rank{rank}.json"), rec)


def _means(times: list[float], drop: int) -> dict:
    n = len(times)
    return {
        "mean_after_drop": statistics.fmean(times[drop:]),
        "mean_first_part": statistics.fmean(times[drop : min(n, drop + 15)]),
        "mean_second_half": statistics.fmean(times[n // 2 :]),
    }


def _per_round(mine: list[dict], base: list[dict], drop: int) -> list[float]:
    """Overhead % of each of ``mine``'s fits against the baseline fit of its round."""
    mean = {id(x): _means(x["iter_s"], drop)["mean_after_drop"] for x in (*mine, *base)}
    return [100.0 * (mean[id(x)] / mean[id(b)] - 1.0) for x in mine for b in base if b["round"] == x["round"]]


def run(args, preset: dict, fit, ray_env: dict, out: Path) -> dict:
    """The fits, one per (variant, k) and round, in one Ray session; returns the results object."""
    import ray

    variants = [v.strip() for v in args.variants.split(",")] if args.variants else ["none", "ray_sync", "cf_fixed"]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--user-loop: unknown variant(s) {bad}; choose from {','.join(VARIANTS)}")
    ks = args.ks or [10]
    workers = (args.workers or [2])[0]
    iters, drop = args.iters or 80, 5
    fits: list[tuple[str, int]] = []
    for v in variants:
        fits += [(v, 0)] if v == "none" else [(v, k) for k in ks]
    rounds = args.rounds or 1
    seg_dir = out / "user_loop"
    seg_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(ray_env)
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ray_env}
    )
    mod = __import__("benchmarks.user_loop", fromlist=["_loop"])
    runs = []
    try:
        for r in range(rounds):
            order = fits[r % len(fits) :] + fits[: r % len(fits)]
            for v, k in order:
                name = f"user-r{r}-{v}" + (f"-k{k}" if k else "")
                cfg = dict(
                    width=preset["width"],
                    layers=preset["layers"],
                    batch=preset["batch"],
                    iters=iters,
                    seed=args.seed,
                    variant=v,
                    k=k,
                    held_persist_every=args.held_persist_every,
                    name=name,
                    out_dir=str(seg_dir),
                )
                t0 = time.time()
                error = None
                try:
                    fit(mod._loop, cfg, workers, name, out / "work", num_to_keep=2 if v.startswith("ray_") else None)
                except Exception as e:  # noqa: BLE001 - report what was measured, and the failure
                    error = f"{type(e).__name__}: {e}"
                p = seg_dir / f"{name}.rank0.json"
                rec = json.loads(p.read_text()) if p.exists() else {}
                shutil.rmtree(out / "work" / name, ignore_errors=True)  # its checkpoints: the disk stays bounded
                runs.append(
                    {**rec, "round": r, "variant": v, "k": k, "name": name, "wall_s": time.time() - t0, "error": error}
                )
    finally:
        ray.shutdown()
    base = [x for x in runs if x["variant"] == "none" and x.get("iter_s")]
    base_m = {key: statistics.fmean(_means(x["iter_s"], drop)[key] for x in base) for key in _means([1.0] * 10, 5)}
    table = []
    for v, k in fits:
        mine = [x for x in runs if (x["variant"], x["k"]) == (v, k) and x.get("iter_s")]
        if not mine:
            continue
        m = {key: statistics.fmean(_means(x["iter_s"], drop)[key] for x in mine) for key in base_m}
        row: dict[str, Any] = {"variant": v, "k": k or None, "fits": len(mine), **m}
        for key in base_m:
            row[key.replace("mean", "overhead_pct")] = 100.0 * (m[key] / base_m[key] - 1.0)
        # Each round against its own baseline fit: the spread across rounds, and the verdicts' interval.
        per_round = [] if v == "none" else _per_round(mine, base, drop)
        row["overhead_pct_rounds"] = per_round
        row["overhead_interval"] = stats.interval(per_round)
        start = [x["actors_cpu_before_loop_s"] for x in mine if x.get("actors_cpu_before_loop_s")]
        if start:
            row["actors_cpu_before_loop_s"] = statistics.fmean(a["holder"] + a["controller"] for a in start)
        budgets = [x["budget"] for x in mine if x.get("budget")]
        if budgets:
            n_it = sum(len(x["iter_s"]) for x in mine if x.get("budget"))
            parts = {p for b in budgets for p in b}
            row["budget_wall_ms_per_iter"] = {
                p: 1e3 * sum((b.get(p) or {}).get("wall_s", 0.0) for b in budgets) / n_it for p in sorted(parts)
            }
            row["budget_cpu_ms_per_iter"] = {
                p: 1e3 * sum((b.get(p) or {}).get("cpu_s", 0.0) for b in budgets) / n_it for p in sorted(parts)
            }
        acpu = [x["actors_cpu_s"] for x in mine if x.get("actors_cpu_s")]
        if acpu:
            n_it = sum(len(x["iter_s"]) for x in mine if x.get("actors_cpu_s"))
            row["holder_cpu_ms_per_iter"] = 1e3 * sum(a["holder"] for a in acpu) / n_it
            row["controller_cpu_ms_per_iter"] = 1e3 * sum(a["controller"] for a in acpu) / n_it
        if any("persist_every" in x for x in mine):
            row["persist_every_last"] = [(x.get("persist_every") or [1])[-1] for x in mine]
        failed = sum(x.get("save_failures") or 0 for x in mine)
        if failed:
            row["save_failures"] = failed
        n_iters = sum(len(x["iter_s"]) for x in mine)
        row["worker_cpu_ms_per_iter"] = 1e3 * sum(x["cpu_s"] for x in mine) / n_iters
        # The training thread's own CPU (the loop, cf_ray's calls in it): the rest of the worker's is its
        # other threads (the snapshot thread, Ray's, gloo's).
        row["train_thread_cpu_ms_per_iter"] = 1e3 * sum(x.get("train_thread_cpu_s", 0.0) for x in mine) / n_iters
        table.append(row)
    return {"protocol": "one fit per variant (issue #25)", "workers": workers, "iters": iters, "drop": drop,
            "rounds": rounds, "table": table, "runs": runs}  # fmt: skip


def render(res: dict) -> str:
    lines = [
        f"### A user's loop (one fit per variant, {res['workers']} worker(s), {res['iters']} iterations, first "
        f"{res['drop']} dropped, {res['rounds']} round(s))",
        "",
        f"| variant | k | fits | overhead % (iterations {res['drop'] + 1}-{res['iters']}: the issue's figure) "
        f"| iterations {res['drop'] + 1}-{res['drop'] + 15} | second half ({res['iters'] // 2 + 1}-{res['iters']}) "
        "| per round (against that round's baseline) | 95 % interval "
        "| worker CPU ms/iter | of it the training thread | holder + controller CPU ms/iter "
        "| their CPU before the loop s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["table"]:
        actors = (
            f"{r['holder_cpu_ms_per_iter']:.0f} + {r['controller_cpu_ms_per_iter']:.0f}"
            if r.get("holder_cpu_ms_per_iter") is not None
            else "–"
        )
        lines.append(
            f"| {r['variant']} | {r['k'] or '–'} | {r['fits']} | {r['overhead_pct_after_drop']:+.1f} "
            f"| {r['overhead_pct_first_part']:+.1f} | {r['overhead_pct_second_half']:+.1f} "
            f"| {_rounds(r)} | {_interval(r)} "
            f"| {r['worker_cpu_ms_per_iter']:.0f} | {r['train_thread_cpu_ms_per_iter']:.0f} | {actors} "
            f"| {r.get('actors_cpu_before_loop_s') or 0:.1f} |"
        )
    lines.append("")
    for r in res["table"]:
        if r.get("save_failures"):
            lines.append(
                f"**{r['variant']} k={r['k']}: {r['save_failures']} checkpoint write(s) failed** (see the fits' "
                "profiles): a failed write costs less than one that lands, so this row is not a measurement."
            )
    for r in res["table"]:
        if r.get("budget_wall_ms_per_iter"):
            walls = ", ".join(f"{p} {v:.1f}" for p, v in r["budget_wall_ms_per_iter"].items() if v >= 0.1)
            written = r.get("persist_every_last")
            lines.append(
                f"{r['variant']} k={r['k']}: cf_ray's training-thread and snapshot-thread wall ms/iteration: {walls}"
                + (f"; one snapshot in N written at the end of each fit, N = {written}" if written else "")
            )
    lines.append("")
    return "\n".join(lines)


def _rounds(row: dict) -> str:
    return ", ".join(f"{v:+.1f}" for v in row.get("overhead_pct_rounds") or []) or "–"


def _interval(row: dict) -> str:
    iv = row.get("overhead_interval") or {}
    return "–" if iv.get("lo") is None else f"[{iv['lo']:+.1f}, {iv['hi']:+.1f}]"
