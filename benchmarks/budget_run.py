"""``cf-ray bench --budgets``: whether ``Adaptive``'s automatic interval can be trusted (issue #45).

In one Ray session, interleaved, every fit beside the same job without cf_ray: for each job shape
and seeded round, one ``TorchTrainer.fit()`` without checkpointing (``none``) and one with
``cf_ray.Adaptive(budget_pct=b)`` for every budget, in an order rotated over the rounds; then, on
the fast shape, ``Adaptive(budget_pct=5, mtbf_s=--budget-mtbf-s)`` (a prior) without and with
injected kills (rank 1 SIGKILLs itself at fixed steps; Ray Train restarts the group, cf_ray
restores from memory). The shapes:

  ``ddp302``  the benchmark's reference job: DDP, ``6 x Linear(2048)`` + Adam, 302 MB of state;
  ``mlp50``   a small fast-iteration one: ``4 x Linear(1024)`` + Adam, 50 MB of state, ~75 ms
              iterations on two busy cores;
  ``mlp5``    (``--quick``) ``2 x Linear(512)`` + Adam: seconds per fit, for the smoke test.

Each fit times every iteration of the loop as a user's loop sees it (forward, backward,
``ckpt.step``, the stall included); the wall-clock overhead after warm-up is the mean iteration time
after ``warmup`` iterations against the same iterations of its round's ``none`` fit, and over the
run the same from the third iteration on (the span the policy measures). At the end of the loop
rank 0 reads ``ckpt.explain()`` (the interval in force, ``measured_overhead_pct``, the cost and
where it came from, the reason) and the newest profile row's ``overhead_pct``.

The verdicts of issue #45's targets, each printed with the intervals it is judged on:

* the overhead after warm-up is at most ``budget x 1.2`` in every run;
* the interval is monotone in the budget in every run (a smaller budget, an interval no shorter);
* the interval's spread over the runs of one setting (max / min) is within 1.5;
* ``measured_overhead_pct`` and the profile's ``overhead_pct`` are within 3 points of the wall-clock
  overhead over the run;
* with injected kills against a prior, the interval after the failures is shorter than without, in
  every round (in seconds of training, ``interval x iter_s``: the two fits' iteration times can
  differ on a shared machine; the steps are printed beside).

The baseline's own spread (its mean iteration time over the rounds, as a percentage) is reported
beside them: on a shared machine a verdict within that spread says little. With
``--budget-idle-arm`` each round also has an ``idle`` fit per shape: cf_ray attached (its controller,
holder, spare workers, ``ckpt.step`` at every iteration) with its first checkpoint past the run's
end; its overhead against the same round's ``none`` fit is what cf_ray costs the job without any
checkpoint, which no budget (and no figure cf_ray reports) can see.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.proc_cpu import ProcCPU

SHAPES: dict[str, dict[str, Any]] = {
    "ddp302": dict(width=2048, layers=6, batch=32, iters=200, warmup=60),
    "mlp50": dict(width=1024, layers=4, batch=128, iters=420, warmup=100),
    "mlp5": dict(width=512, layers=2, batch=64, iters=600, warmup=150),
}
FULL = dict(shapes=["ddp302", "mlp50"], budgets=[2.0, 5.0, 20.0], rounds=5, kill_shape="mlp50")
QUICK = dict(shapes=["mlp5"], budgets=[5.0, 20.0], rounds=2, kill_shape="mlp5")
OVER_BUDGET_FACTOR = 1.2
SPREAD_FACTOR = 1.5
AGREE_POINTS = 3.0


def add_arguments(p) -> None:
    g = p.add_argument_group("the automatic interval against its budget (--budgets, issue #45)")
    g.add_argument(
        "--budgets",
        action="store_true",
        help="Adaptive at budgets 2, 5, 20 %% on two job shapes, 5 seeded rounds, each fit beside the same job "
        "without cf_ray (with --quick: one small shape, two budgets, two rounds)",
    )
    g.add_argument("--budget-list", help="budgets in percent, e.g. 2,5,20 (default: the preset's)")
    g.add_argument("--budget-shapes", help=f"comma-separated subset of {','.join(SHAPES)} (default: the preset's)")
    g.add_argument("--budget-rounds", type=int, help="seeded rounds (default: the preset's)")
    g.add_argument(
        "--budget-mtbf-s", type=float, default=600.0, help="the prior of the kill arms (default: %(default)s s)"
    )
    g.add_argument("--budget-no-kills", action="store_true", help="skip the arms with injected kills")
    g.add_argument(
        "--budget-idle-arm",
        action="store_true",
        help="add per shape a fit with cf_ray attached that takes no checkpoint: what its actors, spare "
        "workers and per-iteration bookkeeping cost the job without one",
    )


def _loop(cfg: dict) -> None:
    """``train_loop_per_worker``: the job, timed per iteration; killed at ``kill_steps`` (rank 1)."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    from benchmarks.savers import _barrier, _seeded_job, _write_json

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    model, opt, x, y = _seeded_job(cfg, rank)
    ckpt, step = None, 0
    if cfg["budget"] is not None or cfg.get("idle"):
        import cf_ray

        if cfg.get("idle"):  # attached, its first checkpoint past the run's end
            never = cfg["iters"] + 1
            policy = cf_ray.Adaptive(min_interval=never, max_interval=never, first_checkpoint_step=never)
        else:
            policy = cf_ray.Adaptive(budget_pct=cfg["budget"], mtbf_s=cfg.get("mtbf_s"))
        conf = cf_ray.CheckpointConfig(policy=policy, keep_last=2, register_with_ray=False, final_model=None)
        ckpt = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=conf)
        step = ckpt.restore().step
    times: list[float] = []
    sched: list[tuple[float, float]] = []  # per iteration: the training thread's (CPU, run-queue wait) seconds
    s0 = _schedstat()
    while step < cfg["iters"]:
        t0 = time.perf_counter()
        F.mse_loss(model(x), y).backward()
        if ckpt is not None:
            ckpt.step(opt)
        else:
            opt.step()
        opt.zero_grad()
        step += 1
        times.append(time.perf_counter() - t0)
        s1 = _schedstat()
        if s0 is not None and s1 is not None:
            sched.append((s1[0] - s0[0], s1[1] - s0[1]))
        s0 = s1
        if rank == 1 and step in cfg["kill_steps"]:
            marker = os.path.join(cfg["out_dir"], f"{cfg['name']}.kill{step}")
            try:
                fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                continue  # killed here before: this attempt goes on
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    rec: dict[str, Any] = {"iter_s": times, "start_step": cfg["iters"] - len(times)}
    if sched:
        rec["thread_cpu_s"], rec["runqueue_s"] = [c for c, _ in sched], [w for _, w in sched]
    if ckpt is not None and rank == 0:
        e = ckpt.explain() or {}
        rec["explain"] = {
            key: e.get(key)
            for key in (
                "interval",
                "binding",
                "reason",
                "measured_overhead_pct",
                "predicted_overhead_pct",
                "cost_s",
                "cost_source",
                "cpu_taken_s",
                "queued_s",
                "slowdown_evidence",
                "iter_s",
                "stall_s",
                "background_s",
                "cadence",
                "hazard",
                "records",
            )
        }
        changes = [ev for ev in ckpt.events() if ev.get("event") == "interval" and ev.get("interval")]
        rec["intervals"] = [ev["interval"] for ev in changes]
        # Each change with the policy's reason and the figures it used: a dip or a swing in the
        # intervals above can be read back from the JSON instead of a rerun.
        rec["interval_changes"] = [
            {"interval": ev["interval"], "time": ev.get("time")}
            | {
                key: why.get(key)
                for key in (
                    "reason",
                    "phase",
                    "slowdown_measured",
                    "slowdown_evidence",
                    "cost_s",
                    "iter_s",
                    "background_s",
                )
            }
            for ev in changes
            for why in [ev.get("why") if isinstance(ev.get("why"), dict) else {"reason": ev.get("why")}]
        ]
        rec["checkpoints_taken"] = ckpt.checkpoints_taken
        every = ckpt.profile_rows()
        rows = [r for r in every if r.get("overhead_pct") is not None]
        rec["profile_overhead_pct"] = rows[-1]["overhead_pct"] if rows else None
        # Every checkpoint's row (its step, stall, guard, copy, persist, slot wait, the job's overhead
        # so far; not the policy's per-checkpoint cost, which only the reasons above carry).
        rec["profile_rows"] = every
    if ckpt is not None:
        rec["save_failures"] = len(ckpt.finish().failures)
    _barrier()
    _write_json(os.path.join(cfg["out_dir"], f"{cfg['name']}.rank{rank}.json"), rec)


