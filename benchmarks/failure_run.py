"""``cf-ray bench --failures``: a real training job on this machine with SIGKILLs drawn from a Poisson
process (and one with drains), cf_ray's ``Adaptive`` against Ray Train's periodic checkpoint (issue #26).

Each *arm* is one ``TorchTrainer.fit()`` of the same job (2 workers, gloo, DDP, ``layers x
Linear(width)`` + Adam on a fixed synthetic batch) that trains for the same *up-time*
(``--fail-duration`` seconds of training, counted from each attempt's first step; the start-up and
the recoveries add to its wall time as badput), with the same failures at the same points of that
up-time:

* ``cf_adaptive``: ``cf_ray.Checkpointer`` with ``cf_ray.Adaptive()`` (its defaults: no failure
  prior, a 5 % budget);
* ``cf_persist_all`` (only when named in ``--fail-arms``): the same with every snapshot persisted,
  as before ``persist_every`` (``AnyOf(Adaptive(), FixedInterval(every=2**30))``: Adaptive's
  interval, the fixed member's ``persist_every=1``), to show what holding snapshots in memory only
  between persists buys;
* ``ray_default``: Ray Train's documented way — rank 0 ``torch.save`` into a temporary directory,
  every rank ``ray.train.report(checkpoint=...)`` (SYNC) — at its periodic default, once per epoch
  (``--epoch-steps``; Ray Train has no frequency setting: ``CheckpointConfig.checkpoint_frequency``
  is deprecated and its documented loop and Lightning callback report once per epoch); restored
  with ``ray.train.get_checkpoint()``;
* ``ray_fixed``: the same every ``k`` steps, for every ``k`` of ``--fail-grid`` (the best is
  reported as Ray's best fixed interval).

The failures: rank 1 SIGKILLs itself after gaps of time up drawn from an exponential distribution
of mean ``--fail-mtbf`` (a Poisson process in the time the job trains; the same gaps, same seed,
for every arm), Ray Train restarts the worker group (``FailureConfig``). Kills and the end are both
on the up-time clock, so every arm meets the same kills (:func:`planned_kills`); with the end on
the wall clock instead (before 2026-11-28), a kill due in the last seconds fell inside the window for
an arm whose recoveries were quick and outside it for another, and two runs of one arm differed by a
kill. ``--fail-rounds N`` runs every arm ``N`` times, round ``r`` with the failure trace of seed
``--seed + r`` (the same for every arm of the round) and the arms in rotated order; each target is
judged on the per-round differences (cf_ray's ratio minus Ray's, same failures): met when every
round's is above zero, missed when every round's is below, within noise otherwise. Mode ``drains``: the
same, and ``--fail-grace`` seconds before each kill the rank gets a preemption notice — cf_ray's
``ckpt.request_checkpoint(preemption=True, deadline_s=grace)``, as a drain or SIGTERM handler would
pass it on; Ray Train's loop has no such hook and carries on.

Measured from rank 0's per-step log (the same for every arm), as Google's ML Goodput Measurement
splits it: productive time (final step x the median step time without a checkpoint), checkpoint
save (the training thread's time in ``report``/``torch.save``, or cf_ray's stall), checkpoint
restore (``restore()`` / ``get_checkpoint`` + ``torch.load``), wasted progress (the steps redone
after each kill, their own durations), recovery (kill to the next attempt's first step, less its
restore) and start-up (``fit()`` to the first step, less the first restore); ``other`` is the rest.
The effective training time ratio is productive / wall. For the cf_ray arm, the split the run's
controller exported (``cf_ray.Run(...).goodput()``) is kept beside it.

Run it in a quiet window; ``--fail-preset tiny`` is a smoke test (about 3 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEMA = "cf_ray.failure_run/2"  # /2: up-time end, rounds (2026-11-28)
ARMS = ("cf_adaptive", "ray_default", "ray_fixed")
EXTRA_ARMS = ("cf_persist_all",)  # run only when named in --fail-arms
CF_ARMS = ("cf_adaptive", "cf_persist_all")  # the arms that run cf_ray
MODES = ("kills", "drains")

FAIL_PRESETS: dict[str, dict[str, Any]] = {
    # A smoke test: a tiny model, a few kills, one fixed interval for Ray.
    "tiny": dict(width=64, layers=2, batch=4, duration_s=40.0, mtbf_s=12.0, grace_s=3.0, grid=[20], epoch_steps=200),
    # The run: the quick bench model (6 x Linear(1024) + Adam, ~76 MB), kills every 90 s on
    # average, 15 minutes per arm; Ray over a grid of fixed intervals.
    "real": dict(
        width=1024,
        layers=6,
        batch=32,
        duration_s=900.0,
        mtbf_s=90.0,
        grace_s=10.0,
        grid=[10, 25, 50, 100],
        epoch_steps=1000,
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a real job with failures (--failures, issue #26)")
    g.add_argument(
        "--failures",
        action="store_true",
        help="cf_ray Adaptive against Ray Train's periodic checkpoint, "
        "with SIGKILLs drawn from a Poisson process (and drains)",
    )
    g.add_argument("--fail-preset", choices=sorted(FAIL_PRESETS), default="real", help="sizes (default: %(default)s)")
    g.add_argument(
        "--fail-arms",
        default=",".join(ARMS),
        help=f"comma-separated subset of %(default)s, or of {','.join(ARMS + EXTRA_ARMS)}",
    )
    g.add_argument("--fail-modes", default=",".join(MODES), help="comma-separated subset of %(default)s")
    g.add_argument("--fail-mtbf", type=float, help="mean seconds of training between two kills")
    g.add_argument(
        "--fail-duration", type=float, help="seconds each arm trains (up-time, from each attempt's first step)"
    )
    g.add_argument(
        "--fail-rounds",
        type=int,
        default=1,
        help="run every arm this many times, round r with the failures of seed --seed + r (default: %(default)s)",
    )
    g.add_argument("--fail-grace", type=float, help="drains: seconds between the notice and the kill")
    g.add_argument("--fail-grid", help="ray_fixed's intervals, e.g. 10,25,50,100")
    g.add_argument("--epoch-steps", type=int, help="ray_default: steps per epoch (a checkpoint per epoch)")


# ================================================================================================
# Worker side
# ================================================================================================


def _kills_done(out: str) -> int:
    return sum(1 for n in os.listdir(out) if n.startswith("kill_"))


def _failure_loop(cfg: dict) -> None:
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from benchmarks.savers import _build_model

    torch.set_num_threads(1)
    attempt_t = time.time()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    out = cfg["out_dir"]
    torch.manual_seed(cfg["seed"])
    model = ray.train.torch.prepare_model(_build_model(cfg["width"], cfg["layers"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g)
    arm, k = cfg["arm"], cfg.get("k")
    ckpt = None
    t0 = time.time()
    if arm in CF_ARMS:
        import cf_ray

        policy = (
            cf_ray.Adaptive()
            if arm == "cf_adaptive"
            else cf_ray.AnyOf(policies=(cf_ray.Adaptive(), cf_ray.FixedInterval(every=1 << 30)))
        )
        ckpt = cf_ray.Checkpointer(
            {"model": model, "optimizer": opt},
            # Not registered with Ray Train, as in the bench's own cf_ray variants (cf_ray's checkpoint
            # path without Ray Train's bookkeeping); no consolidated final model (not timed anyway).
            config=cf_ray.CheckpointConfig(policy=policy, keep_last=2, final_model=None, register_with_ray=False),
        )
        resume = ckpt.restore()
        step, source = resume.step, resume.source
    else:
        step, source = 0, "fresh"
        got = ray.train.get_checkpoint()
        if got is not None:
            with got.as_directory() as d:
                state = torch.load(os.path.join(d, "checkpoint.pt"), weights_only=True)
            getattr(model, "module", model).load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            step, source = int(state["step"]), "storage"
    restore_s = time.time() - t0
    log = open(os.path.join(out, f"steps_rank{rank}.jsonl"), "a", buffering=1) if rank == 0 else None
    if log is not None:
        log.write(
            json.dumps({"ev": "attempt", "t": attempt_t, "restore_s": restore_s, "step": step, "source": source}) + "\n"
        )
    kill_rank = 1 if ctx.get_world_size() > 1 else 0
    n_kill = _kills_done(out)
    gaps = cfg["gaps"]
    kill_at = notice_at = end_unix = math.inf
    noticed = False
    flag = torch.zeros(1)
    while True:
        t_step = time.time()
        if end_unix == math.inf and rank == 0:  # this attempt's share of the arm's up-time
            end_unix = t_step + up_time_left(cfg["duration_s"], gaps, n_kill)
        if kill_at == math.inf and n_kill < len(gaps):
            kill_at = t_step + gaps[n_kill]  # a gap of time up, from this attempt's first step
            notice_at = kill_at - cfg["grace_s"] if cfg["mode"] == "drains" else math.inf
        flag[0] = 1.0 if t_step >= end_unix else 0.0
        dist.all_reduce(flag)  # every rank stops at the same step
        if flag[0] > 0:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        save_s = 0.0
        if ckpt is not None:
            before = ckpt.stall_s_total
            ckpt.step(opt)
            save_s = ckpt.stall_s_total - before
        else:
            opt.step()
        step += 1
        if ckpt is None and step % k == 0:
            t_save = time.time()
            _ray_report(model, opt, step, rank)
            save_s = time.time() - t_save
        opt.zero_grad()
        if log is not None:
            log.write(json.dumps({"s": step, "t0": t_step, "t1": time.time(), "save": save_s}) + "\n")
        now = time.time()
        if rank == kill_rank and not noticed and now >= notice_at:
            noticed = True
            if ckpt is not None:
                ckpt.request_checkpoint(preemption=True, deadline_s=cfg["grace_s"])
            with open(os.path.join(out, f"notice_{n_kill:04d}.json"), "w") as f:
                json.dump({"t": now, "step": step}, f)
        if rank == kill_rank and now >= kill_at:
            fd = os.open(os.path.join(out, f"kill_{n_kill:04d}.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            os.write(fd, json.dumps({"t": now, "step": step}).encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    if log is not None:  # the training ends here (cf_ray's finish() writes the final model: not timed)
        log.write(json.dumps({"ev": "end", "t": time.time(), "step": step}) + "\n")
        log.close()
    if ckpt is not None:
        ckpt.finish()


def up_time_left(duration_s: float, gaps: list[float], kills_done: int) -> float:
    """Seconds the attempt after ``kills_done`` kills trains, from its first step: the arm's
    up-time less what the attempts before it trained (attempt ``i`` trained ``gaps[i]`` from its
    first step to its kill). A slow start-up or recovery adds to the arm's wall time, never takes
    from its training."""
    return max(0.0, duration_s - sum(gaps[:kills_done]))


def planned_kills(duration_s: float, gaps: list[float]) -> int:
    """How many kills fall within ``duration_s`` of up-time: the same for every arm."""
    n, up = 0, 0.0
    for g in gaps:
        up += g
        if up >= duration_s:
            break
        n += 1
    return n


def _ray_report(model, opt, step: int, rank: int) -> None:
    """Ray Train's documented SYNC checkpoint: rank 0 ``torch.save`` into a temporary directory,
    every rank ``ray.train.report``."""
    import ray.train
    import torch
    from ray.train import Checkpoint

    with tempfile.TemporaryDirectory(prefix="cfbench-fail-") as tmp:
        ckpt = None
        if rank == 0:
            module = getattr(model, "module", model)
            torch.save(
                {"model": module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                os.path.join(tmp, "checkpoint.pt"),
            )
            ckpt = Checkpoint.from_directory(tmp)
        ray.train.report({"step": step}, checkpoint=ckpt)


# ================================================================================================
# Driver side: the analysis (pure, tested on synthetic logs)
# ================================================================================================


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by the SIGKILL
    return out


def analyse(records: list[dict], kills: list[dict], fit_start: float) -> dict:
    """The effective training time ratio, the wasted work and the badput split of one arm, from
    rank 0's log (``attempt``/step/``end`` records, in order) and the kill records.

    Returns ``{"wall_s", "productive_s", "effective_training_ratio", "final_step", "ideal_step_s",
    "kills", "wasted_steps", "badput_s": {category: s}}``.
    """
    attempts: list[dict] = []
    for r in records:
        if r.get("ev") == "attempt":
            attempts.append({**r, "steps": []})
        elif "s" in r and attempts:
            attempts[-1]["steps"].append(r)
    ends = [r for r in records if r.get("ev") == "end"]
    all_steps = [s for a in attempts for s in a["steps"]]
    if not attempts or not all_steps:
        return {"error": "no step was logged"}
    clean = [s["t1"] - s["t0"] for s in all_steps if not s.get("save")]
    ideal = statistics.median(clean) if clean else statistics.median(s["t1"] - s["t0"] for s in all_steps)
    end_t = ends[-1]["t"] if ends else all_steps[-1]["t1"]
    final = attempts[-1]["steps"][-1]["s"] if attempts[-1]["steps"] else attempts[-1]["step"]
    wall = end_t - fit_start
    bad = dict.fromkeys(("checkpoint_save", "checkpoint_restore", "wasted_progress", "recovery", "startup"), 0.0)
    wasted_steps = 0
    kills = sorted(kills, key=lambda kk: kk["t"])
    for i, a in enumerate(attempts):
        first = a["steps"][0]["t0"] if a["steps"] else None
        bad["checkpoint_restore"] += a["restore_s"]
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        if nxt is not None:  # this attempt was killed: its steps past the next restore are redone
            lost = [s for s in a["steps"] if s["s"] > nxt["step"]]
            wasted_steps += len(lost)
            bad["wasted_progress"] += sum(s["t1"] - s["t0"] for s in lost)
            kept = [s for s in a["steps"] if s["s"] <= nxt["step"]]
        else:
            kept = a["steps"]
        bad["checkpoint_save"] += sum(s.get("save") or 0.0 for s in kept)
        if i == 0:
            if first is not None:
                bad["startup"] += max(0.0, first - fit_start - a["restore_s"])
        else:
            killed_at = kills[i - 1]["t"] if i - 1 < len(kills) else attempts[i - 1]["steps"][-1]["t1"]
            start = first if first is not None else a["t"] + a["restore_s"]
            bad["recovery"] += max(0.0, start - killed_at - a["restore_s"])
    productive = final * ideal
    bad["other"] = wall - productive - sum(bad.values())
    return {
        "wall_s": wall,
        "productive_s": productive,
        "effective_training_ratio": productive / wall if wall > 0 else None,
        "final_step": final,
        "ideal_step_s": ideal,
        "kills": len(attempts) - 1,
        "wasted_steps": wasted_steps,
        "badput_s": bad,
    }


# ================================================================================================
# Driver side: the runs
# ================================================================================================


def _arms(arms: list[str], grid: list[int], epoch_steps: int) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    for arm in arms:
        if arm in CF_ARMS:
            out.append((arm, None))
        elif arm == "ray_default":
            out.append((arm, epoch_steps))
        elif arm == "ray_fixed":
            out += [(arm, k) for k in grid]
        else:
            raise SystemExit(f"unknown arm {arm!r}; choose from {','.join(ARMS + EXTRA_ARMS)}")
    return out


def _one(
    mode: str, arm: str, k: int | None, p: dict, gaps: list[float], root: Path, seed: int, round_: int = 0
) -> dict:
    from benchmarks.bench import _fit

    name = f"{mode}-{arm}" + (f"-k{k}" if arm == "ray_fixed" else "") + (f"-r{round_}" if round_ else "")
    out = root / "logs" / name
    out.mkdir(parents=True, exist_ok=True)
    fit_start = time.time()
    cfg = {
        "arm": arm,
        "k": k,
        "mode": mode,
        "width": p["width"],
        "layers": p["layers"],
        "batch": p["batch"],
        "seed": seed,
        "gaps": gaps,
        "grace_s": p["grace_s"],
        "out_dir": str(out),
        "duration_s": p["duration_s"],
    }
    error = None
    try:
        _fit(_failure_loop, cfg, 2, name, root / "storage", max_failures=len(gaps) + 5, num_to_keep=2)
    except Exception as e:  # noqa: BLE001 - one arm failing must not lose the others' figures
        error = repr(e)
    kills = [json.loads((out / n).read_text()) for n in sorted(os.listdir(out)) if n.startswith("kill_")]
    res = analyse(_read_jsonl(out / "steps_rank0.jsonl"), kills, fit_start)
    res.update(
        mode=mode,
        arm=arm,
        k=k,
        name=name,
        round=round_,
        planned_kills=planned_kills(p["duration_s"], gaps),
        fit_error=error,
    )
    if arm in CF_ARMS:
        res["controller_goodput"] = _controller_goodput(root / "storage", name)
    return res


def _warm_up(p: dict, root: Path, seed: int) -> float:
    """One short fit without failures or checkpoints before the arms, not counted: the first
    ``fit()`` of a Ray session starts slower than the later ones (seen: 30.8 s from ``fit()`` to the
    first step for the first arm, 20-23 s for the others), which would be charged to whichever arm
    runs first as start-up badput."""
    from benchmarks.bench import _fit

    out = root / "logs" / "warm-up"
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "arm": "ray_fixed", "k": 1 << 30, "mode": "kills", "width": p["width"], "layers": p["layers"],
        "batch": p["batch"], "seed": seed, "gaps": [], "grace_s": p["grace_s"], "out_dir": str(out),
        "duration_s": 5.0,
    }  # fmt: skip
    t0 = time.time()
    _fit(_failure_loop, cfg, 2, "warm-up", root / "storage", max_failures=0, num_to_keep=2)
    return time.time() - t0


def _controller_goodput(storage: Path, name: str) -> dict | None:
    """What the cf_ray run's controller exported (its goodput.json, written as it ends)."""
    from cf_ray import report

    for _ in range(30):
        try:
            got = report.read_run_goodput(str(storage), name)
        except Exception:  # noqa: BLE001
            got = None
        if got is not None:
            return got
        time.sleep(1.0)
    return None


