"""The GPU run of issue #25, end to end, on one lent GPU within a few minutes: ``TorchTrainer`` with a
CUDA model (one worker, NCCL), cf_ray at k=1 and k=10 against DCP ``async_save`` and Ray's ASYNC
report, the step-time overhead with its interval, and a worker SIGKILLed and restored bitwise (from
memory and from storage).

    python benchmarks/gpu_e2e.py --out DIR                      # on the GPU machine (benchmarks/gpu_run.sh)
    python benchmarks/gpu_e2e.py --out DIR --device cpu --quick # the same logic on a CPU, small

One worker: NCCL refuses two ranks on one device, and a lent machine has one. Phases, each its own
process with its own Ray and a time limit, each writing its part as it ends, so one that fails or
runs out of time loses nothing of the others:

* ``overhead``: one ``fit()``, the benchmark's interleaved segments (``benchmarks/segments.py``:
  rounds, a baseline around every segment, windows of whole periods, the iteration time taken after
  ``torch.cuda.synchronize()``): ``none``, ``cf_fixed`` k=1 and k=10, ``dcp_async`` k=10 and
  ``ray_async`` k=10 (``ray.train.report(..., checkpoint_upload_mode=CheckpointUploadMode.ASYNC)``);
  the k=1 targets of the issue (step-time overhead <= 5 %) judged from the interval over rounds.
* ``recovery``: ``FixedInterval(k)``; at step ``2k`` the model's and optimizer's bytes are hashed
  (SHA-256) and the checkpoint awaited, the worker trains on and SIGKILLs itself mid-interval; Ray
  Train restarts it (``max_failures``), cf_ray restores (``restore_from="memory"``, then a second run
  with ``"storage"``), and the restored state's hash must be the one taken at that step.

Writes ``DIR/gpu_e2e.json`` (every figure, rewritten after each phase), ``DIR/gpu_e2e.md`` (the
table) and ``DIR/gpu_e2e.<phase>.log``; checkpoints go to ``--scratch`` (not ``DIR``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

SIZES = {
    # ~1.2 GB of model + Adam state, ~0.1 s per iteration on an H100 (fp32).
    "cuda": dict(width=4096, layers=6, batch=8192, iters=20, rounds=2, every=5),
    "quick": dict(width=256, layers=2, batch=16, iters=6, rounds=2, every=2),
}
PHASES = {"overhead": 160.0, "recovery": 110.0}  # seconds of the default budget (their shares of --budget-s)


# ================================================================================================
# Worker side
# ================================================================================================


def _digest(model, opt) -> str:
    """SHA-256 of the model's and the optimizer's tensors (bytes, in state-dict order) and the rest of
    the optimizer's state (step counts, hyper-parameters) as JSON."""
    import torch

    h = hashlib.sha256()
    other: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                other.append(str(k))
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            other.append(repr(x))

    walk(model.state_dict())
    walk(opt.state_dict())
    h.update(json.dumps(other).encode())
    return h.hexdigest()


