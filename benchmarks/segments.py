"""The training loop of ``cf-ray bench`` (runs inside the TorchTrainer workers): the segments of
one CPU setting, each variant's saver in turn, and the recovery measurement.

A segment (``bench._plan``) is ``lead`` untimed iterations, then ``iters`` timed ones (the *window*),
then the saver's drain (untimed, its seconds recorded). For a variant that checkpoints every ``k``
iterations, ``lead`` is a multiple of ``k`` (at least 3), so the lead-in's last iteration takes a
checkpoint and the window, ``m x k`` iterations, holds exactly ``m`` whole periods: the training
thread's part of ``m`` checkpoints and the background part (copy, persist) of ``m`` (the lead-in's
and all but the last window's; the last one's runs in the drain). What is timed is each iteration
of the loop as a user's loop sees it: forward, backward, ``ckpt.step``/``optimizer.step`` and the
saver's ``save``; the background work competes with it for the cores.

Per segment, rank by rank, a JSON file: the window's iteration times, the worker's process and
training-thread CPU, and for cf_ray the checkpoint-path budget (``Checkpointer.cpu_budget``: over
the window, and from the window's start to the drain's end, which covers the background of the
window's checkpoints) and the holder's and controller's CPU (rank 0).
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any

from benchmarks.savers import (
    _barrier,
    _build_model,
    _CfSave,
    _CopyFloor,
    _DcpSave,
    _fsdp2,
    _MemMonitor,
    _NoSave,
    _RaySave,
    _read_json,
    _state_bytes,
    _trim_memory,
    _write_json,
)


def lead_for(k: int) -> int:
    """Untimed iterations before a segment's window: a multiple of ``k`` with at least two
    checkpoints and at least 3 iterations, so that both of cf_ray's snapshot slots have been filled
    once. (Until 2026-11-28 one checkpoint for ``k >= 3``: the window's first checkpoint filled the
    second slot for the first time, faulting its pages in; at k=10 that checkpoint stalled 0.2-0.86 s
    against 3-16 ms for the later ones, one of the window's four. A run of a user's loop pays it
    once, not every 40 iterations. Those faults were there because the fault-in ahead of the first
    checkpoint took no page, fixed on 2026-11-29; the lead-in keeps its two checkpoints.)"""
    return k * max(2, math.ceil(3 / k))


def window_for(k: int, iters: int) -> int:
    """Timed iterations of a segment at interval ``k``: whole periods, at least one, about ``iters``."""
    return k * max(1, math.ceil(iters / k))


def _delta(now: dict, before: dict) -> dict:
    """``now - before`` of two budgets (``{part: {field: value}}``) or actor CPU readings."""
    out: dict[str, Any] = {}
    for part, v in now.items():
        if isinstance(v, dict):
            b = before.get(part) or {}
            out[part] = {f: x - b.get(f, 0) for f, x in v.items()}
        elif v is not None and before.get(part) is not None:
            out[part] = v - before[part]
    return out


def _bench_loop(cfg: dict) -> None:
    """``train_loop_per_worker`` of one CPU setting: the segments, then (optionally) the recovery
    measurement, which restarts this worker group; restarted attempts skip finished segments."""
    import ray.train

    t_loop = time.time()
    ctx = ray.train.get_context()
    state_file = os.path.join(cfg["out_dir"], f"{cfg['setting']}.state.json")
    if cfg["plan"] and not _read_json(state_file).get("segments_done"):
        _run_segments(cfg, ctx, t_loop)
        _barrier()
        if ctx.get_world_rank() == 0:
            _write_json(state_file, {"segments_done": True})
        _barrier()
    if cfg.get("recovery"):
        _trim_memory()
        _recovery(dict(cfg["recovery"], out_dir=cfg["out_dir"]), ctx, t_loop)


def _warmup(cfg: dict, step, world: int) -> int:
    """``warmup`` iterations, then as many more as make ``warmup_s`` seconds (rank 0's clock, the same
    count on every rank): the first minute of a Ray Train job is slower (its processes start, the
    allocator grows), which made the first baseline segment the slowest in every earlier run."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    for i in range(cfg["warmup"]):  # creates Adam's state; first-touch costs are not measured
        step(i)
    per = (time.perf_counter() - t0) / max(1, cfg["warmup"])
    extra = torch.tensor([min(2000, max(0, math.ceil((cfg.get("warmup_s") or 0) / max(per, 1e-3)) - cfg["warmup"]))])
    if world > 1:
        dist.broadcast(extra, src=0)
    for i in range(int(extra.item())):
        step(cfg["warmup"] + i)
    return cfg["warmup"] + int(extra.item())