def _verdict(diffs: list[float]) -> str:
    """The CPU bench's verdict words (:mod:`benchmarks.stats`), here from the sign of every round's
    difference: a few rounds of several minutes each give no useful t-interval."""
    from benchmarks.stats import MET, MISSED, NOISE

    if diffs and min(diffs) > 0:
        return MET
    if diffs and max(diffs) < 0:
        return MISSED
    return NOISE


def _targets(rows: list[dict]) -> list[dict]:
    """cf_ray's ratio against Ray's default and Ray's best fixed interval (the ``k`` of the highest
    mean ratio over the rounds), per mode, judged on the per-round differences (:func:`_verdict`)."""
    out = []
    for mode in sorted({r["mode"] for r in rows}):
        ratio: dict[tuple[str, int | None], dict[int, float]] = {}
        for r in rows:
            if r["mode"] == mode and r.get("effective_training_ratio") is not None:
                ratio.setdefault((r["arm"], r["k"]), {})[r.get("round", 0)] = r["effective_training_ratio"]
        cf = next((v for (a, _), v in ratio.items() if a == "cf_adaptive"), None)
        if cf is None:
            continue
        fixed = {k: v for (a, k), v in ratio.items() if a == "ray_fixed"}
        ray = [("cf_ray's ratio above Ray's periodic default", v) for (a, _), v in ratio.items() if a == "ray_default"]
        if fixed:
            best = max(fixed, key=lambda k: statistics.mean(fixed[k].values()))
            ray.append((f"cf_ray's ratio above Ray's best fixed interval (k={best})", fixed[best]))
        for target, theirs in ray:
            rounds = sorted(set(cf) & set(theirs))
            diffs = [cf[i] - theirs[i] for i in rounds]
            verdict = _verdict(diffs)
            out.append(
                {
                    "mode": mode,
                    "target": target,
                    "cf": statistics.mean(cf[i] for i in rounds) if rounds else None,
                    "ray": statistics.mean(theirs[i] for i in rounds) if rounds else None,
                    "rounds": len(rounds),
                    "diffs": diffs,
                    "verdict": verdict,
                    "met": verdict == "met",
                }
            )
    return out


