"""The worker side of ``cf-ray bench``: what each variant does at a checkpoint (the *savers*), and the
helpers the training loops share (model, memory monitor, barrier, JSON files).

A saver is created for one segment of the loop (``benchmarks/segments.py``); the loop asks it
``due(i)`` after the optimizer step of the segment's i-th iteration (cf_ray decides itself, inside
``ckpt.step``), calls ``save(i)``, and ``drain()`` after the segment (outside the timed window).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any


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


def _seeded_job(cfg: dict, rank: int):
    """The user-loop benchmarks' job on one rank: the seeded reference model under Ray Train's DDP,
    its Adam optimizer and one fixed batch ``(x, y)`` drawn for the rank."""
    import ray.train.torch
    import torch

    torch.manual_seed(cfg["seed"])
    model = ray.train.torch.prepare_model(_build_model(cfg["width"], cfg["layers"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1 + rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=gen)
    y = torch.randn(cfg["batch"], cfg["width"], generator=gen)
    return model, opt, x, y


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


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


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
        self.actors_cpu0 = self.actors_cpu() if rank == 0 else None

    def actors_cpu(self) -> dict[str, float] | None:
        """CPU seconds used so far by this run's holder (phase 2: the persist) and controller processes,
        each read in its own process (``time.process_time`` through ``__ray_call__``)."""
        import ray

        try:
            refs = [a.__ray_call__.remote(_actor_cpu) for a in (self.ckpt.holder, self.ckpt.controller)]
            holder, controller = ray.get(refs, timeout=60)
            return {"holder": holder, "controller": controller}
        except Exception:  # noqa: BLE001 - a figure we can live without
            return None

    def budget(self) -> dict[str, dict[str, float]]:
        """This rank's checkpoint-path budget so far (``Checkpointer.cpu_budget``)."""
        return self.ckpt.cpu_budget

    def taken(self) -> int:
        return self.ckpt.checkpoints_taken

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
        return run.profile_rows(), run.summary()

    def finish(self) -> dict:
        c = self.ckpt
        return {
            "checkpoints_taken": c.checkpoints_taken,
            "stall_s_total": c.stall_s_total,
            "resume_source": self.resume.source,
        }