def _make_saver(cfg: dict, seg: dict, k: int, model, opt, rank: int, exp_path: str, dcp_pg):
    import cf_ray

    variant, name = seg["variant"], seg["name"]
    if variant == "none":
        return _NoSave()
    if variant in ("ray_sync", "ray_async"):
        return _RaySave(variant.split("_")[1], k, model, opt, rank, name)
    if variant == "dcp_async":
        return _DcpSave(k, model, opt, rank, os.path.join(exp_path, name, "dcp"), dcp_pg)
    if variant == "floor_copy":
        return _CopyFloor(k, model, opt)
    if variant in ("cf_fixed", "cf_auto", "cf_held"):
        policy = (
            cf_ray.FixedInterval(every=k)
            if variant == "cf_fixed"
            else cf_ray.FixedInterval(every=k, persist_every=int(cfg.get("held_persist_every", 20)))
            if variant == "cf_held"
            else cf_ray.Adaptive(budget_pct=cfg.get("budget_pct", 5.0))
        )
        return _CfSave(policy, model, opt, rank, exp_path, name, register=cfg["cf_register"])
    raise ValueError(f"unknown variant {variant!r}")


def _run_segments(cfg: dict, ctx, t_loop: float) -> None:
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    exp_path = ctx.get_storage().experiment_fs_path
    mon = _MemMonitor()
    rss_before_model, anon_before_model, _ = _MemMonitor.read()
    torch.manual_seed(cfg["seed"])
    if cfg.get("parallel") == "fsdp2":
        model = _fsdp2(_build_model(cfg["width"], cfg["layers"]), world)
    else:
        model = ray.train.torch.prepare_model(_build_model(cfg["width"], cfg["layers"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1 + rank)
    batches = [
        (torch.randn(cfg["batch"], cfg["width"], generator=gen), torch.randn(cfg["batch"], cfg["width"], generator=gen))
        for _ in range(4)
    ]
    on_cuda = cfg.get("device") == "cuda"
    if on_cuda:  # benchmarks/gpu_e2e.py: the model is on the worker's GPU (prepare_model put it there)
        device = ray.train.torch.get_device()
        batches = [(x.to(device), y.to(device)) for x, y in batches]

    def forward_backward(i: int) -> None:
        x, y = batches[i % len(batches)]
        F.mse_loss(model(x), y).backward()

    def synced() -> None:
        """On a GPU an iteration's time is the device's: wait for its kernels before the clock reads."""
        if on_cuda:
            torch.cuda.synchronize()

    def plain_step(i: int) -> None:
        forward_backward(i)
        opt.step()
        opt.zero_grad()

    t_warm = time.perf_counter()
    warmup_iters = _warmup(cfg, plain_step, world)
    warmup_s = time.perf_counter() - t_warm
    state_bytes = _state_bytes(model, opt)
    rank_state_bytes = _state_bytes(model, opt, local=True)
    # DCP's own gloo group, as torchtitan gives async_save (on a GPU too: NCCL is the default group there).
    wants_dcp = any(s["variant"] == "dcp_async" for s in cfg["plan"])
    dcp_pg = dist.new_group(backend="gloo") if wants_dcp and (world > 1 or on_cuda) else None
    out_dir = cfg["out_dir"]
    auto_k = None  # the interval Adaptive chose in the latest cf_auto segment (the same on every rank)
    for seg in cfg["plan"]:
        name, variant, k = seg["name"], seg["variant"], seg["k"]
        lead, iters = seg["lead"], seg["iters"]
        if seg.get("probe") is not None:
            if not auto_k or auto_k + seg["probe"] < 1:
                continue  # no interval chosen, or k - 1 == 0
            k = auto_k + seg["probe"]
            lead, iters = lead_for(k), window_for(k, cfg["iters"])
        _trim_memory()
        mon.reset()
        rss_start, anon_start, shmem_start = _MemMonitor.read()
        t_setup = time.perf_counter()
        saver = _make_saver(cfg, seg, k, model, opt, rank, exp_path, dcp_pg)
        setup_s = time.perf_counter() - t_setup
        cf = isinstance(saver, _CfSave)
        _barrier()
        actors = {"setup": saver.actors_cpu() if cf and rank == 0 else None}
        stalls: list[float] = []
        due_n = 0

        def iteration(i: int, saver=saver, cf=cf, stalls=stalls) -> bool:
            nonlocal due_n
            forward_backward(i)
            took = False
            if cf:
                took = saver.ckpt.step(opt)
            else:
                if isinstance(saver, _CopyFloor):
                    saver.guard()
                opt.step()
            opt.zero_grad()
            if saver.due(i):
                stalls.append(saver.save(i))
                due_n += 1
                took = True
            return took

        t_lead = time.perf_counter()
        for i in range(1, lead + 1):
            iteration(i)
        lead_s = time.perf_counter() - t_lead
        stalls.clear()
        due_n = 0
        budget0 = saver.budget() if cf else {}
        taken0 = saver.taken() if cf else 0
        if cf and rank == 0:
            actors["window_start"] = saver.actors_cpu()
        times = []
        cpu0, thread0 = time.process_time(), time.thread_time()
        wall_start = time.time()
        synced()
        t_seg = time.perf_counter()
        for i in range(lead + 1, lead + iters + 1):
            t0 = time.perf_counter()
            iteration(i)
            synced()
            times.append(time.perf_counter() - t0)
        loop_s = time.perf_counter() - t_seg
        wall_end = time.time()
        cpu_s, thread_cpu_s = time.process_time() - cpu0, time.thread_time() - thread0
        budget1 = saver.budget() if cf else {}
        ckpts_window = (saver.taken() - taken0) if cf else due_n
        if cf and rank == 0:
            actors["window_end"] = saver.actors_cpu()
        t_drain = time.perf_counter()
        saver.drain()
        drain_s = time.perf_counter() - t_drain
        rec: dict[str, Any] = {
            "segment": name,
            "variant": variant,
            "k": k,
            "round": seg["round"],
            "rank": rank,
            "world_size": world,
            "probe": seg.get("probe"),
            "lead": lead,
            "lead_s": lead_s,
            "iter_s": times,
            "stall_s": list(stalls),
            "ckpts_window": ckpts_window,
            "loop_s": loop_s,
            "drain_s": drain_s,
            "setup_s": setup_s,
            "warmup_iters": warmup_iters,
            "warmup_s": warmup_s,
            "state_bytes": state_bytes,
            "rank_state_bytes": rank_state_bytes,
            "rss_before_model": rss_before_model,
            "anon_before_model": anon_before_model,
            "rss_start": rss_start,
            "anon_start": anon_start,
            "shmem_start": shmem_start,
            "wall_start": wall_start,
            "wall_end": wall_end,
            "loop_entered": t_loop,
            "cpu_s": cpu_s,
            "train_thread_cpu_s": thread_cpu_s,
        }
        if cf:
            rec["budget_window"] = _delta(budget1, budget0)
            rec["budget_to_drain"] = _delta(saver.budget(), budget0)  # the window's checkpoints' background
            _barrier()  # every rank's wait() has sent its last timing sample to the controller
            if rank == 0:
                actors["drained"] = saver.actors_cpu()
                a = actors
                if a.get("window_start") and a.get("window_end"):
                    rec["actors_cpu_window_s"] = _delta(a["window_end"], a["window_start"])
                if a.get("setup") and a.get("drained"):
                    rec["actors_cpu_segment_s"] = _delta(a["drained"], a["setup"])
                rec["profile_rows"], rec["controller_summary"] = saver.profile()
                rec["holder_held"] = saver.held()
            t_fin = time.perf_counter()
            rec.update(saver.finish())
            saver.ckpt.finish()
            rec["finish_s"] = time.perf_counter() - t_fin
        else:
            rec.update(saver.finish())
        rec.update(peak_rss=mon.peak, peak_rss_anon=mon.peak_anon, peak_rss_shmem=mon.peak_shmem)
        _write_json(os.path.join(out_dir, f"{name}.rank{rank}.json"), rec)
        saver = None
        if variant == "cf_auto":
            chosen = torch.tensor([int((rec.get("controller_summary") or {}).get("interval") or 0)])
            if world > 1:
                dist.broadcast(chosen, src=0)
            auto_k = int(chosen.item())
        _barrier()
    mon.stop()


def _recovery(cfg: dict, ctx, t_attempt: float) -> None:
    """For each restore source: train to the kill step, SIGKILL rank 1 (Ray Train restarts the
    group); in the next attempt restore, and time the first resumed iteration."""
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    import cf_ray

    torch.set_num_threads(1)
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    exp_path = ctx.get_storage().experiment_fs_path
    state_file = os.path.join(cfg["out_dir"], "recovery_state.json")
    state = _read_json(state_file)
    torch.manual_seed(cfg["seed"])
    t_model = time.time()
    model = ray.train.torch.prepare_model(_build_model(cfg["width"], cfg["layers"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1 + rank)
    x, y = (
        torch.randn(cfg["batch"], cfg["width"], generator=gen),
        torch.randn(cfg["batch"], cfg["width"], generator=gen),
    )
    k, kill_step = cfg["every"], cfg["kill_step"]
    for source in ("memory", "storage"):
        info = state.get(source, {})
        if info.get("done"):
            continue
        conf = cf_ray.CheckpointConfig(
            policy=cf_ray.FixedInterval(every=k),
            keep_last=2,
            storage_path=exp_path,
            run_name=f"recovery-{source}",
            restore_from=source,
            final_model=None,
            register_with_ray=False,
        )
        t_ckpt = time.time()
        ckpt = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=conf)
        t_restore = time.time()
        resume = ckpt.restore()
        t_restored = time.time()
        resumed = bool(info.get("killed"))
        stop_at = resume.step + cfg["after_resume"] if resumed else kill_step
        first_done = None
        while ckpt.step_count < stop_at:
            F.mse_loss(model(x), y).backward()
            ckpt.step(opt)
            opt.zero_grad()
            if first_done is None:
                first_done = time.time()
            if not resumed and ckpt.step_count == kill_step - 1:
                ckpt.wait()  # the last interval's checkpoint is durable: memory and storage hold the same step
        if not resumed:
            if rank == world - 1:
                state[source] = {
                    "killed": True,
                    "kill_time": time.time(),
                    "kill_step": ckpt.step_count,
                    "interval": k,
                    "state_bytes": _state_bytes(model, opt),
                    "killed_rank": rank,
                }
                _write_json(state_file, state)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # the other ranks: blocked until Ray Train tears the group down
            return
        ckpt.finish()
        mine = {
            "attempt_start": t_attempt,
            "model_start": t_model,
            "checkpointer_start": t_ckpt,
            "restore_start": t_restore,
            "restore_end": t_restored,
            "first_iteration_end": first_done,
            "resume_source": resume.source,
            "resume_step": resume.step,
            "resume_seconds": resume.seconds,
            "generation": resume.generation,
        }
        _write_json(os.path.join(cfg["out_dir"], f"recovery-{source}.rank{rank}.json"), mine)
        _barrier()
        if rank == 0:
            state[source] = dict(info, done=True)
            _write_json(state_file, state)
        _barrier()
        state = _read_json(state_file)
        del ckpt
