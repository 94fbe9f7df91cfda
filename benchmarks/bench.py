"""``cf-ray bench``: cf_ray against what a Ray Train user would otherwise use, in one invocation.

What runs (see ``benchmarks/README.md`` for every JSON key):

* **Machine limits**, measured first in the same invocation: host memcpy bandwidth (one thread,
  as the snapshot copy runs), storage write+fsync bandwidth (16 MiB chunks, as cf_ray writes),
  CRC-32 throughput (ISA-L's, as cf_ray uses; cf_ray checksums every byte it persists) and the first touch of newly
  allocated memory (page faults; slow on VMs, and every new host buffer pays it once).
* **The reference job** (``TorchTrainer``, gloo, DDP, ``n x Linear(w, w)`` + Adam, synthetic data,
  fixed seed), once per CPU setting: every core busy (2 workers x 1 thread on 2 cores) and one
  core left free (1 worker). Inside *one* ``fit()`` per setting, the variants run as consecutive
  *segments* of the same loop on the same model and optimizer (Ray's start-up of ~10-20 s is paid
  once per setting, not once per variant), in rounds whose order alternates, with the
  no-checkpoint baseline first and last in every round so drift on a noisy machine shows:

  ``none``       no checkpointing;
  ``ray_sync``   Ray Train's documented way: rank 0 ``torch.save`` into a temporary directory,
                 every rank ``ray.train.report(checkpoint=Checkpoint.from_directory(...))``, SYNC;
  ``ray_async``  the same with ``CheckpointUploadMode.ASYNC``;
  ``dcp_async``  ``torch.distributed.checkpoint.async_save`` (own gloo group), the previous save
                 awaited before the next one, as torchtitan does;
  ``cf_fixed``   ``cf_ray.Checkpointer`` with ``FixedInterval(every=k)``;
  ``cf_auto``    ``cf_ray.Checkpointer`` with ``Adaptive(budget_pct=--budget-pct)`` (2 % by default),
                 followed by two *probes*: ``cf_fixed`` at the interval ``k`` it chose and at ``k - 1``,
                 each measured over whole periods after its first checkpoint (steady state), so the
                 output shows whether ``k`` is within the budget and the shortest interval that is.

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
import gc
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = "cf_ray.bench/1"

_PROBE_TAG = {0: "@auto", -1: "@auto-1"}
_PROBE_LABEL = {0: " at Adaptive's k", -1: " at Adaptive's k−1"}
VARIANTS = ("none", "ray_sync", "ray_async", "dcp_async", "cf_fixed", "cf_auto", "floor_copy")
LABELS = {
    "none": "no checkpoint",
    "ray_sync": "Ray SYNC (torch.save + report)",
    "ray_async": "Ray ASYNC upload",
    "dcp_async": "DCP async_save",
    "cf_fixed": "cf_ray FixedInterval",
    "cf_auto": "cf_ray Adaptive",
    "floor_copy": "one memcpy of the state, nothing else (floor)",
}
SETTINGS = {
    2: ("w2", "every core busy: 2 workers x 1 thread on 2 cores"),
    1: ("w1", "one core left free: 1 worker x 1 thread"),
}
HEALTH_CHECK_S = "0.05"
_MiB = 1024 * 1024

PRESETS: dict[str, dict[str, Any]] = {
    # Must finish in < 4 min on 2 cores: a smaller model, k = 10 for every variant (k = 1 for cf_ray
    # only), one round with the baseline first and last, a reduced second setting.
    "quick": dict(
        width=1024,
        layers=6,
        batch=32,
        iters=60,
        warmup=5,
        rounds=1,
        workers=[2, 1],
        matrix={
            "none": [0],
            "ray_sync": [10],
            "ray_async": [10],
            "dcp_async": [10],
            "cf_fixed": [1, 10],
            "cf_auto": [0],
        },
        matrix_w1={
            "none": [0],
            "ray_sync": [10],
            "ray_async": [10],
            "dcp_async": [10],
            "cf_fixed": [10],
            "cf_auto": [0],
        },
        large_width=2048,
        large_layers=6,
        large_batch=8,
        rec_every=2,
        rec_kill_step=5,
        budget_s=240,
    ),
    # The reference job of the issue: 6 x Linear(2048, 2048) + Adam (~302 MB of state), k in {1, 10, 50}.
    # One round (the baseline opens and closes it, so drift shows) of 100 iterations per segment:
    # ~40 min on 2 cores; --rounds 2 --iters 150 for tighter figures (~1.5 h).
    "full": dict(
        width=2048,
        layers=6,
        batch=32,
        iters=100,
        warmup=5,
        rounds=1,
        workers=[2, 1],
        matrix={
            "none": [0],
            "ray_sync": [1, 10, 50],
            "ray_async": [1, 10, 50],
            "dcp_async": [1, 10, 50],
            "cf_fixed": [1, 10, 50],
            "cf_auto": [0],
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
# Worker side (runs inside TorchTrainer workers)
# ================================================================================================


class _MemMonitor:
    """Samples this process's resident memory on a thread; ``peak`` since the last ``reset``."""

    def __init__(self, period: float = 0.05):
        self.period = period
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.peak = self.peak_anon = self.peak_shmem = 0
        self.reset()
        self._thread = threading.Thread(target=self._run, name="cf_ray-bench-rss", daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> tuple[int, int, int]:
        """(RSS, anonymous RSS, shared-memory RSS) in bytes."""
        try:
            vals = {}
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(("VmRSS:", "RssAnon:", "RssShmem:")):
                        k, v = line.split(":", 1)
                        vals[k] = int(v.split()[0]) * 1024
            return vals.get("VmRSS", 0), vals.get("RssAnon", 0), vals.get("RssShmem", 0)
        except OSError:
            import psutil

            rss = psutil.Process().memory_info().rss
            return rss, rss, 0

    def reset(self) -> None:
        rss, anon, shm = self.read()
        with self._lock:
            self.peak, self.peak_anon, self.peak_shmem = rss, anon, shm

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            rss, anon, shm = self.read()
            with self._lock:
                self.peak = max(self.peak, rss)
                self.peak_anon = max(self.peak_anon, anon)
                self.peak_shmem = max(self.peak_shmem, shm)

    def stop(self) -> None:
        self._stop.set()


def _trim_memory() -> None:
    """Return freed heap to the OS so a segment's peak RSS is its own, not a previous segment's."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # noqa: BLE001 - not glibc: peaks are then upper bounds
        pass


def _build_model(width: int, layers: int):
    import torch

    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def _fsdp2(model, world: int):
    """The reference model sharded with FSDP2 (``fully_shard`` per Linear, then the root) on a CPU
    mesh of the worker group (gloo), as torchtitan shards its blocks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _state_bytes(model, opt, *, local: bool = False) -> int:
    """Bytes of model + optimizer state: of the whole job, or (``local``) the part this worker holds
    (the same for DDP; for FSDP2 the local shards of the DTensors)."""
    import torch

    def nbytes(t) -> int:
        if local and hasattr(t, "to_local"):
            t = t.to_local()
        return t.numel() * t.element_size()

    n = sum(nbytes(p) for p in model.parameters())
    for st in opt.state.values():
        n += sum(nbytes(v) for v in st.values() if isinstance(v, torch.Tensor))
    return n


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=_json_default)
    os.replace(tmp, path)


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


