"""``cf-ray bench``: cf_ray against what a Ray Train user would otherwise use, in one invocation.

What runs (see ``docs/benchmarks/json-keys.md`` for every JSON key):

* **Machine limits**, measured first in the same invocation: host memcpy bandwidth (one thread,
  as the snapshot copy runs), storage write+fsync bandwidth (16 MiB chunks, as cf_ray writes),
  CRC-32 throughput (ISA-L's, as cf_ray uses; cf_ray checksums every byte it persists) and the first touch of newly
  allocated memory (page faults; slow on VMs, and every new host buffer pays it once).
* **The reference job** (``TorchTrainer``, gloo, DDP, ``n x Linear(w, w)`` + Adam, synthetic data,
  fixed seed), once per CPU setting: every core busy (2 workers x 1 thread on 2 cores) and one
  core left free (1 worker). Inside *one* ``fit()`` per setting, after a warm-up of at least
  ``--warmup-s`` seconds, the variants run as *segments* of the same loop on the same model and
  optimizer, interleaved in rounds (A B C, B C A, ...): every round opens with a no-checkpoint
  segment and the run ends with one, so each segment's overhead is taken against the baseline of
  its own time, each variant gets one overhead per round, and the verdicts come from the spread
  over rounds (``benchmarks/stats.py``). A segment (``benchmarks/segments.py``) is an untimed
  lead-in ending with a checkpoint, a timed window of whole checkpoint periods (every iteration
  of the loop as a user's loop sees it: forward, backward, ``ckpt.step``/``optimizer.step`` and
  the save, with the background work competing for the cores), then an untimed drain:

  ``none``       no checkpointing;
  ``ray_sync``   Ray Train's documented way: rank 0 ``torch.save`` into a temporary directory,
                 every rank ``ray.train.report(checkpoint=Checkpoint.from_directory(...))``, SYNC;
  ``ray_async``  the same with ``CheckpointUploadMode.ASYNC``;
  ``dcp_async``  ``torch.distributed.checkpoint.async_save`` (own gloo group), the previous save
                 awaited before the next one, as torchtitan does;
  ``cf_fixed``   ``cf_ray.Checkpointer`` with ``FixedInterval(every=k)`` (which snapshots are written
                 measured: the default ``persist_every=None``);
  ``cf_auto``    ``cf_ray.Checkpointer`` with ``Adaptive(budget_pct=--budget-pct)`` (2 % by default),
                 followed by two *probes*: ``cf_fixed`` at the interval ``k`` it chose and at ``k - 1``,
                 so the output shows whether ``k`` is within the budget and the shortest interval that is;
  ``cf_held``    ``cf_ray.Checkpointer`` with ``FixedInterval(every=k, persist_every=--held-persist-every)``:
                 one snapshot in N written to storage, the others held in memory only (1: every one;
                 not run unless named in ``--variants``);
  ``floor_copy`` one copy of the state per checkpoint on a guarded thread and nothing else.

  For cf_ray: the per-checkpoint CPU breakdown of the worker (``Checkpointer.cpu_budget``) and
  the holder's and controller's CPU per checkpoint.

* **Recovery** (a larger model: ~1 GB of state with ``--full``, the 302 MB reference model with
  ``--quick``), inside the first 2-worker ``fit()`` (``max_failures=2``; restarted attempts skip the
  finished segments): rank 1 is SIGKILLed mid-interval twice, once restoring from memory and once
  from storage.

Ray's report throttle (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, default 2 s) is lowered to 0.05 s
for the whole invocation, so that Ray's own ways are not penalised by a polling period.

It lives outside the installed package, in the repository's ``benchmarks/`` package. Ray pickles
the loops by reference, so the workers get the repository root on their ``PYTHONPATH`` through
the ``runtime_env`` of the local Ray it starts (``_ray_env``). Run it as ``cf-ray bench`` (from
a clone of the repository), ``python -m benchmarks.bench`` or ``python benchmarks/bench.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.render import plot, render_markdown, render_readme
from benchmarks.results import LABELS, VARIANTS, _aggregate_setting, _recovery_summary, _targets
from benchmarks.savers import _json_default
from benchmarks.segments import lead_for, window_for

__all__ = ["LABELS", "SCHEMA", "VARIANTS", "build_parser", "main", "render_markdown", "render_readme", "run"]

SCHEMA = "cf_ray.bench/2"

SETTINGS = {
    2: ("w2", "every core busy: 2 workers x 1 thread on 2 cores"),
    1: ("w1", "one core left free: 1 worker x 1 thread"),
}
HEALTH_CHECK_S = "0.05"
_MiB = 1024 * 1024

PRESETS: dict[str, dict[str, Any]] = {
    # Short on 2 cores (~5 min): a smaller model, k = 10 for every variant (and k = 1 for cf_ray),
    # two rounds of 20-iteration windows, a reduced second setting.
    "quick": dict(
        width=1024,
        layers=6,
        batch=32,
        iters=20,
        warmup=5,
        warmup_s=5.0,
        rounds=2,
        workers=[2, 1],
        matrix={
            "none": [0],
            "ray_sync": [10],
            "ray_async": [10],
            "dcp_async": [10],
            "cf_fixed": [1, 10],
            "cf_auto": [0],
        },
        matrix_w1={"none": [0], "ray_sync": [10], "cf_fixed": [1, 10], "floor_copy": [1]},
        large_width=2048,
        large_layers=6,
        large_batch=8,
        rec_every=2,
        rec_kill_step=5,
        budget_s=300,
    ),
    # The reference job of the issue: 6 x Linear(2048, 2048) + Adam (~302 MB of state), k in {1, 10},
    # the floor at k = 1, three rounds of 40-iteration windows (whole periods) after a 30 s warm-up:
    # ~55 min on 2 cores; --rounds 5 for tighter intervals, --ks 1,10,50 for the old matrix.
    "full": dict(
        width=2048,
        layers=6,
        batch=32,
        iters=40,
        warmup=5,
        warmup_s=30.0,
        rounds=3,
        workers=[2, 1],
        matrix={
            "none": [0],
            "ray_sync": [1, 10],
            "ray_async": [1, 10],
            "dcp_async": [1, 10],
            "cf_fixed": [1, 10],
            "cf_auto": [0],
            "floor_copy": [1],
        },
        matrix_w1=None,
        large_width=2048,
        large_layers=20,
        large_batch=8,
        rec_every=5,
        rec_kill_step=14,
        budget_s=None,
    ),
}


# ================================================================================================
# Driver side
# ================================================================================================


def measure_limits(directory: Path, nbytes: int) -> dict:
    """Host memcpy (one thread), storage write+fsync and CRC-32 bandwidths, in GB/s (1e9 B/s)."""
    import numpy as np
    import torch

    from cf_ray._engine.storage.base import _crc32

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 256 * _MiB
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        memcpy = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            memcpy.append(n / (time.perf_counter() - t0) / 1e9)
        touch = []
        for _ in range(3):
            t0 = time.perf_counter()
            fresh = torch.empty(n, dtype=torch.uint8)
            fresh.fill_(1)  # page faults: the cost of any newly allocated host buffer
            touch.append(n / (time.perf_counter() - t0) / 1e9)
            del fresh
        buf = src.numpy()
        crc = []
        for _ in range(3):
            t0 = time.perf_counter()
            _crc32(memoryview(buf))
            crc.append(n / (time.perf_counter() - t0) / 1e9)
        del src, dst
    finally:
        torch.set_num_threads(threads)
    directory.mkdir(parents=True, exist_ok=True)
    chunk = np.random.default_rng(0).integers(0, 255, 16 * _MiB, dtype=np.uint8)
    write = []
    for i in range(3):
        path = directory / f"bandwidth_probe_{i}.bin"
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left > 0:
                mv = memoryview(chunk)[: min(left, chunk.nbytes)]
                while mv.nbytes:
                    mv = mv[os.write(fd, mv) :]
                left -= min(left, chunk.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        write.append(nbytes / (time.perf_counter() - t0) / 1e9)
        path.unlink()
    during = _memcpy_during_direct_write(directory, nbytes)
    return {
        **during,
        "memcpy_gbps": statistics.median(memcpy),
        "memcpy_gbps_best": max(memcpy),
        "memcpy_test_bytes": n,
        "storage_write_fsync_gbps": statistics.median(write),
        "storage_write_fsync_gbps_best": max(write),
        "storage_test_bytes": nbytes,
        "storage_path": str(directory),
        "crc32_gbps": statistics.median(crc),
        "first_touch_gbps": statistics.median(touch),
        "note": "medians of 5 (memcpy), 3 (storage, crc32) runs; GB = 1e9 bytes; one thread",
    }


def _memcpy_during_direct_write(directory: Path, nbytes: int) -> dict:
    """Memcpy bandwidth (one thread) while another thread writes ``nbytes`` with ``O_DIRECT`` from a
    page-aligned buffer, as the holder persists a slot: what the persist's DMA leaves of the memory
    bandwidth that training and the snapshot copy use."""
    import mmap

    import torch

    from cf_ray._engine.storage.direct_io import write_aligned

    buf = mmap.mmap(-1, 64 * _MiB)  # page-aligned, like a slot
    buf.write(os.urandom(1 << 20) * 64)
    path = directory / "bandwidth_probe_direct.bin"
    done = threading.Event()
    wrote: list[float] = []

    def writer() -> None:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left > 0 and not done.is_set():
                n = min(left, len(buf))
                write_aligned(fd, memoryview(buf)[:n])
                left -= n
            os.fsync(fd)
        finally:
            os.close(fd)
        wrote.append((nbytes - max(left, 0)) / (time.perf_counter() - t0) / 1e9)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = torch.ones(128 * _MiB, dtype=torch.uint8)
    dst = torch.zeros(128 * _MiB, dtype=torch.uint8)
    th = threading.Thread(target=writer, daemon=True)
    gbps = []
    try:
        th.start()
        while th.is_alive() and len(gbps) < 50:
            t0 = time.perf_counter()
            dst.copy_(src)
            gbps.append(src.numel() / (time.perf_counter() - t0) / 1e9)
    finally:
        done.set()
        th.join()
        torch.set_num_threads(threads)
        with contextlib.suppress(OSError):
            path.unlink()
        buf.close()
    return {
        "memcpy_gbps_during_direct_write": statistics.median(gbps) if gbps else None,
        "direct_write_gbps": wrote[0] if wrote else None,
    }


def _plan(matrix: dict[str, list[int]], rounds: int, iters: int, setting: str, *, probes: bool = True) -> list[dict]:
    """Segments interleaved in rounds: round r runs every (variant, k) block once, in the order
    rotated by r (A B C, B C A, C A B, ...), after a no-checkpoint segment; one more closes the run,
    so every segment has a baseline before and after it.

    Each segment has ``lead`` untimed iterations (a multiple of its ``k``, ending with a checkpoint)
    and ``iters`` timed ones (whole periods: ``window_for``). Every ``cf_auto`` segment is followed
    by two *probe* segments (unless ``probes`` is false), ``cf_fixed`` at the interval ``k`` Adaptive
    chose in it and at ``k - 1`` (``probe`` 0 and -1; ``k``, ``lead`` and ``iters`` resolved at run time).
    """
    blocks = []
    for v in VARIANTS:
        if v == "none":
            continue
        for k in matrix.get(v, []):
            probe_segs = [("cf_fixed", 0, 0), ("cf_fixed", 0, -1)] if v == "cf_auto" and probes else []
            blocks.append([(v, k, None), *probe_segs])
    has_base = "none" in matrix
    plan = []

    def add(r: int, j: int, v: str, k: int, probe: int | None) -> None:
        tag = "" if probe is None else ("-auto" if probe == 0 else "-auto-1")
        if v == "none":
            lead, n = 1, iters
        elif v == "cf_auto" or probe is not None:
            lead, n = 3, iters  # probes: resolved at run time
        else:
            lead, n = lead_for(k), window_for(k, iters)
        plan.append(
            {
                "name": f"{setting}-r{r}-{j:02d}-{v}" + (f"-k{k}" if k else "") + tag,
                "variant": v,
                "k": k,
                "round": r,
                "lead": lead,
                "iters": n,
                "probe": probe,
            }
        )

    for r in range(rounds):
        shift = r % len(blocks) if blocks else 0
        order = [seg for b in blocks[shift:] + blocks[:shift] for seg in b]
        seq = [("none", 0, None), *order] if has_base else order
        for j, (v, k, probe) in enumerate(seq):
            add(r, j, v, k, probe)
    if has_base:
        add(rounds, 0, "none", 0, None)  # closes the last round: its segments have a baseline after them
    return plan


_REPO_ROOT = str(Path(__file__).resolve().parents[1])


def _ray_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {
        # The workers import this module by name (the loops are pickled by reference).
        "PYTHONPATH": _REPO_ROOT + (os.pathsep + path if path else ""),
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": HEALTH_CHECK_S,
        # cf_ray's actors of finished segments go away quickly instead of holding snapshots 120 s.
        "CF_RAY_CONTROLLER_LINGER_S": "2",
        "OMP_NUM_THREADS": "1",
        "RAY_TRAIN_V2_ENABLED": "1",
    }


def _fit(loop, cfg: dict, workers: int, name: str, storage: Path, max_failures: int = 0, num_to_keep: int | None = 2):
    import ray.train
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        loop,
        train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(storage),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=num_to_keep),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def _host() -> dict:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0.0
    with contextlib.suppress(Exception):
        import psutil

        mem = psutil.virtual_memory().total / 1e9
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu or "unknown CPU",
        "cores": os.cpu_count(),
        "mem_gb": mem,
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
    }


# -- the run ------------------------------------------------------------------------------------


def _parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cf-ray bench",
        description="Benchmark cf_ray against Ray Train's own checkpointing (SYNC, ASYNC) and DCP async_save, "
        "in one invocation, against the machine's measured memcpy and storage bandwidth.",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--quick",
        dest="preset",
        action="store_const",
        const="quick",
        help="small model, k=10 (and k=1 for cf_ray), two rounds of 20-iteration windows: ~5 min on an idle 2-core machine",
    )
    g.add_argument(
        "--full",
        dest="preset",
        action="store_const",
        const="full",
        help="6 x Linear(2048) + Adam (~302 MB), k in {1,10} and the floor, three rounds, ~55 min on 2 cores (default)",
    )
    p.set_defaults(preset="full")
    p.add_argument("--out", default="results/bench", help="output directory (default: %(default)s)")
    p.add_argument("--json", default=None, help="results JSON path (default: OUT/results.json)")
    p.add_argument("--width", type=int, help="Linear width of the reference model")
    p.add_argument("--layers", type=int, help="number of Linear layers of the reference model")
    p.add_argument("--batch", type=int, help="batch size per worker")
    p.add_argument("--workers", type=_parse_ints, help="CPU settings as worker counts, e.g. 2,1")
    p.add_argument("--iters", type=int, help="timed iterations per segment (rounded up to whole periods of its k)")
    p.add_argument("--warmup", type=int, help="untimed iterations before the first segment (at least)")
    p.add_argument("--warmup-s", type=float, help="untimed seconds of training before the first segment (at least)")
    p.add_argument(
        "--rounds", type=int, help="rounds over all variants, interleaved (the order rotates); 2+ for intervals"
    )
    p.add_argument("--no-probes", action="store_true", help="skip the FixedInterval probes at Adaptive's k and k-1")
    p.add_argument("--ks", type=_parse_ints, help="checkpoint intervals for every variant, e.g. 1,10,50")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument(
        "--held-persist-every",
        type=int,
        default=20,
        help="cf_held's FixedInterval(persist_every=...): one snapshot in this many written (default: %(default)s)",
    )
    p.add_argument(
        "--budget-pct",
        type=float,
        default=2.0,
        help="cf_auto's Adaptive(budget_pct=...): the overhead budget in percent (default: %(default)s, "
        "the benchmark's target; the library's default is 5)",
    )
    p.add_argument(
        "--parallel",
        choices=["ddp", "fsdp2"],
        default="ddp",
        help="how the reference model is parallelised: ddp (ray.train.torch.prepare_model, the default) or "
        "fsdp2 (fully_shard per Linear on a CPU mesh: each worker checkpoints its shards; Ray's own "
        "variants and the recovery measurement are DDP-only and left out)",
    )
    p.add_argument("--large-width", type=int, help="Linear width of the recovery model")
    p.add_argument("--large-layers", type=int, help="number of Linear layers of the recovery model (~1 GB: 20)")
    p.add_argument("--no-recovery", action="store_true", help="skip the SIGKILL/restore measurement")
    p.add_argument(
        "--cf-register",
        action="store_true",
        help="register the cf_ray variants' checkpoints with Ray Train (off by default: the segments "
        "measure cf_ray's checkpoint path without Ray Train's bookkeeping, a ray.train.report of every "
        "rank at most every CF_RAY_REGISTER_INTERVAL_S)",
    )
    p.add_argument("--storage", default=None, help="checkpoint storage directory (default: OUT/work)")
    p.add_argument("--keep-storage", action="store_true", help="keep the checkpoints written (default: delete)")
    p.add_argument("--object-store-gb", type=float, default=None, help="Ray object store size in GB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--user-loop",
        action="store_true",
        help="the cross-check of #25 instead: a user's loop, one fit per variant (none, ray_sync, ray_async, "
        "cf_fixed with the default CheckpointConfig, cf_bench with the benchmark's), 80 iterations, the first "
        "5 dropped (--iters, --ks, --workers, --rounds, --variants apply); writes OUT/results-user-loop.json",
    )
    p.add_argument(
        "--render-readme",
        metavar="RESULTS_JSON",
        help="print the performance tables of docs/benchmarks/single-node.md, generated from RESULTS_JSON, and exit",
    )
    from benchmarks import (
        budget_run,
        cluster,
        failure_run,
        failure_sim,
    )  # multi-node (#12), failures (#26), budgets (#45)

    cluster.add_arguments(p)
    failure_sim.add_arguments(p)
    failure_run.add_arguments(p)
    budget_run.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from benchmarks.bytecode import precompile

    precompile()  # every worker of every variant imports cf_ray: not compiled again in each
    if args.render_readme:
        print(render_readme(json.loads(Path(args.render_readme).read_text())))
        return 0
    if args.cluster:
        from benchmarks import cluster

        return cluster.main(args, argv if argv is not None else sys.argv[1:])
    if args.simulate:
        from benchmarks import failure_sim

        return failure_sim.main(args, argv if argv is not None else sys.argv[1:])
    if args.failures:
        from benchmarks import failure_run

        return failure_run.main(args, argv if argv is not None else sys.argv[1:])
    if args.user_loop:
        return _user_loop(args)
    if args.budgets:
        return _budgets(args, argv if argv is not None else sys.argv[1:])
    results = run(args, argv if argv is not None else sys.argv[1:])
    print(render_markdown(results))
    print(
        f"JSON: {results['meta']['json']}" + (f"   plot: {results['meta']['plot']}" if results["meta"]["plot"] else "")
    )
    return 0


def _user_loop(args: argparse.Namespace) -> int:
    from benchmarks import user_loop

    preset = dict(PRESETS[args.preset])
    for key in ("width", "layers", "batch"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res = user_loop.run(args, preset, _fit, _ray_env(), out)
    res["meta"] = {"host": _host(), "loadavg_end": list(os.getloadavg()), "model": preset}
    path = out / "results-user-loop.json"
    path.write_text(json.dumps(res, indent=1, default=_json_default))
    print(user_loop.render(res))
    print(f"JSON: {path}")
    return 0


def _budgets(args: argparse.Namespace, argv: list[str]) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks import budget_run

    path = Path(args.json) if args.json else out / "results-budgets.json"

    def save(res: dict) -> None:  # after every fit, and at the end
        res["meta"] = {"host": _host(), "loadavg_end": list(os.getloadavg()), "argv": argv}
        path.write_text(json.dumps(res, indent=1, default=_json_default))

    res = budget_run.run(args, _fit, _ray_env(), out, save=save)
    save(res)
    print(budget_run.render(res))
    print(f"JSON: {path}")
    return 0


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    import cf_ray

    t_start = time.time()
    load_start = os.getloadavg()
    preset = dict(PRESETS[args.preset])
    keys = (
        "width",
        "layers",
        "batch",
        "iters",
        "warmup",
        "warmup_s",
        "rounds",
        "workers",
        "large_width",
        "large_layers",
    )
    for key in keys:
        val = getattr(args, key)
        if val is not None:
            preset[key] = val
    # The floor is a reference figure, not a way to checkpoint: where the preset has it, or when named.
    variants = [v.strip() for v in args.variants.split(",")] if args.variants else list(VARIANTS)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {','.join(VARIANTS)}")
    if args.parallel == "fsdp2":
        ray_ways = [v for v in variants if v.startswith("ray_")]
        if args.variants and ray_ways:
            raise SystemExit(
                f"--parallel fsdp2 runs none, dcp_async, cf_fixed and cf_auto; {ray_ways} save a DDP "
                "state dict from rank 0 and are left out: drop them from --variants"
            )
        variants = [v for v in variants if not v.startswith("ray_")]
        args.no_recovery = True  # the recovery job is the DDP one

    def matrix_for(workers: int) -> dict[str, list[int]]:
        base = preset["matrix"] if workers != 1 or not preset.get("matrix_w1") else preset["matrix_w1"]
        if args.ks:
            base = {
                v: ([0] if v in ("none", "cf_auto") else list(args.ks))
                for v in VARIANTS
                if v not in ("floor_copy", "cf_held") or args.variants
            }
        return {v: ks for v, ks in base.items() if v in variants}

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    storage = Path(args.storage).resolve() if args.storage else out / "work"
    if storage.exists():
        shutil.rmtree(storage, ignore_errors=True)
    seg_dir = storage / "segments"
    seg_dir.mkdir(parents=True, exist_ok=True)
    params = preset["layers"] * (preset["width"] ** 2 + preset["width"])
    state_guess = params * 4 * 3
    limits = measure_limits(storage / "probe", int(max(256 * _MiB, min(state_guess, 1024 * _MiB))))

    import ray
    import torch

    if ray.is_initialized():
        raise SystemExit(
            "cf-ray bench starts its own local Ray (2 CPUs, its own settings); "
            "call it without Ray initialised in this process"
        )
    env = _ray_env()
    os.environ.update(env)
    large_params = preset["large_layers"] * (preset["large_width"] ** 2 + preset["large_width"])
    store = args.object_store_gb or max(2.0, 3.5 * large_params * 12 / 1e9)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=int(store * 1e9),
        runtime_env={"env_vars": env},
    )
    from benchmarks import segments  # the workers import it by name (the loop is pickled by reference)

    settings_out, variants_out = [], []
    rcfg = None
    if not args.no_recovery:
        rcfg = {
            "width": preset["large_width"],
            "layers": preset["large_layers"],
            "batch": preset["large_batch"],
            "seed": args.seed,
            "every": preset["rec_every"],
            "kill_step": preset["rec_kill_step"],
            "after_resume": 2,
        }
    # The recovery job rides on the first 2-worker setting (its restarts skip the finished segments),
    # which saves one TorchTrainer start-up; without a 2-worker setting it gets its own fit.
    runs = [(w, True) for w in preset["workers"]]
    rec_host = next((i for i, w in enumerate(preset["workers"]) if w == 2), None)
    if rcfg is not None and rec_host is None:
        runs.append((2, False))
        rec_host = len(runs) - 1
    recovery = None
    try:
        for i, (workers, has_segments) in enumerate(runs):
            sid, desc = SETTINGS.get(workers, (f"w{workers}", f"{workers} workers x 1 thread"))
            plan = (
                _plan(matrix_for(workers), preset["rounds"], preset["iters"], sid, probes=not args.no_probes)
                if has_segments
                else []
            )
            with_recovery = rcfg is not None and i == rec_host
            cfg = {
                "setting": sid if has_segments else "recovery",
                "width": preset["width"],
                "layers": preset["layers"],
                "batch": preset["batch"],
                "warmup": preset["warmup"],
                "warmup_s": preset.get("warmup_s"),
                "iters": preset["iters"],
                "seed": args.seed,
                "plan": plan,
                "out_dir": str(seg_dir),
                "cf_register": args.cf_register,
                "budget_pct": args.budget_pct,
                "held_persist_every": args.held_persist_every,
                "parallel": args.parallel,
                "recovery": rcfg if with_recovery else None,
            }
            t0 = time.time()
            error = None
            try:
                # Ray keeps its last 2 checkpoints (the Ray variants' and, with --cf-register, cf_ray's
                # pointers; cf_ray keeps a registered step until Ray drops it).
                _fit(
                    segments._bench_loop,
                    cfg,
                    workers,
                    f"bench-{sid}" if has_segments else "bench-recovery",
                    storage,
                    max_failures=2 if with_recovery else 0,
                    num_to_keep=2,
                )
            except Exception as e:  # noqa: BLE001 - report what was measured, and the failure
                error = f"{type(e).__name__}: {e}"
                print(f"cf-ray bench: {sid} failed: {error}", file=sys.stderr)
            if with_recovery:
                recovery = dict(_recovery_summary(seg_dir, 2), error=error)
                recovery.update(
                    params=large_params,
                    interval=rcfg["every"],
                    model=f"{preset['large_layers']} x Linear({preset['large_width']})",
                    note="storage reads may be served from the page cache (no cache drop); "
                    "kill -> restart is Ray Train's failure detection and worker-group restart",
                )
            if not has_segments:
                continue
            vs, extra = _aggregate_setting(sid, workers, desc, seg_dir, plan, str(storage / f"bench-{sid}"))
            variants_out += vs
            entered = extra.pop("loop_entered")
            settings_out.append(
                dict(
                    extra,
                    setting=sid,
                    workers=workers,
                    desc=desc,
                    wall_s=time.time() - t0,
                    startup_s=entered - t0 if entered else None,
                    error=error,
                    includes_recovery=with_recovery,
                    segments=[s["name"] for s in plan],
                )
            )
    finally:
        ray.shutdown()
    skipped = _skipped(preset, matrix_for, variants, variants_out, args)
    json_path = Path(args.json).resolve() if args.json else out / "results.json"
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "meta": {
            "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "cf-ray bench " + " ".join(shlex.quote(a) for a in argv),
            "preset": args.preset,
            "host": _host(),
            "versions": {
                "cf_ray": cf_ray.__version__,
                "ray": ray.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "env": env,
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "wall_s": time.time() - t_start,
            "json": str(json_path),
            "plot": None,
            "noise": "other jobs may share this machine; see loadavg_* and each setting's baseline_drift_pct",
        },
        "config": {
            "model": {
                "width": preset["width"],
                "layers": preset["layers"],
                "batch": preset["batch"],
                "params": params,
                "state_bytes": settings_out[0]["state_bytes"] if settings_out else state_guess,
            },
            "recovery_model": {
                "width": preset["large_width"],
                "layers": preset["large_layers"],
                "batch": preset["large_batch"],
                "params": large_params,
                "interval": preset["rec_every"],
                "kill_step": preset["rec_kill_step"],
            },
            "budget_pct": args.budget_pct,
            "held_persist_every": args.held_persist_every,
            "parallel": args.parallel,
            "iters": preset["iters"],
            "warmup": preset["warmup"],
            "warmup_s": preset.get("warmup_s"),
            "rounds": preset["rounds"],
            "workers": preset["workers"],
            "matrix": {str(w): matrix_for(w) for w in preset["workers"]},
            "seed": args.seed,
        },
        "limits": limits,
        "settings": settings_out,
        "variants": variants_out,
        "skipped": skipped,
        "recovery": recovery,
    }
    results["targets"] = _targets(results)
    png = plot(results, out / "overhead.png") if variants_out else None
    results["meta"]["plot"] = str(png) if png else None
    json_path.write_text(json.dumps(results, indent=1, default=_json_default))
    (out / "results.md").write_text(render_markdown(results))
    if not args.keep_storage:
        for child in storage.iterdir():
            if child.name != "segments":
                shutil.rmtree(child, ignore_errors=True)
    return results


def _skipped(preset, matrix_for, variants, variants_out, args) -> list[dict]:
    """(variant, k) pairs of the full matrix that this run left out, with why and what they would cost."""
    if args.ks:
        return []
    full = PRESETS["full"]["matrix"]
    out = []
    for workers in preset["workers"]:
        sid = SETTINGS.get(workers, (f"w{workers}",))[0]
        have = matrix_for(workers)
        base = next((s for s in variants_out if s["setting"] == sid and s["variant"] == "none"), None)
        for v, ks in full.items():
            if v not in variants:
                continue
            for k in ks:
                if k in have.get(v, []):
                    continue
                reason = f"{args.preset} preset"
                at10 = next(
                    (s for s in variants_out if s["setting"] == sid and s["variant"] == v and s["k"] == 10), None
                )
                if base and at10 and at10.get("stall_per_ckpt_s") is not None:
                    est = preset["iters"] * (base["iter_mean_s"] + at10["stall_per_ckpt_s"] / max(k, 1))
                    reason += f"; would take ~{est:.0f} s (estimate from k=10's stall per checkpoint)"
                if preset.get("budget_s"):
                    reason += f" within a {preset['budget_s']} s budget"
                out.append({"setting": sid, "variant": v, "k": k, "reason": reason})
    return out


if __name__ == "__main__":
    # As a script (``python benchmarks/bench.py``), run the importable module, which the workers share.
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    from benchmarks.bench import main as _main

    sys.exit(_main())