def render(res: dict) -> str:
    cats = ("checkpoint_save", "checkpoint_restore", "wasted_progress", "recovery", "startup", "other")
    rounds = res.get("rounds", 1)
    lines = [
        f"# Real run with failures ({res['preset']}: mean {res['mtbf_s']:g} s between kills, "
        f"{res['duration_s']:g} s of up-time per arm, {rounds} round(s))",
        "",
        "| mode | round | arm | k | ratio | final step | kills (planned) | wasted steps | " + " | ".join(cats) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(cats),
    ]
    for r in res["rows"]:
        head = f"| {r['mode']} | {r.get('round', 0)} | {r['arm']} | {r.get('k') or 'auto'} |"
        if r.get("wall_s") is None:
            why = r.get("error") or r.get("fit_error")
            lines.append(f"{head} error: {why} |")
            continue
        bad = r["badput_s"]
        lines.append(
            f"{head} {r['effective_training_ratio']:.3f} | {r['final_step']} | {r['kills']} "
            f"({r.get('planned_kills', '?')}) | {r['wasted_steps']} | "
            + " | ".join(f"{bad[c]:.1f} s" for c in cats)
            + " |"
        )
    lines += [
        "",
        "| mode | target | cf_ray (mean) | Ray (mean) | cf_ray − Ray per round | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for t in res["targets"]:
        diffs = ", ".join(f"{d:+.3f}" for d in t.get("diffs", []))
        verdict = t.get("verdict") or ("met" if t["met"] else "missed")
        cf, ray = (f"{v:.3f}" if v is not None else "–" for v in (t["cf"], t["ray"]))
        lines.append(f"| {t['mode']} | {t['target']} | {cf} | {ray} | {diffs} | {verdict} |")
    return "\n".join(lines)


def _gaps(p: dict, seed: int) -> list[float]:
    """The failure trace of one round: gaps of up-time between kills, exponential of mean ``mtbf_s``."""
    rng = random.Random(seed)
    return [rng.expovariate(1.0 / p["mtbf_s"]) for _ in range(int(3 * p["duration_s"] / p["mtbf_s"]) + 10)]


def main(args: argparse.Namespace, argv: list[str]) -> int:
    import ray

    from benchmarks.bench import _host, _ray_env

    p = dict(FAIL_PRESETS[args.fail_preset])
    for key, val in (
        ("mtbf_s", args.fail_mtbf),
        ("duration_s", args.fail_duration),
        ("grace_s", args.fail_grace),
        ("epoch_steps", args.epoch_steps),
    ):
        if val is not None:
            p[key] = val
    if args.fail_grid:
        p["grid"] = [int(x) for x in args.fail_grid.split(",") if x.strip()]
    modes = [m for m in args.fail_modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {','.join(MODES)}")
    arms = _arms([a for a in args.fail_arms.split(",") if a], p["grid"], p["epoch_steps"])
    if args.fail_rounds < 1:
        raise SystemExit(f"--fail-rounds must be at least 1, not {args.fail_rounds}")
    traces = [_gaps(p, args.seed + r) for r in range(args.fail_rounds)]
    root = Path(args.out).resolve()  # Ray Train takes an absolute storage path only
    root.mkdir(parents=True, exist_ok=True)
    if ray.is_initialized():
        raise SystemExit("cf-ray bench --failures starts its own local Ray; call it without Ray initialised")
    env = _ray_env()
    os.environ.update(env)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    t0 = time.time()
    rows = []
    warm_up_s = None
    try:
        warm_up_s = _warm_up(p, root, args.seed)
        print(f"warm-up fit: {warm_up_s:.1f} s (not counted)", file=sys.stderr)
        for r, gaps in enumerate(traces):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]  # rotated: drift hits every arm alike
            for mode in modes:
                for arm, k in order:
                    rows.append(_one(mode, arm, k, p, gaps, root, args.seed, r))
                    print(f"{rows[-1]['name']}: ratio {rows[-1].get('effective_training_ratio')}", file=sys.stderr)
    finally:
        ray.shutdown()
    res = {
        "schema": SCHEMA,
        "command": "cf-ray bench " + " ".join(argv),
        "preset": args.fail_preset,
        **{k: p[k] for k in ("mtbf_s", "duration_s", "grace_s", "epoch_steps", "grid", "width", "layers", "batch")},
        "rounds": args.fail_rounds,
        "seed": args.seed,
        "gaps_s": traces[0],
        "gaps_by_round": traces,
        "host": _host(),
        "loadavg_start": os.getloadavg(),
        "wall_s": time.time() - t0,
        "warm_up_s": warm_up_s,
        "rows": rows,
    }
    res["targets"] = _targets(rows)
    path = Path(args.json) if args.json else root / "failures.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print(render(res))
    print(f"JSON: {path}")
    return 0