class _NoSave:
    """Variant ``none``."""

    uses_checkpointer = False

    def due(self, step: int) -> bool:  # noqa: ARG002 - the saver interface
        return False

    def save(self, step: int) -> float:  # noqa: ARG002 - the saver interface
        return 0.0

    def drain(self) -> None:
        pass

    def finish(self) -> dict:
        return {"checkpoints_taken": 0, "checkpoints_committed": 0, "bytes_written": 0}


class _CopyFloor:
    """Variant ``floor_copy`` (not a checkpoint: a lower bound for any that snapshots to host memory).

    Every k steps a thread copies the model's and the optimizer's tensors once into a host buffer
    allocated and faulted in up front, while the next forward/backward runs; the next optimizer step
    waits for it (the weight-update guard). No checksum, no hand-off, no persist: what one copy of
    the state per checkpoint costs training on this machine, whoever makes it. Not in any preset;
    name it with ``--variants``.
    """

    uses_checkpointer = False

    def __init__(self, k: int, model, opt):
        import torch

        self.k = k
        self.tensors = [p.data for p in model.parameters()]
        self.tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
        total = sum(t.numel() * t.element_size() for t in self.tensors)
        self.buf = torch.zeros(total, dtype=torch.uint8)  # zero-filled: every page faulted in now
        self.thread: threading.Thread | None = None
        self.n = 0
        self.copy_s: list[float] = []

    def due(self, step: int) -> bool:
        return step % self.k == 0

    def _copy(self) -> None:
        import torch

        t0 = time.perf_counter()
        off = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.buf[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        self.copy_s.append(time.perf_counter() - t0)

    def guard(self) -> None:
        """Before the optimizer step: the copy must have read the weights it snapshots."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def save(self, step: int) -> float:  # noqa: ARG002 - the saver interface
        t0 = time.perf_counter()
        self.guard()
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()
        self.n += 1
        return time.perf_counter() - t0

    def drain(self) -> None:
        self.guard()

    def finish(self) -> dict:
        copy_s = sorted(self.copy_s)
        return {
            "checkpoints_taken": self.n,
            "checkpoints_committed": 0,
            "bytes_written": 0,
            "floor_copy_s_median": copy_s[len(copy_s) // 2] if copy_s else None,
        }


class _RaySave:
    """Ray Train's documented way: rank 0 ``torch.save`` into a temporary directory + ``report``."""

    uses_checkpointer = False

    def __init__(self, mode: str, k: int, model, opt, rank: int, seg: str):
        from ray.train import CheckpointUploadMode

        self.mode = CheckpointUploadMode.SYNC if mode == "sync" else CheckpointUploadMode.ASYNC
        self.k, self.model, self.opt, self.rank, self.seg = k, model, opt, rank, seg
        self.n = 0
        self.ckpt_bytes = 0

    def due(self, step: int) -> bool:
        return step % self.k == 0

    def save(self, step: int) -> float:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        t0 = time.perf_counter()
        metrics = {"segment": self.seg, "step": step}
        if self.mode == CheckpointUploadMode.SYNC:
            # The documented SYNC pattern: the temporary directory lives for the report call.
            with tempfile.TemporaryDirectory(prefix="cfbench-ray-") as tmp:
                ckpt = None
                if self.rank == 0:
                    self._torch_save(tmp, step)
                    ckpt = Checkpoint.from_directory(tmp)
                ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=self.mode)
        else:
            # ASYNC: Ray uploads from the directory in the background and deletes it afterwards.
            ckpt = None
            if self.rank == 0:
                tmp = tempfile.mkdtemp(prefix="cfbench-ray-")
                self._torch_save(tmp, step)
                ckpt = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=self.mode)
        self.n += 1
        return time.perf_counter() - t0

    def _torch_save(self, directory: str, step: int) -> None:
        import torch

        module = getattr(self.model, "module", self.model)
        path = os.path.join(directory, "checkpoint.pt")
        torch.save({"model": module.state_dict(), "optimizer": self.opt.state_dict(), "step": step}, path)
        self.ckpt_bytes = os.path.getsize(path)

    def drain(self) -> None:
        import ray.train
        from ray.train import CheckpointConsistencyMode

        if self.n:
            # Blocks until the latest reported checkpoint is uploaded and committed (ASYNC's tail).
            ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)

    def finish(self) -> dict:
        # Every report carrying a checkpoint is committed once drain() returned. Bytes: the
        # torch.save file in the temporary directory plus Ray's copy of it into storage.
        written = 2 * self.ckpt_bytes * self.n if self.rank == 0 else 0
        return {
            "checkpoints_taken": self.n,
            "checkpoints_committed": self.n,
            "bytes_written": written,
            "ckpt_bytes": self.ckpt_bytes if self.rank == 0 else 0,
        }