def _schedstat() -> tuple[float, float] | None:
    """This thread's (seconds on a CPU, seconds runnable but waiting for one) from Linux's
    ``/proc/thread-self/schedstat``; ``None`` without it."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


def _thread_split(x: dict, a: dict | None, lo: int) -> dict:
    """Milliseconds per iteration that fit ``x``'s rank 0 spent over fit ``a`` (the attached one)
    from iteration ``lo`` on: in its training thread's own CPU, waiting for a CPU, and the rest."""
    keys = ("iter_s", "thread_cpu_s", "runqueue_s")
    if a is None or not all(x.get(k) and a.get(k) for k in keys):
        return {}
    d = {k: (_mean(x[k][lo:]) or 0.0) - (_mean(a[k][lo:]) or 0.0) for k in keys}
    return {
        "thread_cpu_over_attached_ms": 1e3 * d["thread_cpu_s"],
        "runqueue_over_attached_ms": 1e3 * d["runqueue_s"],
        "off_cpu_over_attached_ms": 1e3 * (d["iter_s"] - d["thread_cpu_s"] - d["runqueue_s"]),
    }


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _overhead(times: list[float], base: list[float], lo: int) -> float | None:
    """Percent over ``base`` of the mean of ``times[lo:]`` (the same iterations of both fits)."""
    a, b = _mean(times[lo:]), _mean(base[lo:])
    return None if a is None or not b else 100.0 * (a / b - 1.0)