def _recovery_loop(cfg: dict) -> None:
    """Per source: train to a checkpoint, hash it, train on, SIGKILL; restored: compare the hash."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    import cf_ray
    from benchmarks.savers import _build_model, _read_json, _state_bytes, _write_json

    t_attempt = time.time()
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    exp_path = ctx.get_storage().experiment_fs_path
    state_file = os.path.join(cfg["out_dir"], "recovery_state.json")
    state = _read_json(state_file)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(_build_model(cfg["width"], cfg["layers"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["batch"], cfg["width"], generator=gen).to(device)
    y = torch.randn(cfg["batch"], cfg["width"], generator=gen).to(device)
    k = cfg["every"]
    for source in ("memory", "storage"):
        info = state.get(source, {})
        if info.get("done"):
            continue
        conf = cf_ray.CheckpointConfig(
            policy=cf_ray.FixedInterval(every=k),
            keep_last=2,
            storage_path=exp_path,
            run_name=f"gpu-recovery-{source}",
            restore_from=source,
            final_model=None,
            register_with_ray=False,
        )
        ckpt = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=conf)
        t_restore = time.time()
        resume = ckpt.restore()
        t_restored = time.time()
        if info.get("killed"):
            got = _digest(model, opt)
            first = None
            for _ in range(2):
                F.mse_loss(model(x), y).backward()
                ckpt.step(opt)
                opt.zero_grad()
                if first is None:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    first = time.time()
            ckpt.finish()
            state[source] = dict(
                info,
                done=True,
                resume_source=resume.source,
                resume_step=resume.step,
                restore_s=resume.seconds,
                restore_phases=resume.phases,
                read_bytes=resume.read_bytes,
                digest_restored=got,
                bitwise=got == info.get("digest"),
                kill_to_restart_s=t_attempt - info["kill_time"],
                kill_to_first_iteration_s=(first or t_restored) - info["kill_time"],
                restore_wall_s=t_restored - t_restore,
            )
            _write_json(state_file, state)
            continue
        target, kill_at = 2 * k, 2 * k + max(1, k // 2)
        while ckpt.step_count < kill_at:
            F.mse_loss(model(x), y).backward()
            took = ckpt.step(opt)
            opt.zero_grad()
            if took and ckpt.step_count == target:
                ckpt.wait()  # durable: memory and storage hold the same step
                info = {"step": target, "digest": _digest(model, opt), "state_bytes": _state_bytes(model, opt)}
        state[source] = dict(info, killed=True, kill_step=ckpt.step_count, kill_time=time.time(), interval=k)
        _write_json(state_file, state)
        os.kill(os.getpid(), signal.SIGKILL)


# ================================================================================================
# Phases (each its own process)
# ================================================================================================


def _ray_init(device: str) -> None:
    import ray

    from benchmarks.bench import _ray_env

    env = _ray_env()
    os.environ.update(env)
    ray.init(
        address="local",
        num_cpus=max(2, os.cpu_count() or 2),
        num_gpus=1 if device == "cuda" else 0,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )


def _fit(loop, cfg: dict, name: str, storage: Path, device: str, max_failures: int = 0):
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        loop,
        train_loop_config=cfg,
        torch_config=TorchConfig(backend="nccl" if device == "cuda" else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=1, use_gpu=device == "cuda", resources_per_worker={"CPU": 1}
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(storage),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def phase_overhead(args, size: dict, scratch: Path) -> dict:
    from benchmarks import segments, stats
    from benchmarks.bench import _plan
    from benchmarks.results import _aggregate_setting

    matrix = {"none": [0], "cf_fixed": [1, 10], "dcp_async": [10], "ray_async": [10]}
    plan = _plan(matrix, size["rounds"], size["iters"], "gpu", probes=False)
    seg_dir = scratch / "segments"
    seg_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "setting": "gpu",
        "width": size["width"],
        "layers": size["layers"],
        "batch": size["batch"],
        "warmup": 5,
        "warmup_s": 10.0 if args.device == "cuda" else 0.0,
        "iters": size["iters"],
        "seed": 0,
        "plan": plan,
        "out_dir": str(seg_dir),
        "cf_register": False,
        "budget_pct": 2.0,
        "parallel": "ddp",
        "device": args.device,
        "recovery": None,
    }
    _ray_init(args.device)
    error = None
    try:
        _fit(segments._bench_loop, cfg, "gpu-overhead", scratch, args.device)
    except Exception as e:  # noqa: BLE001 - what was measured is reported with the failure
        error = f"{type(e).__name__}: {e}"
    variants, extra = _aggregate_setting("gpu", 1, "one GPU worker", seg_dir, plan, str(scratch / "gpu-overhead"))
    for v in variants:
        v.pop("iter_s_by_segment", None)
        v.pop("schedules", None)
    by = {v["id"]: v for v in variants}
    targets = []
    k1 = by.get("gpu/cf_fixed/k1")
    if k1:
        targets.append(
            {
                "target": "GPU: k=1 step-time overhead <= 5 %",
                "measured": k1["overhead_pct"],
                "interval": [k1["overhead_interval"].get("lo"), k1["overhead_interval"].get("hi")],
                "verdict": stats.judge(k1["overhead_interval"], 5.0),
            }
        )
    for other in ("dcp_async", "ray_async"):
        cf, o = by.get("gpu/cf_fixed/k10"), by.get(f"gpu/{other}/k10")
        if cf and o:
            common = sorted(set(cf["overhead_pct_per_round"]) & set(o["overhead_pct_per_round"]), key=int)
            d = [cf["overhead_pct_per_round"][r] - o["overhead_pct_per_round"][r] for r in common]
            iv = stats.interval(d, extra.get("baseline_noise_pct"))
            targets.append(
                {
                    "target": f"GPU: k=10 cf_ray overhead < {other} (per-round difference <= 0)",
                    "measured": iv["mean"],
                    "interval": [iv.get("lo"), iv.get("hi")],
                    "verdict": stats.judge(iv, 0.0),
                }
            )
    return {"variants": variants, "baseline": extra, "targets": targets, "error": error}


def phase_recovery(args, size: dict, scratch: Path) -> dict:
    from benchmarks.savers import _read_json

    out_dir = scratch / "recovery"
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {k: size[k] for k in ("width", "layers", "batch", "every")}
    cfg["out_dir"] = str(out_dir)
    _ray_init(args.device)
    error = None
    mod = __import__("benchmarks.gpu_e2e", fromlist=["_recovery_loop"])
    try:
        _fit(mod._recovery_loop, cfg, "gpu-recovery", scratch, args.device, max_failures=2)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    state = _read_json(str(out_dir / "recovery_state.json"))
    return {"sources": state, "error": error}


# ================================================================================================
# Driver
# ================================================================================================


def _env(device: str) -> dict:
    out: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "device": device}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
            out["gpu_mem_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
    except Exception as e:  # noqa: BLE001
        out["torch_error"] = repr(e)
    try:
        import ray

        out["ray"] = ray.__version__
        import cf_ray

        out["cf_ray"] = cf_ray.__version__
    except Exception as e:  # noqa: BLE001
        out["import_error"] = repr(e)
    return out


def _run_phase(name: str, args, out: Path, limit: float) -> dict:
    """The phase in its own process group, killed (with its Ray) at ``limit`` seconds."""
    part = out / f"gpu_e2e.{name}.part.json"
    log = out / f"gpu_e2e.{name}.log"
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, "--out", str(out), "--device", args.device]
    cmd += ["--scratch", args.scratch] + (["--quick"] if args.quick else [])
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Ray's processes of a killed phase: stop them (they may sit in their own sessions).
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, timeout=60)
    res = json.loads(part.read_text()) if part.exists() else {}
    part.unlink(missing_ok=True)
    state = Path(args.scratch) / name / "recovery" / "recovery_state.json"
    if not res and state.exists():  # the recovery ran out of time: what it recorded so far
        res = {"sources": json.loads(state.read_text()), "error": "partial: the phase did not end"}
    _trim(log)
    return dict(res, status=status, wall_s=time.time() - t0)


def _trim(log: Path, keep: int = 4 << 20) -> None:
    if log.exists() and log.stat().st_size > keep:
        data = log.read_bytes()[-keep:]
        log.write_bytes(b"[... cut ...]\n" + data)


def _num(x, spec: str = ".2f") -> str:
    return "–" if not isinstance(x, (int, float)) else format(x, spec)


def render(res: dict) -> str:
    env = res.get("env", {})
    lines = [
        f"## GPU run ({env.get('gpu', env.get('device'))}, torch {env.get('torch')}, Ray {env.get('ray')}, "
        f"cf_ray {env.get('cf_ray')})",
        "",
    ]
    ov = res.get("overhead") or {}
    base = ov.get("baseline") or {}
    m = res.get("size", {})
    lines.append(
        f"Model {m.get('layers')} x Linear({m.get('width')}) + Adam, batch {m.get('batch')}; one worker "
        f"({'NCCL' if env.get('device') == 'cuda' else 'gloo'}); "
        f"baseline {1e3 * (base.get('baseline_iter_mean_s') or float('nan')):.1f} ms/iteration, drift "
        f"{base.get('baseline_drift_pct') or float('nan'):.1f} %; phase {ov.get('status')} in {ov.get('wall_s', 0):.0f} s"
        + (f"; error: {ov['error']}" if ov.get("error") else "")
    )
    lines += [
        "",
        "| variant | k | step ms | overhead % [95 %] | rounds | stall/ckpt ms | ckpts |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in ov.get("variants", []):
        iv = v.get("overhead_interval") or {}
        stall = v.get("stall_per_ckpt_s")
        lines.append(
            f"| {v['label']} | {v['k'] or '–'} | {1e3 * v['iter_mean_s']:.1f} | {v['overhead_pct']:+.1f} "
            f"[{iv.get('lo') if iv.get('lo') is None else round(iv['lo'], 1)}, "
            f"{iv.get('hi') if iv.get('hi') is None else round(iv['hi'], 1)}] | {v['rounds']} "
            f"| {'–' if stall is None else f'{1e3 * stall:.1f}'} | {v.get('checkpoints_window')} |"
        )
    for v in ov.get("variants", []):
        b = v.get("cpu_breakdown")
        if b:
            parts = ", ".join(f"{p} {x['cpu_ms_per_ckpt']:.1f}" for p, x in b.items() if p != "total")
            holder = v.get("holder_cpu_ms_per_ckpt")
            lines.append(
                f"\n{v['id']}: worker CPU ms per checkpoint: {parts}; holder "
                f"{'–' if holder is None else f'{holder:.0f}'} ms per checkpoint"
            )
    lines += ["", "| target | measured [interval] | verdict |", "|---|---|---|"]
    for t in ov.get("targets", []):
        lo, hi = t["interval"]
        shown = "–" if t["measured"] is None else f"{t['measured']:+.1f}"
        if lo is not None and hi is not None:
            shown += f" [{lo:+.1f}, {hi:+.1f}]"
        lines.append(f"| {t['target']} | {shown} | {t['verdict']} |")
    rec = res.get("recovery") or {}
    lines += [
        "",
        f"Recovery ({rec.get('status')}, {rec.get('wall_s', 0):.0f} s)"
        + (f": {rec['error']}" if rec.get("error") else ""),
    ]
    lines += [
        "",
        "| restore from | step | got | bitwise | restore s | kill → first iteration s |",
        "|---|---|---|---|---|---|",
    ]
    for src, r in (rec.get("sources") or {}).items():
        lines.append(
            f"| {src} | {r.get('step')} | {r.get('resume_source')} @ {r.get('resume_step')} | {r.get('bitwise')} "
            f"| {_num(r.get('restore_s'))} | {_num(r.get('kill_to_first_iteration_s'))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the JSON, the table and the logs go")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="a tiny model (the CPU check of the logic)")
    p.add_argument("--scratch", default="/tmp/cf_gpu_e2e", help="checkpoint storage (deleted at the start)")
    p.add_argument("--budget-s", type=float, default=sum(PHASES.values()), help="seconds for all phases")
    p.add_argument("--phases", default=",".join(PHASES), help="which phases to run (default: %(default)s)")
    p.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    for k in ("width", "layers", "batch", "iters", "rounds", "every"):
        p.add_argument(f"--{k}", type=int)
    args = p.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "cuda"])
    size.update({k: getattr(args, k) for k in size if getattr(args, k, None) is not None})
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch).resolve()
    if args.phase:  # one phase, in its own process
        fn = {"overhead": phase_overhead, "recovery": phase_recovery}[args.phase]
        res = fn(args, size, scratch / args.phase)
        (out / f"gpu_e2e.{args.phase}.part.json").write_text(json.dumps(res, default=str))
        return 0
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_e2e: no CUDA device here: nothing to measure (use --device cpu --quick for the logic)")
            return 0
    res: dict[str, Any] = {"schema": "cf_ray.gpu_e2e/1", "env": _env(args.device), "size": size, "argv": argv}
    path = out / "gpu_e2e.json"
    t_end = time.time() + args.budget_s
    chosen = {n: PHASES[n] for n in args.phases.split(",") if n in PHASES}
    for name, share in chosen.items():
        limit = min(share * args.budget_s / sum(chosen.values()), t_end - time.time())
        if limit < 20:
            res[name] = {"status": "skipped: no time left"}
        else:
            res[name] = _run_phase(name, args, out, limit)
        path.write_text(json.dumps(res, indent=1, default=str))
        (out / "gpu_e2e.md").write_text(render(res))
    shutil.rmtree(scratch, ignore_errors=True)
    print(render(res))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