class _DcpSave:
    """``torch.distributed.checkpoint.async_save`` every k steps into a directory under storage."""

    uses_checkpointer = False

    def __init__(self, k: int, model, opt, rank: int, root: str, pg):
        self.k, self.model, self.opt, self.rank, self.root, self.pg = k, model, opt, rank, root, pg
        self.future = None
        self.done_dirs: list[str] = []
        self.pending_dir: str | None = None
        self.n = self.committed = 0
        self.bytes_written = 0
        self.ckpt_bytes = 0
        if rank == 0:
            os.makedirs(root, exist_ok=True)

    def due(self, step: int) -> bool:
        return step % self.k == 0

    def _complete_previous(self) -> None:
        if self.future is None:
            return
        self.future.result()
        self.future = None
        self.committed += 1
        self.done_dirs.append(self.pending_dir)
        if self.rank == 0:
            # Keep the last two completed checkpoints (as the other variants do).
            while len(self.done_dirs) > 2:
                old = self.done_dirs.pop(0)
                self._account(old)
                shutil.rmtree(old, ignore_errors=True)

    def _account(self, path: str) -> None:
        n = _dir_bytes(path)
        self.bytes_written += n
        self.ckpt_bytes = n

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        self._complete_previous()
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        path = os.path.join(self.root, f"step_{step:08d}")
        self.pending_dir = path
        self.future = dcp.async_save(
            {"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path, process_group=self.pg
        )
        self.n += 1
        return time.perf_counter() - t0

    def drain(self) -> None:
        self._complete_previous()

    def finish(self) -> dict:
        if self.rank == 0:
            for d in self.done_dirs:
                self._account(d)
        return {
            "checkpoints_taken": self.n,
            "checkpoints_committed": self.committed,
            "bytes_written": self.bytes_written if self.rank == 0 else 0,
            "ckpt_bytes": self.ckpt_bytes if self.rank == 0 else 0,
        }


def _actor_cpu(_actor) -> float:
    """CPU seconds of the calling actor's process (``__ray_call__`` passes the actor instance first)."""
    return time.process_time()


class _CfSave:
    """cf_ray: the checkpoint is taken inside ``ckpt.step(optimizer)``."""

    uses_checkpointer = True

    def __init__(self, policy, model, opt, rank: int, storage_path: str, run_name: str, register: bool):
        import cf_ray

        self.rank = rank
        self.storage_path, self.run_name = storage_path, run_name
        cfg = cf_ray.CheckpointConfig(
            policy=policy,
            keep_last=2,
            storage_path=storage_path,
            run_name=run_name,
            final_model=None,
            register_with_ray=register,
        )
        self.ckpt = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=cfg)
        self.resume = self.ckpt.restore()
        self.actors_cpu0 = self._actors_cpu() if rank == 0 else None

    def _actors_cpu(self) -> float | None:
        """CPU seconds used so far by this run's holder and controller processes (phase 2 runs there)."""
        import ray

        try:
            refs = [a.__ray_call__.remote(_actor_cpu) for a in (self.ckpt.holder, self.ckpt.controller)]
            return sum(ray.get(refs, timeout=60))
        except Exception:  # noqa: BLE001 - a figure we can live without
            return None

    def due(self, step: int) -> bool:  # noqa: ARG002 - the saver interface
        return False

    def save(self, step: int) -> float:  # noqa: ARG002 - the saver interface
        return 0.0

    def drain(self) -> None:
        self.ckpt.wait()

    def held(self) -> dict | None:
        """Host memory this node's holder holds for snapshots (its slots' resident pages and the copies
        it keeps for other nodes) and the bytes it copied so far (``Holder.held_bytes``)."""
        import ray

        try:
            return ray.get(self.ckpt.holder.held_bytes.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a figure we can live without
            return None

    def profile(self) -> tuple[list[dict], dict]:
        """The run's profile rows and summary, from its live controller (through the public ``cf_ray.Run``)."""
        import cf_ray

        run = cf_ray.Run(self.storage_path, self.run_name)
        rows = run.profile_rows()
        summary = run.summary()
        now = self._actors_cpu()
        if now is not None and self.actors_cpu0 is not None:
            summary = dict(summary, actors_cpu_s=now - self.actors_cpu0)
        return rows, summary

    def finish(self) -> dict:
        c = self.ckpt
        return {
            "checkpoints_taken": c.checkpoints_taken,
            "stall_s_total": c.stall_s_total,
            "resume_source": self.resume.source,
        }


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


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _run_segments(cfg: dict, ctx, t_loop: float) -> None:
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import cf_ray

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

    def forward_backward(i: int) -> None:
        x, y = batches[i % len(batches)]
        F.mse_loss(model(x), y).backward()

    for i in range(cfg["warmup"]):  # creates Adam's state; first-touch costs are not measured
        forward_backward(i)
        opt.step()
        opt.zero_grad()
    state_bytes = _state_bytes(model, opt)
    rank_state_bytes = _state_bytes(model, opt, local=True)
    dcp_pg = (
        dist.new_group(backend="gloo") if any(s["variant"] == "dcp_async" for s in cfg["plan"]) and world > 1 else None
    )
    out_dir = cfg["out_dir"]
    auto_k = None  # the interval Adaptive chose in the latest cf_auto segment (the same on every rank)
    for seg in cfg["plan"]:
        name, variant, k = seg["name"], seg["variant"], seg["k"]
        iters, steady_from = cfg["iters"], 0
        if seg.get("probe") is not None:
            if not auto_k or auto_k + seg["probe"] < 1:
                continue  # no interval chosen, or k - 1 == 0
            k = auto_k + seg["probe"]
            # m whole periods after the first checkpoint (the overhead is measured over them), at
            # least two and at least as many iterations as the other segments.
            m = max(2, math.ceil(cfg["iters"] / k))
            iters, steady_from = (m + 1) * k - 1, k - 1
        _trim_memory()
        mon.reset()
        rss_start, anon_start, shmem_start = _MemMonitor.read()
        t_setup = time.perf_counter()
        if variant == "none":
            saver = _NoSave()
        elif variant in ("ray_sync", "ray_async"):
            saver = _RaySave(variant.split("_")[1], k, model, opt, rank, name)
        elif variant == "dcp_async":
            saver = _DcpSave(k, model, opt, rank, os.path.join(exp_path, name, "dcp"), dcp_pg)
        elif variant == "floor_copy":
            saver = _CopyFloor(k, model, opt)
        elif variant in ("cf_fixed", "cf_auto"):
            policy = (
                cf_ray.FixedInterval(every=k)
                if variant == "cf_fixed"
                else cf_ray.Adaptive(budget_pct=cfg.get("budget_pct", 5.0))
            )
            saver = _CfSave(policy, model, opt, rank, exp_path, name, register=cfg["cf_register"])
        else:
            raise ValueError(f"unknown variant {variant!r}")
        setup_s = time.perf_counter() - t_setup
        _barrier()
        times, stalls = [], []
        cpu0, thread0 = time.process_time(), time.thread_time()
        t_seg = time.perf_counter()
        wall_start = time.time()
        for i in range(1, iters + 1):
            t0 = time.perf_counter()
            forward_backward(i)
            if saver.uses_checkpointer:
                saver.ckpt.step(opt)
            else:
                if isinstance(saver, _CopyFloor):
                    saver.guard()
                opt.step()
            opt.zero_grad()
            if saver.due(i):
                stalls.append(saver.save(i))
            times.append(time.perf_counter() - t0)
        loop_s = time.perf_counter() - t_seg
        cpu_s, thread_cpu_s = time.process_time() - cpu0, time.thread_time() - thread0
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
            "steady_from": steady_from,
            "iter_s": times,
            "stall_s": stalls,
            "loop_s": loop_s,
            "drain_s": drain_s,
            "setup_s": setup_s,
            "state_bytes": state_bytes,
            "rank_state_bytes": rank_state_bytes,
            "rss_before_model": rss_before_model,
            "anon_before_model": anon_before_model,
            "rss_start": rss_start,
            "anon_start": anon_start,
            "shmem_start": shmem_start,
            "wall_start": wall_start,
            "loop_entered": t_loop,
            "cpu_s": cpu_s,
            "train_thread_cpu_s": thread_cpu_s,
        }
        if saver.uses_checkpointer:
            _barrier()  # every rank's wait() has sent its last timing sample to the controller
            if rank == 0:
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
        del saver
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


# ================================================================================================
# Driver side
# ================================================================================================