def _settings(opts: dict, no_kills: bool, idle: bool = False) -> list[dict]:
    """The fits of one round: per shape ``none``, ``idle`` (with ``idle``: cf_ray attached, no
    checkpoint) and one per budget; on the kill shape, the prior without and with kills."""
    out = []
    for shape in opts["shapes"]:
        out.append({"shape": shape, "arm": "none", "budget": None})
        if idle:
            out.append({"shape": shape, "arm": "idle", "budget": None, "idle": True})
        out += [{"shape": shape, "arm": f"b{b:g}", "budget": b} for b in opts["budgets"]]
    if not no_kills and opts["kill_shape"]:
        s = opts["kill_shape"]
        out.append({"shape": s, "arm": "prior", "budget": 5.0, "prior": True, "kills": False})
        out.append({"shape": s, "arm": "prior_kills", "budget": 5.0, "prior": True, "kills": True})
    return out


def run(args, fit, ray_env: dict, out: Path, save=None) -> dict:
    """Every fit, in one Ray session; returns the results object (with its verdicts). ``save``, when
    given, is called with the results so far (``complete`` false) after every fit, so that a run
    stopped part-way (a time limit, a crash) keeps what it measured."""
    import ray

    opts = dict(QUICK if args.preset == "quick" else FULL)
    if args.budget_list:
        opts["budgets"] = [float(v) for v in args.budget_list.split(",")]
    if args.budget_shapes:
        opts["shapes"] = [s.strip() for s in args.budget_shapes.split(",")]
        unknown = [s for s in opts["shapes"] if s not in SHAPES]
        if unknown:
            raise SystemExit(f"--budget-shapes: unknown shape(s) {unknown}; choose from {','.join(SHAPES)}")
        if opts["kill_shape"] not in opts["shapes"]:
            opts["kill_shape"] = opts["shapes"][-1]
    rounds = args.budget_rounds or opts["rounds"]
    workers = (args.workers or [2])[0]
    fits = _settings(opts, args.budget_no_kills, args.budget_idle_arm)
    seg = out / "budgets"
    seg.mkdir(parents=True, exist_ok=True)
    os.environ.update(ray_env)
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": ray_env}
    )
    mod = __import__("benchmarks.budget_run", fromlist=["_loop"])
    runs = []
    try:
        for r in range(rounds):
            order = fits[r % len(fits) :] + fits[: r % len(fits)]
            for f in order:
                shape = dict(SHAPES[f["shape"]])
                if args.iters:  # --iters: a shorter run (the smoke test), its warm-up a quarter of it
                    shape.update(iters=args.iters, warmup=args.iters // 4)
                name = f"budget-r{r}-{f['shape']}-{f['arm']}"
                iters = shape["iters"]
                cfg = dict(
                    shape,
                    seed=args.seed + r,
                    budget=f["budget"],
                    idle=bool(f.get("idle")),
                    mtbf_s=args.budget_mtbf_s if f.get("prior") else None,
                    kill_steps=[iters // 3, iters // 2] if f.get("kills") else [],
                    name=name,
                    out_dir=str(seg),
                )
                t0, error, cpu = time.time(), None, ProcCPU().start()
                try:
                    fit(mod._loop, cfg, workers, name, out / "work", max_failures=4 if f.get("kills") else 0)
                except Exception as e:  # noqa: BLE001 - report what was measured, and the failure
                    error = f"{type(e).__name__}: {e}"
                finally:
                    cpu_s = cpu.stop()
                p = seg / f"{name}.rank0.json"
                rec = json.loads(p.read_text()) if p.exists() else {}
                shutil.rmtree(out / "work" / name, ignore_errors=True)
                runs.append(
                    {**rec, **f, "round": r, "seed": args.seed + r, "warmup": shape["warmup"],
                     "wall_s": time.time() - t0, "error": error, "cpu_s_by_process": cpu_s}
                )  # fmt: skip
                if save is not None:
                    save(_results(opts, workers, rounds, runs, complete=False))
    finally:
        ray.shutdown()
    return _results(opts, workers, rounds, runs, complete=True)


def _results(opts: dict, workers: int, rounds: int, runs: list[dict], complete: bool) -> dict:
    return {
        **opts, "protocol": "issue #45: budgets", "workers": workers, "rounds": rounds,
        "complete": complete, "fits_done": len(runs), **judge(runs, opts), "cpu": cpu_by_fit(runs),
    }  # fmt: skip


#: The process kinds that are cf_ray's own (its actors; the spares run as ``ray::IDLE`` until used).
CF_RAY_PROCESSES = ("ray::Controller", "ray::Holder")


def cpu_by_fit(runs: list[dict]) -> list[dict]:
    """Per fit, the CPU seconds of every process kind of the driver's Ray during it, and what cf_ray's
    actors and the idle worker processes (the spares among them) used as a percentage of one core:
    CPU the two training workers did not get, in every iteration alike."""
    out = []
    for x in runs:
        cpu, wall = x.get("cpu_s_by_process") or {}, x.get("wall_s") or 0.0
        own = sum(cpu.get(k, 0.0) for k in CF_RAY_PROCESSES)
        out.append(
            {
                "fit": f"r{x['round']}-{x['shape']}-{x['arm']}",
                "wall_s": round(wall, 1),
                "training_cpu_s": cpu.get("ray::RayTrainWorker"),
                "cf_ray_actors_pct_of_core": round(100 * own / wall, 2) if wall else None,
                "idle_workers_pct_of_core": round(100 * cpu.get("ray::IDLE", 0.0) / wall, 2) if wall else None,
                "cpu_s_by_process": cpu,
            }
        )
    return out


def judge(runs: list[dict], opts: dict) -> dict:
    """Per run its overheads against its round's baseline; the verdicts of issue #45's targets."""
    table, idle = [], []
    base = {(x["shape"], x["round"]): x for x in runs if x["arm"] == "none" and x.get("iter_s")}
    attached_fit = {(x["shape"], x["round"]): x for x in runs if x["arm"] == "idle" and x.get("iter_s")}
    for x in runs:
        b = base.get((x["shape"], x["round"]))
        if x["arm"] == "none" or not x.get("iter_s") or b is None or x.get("kills"):
            continue
        warm = x.get("warmup", SHAPES[x["shape"]]["warmup"])
        if x["arm"] == "idle":  # cf_ray attached, no checkpoint: its cost without one (no verdict)
            idle.append((x["shape"], x["round"], _overhead(x["iter_s"], b["iter_s"], warm)))
            continue
        e = x.get("explain") or {}
        a = attached_fit.get((x["shape"], x["round"]))
        table.append(
            {
                "shape": x["shape"],
                "arm": x["arm"],
                "budget": x["budget"],
                "round": x["round"],
                "interval": e.get("interval"),
                "intervals": x.get("intervals"),
                "interval_changes": x.get("interval_changes"),
                "overhead_after_warmup_pct": _overhead(x["iter_s"], b["iter_s"], warm),
                "overhead_run_pct": _overhead(x["iter_s"], b["iter_s"], 2),
                # Against the round's fit with cf_ray attached and no checkpoint: the checkpoints' own cost.
                "over_attached_after_warmup_pct": _overhead(x["iter_s"], a["iter_s"], warm) if a else None,
                "over_attached_run_pct": _overhead(x["iter_s"], a["iter_s"], 2) if a else None,
                "measured_overhead_pct": e.get("measured_overhead_pct"),
                "profile_overhead_pct": x.get("profile_overhead_pct"),
                "cost_s": e.get("cost_s"),
                "cost_source": e.get("cost_source"),
                "cpu_taken_s": e.get("cpu_taken_s"),
                "queued_s": e.get("queued_s"),
                # Where the time over the attached fit went, per iteration after warm-up (rank 0's
                # training thread): more CPU of its own (caches, memory bandwidth), more waiting for
                # a core (the run queue), the rest off a CPU (the collectives, waiting on rank 1).
                **_thread_split(x, a, warm),
                "reason": e.get("reason"),
                "checkpoints_taken": x.get("checkpoints_taken"),
            }
        )
    verdicts = {}
    main = [t for t in table if t["arm"] != "prior"]
    over = [
        (t["shape"], t["budget"], t["round"], t["overhead_after_warmup_pct"], t["interval"])
        for t in main
        if t["overhead_after_warmup_pct"] is not None
    ]
    verdicts["overhead_within_budget_x1.2"] = {
        "met": bool(over) and all(o <= b * OVER_BUDGET_FACTOR for _, b, _, o, _ in over),
        "runs": over,
    }
    mono, spread = [], []
    for shape in opts["shapes"]:
        for r in {t["round"] for t in main if t["shape"] == shape}:
            ks = [
                (t["budget"], t["interval"])
                for t in main
                if t["shape"] == shape and t["round"] == r and t["interval"] is not None
            ]
            ks.sort()
            mono.append((shape, r, ks, all(a[1] >= b[1] for a, b in zip(ks, ks[1:]))))
        for b in opts["budgets"]:
            ks = [t["interval"] for t in main if t["shape"] == shape and t["budget"] == b and t["interval"]]
            if ks:
                spread.append((shape, b, ks, max(ks) / min(ks)))
    verdicts["interval_monotone_in_budget"] = {"met": bool(mono) and all(m[3] for m in mono), "runs": mono}
    verdicts["interval_spread_within_x1.5"] = {
        "met": bool(spread) and all(s[3] <= SPREAD_FACTOR for s in spread),
        "settings": spread,
    }
    agree = [
        (
            t["shape"],
            t["budget"],
            t["round"],
            t["overhead_run_pct"],
            t["measured_overhead_pct"],
            t["profile_overhead_pct"],
        )
        for t in main
        if t["overhead_run_pct"] is not None
    ]
    verdicts["reported_overhead_within_3_points"] = {
        "met": bool(agree)
        and all(
            m is not None and p is not None and abs(m - w) <= AGREE_POINTS and abs(p - w) <= AGREE_POINTS
            for _, _, _, w, m, p in agree
        ),
        "runs": agree,
    }
    kills = []
    for r in sorted({x["round"] for x in runs}):
        a = next((x for x in runs if x["round"] == r and x["arm"] == "prior"), None)
        k = next((x for x in runs if x["round"] == r and x["arm"] == "prior_kills"), None)
        if a and k:
            # In seconds of training (interval x iteration time): on a shared machine the two fits'
            # iterations can differ, and what a failure loses is time.
            ea, ek = a.get("explain") or {}, k.get("explain") or {}
            sa, sk = (
                (e["interval"] * e["iter_s"] if e.get("interval") and e.get("iter_s") else None) for e in (ea, ek)
            )
            kills.append(
                (r, ea.get("interval"), ek.get("interval"), sa, sk, sa is not None and sk is not None and sk < sa)
            )
    if kills:
        verdicts["interval_shorter_after_kills"] = {
            "met": all(x[5] for x in kills),
            "rounds": kills,  # (round, steps without, steps with kills, seconds without, seconds with, met)
        }
    spread_base = {}
    for shape in opts["shapes"]:
        means = [_mean(x["iter_s"][2:]) for x in runs if x["shape"] == shape and x["arm"] == "none" and x.get("iter_s")]
        means = [m for m in means if m]
        if len(means) >= 2:
            spread_base[shape] = {
                "iter_s_mean": statistics.fmean(means),
                "spread_pct": 100.0 * statistics.stdev(means) / statistics.fmean(means),
            }
    errors = [(x["round"], x["shape"], x["arm"], x["error"]) for x in runs if x.get("error")]
    # The same two verdicts against the fit with cf_ray attached and no checkpoint (where the round has
    # one): what the checkpoints cost, which is what the budget and the reported figures are about.
    vs = [t for t in main if t["over_attached_after_warmup_pct"] is not None]
    if vs:
        within = [t["over_attached_after_warmup_pct"] <= t["budget"] * OVER_BUDGET_FACTOR for t in vs]
        agrees = [
            t["measured_overhead_pct"] is not None
            and abs(t["measured_overhead_pct"] - t["over_attached_run_pct"]) <= AGREE_POINTS
            for t in vs
        ]
        verdicts["against_attached_no_checkpoint"] = {
            "met": all(within) and all(agrees),
            "within_budget_x1.2": sum(within),
            "reported_within_3_points": sum(agrees),
            "of": len(vs),
            "runs": [
                (
                    t["shape"],
                    t["budget"],
                    t["round"],
                    t["over_attached_after_warmup_pct"],
                    t["over_attached_run_pct"],
                    t["measured_overhead_pct"],
                )
                for t in vs
            ],
        }
    attached = {
        shape: {
            "after_warmup_pct": [o for s, _, o in idle if s == shape],
            "mean_pct": _mean([o for s, _, o in idle if s == shape and o is not None]),
        }
        for shape in sorted({s for s, _, _ in idle})
    }
    return {
        "table": table,
        "verdicts": verdicts,
        "baseline": spread_base,
        "attached_no_checkpoint": attached,
        "errors": errors,
        "runs": runs,
    }


def render(res: dict) -> str:
    lines = [
        f"### The automatic interval against its budget ({res['workers']} workers, {res['rounds']} seeded rounds, "
        "every fit beside its round's fit without cf_ray)",
        "",
        "| shape | budget % | round | interval | overhead after warm-up % | over the run % "
        "| measured_overhead_pct | profile overhead_pct | cost s (source) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt="{:+.1f}"):
        return "–" if v is None else fmt.format(v)

    for t in sorted(res["table"], key=lambda t: (t["shape"], t["arm"] == "prior", t["budget"], t["round"])):
        label = f"{t['budget']:g}" + (" (prior)" if t["arm"] == "prior" else "")
        lines.append(
            f"| {t['shape']} | {label} | {t['round']} | {t['interval']} | {f(t['overhead_after_warmup_pct'])} "
            f"| {f(t['overhead_run_pct'])} | {f(t['measured_overhead_pct'])} | {f(t['profile_overhead_pct'])} "
            f"| {f(t['cost_s'], '{:.4f}')} ({t['cost_source']}) |"
        )
    lines.append("")
    for shape, b in res["baseline"].items():
        lines.append(
            f"baseline {shape}: {1e3 * b['iter_s_mean']:.1f} ms per iteration, spread over rounds {b['spread_pct']:.1f} %"
        )
    for shape, a in res.get("attached_no_checkpoint", {}).items():
        rounds = ", ".join(f(o) for o in a["after_warmup_pct"])
        lines.append(
            f"cf_ray attached without a checkpoint, {shape}: {f(a['mean_pct'])} % after warm-up on average "
            f"(rounds: {rounds}): the cost of its actors, spare workers and bookkeeping, which no budget sees"
        )
    lines.append("")
    for name, v in res["verdicts"].items():
        detail = {k: v[k] for k in v if k != "met"}
        lines.append(f"- **{name}: {'met' if v['met'] else 'MISSED'}** {json.dumps(detail, default=str)}")
    lines.append("")
    lines.append("CPU during each fit (% of one core; the training workers' CPU seconds beside):")
    for c in res.get("cpu", []):
        lines.append(
            f"- {c['fit']}: cf_ray's actors {c['cf_ray_actors_pct_of_core']} %, idle worker processes "
            f"{c['idle_workers_pct_of_core']} %, training {c['training_cpu_s']} s in {c['wall_s']} s"
        )
    split = [t for t in res["table"] if "runqueue_over_attached_ms" in t]
    if split:
        lines.append("")
        lines.append(
            "Where each fit's time over its round's attached fit went (rank 0's training thread, ms per iteration "
            "after warm-up): its own CPU / waiting for a core / off a CPU (collectives); the policy's cost, "
            "its CPU floor and the wait it measured (s per checkpoint):"
        )
        for t in split:
            lines.append(
                f"- r{t['round']}-{t['shape']}-b{t['budget']:g} (interval {t['interval']}): "
                f"{f(t['thread_cpu_over_attached_ms'])} / {f(t['runqueue_over_attached_ms'])} / "
                f"{f(t['off_cpu_over_attached_ms'])}; cost {f(t['cost_s'], '{:.3f}')}, "
                f"cpu_taken_s {f(t['cpu_taken_s'], '{:.3f}')}, queued_s {f(t.get('queued_s'), '{:.3f}')}"
            )
    for e in res["errors"]:
        lines.append(f"- fit failed: {e}")
    return "\n".join(lines)