def measure_limits(directory: Path, nbytes: int) -> dict:
    """Host memcpy (one thread), storage write+fsync and CRC-32 bandwidths, in GB/s (1e9 B/s)."""
    import numpy as np
    import torch

    from cf_ray._engine.storage.fs import _crc32

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
    return {
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


def _plan(matrix: dict[str, list[int]], rounds: int, iters: int, setting: str) -> list[dict]:
    """Segments in rounds of alternating order; the baseline opens and closes every round.

    Every ``cf_auto`` segment is followed by two *probe* segments, ``cf_fixed`` at the interval
    ``k`` Adaptive chose in it and at ``k - 1`` (``probe`` 0 and -1; ``k`` is resolved at run time),
    which show whether the chosen interval is within the budget and the shortest that is.
    """
    blocks = []
    for v in VARIANTS:
        if v == "none":
            continue
        for k in matrix.get(v, []):
            blocks.append([(v, k, None)] + ([("cf_fixed", 0, 0), ("cf_fixed", 0, -1)] if v == "cf_auto" else []))
    plan = []
    for r in range(rounds):
        order = [seg for b in (blocks if r % 2 == 0 else list(reversed(blocks))) for seg in b]
        seq = [("none", 0, None)] + order + [("none", 0, None)] if "none" in matrix else order
        for j, (v, k, probe) in enumerate(seq):
            tag = "" if probe is None else ("-auto" if probe == 0 else "-auto-1")
            plan.append(
                {
                    "name": f"{setting}-r{r}-{j:02d}-{v}" + (f"-k{k}" if k else "") + tag,
                    "variant": v,
                    "k": k,
                    "round": r,
                    "iters": iters,
                    "probe": probe,
                }
            )
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


def _read_profile_from_storage(storage_path: str, run_name: str) -> list[dict] | None:
    """The profile rows saved by the controller, through cf_ray.report when it exists."""
    try:
        from cf_ray import report
    except ImportError:
        return None
    fn = getattr(report, "read_run_profile", None)
    if fn is None:
        return None
    try:
        got = fn(storage_path, run_name)
    except Exception:  # noqa: BLE001 - the in-loop controller rows are the fallback
        return None
    if hasattr(got, "to_dict"):
        got = got.to_dict("records")
    if isinstance(got, list) and got and isinstance(got[0], dict) and "persist_s" in got[0]:
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in got]
    return None


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs), "mean": statistics.fmean(xs)}


def _aggregate_setting(
    setting: str, workers: int, desc: str, seg_dir: Path, plan: list[dict], storage_path: str
) -> tuple[list[dict], dict]:
    """One object per (variant, k) of this setting, from the segments' per-rank JSON files."""
    recs: dict[str, list[dict]] = {}
    for seg in plan:
        ranks = []
        for r in range(workers):
            p = seg_dir / f"{seg['name']}.rank{r}.json"
            if p.exists():
                ranks.append(json.loads(p.read_text()))
        if ranks:
            recs[seg["name"]] = ranks
    # Probe segments' k is resolved at run time (the interval Adaptive chose); they only measure
    # their steady state: the iterations from their first checkpoint on.
    plan = [
        dict(s, k=recs[s["name"]][0]["k"]) if s.get("probe") is not None else s
        for s in plan
        if s.get("probe") is None or s["name"] in recs
    ]
    base_segs = [recs[s["name"]] for s in plan if s["variant"] == "none" and s["name"] in recs]
    base_times = [t for ranks in base_segs for t in ranks[0]["iter_s"]]
    base_mean = statistics.fmean(base_times) if base_times else float("nan")
    base_round: dict[int, float] = {}
    for s in plan:
        if s["variant"] == "none" and s["name"] in recs:
            base_round.setdefault(s["round"], [])
            base_round[s["round"]] += recs[s["name"]][0]["iter_s"]  # type: ignore[operator]
    base_round_mean = {r: statistics.fmean(v) for r, v in base_round.items()}  # type: ignore[arg-type]
    state_bytes = next(iter(recs.values()))[0]["state_bytes"] if recs else 0
    # What one worker holds (FSDP2: its shards; DDP: the whole state), the largest over ranks.
    rank_state_bytes = max(
        (rec.get("rank_state_bytes", rec["state_bytes"]) for ranks in recs.values() for rec in ranks),
        default=0,
    )
    out = []
    keys = []
    for s in plan:
        key = (s["variant"], s["k"], s.get("probe"))
        if key not in keys:
            keys.append(key)

    def timed(rec: dict) -> list[float]:
        return rec["iter_s"][rec.get("steady_from") or 0 :]

    for variant, k, probe in keys:
        segs = [
            (s, recs[s["name"]])
            for s in plan
            if (s["variant"], s["k"], s.get("probe")) == (variant, k, probe) and s["name"] in recs
        ]
        if not segs:
            continue
        times = [t for _, ranks in segs for t in timed(ranks[0])]
        n = len(times)
        n_all = sum(len(ranks[0]["iter_s"]) for _, ranks in segs)
        mean = statistics.fmean(times)
        drain = sum(ranks[0]["drain_s"] for _, ranks in segs)
        obj: dict[str, Any] = {
            "id": f"{setting}/{variant}" + (f"/k{k}" if k else "") + ("" if probe is None else _PROBE_TAG[probe]),
            "setting": setting,
            "workers": workers,
            "setting_desc": desc,
            "variant": variant,
            "label": LABELS[variant] + ("" if probe is None else _PROBE_LABEL[probe]),
            "k": k or None,
            "probe": probe,
            "rounds": len(segs),
            "iterations": n,
            "iter_median_s": statistics.median(times),
            "iter_min_s": min(times),
            "iter_max_s": max(times),
            "iter_mean_s": mean,
            "overhead_pct": 100.0 * (mean / base_mean - 1.0),
            "overhead_incl_drain_pct": 100.0 * ((sum(times) + drain) / n / base_mean - 1.0),
            "overhead_pct_per_round": [
                100.0 * (statistics.fmean(timed(ranks[0])) / base_round_mean.get(s["round"], base_mean) - 1.0)
                for s, ranks in segs
            ],
            "iter_mean_s_per_round": [statistics.fmean(timed(ranks[0])) for _, ranks in segs],
            "drain_s": drain / len(segs),
            "setup_s": statistics.fmean(r[0]["setup_s"] for _, r in segs),
            # CPU time is far less sensitive than wall time to other jobs on the machine.
            "worker_cpu_ms_per_iter": [
                1e3 * sum(r[w]["cpu_s"] for _, r in segs) / n_all for w in range(len(segs[0][1]))
            ],
            "train_thread_cpu_ms_per_iter": [
                1e3 * sum(r[w]["train_thread_cpu_s"] for _, r in segs) / n_all for w in range(len(segs[0][1]))
            ],
            "state_bytes": state_bytes,
            "rank_state_bytes": rank_state_bytes,
            "segments": [s["name"] for s, _ in segs],
        }
        # Stall per checkpoint on the training thread; ranks wait for each other, the max governs.
        per_rank_stall = []
        taken = committed = 0
        written = 0
        for _, ranks in segs:
            for rec in ranks:
                if variant.startswith("cf_"):
                    if rec.get("checkpoints_taken"):
                        per_rank_stall.append((rec["rank"], rec["stall_s_total"], rec["checkpoints_taken"]))
                elif rec["stall_s"]:
                    per_rank_stall.append((rec["rank"], sum(rec["stall_s"]), len(rec["stall_s"])))
            r0 = ranks[0]
            taken += r0.get("checkpoints_taken", 0)
            written += sum(rec.get("bytes_written", 0) for rec in ranks)
            committed += r0.get("checkpoints_committed", 0)
        if per_rank_stall:
            by_rank: dict[int, list[float]] = {}
            for rank, tot, cnt in per_rank_stall:
                by_rank.setdefault(rank, [0.0, 0])
                by_rank[rank][0] += tot  # type: ignore[index]
                by_rank[rank][1] += cnt  # type: ignore[index]
            per_ckpt = {r: v[0] / v[1] for r, v in by_rank.items() if v[1]}
            obj["stall_per_ckpt_s"] = max(per_ckpt.values())
            obj["stall_per_ckpt_s_by_rank"] = [per_ckpt[r] for r in sorted(per_ckpt)]
        else:
            obj["stall_per_ckpt_s"] = None
        obj["checkpoints_taken"] = taken
        if variant.startswith("cf_"):
            rows_all, intervals = [], []
            src = "controller"
            for s, ranks in segs:
                rows = _read_profile_from_storage(storage_path, s["name"])
                if rows is not None:
                    src = "cf_ray.report.read_run_profile"
                else:
                    rows = ranks[0].get("profile_rows") or []
                rows_all += rows
                summ = ranks[0].get("controller_summary") or {}
                intervals.append(summ.get("interval"))
                obj.setdefault("schedules", []).append(summ.get("schedules"))
                if variant == "cf_auto":  # why the policy chose each interval (its explain())
                    obj.setdefault("interval_events", []).append(
                        [
                            {k: e.get(k) for k in ("previous", "interval", "why")}
                            for e in summ.get("events", [])
                            if e.get("event") == "interval"
                        ]
                    )
            acpu = [(r[0].get("controller_summary") or {}).get("actors_cpu_s") for _, r in segs]
            if all(a is not None for a in acpu):
                obj["cf_actors_cpu_ms_per_iter"] = 1e3 * sum(acpu) / n_all
            done = [r for r in rows_all if r.get("committed")]
            committed = len(done)
            written = sum(int(r.get("bytes") or 0) for r in done)
            persist = [r["persist_s"] for r in done if r.get("persist_s")]
            gbps = [r["bytes"] / r["persist_s"] / 1e9 for r in done if r.get("persist_s") and r.get("bytes")]
            obj.update(
                profile_source=src,
                persist_s_median=statistics.median(persist) if persist else None,
                persist_gbps_median=statistics.median(gbps) if gbps else None,
                snapshot_bytes=statistics.median([r["bytes"] for r in done]) if done else None,
                not_committed=sum(1 for r in rows_all if not r.get("committed")),
                copy_s_median=_median_of(rows_all, "copy_s"),
                chosen_interval=intervals[-1] if variant == "cf_auto" else k,
            )
            # Passes over the state on the host per checkpoint (#14), from the copies cf_ray
            # instruments (workers and holders): bytes copied, and bytes read again to checksum.
            counted = [r for r in done if r.get("copied_bytes") is not None and r.get("bytes")]
            if counted:
                obj["host_copied_x"] = statistics.median(r["copied_bytes"] / r["bytes"] for r in counted)
                obj["host_crc_reread_x"] = statistics.median(
                    (r.get("crc_read_bytes") or 0) / r["bytes"] for r in counted
                )
                obj["host_passes"] = obj["host_copied_x"] + obj["host_crc_reread_x"]
            held = [ranks[0].get("holder_held") for _, ranks in segs if ranks[0].get("holder_held")]
            if held:
                obj["held_bytes"] = max(h["slots"] + h["copies"] for h in held)
        else:
            obj["ckpt_bytes"] = max((rec.get("ckpt_bytes", 0) for _, ranks in segs for rec in ranks), default=0)
        obj["checkpoints_committed"] = committed
        obj["bytes_written"] = written
        # Memory per worker: VmRSS also counts object-store pages the worker has mapped (shared
        # memory, owned by the store, kept mapped across segments); the private (anonymous) part
        # is what the process itself holds, measured above its value before the model was built.
        nranks = len(segs[0][1])
        obj["peak_rss_mb_per_worker"] = [max(r[w]["peak_rss"] for _, r in segs) / _MiB for w in range(nranks)]
        obj["peak_private_mb_per_worker"] = [max(r[w]["peak_rss_anon"] for _, r in segs) / _MiB for w in range(nranks)]
        obj["peak_private_above_start_mb"] = (
            max(rec["peak_rss_anon"] - rec["anon_before_model"] for _, ranks in segs for rec in ranks) / _MiB
        )
        obj["peak_rss_shmem_mb"] = max(rec["peak_rss_shmem"] for _, ranks in segs for rec in ranks) / _MiB
        out.append(obj)
    drift = None
    if len(base_segs) > 1:
        ms = [statistics.fmean(r[0]["iter_s"]) for r in base_segs]
        drift = 100.0 * (max(ms) - min(ms)) / statistics.fmean(ms)
    entered = [ranks[0].get("loop_entered") for ranks in recs.values() if ranks[0].get("loop_entered")]
    extra = {
        "loop_entered": min(entered) if entered else None,
        "baseline_iter_mean_s": base_mean,
        "baseline_drift_pct": drift,
        "state_bytes": state_bytes,
        "rank_state_bytes": rank_state_bytes,
        "baseline_segment_means_s": [statistics.fmean(r[0]["iter_s"]) for r in base_segs],
    }
    return out, extra


def _median_of(rows: list[dict], key: str):
    xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def _recovery_summary(seg_dir: Path, workers: int) -> dict:
    state_file = seg_dir / "recovery_state.json"
    if not state_file.exists():
        return {"error": "the recovery job wrote no state"}
    state = json.loads(state_file.read_text())
    out: dict[str, Any] = {}
    for source in ("memory", "storage"):
        info = state.get(source, {})
        ranks = []
        for r in range(workers):
            p = seg_dir / f"recovery-{source}.rank{r}.json"
            if p.exists():
                ranks.append(json.loads(p.read_text()))
        if not ranks or not info.get("killed"):
            out[source] = {"error": "did not complete", "state": info}
            continue
        r0 = ranks[0]
        kill = info["kill_time"]
        first = max(r["first_iteration_end"] for r in ranks if r.get("first_iteration_end"))
        out[source] = {
            "kill_step": info["kill_step"],
            "resume_step": r0["resume_step"],
            "resume_source": r0["resume_source"],
            "iterations_lost": info["kill_step"] - r0["resume_step"],
            "interval": info["interval"],
            "kill_to_first_iteration_s": first - kill,
            "kill_to_restart_s": min(r["attempt_start"] for r in ranks) - kill,
            "restore_s": max(r["resume_seconds"] for r in ranks),
            "restore_s_by_rank": [r["resume_seconds"] for r in ranks],
            "state_bytes": info.get("state_bytes"),
        }
        out["state_bytes"] = info.get("state_bytes")
    m, s = out.get("memory", {}), out.get("storage", {})
    if m.get("restore_s") and s.get("restore_s"):
        out["restore_speedup"] = s["restore_s"] / m["restore_s"]
    return out


def _targets(results: dict) -> list[dict]:
    """Each of cf_ray's goals, with the measured value and met/missed (None: not measured)."""
    lim = results["limits"]
    out = []
    prefix = "FSDP2: " if results.get("config", {}).get("parallel") == "fsdp2" else ""

    def add(tid, setting, text, measured, bound, met, note=""):
        out.append(
            {
                "id": tid,
                "setting": setting,
                "target": prefix + text,
                "measured": measured,
                "bound": bound,
                "met": met,
                "note": note,
            }
        )

    by = {v["id"]: v for v in results["variants"]}
    for setting, _desc in sorted({(v["setting"], v["setting_desc"]) for v in results["variants"]}):
        auto = by.get(f"{setting}/cf_auto")
        if auto:
            add(
                "auto_overhead",
                setting,
                "cf_ray Adaptive overhead (2 % budget) <= 3 %",
                auto["overhead_pct"],
                3.0,
                auto["overhead_pct"] <= 3.0,
                f"interval chosen: {auto.get('chosen_interval')}; whole segment, profiling included",
            )
        budget = results["config"].get("budget_pct")
        for at in (v for v in results["variants"] if v["setting"] == setting and v.get("probe") == 0):
            k = at["k"]
            below = by.get(f"{setting}/cf_fixed/k{k - 1}@auto-1")
            add(
                "auto_within_budget",
                setting,
                f"FixedInterval at Adaptive's k={k}: overhead <= budget",
                at["overhead_pct"],
                budget,
                at["overhead_pct"] <= budget,
                f"steady state over {at['iterations']} iterations",
            )
            if below:
                add(
                    "auto_shortest",
                    setting,
                    f"k={k} is the shortest within budget: overhead at k-1={k - 1} > budget",
                    below["overhead_pct"],
                    budget,
                    below["overhead_pct"] > budget,
                    f"steady state over {below['iterations']} iterations",
                )
        ks = sorted(
            {
                v["k"]
                for v in results["variants"]
                if v["setting"] == setting and v["variant"] == "cf_fixed" and v.get("probe") is None
            }
        )
        k1 = by.get(f"{setting}/cf_fixed/k1")
        if k1 is not None and setting in ("w1", "w2"):
            cap = 10.0 if setting == "w1" else 30.0
            floor = by.get(f"{setting}/floor_copy/k1")
            add(
                "k1_overhead",
                setting,
                f"k=1: cf_ray overhead <= {cap:.0f} %",
                k1["overhead_pct"],
                cap,
                k1["overhead_pct"] <= cap,
                f"one memcpy of the state per step and nothing else (floor_copy): {floor['overhead_pct']:+.1f} %"
                if floor
                else "",
            )
        for k in ks:
            cf = by[f"{setting}/cf_fixed/k{k}"]["overhead_pct"]
            for other, text, fn in (
                ("ray_sync", f"k={k}: cf_ray overhead <= 1/5 of Ray SYNC", lambda c, o: (c <= o / 5.0, o / 5.0)),
                ("ray_async", f"k={k}: cf_ray overhead < Ray ASYNC", lambda c, o: (c < o, o)),
                ("dcp_async", f"k={k}: cf_ray overhead < DCP async_save", lambda c, o: (c < o, o)),
            ):
                o = by.get(f"{setting}/{other}/k{k}")
                if o is None:
                    continue
                met, bound = fn(cf, o["overhead_pct"])
                add(f"vs_{other}", setting, text, cf, bound, met, f"{other}: {o['overhead_pct']:.1f} %")
        cfs = [v for v in results["variants"] if v["setting"] == setting and v["variant"].startswith("cf_")]
        if cfs and lim.get("memcpy_gbps"):
            worst = max(
                (v for v in cfs if v.get("stall_per_ckpt_s") is not None),
                key=lambda v: v["stall_per_ckpt_s"],
                default=None,
            )
            if worst:
                # A worker snapshots what it holds: the whole state (DDP) or its shards (FSDP2).
                held = worst.get("rank_state_bytes") or worst["state_bytes"]
                ideal = held / (lim["memcpy_gbps"] * 1e9)
                what = "state" if held == worst["state_bytes"] else "state per worker"
                add(
                    "stall",
                    setting,
                    f"stall per checkpoint <= 1.5 x {what} / memcpy bandwidth",
                    worst["stall_per_ckpt_s"],
                    1.5 * ideal,
                    worst["stall_per_ckpt_s"] <= 1.5 * ideal,
                    f"worst: {worst['id']}; {what}/memcpy = {ideal * 1e3:.1f} ms",
                )
            passes = [v for v in cfs if v.get("host_passes") is not None]
            if passes:
                worst_p = max(passes, key=lambda v: v["host_passes"])
                add(
                    "host_passes",
                    setting,
                    "passes over the state per checkpoint on the host <= 1.5",
                    worst_p["host_passes"],
                    1.5,
                    worst_p["host_passes"] <= 1.5,
                    f"worst: {worst_p['id']}; copied {worst_p['host_copied_x']:.2f}x + read again to "
                    f"checksum {worst_p['host_crc_reread_x']:.2f}x (instrumented, workers + holders)",
                )
            held = [v for v in cfs if v.get("held_bytes") is not None]
            if held:
                worst_h = max(held, key=lambda v: v["held_bytes"])
                add(
                    "held",
                    setting,
                    "host memory held for snapshots per node <= 2 x state",
                    worst_h["held_bytes"] / _MiB,
                    2 * worst_h["state_bytes"] / _MiB,
                    worst_h["held_bytes"] <= 2 * worst_h["state_bytes"],
                    f"worst: {worst_h['id']}; the holder's slots (resident) + object-store copies, MB",
                )
            gb = [v["persist_gbps_median"] for v in cfs if v.get("persist_gbps_median")]
            if gb:
                bw = statistics.median(gb)
                need = 0.85 * lim["storage_write_fsync_gbps"]
                add(
                    "persist_bw",
                    setting,
                    "persist at >= 85 % of storage write+fsync bandwidth",
                    bw,
                    need,
                    bw >= need,
                    f"median over cf_ray checkpoints; storage {lim['storage_write_fsync_gbps']:.2f} GB/s",
                )
            worst_mem = max(cfs, key=lambda v: v["peak_private_above_start_mb"])
            base = by.get(f"{setting}/none")
            if base is not None:
                held_by_worker = (worst_mem.get("rank_state_bytes") or worst_mem["state_bytes"]) / _MiB
                delta = worst_mem["peak_private_above_start_mb"] - base["peak_private_above_start_mb"]
                add(
                    "memory",
                    setting,
                    "peak private RSS per worker, with cf_ray minus without, <= 1.1 x state",
                    delta,
                    1.1 * held_by_worker,
                    delta <= 1.1 * held_by_worker,
                    f"worst: {worst_mem['id']}: {worst_mem['peak_private_above_start_mb']:.0f} MB; no "
                    f"checkpointing: {base['peak_private_above_start_mb']:.0f} MB (private RSS above the "
                    "worker's before the model was built)",
                )
    rec = results.get("recovery") or {}
    if rec.get("restore_speedup"):
        add(
            "restore_speedup",
            "recovery",
            "restore from memory >= 3 x faster than from storage",
            rec["restore_speedup"],
            3.0,
            rec["restore_speedup"] >= 3.0,
            f"state {rec.get('state_bytes', 0) / 1e9:.2f} GB",
        )
    for source in ("memory", "storage"):
        r = rec.get(source) or {}
        if "iterations_lost" in r:
            add(
                f"lost_{source}",
                "recovery",
                f"iterations lost <= interval (restore from {source})",
                r["iterations_lost"],
                r["interval"],
                r["iterations_lost"] <= r["interval"],
            )
    return out


# -- output -----------------------------------------------------------------------------------


def _fmt(x, spec=".3f", none="–"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def render_markdown(results: dict, *, heading: str = "##") -> str:
    meta, lim, cfg = results["meta"], results["limits"], results["config"]
    lines = []
    m = cfg["model"]
    parallel = {"fsdp2": "FSDP2 (fully_shard, each worker saves its shards)"}.get(cfg.get("parallel", "ddp"), "DDP")
    lines.append(
        f"Model ({parallel}): {m['layers']} x Linear({m['width']}, {m['width']}) + Adam, {m['params'] / 1e6:.1f} M "
        f"parameters, {m['state_bytes'] / 1e6:.0f} MB of state, batch {m['batch']}, "
        f"{cfg['iters']} iterations per segment, {cfg['rounds']} round(s). "
        f"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={meta['env'].get('RAY_TRAIN_HEALTH_CHECK_INTERVAL_S')} "
        "for every variant (Ray's default 2 s would throttle its own report)."
    )
    lines.append(
        f"Load average at start {meta['loadavg_start'][0]:.2f}, at end {meta['loadavg_end'][0]:.2f} "
        "(other jobs share this machine: timings are noisy; compare variants within one run)."
    )
    lines.append("")
    for setting in results["settings"]:
        sid = setting["setting"]
        vs = [v for v in results["variants"] if v["setting"] == sid]
        if not vs:
            continue
        drift = setting.get("baseline_drift_pct")
        lines.append(f"{heading}# {setting['desc']}")
        lines.append("")
        lines.append(
            f"Baseline {setting['baseline_iter_mean_s']:.3f} s/iteration (mean); drift between baseline "
            f"segments {_fmt(drift, '.1f')} %."
            + (
                f" Each worker holds {setting['rank_state_bytes'] / 1e6:.0f} MB of the state (its shards)."
                if setting.get("rank_state_bytes") and setting["rank_state_bytes"] != setting.get("state_bytes")
                else ""
            )
        )
        lines.append("")
        lines.append(
            "| variant | k | iteration median (min–max) s | overhead % | incl. drain % | stall/ckpt s "
            "| CPU ms/iter (worker 0 + cf_ray actors) | ckpts taken/committed | peak private RSS/worker MB | written GB |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for v in vs:
            k = v["k"] if v["k"] else (f"auto→{v.get('chosen_interval')}" if v["variant"] == "cf_auto" else "–")
            if v.get("probe") is not None:
                k = f"{v['k']} (= auto{'' if v['probe'] == 0 else ' − 1'}, steady state)"
            ovh = "–" if v["variant"] == "none" else _fmt(v["overhead_pct"], "+.1f")
            ovd = "–" if v["variant"] == "none" else _fmt(v["overhead_incl_drain_pct"], "+.1f")
            lines.append(
                f"| {v['label']} | {k} | {v['iter_median_s']:.3f} ({v['iter_min_s']:.3f}–{v['iter_max_s']:.3f}) "
                f"| {ovh} | {ovd} | {_fmt(v.get('stall_per_ckpt_s'))} "
                f"| {_fmt((v.get('worker_cpu_ms_per_iter') or [None])[0], '.0f')}"
                f"{' + ' + _fmt(v['cf_actors_cpu_ms_per_iter'], '.0f') if v.get('cf_actors_cpu_ms_per_iter') else ''} "
                f"| {v['checkpoints_taken']}/{v['checkpoints_committed']} "
                f"| {' / '.join(f'{x:.0f}' for x in v['peak_private_mb_per_worker'])} "
                f"| {v['bytes_written'] / 1e9:.2f} |"
            )
        lines.append("")
    skipped = [s for s in results.get("skipped", [])]
    if skipped:
        lines.append(
            "Not run: " + "; ".join(f"{s['setting']} {s['variant']} k={s['k']} ({s['reason']})" for s in skipped) + "."
        )
        lines.append("")
    lines.append(f"{heading}# Machine limits (same run)")
    lines.append("")
    lines.append("| figure | value |")
    lines.append("|---|---|")
    lines.append(f"| host memcpy, one thread | {lim['memcpy_gbps']:.2f} GB/s |")
    lines.append(
        f"| storage write + fsync ({lim['storage_test_bytes'] / 1e9:.2f} GB, 16 MiB chunks) "
        f"| {lim['storage_write_fsync_gbps']:.2f} GB/s |"
    )
    lines.append(f"| CRC-32 as cf_ray computes it (ISA-L), one thread | {lim['crc32_gbps']:.2f} GB/s |")
    if lim.get("first_touch_gbps"):
        lines.append(f"| first touch of newly allocated memory (page faults) | {lim['first_touch_gbps']:.2f} GB/s |")
    for v in results["variants"]:
        if v["variant"].startswith("cf_") and v.get("stall_per_ckpt_s") is not None:
            held = v.get("rank_state_bytes") or v["state_bytes"]
            ideal = held / (lim["memcpy_gbps"] * 1e9)
            what = "state" if held == v["state_bytes"] else "state per worker"
            lines.append(
                f"| {v['id']}: stall {v['stall_per_ckpt_s'] * 1e3:.1f} ms vs {what}/memcpy "
                f"{ideal * 1e3:.1f} ms | {v['stall_per_ckpt_s'] / ideal:.2f}x |"
            )
        if v["variant"].startswith("cf_") and v.get("persist_s_median"):
            ideal = (v.get("snapshot_bytes") or v["state_bytes"]) / (lim["storage_write_fsync_gbps"] * 1e9)
            lines.append(
                f"| {v['id']}: persist {v['persist_s_median']:.2f} s vs bytes/storage "
                f"{ideal:.2f} s | {100 * ideal / v['persist_s_median']:.0f} % of storage bandwidth |"
            )
    lines.append("")
    rec = results.get("recovery")
    if rec:
        lines.append(
            f"{heading}# Recovery (rank 1 SIGKILLed mid-interval, "
            f"{(rec.get('state_bytes') or 0) / 1e9:.2f} GB of state)"
        )
        lines.append("")
        lines.append(
            "| restore from | kill → first resumed iteration s | kill → restart s | restore s "
            "| iterations lost (interval) |"
        )
        lines.append("|---|---|---|---|---|")
        for source in ("memory", "storage"):
            r = rec.get(source) or {}
            if "restore_s" not in r:
                lines.append(f"| {source} | {r.get('error', 'not run')} | | | |")
                continue
            lines.append(
                f"| {source} (got: {r['resume_source']}) | {r['kill_to_first_iteration_s']:.2f} "
                f"| {r['kill_to_restart_s']:.2f} | {r['restore_s']:.2f} "
                f"| {r['iterations_lost']} ({r['interval']}) |"
            )
        lines.append("")
    lines.append(f"{heading}# Targets")
    lines.append("")
    lines.append("| setting | target | measured | bound | |")
    lines.append("|---|---|---|---|---|")
    for t in results.get("targets", []):
        met = {True: "met", False: "**missed**", None: "n/a"}[t["met"]]
        meas, bound = t["measured"], t["bound"]
        spec = ".0f" if t["id"] in ("memory",) else (".3f" if t["id"] in ("stall",) else ".2f")
        if t["id"].startswith("lost"):
            spec = "d"
        lines.append(
            f"| {t['setting']} | {t['target']} | {_fmt(meas, spec)} | {_fmt(bound, spec)} "
            f"| {met}{' — ' + t['note'] if t['note'] else ''} |"
        )
    lines.append("")
    return "\n".join(lines)


def render_readme(results: dict) -> str:
    """The README's performance section, generated from a results JSON."""
    meta = results["meta"]
    host = meta["host"]
    head = [
        "## Performance",
        "",
        f"Measured {meta['date']} on {host['cpu']} ({host['cores']} cores, {host['mem_gb']:.0f} GB RAM, "
        f"{host['platform']}) with `{meta['command']}` — cf_ray {meta['versions']['cf_ray']}, "
        f"Ray {meta['versions']['ray']}, torch {meta['versions']['torch']}, preset `{meta['preset']}`, "
        f"{meta['wall_s'] / 60:.1f} min.",
        "",
    ]
    body = render_markdown(results, heading="##")
    plot = "" if not meta.get("plot") else f"\n![overhead against k](benchmarks/{Path(meta['plot']).name})\n"
    return "\n".join(head) + body + plot


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    settings = results["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    markers = {"ray_sync": "s", "ray_async": "D", "dcp_async": "^", "cf_fixed": "o", "cf_auto": "*", "floor_copy": "x"}
    for ax, setting in zip(axes[0], settings):
        vs = [v for v in results["variants"] if v["setting"] == setting["setting"]]
        for variant in VARIANTS[1:]:
            pts = sorted(
                (v["k"] or v.get("chosen_interval") or 1, v["overhead_pct"])
                for v in vs
                if v["variant"] == variant and v.get("probe") is None
            )
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                marker=markers[variant],
                ms=12 if variant == "cf_auto" else 6,
                linestyle="" if variant == "cf_auto" else "-",
                label=LABELS[variant],
            )
        probes = sorted((v["k"], v["overhead_pct"]) for v in vs if v.get("probe") is not None)
        if probes:
            ax.plot(
                *zip(*probes),
                marker="x",
                ms=8,
                linestyle="",
                color="black",
                label="FixedInterval at Adaptive's k and k−1 (steady state)",
            )
        budget = results["config"].get("budget_pct")
        if budget:
            ax.axhline(budget, color="red", lw=0.8, ls="--", label=f"budget {budget:g} %")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint interval k (iterations)")
        ax.set_ylabel("overhead vs no checkpoint (%)")
        ax.set_title(setting["desc"], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"cf_ray bench ({results['meta']['preset']}, {results['meta']['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
        help="small model, k=10 (and k=1 for cf_ray), one round: < 4 min on an idle 2-core machine",
    )
    g.add_argument(
        "--full",
        dest="preset",
        action="store_const",
        const="full",
        help="6 x Linear(2048) + Adam (~302 MB), k in {1,10,50}, one round, ~40 min on 2 cores (default)",
    )
    p.set_defaults(preset="full")
    p.add_argument("--out", default="results/bench", help="output directory (default: %(default)s)")
    p.add_argument("--json", default=None, help="results JSON path (default: OUT/results.json)")
    p.add_argument("--width", type=int, help="Linear width of the reference model")
    p.add_argument("--layers", type=int, help="number of Linear layers of the reference model")
    p.add_argument("--batch", type=int, help="batch size per worker")
    p.add_argument("--workers", type=_parse_ints, help="CPU settings as worker counts, e.g. 2,1")
    p.add_argument("--iters", type=int, help="timed iterations per segment")
    p.add_argument("--warmup", type=int, help="untimed iterations before the first segment")
    p.add_argument("--rounds", type=int, help="rounds over all variants (order alternates)")
    p.add_argument("--ks", type=_parse_ints, help="checkpoint intervals for every variant, e.g. 1,10,50")
    p.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)}")
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
        help="let cf_ray register its checkpoints with Ray Train (off by default: with Ray's "
        "num_to_keep, Ray then deletes directories cf_ray's keep_last already deleted and the "
        "run fails with 'Path not found')",
    )
    p.add_argument("--storage", default=None, help="checkpoint storage directory (default: OUT/work)")
    p.add_argument("--keep-storage", action="store_true", help="keep the checkpoints written (default: delete)")
    p.add_argument("--object-store-gb", type=float, default=None, help="Ray object store size in GB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--render-readme",
        metavar="RESULTS_JSON",
        help="print the README performance section generated from RESULTS_JSON and exit",
    )
    from benchmarks import cluster  # the multi-node jobs (#12) and their options live there

    cluster.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render_readme:
        print(render_readme(json.loads(Path(args.render_readme).read_text())))
        return 0
    if args.cluster:
        from benchmarks import cluster

        return cluster.main(args, argv if argv is not None else sys.argv[1:])
    results = run(args, argv if argv is not None else sys.argv[1:])
    print(render_markdown(results))
    print(
        f"JSON: {results['meta']['json']}" + (f"   plot: {results['meta']['plot']}" if results["meta"]["plot"] else "")
    )
    return 0


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    import cf_ray

    t_start = time.time()
    load_start = os.getloadavg()
    preset = dict(PRESETS[args.preset])
    for key in ("width", "layers", "batch", "iters", "warmup", "rounds", "workers", "large_width", "large_layers"):
        val = getattr(args, key)
        if val is not None:
            preset[key] = val
    # The floor is a reference figure, not a way to checkpoint: only when named.
    variants = (
        [v.strip() for v in args.variants.split(",")] if args.variants else [v for v in VARIANTS if v != "floor_copy"]
    )
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
            base = {v: ([0] if v in ("none", "cf_auto") else list(args.ks)) for v in VARIANTS}
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
    mod = sys.modules.get("benchmarks.bench") or __import__("benchmarks.bench", fromlist=["_bench_loop"])
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
            plan = _plan(matrix_for(workers), preset["rounds"], preset["iters"], sid) if has_segments else []
            with_recovery = rcfg is not None and i == rec_host
            cfg = {
                "setting": sid if has_segments else "recovery",
                "width": preset["width"],
                "layers": preset["layers"],
                "batch": preset["batch"],
                "warmup": preset["warmup"],
                "iters": preset["iters"],
                "seed": args.seed,
                "plan": plan,
                "out_dir": str(seg_dir),
                "cf_register": args.cf_register,
                "budget_pct": args.budget_pct,
                "parallel": args.parallel,
                "recovery": rcfg if with_recovery else None,
            }
            t0 = time.time()
            error = None
            try:
                # Ray keeps its last 2 checkpoints; with cf_ray registering into the same run, Ray's
                # clean-up trips over cf_ray's own keep-last deletions (see --cf-register).
                _fit(
                    mod._bench_loop,
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
            "parallel": args.parallel,
            "iters": preset["iters"],
            "warmup": preset["warmup"],
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
