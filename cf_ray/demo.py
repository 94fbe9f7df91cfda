"""The main job: a real TorchTrainer run on a local Ray cluster, one worker SIGKILLed part-way.

``cf-ray demo`` starts a local Ray cluster, trains a small model with ``TorchTrainer`` on 2 CPU
workers with synthetic data, SIGKILLs one worker process part-way, lets Ray Train restart the
workers, resumes with cf_ray, and compares the final weights with those of an uninterrupted run of
the same job. Everything is written under ``--dir`` (default ``./cf_ray_runs/demo``).

:func:`train_loop_per_worker` is also what the end-to-end tests run, with other settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from typing import Any

import torch

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "samples": 1003,
    "dim": 32,
    "hidden": 256,
    "depth": 3,
    "batch_size": 16,
    "epochs": 2,
    "lr": 1e-3,
    "policy": "fixed",  # fixed, epoch, adaptive
    "interval": 5,
    "persist_every": 1,  # the fixed policy's: persist one checkpoint in this many (None: measured), hold the rest in memory
    "budget_pct": 5.0,  # the adaptive policy's overhead budget
    "keep_last": 3,
    "milestone_every": None,
    "restore_from": "auto",
    "kill_rank": 1,
    "kill_at": None,  # step at which kill_rank SIGKILLs itself (once)
    "out_dir": None,
    "storage_path": None,  # None: the run's RunConfig storage
    "storage_filesystem": None,
    "upload_path": None,
    "upload_filesystem": None,
    "step_sleep": 0.0,
    "kill_after_handoff": False,  # wait until the last snapshot is in the holder before the SIGKILL
    "env": {},  # environment variables set in the worker before anything else (cf_ray's variables)
    "release_after_fit_s": 120.0,  # CheckpointConfig.release_after_fit_s
    "replicas": None,  # CheckpointConfig.replication.copies (None: 1 on a cluster of several nodes)
    "replica_label": None,  # CheckpointConfig.replication.label
    "replica_every": 1,  # CheckpointConfig.replication.every
    "resume_from": None,  # another run's checkpoint to start from (CheckpointConfig.resume_from)
}


class SyntheticDataset(torch.utils.data.Dataset):
    """``(id, x, y)`` with ``x`` a fixed function of the id, so any order is reproducible."""

    def __init__(self, n: int, dim: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def build_model(cfg: dict) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    width = cfg["dim"]
    for _ in range(cfg["depth"]):
        layers += [torch.nn.Linear(width, cfg["hidden"]), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
        width = cfg["hidden"]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def _policy(cfg: dict):
    import cf_ray

    if cfg["policy"] == "fixed":
        n = cfg["persist_every"]
        return cf_ray.FixedInterval(every=int(cfg["interval"]), persist_every=None if n is None else int(n))
    if cfg["policy"] == "epoch":
        return cf_ray.EpochEnd()
    if cfg["policy"] == "adaptive":
        return cf_ray.Adaptive(budget_pct=float(cfg["budget_pct"]))
    raise ValueError(f"policy={cfg['policy']!r}: use fixed, epoch or adaptive")


def train_loop_per_worker(config: dict) -> None:
    """The demo's (and the end-to-end tests') training loop. Writes its records under ``out_dir``."""
    import ray.train
    import ray.train.torch

    import cf_ray
    from cf_ray.data import ResumableDistributedSampler

    cfg = {**DEFAULTS, **config}
    os.environ.update(cfg["env"])
    torch.set_num_threads(1)
    torch.manual_seed(cfg["seed"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    dataset = SyntheticDataset(cfg["samples"], cfg["dim"], cfg["seed"])
    # pad=False: every sample exactly once per epoch (torch's DistributedSampler pads with repeats).
    sampler = ResumableDistributedSampler(
        dataset, rank=rank, world_size=world, shuffle=True, seed=cfg["seed"], pad=False
    )
    # A generator of its own keeps iter(loader) from drawing from the global torch RNG, which the
    # checkpoint restores: otherwise a mid-epoch resume would draw once more than an uninterrupted run.
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=cfg["batch_size"], sampler=sampler, generator=torch.Generator().manual_seed(cfg["seed"])
    )
    model = ray.train.torch.prepare_model(build_model(cfg))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": optimizer},
        data={"sampler": sampler},
        config=cf_ray.CheckpointConfig(
            policy=_policy(cfg),
            keep_last=cfg["keep_last"],
            milestone_every=cfg["milestone_every"],
            restore_from=cfg["restore_from"],
            storage_path=cfg["storage_path"],
            storage_filesystem=cfg["storage_filesystem"],
            upload_path=cfg["upload_path"],
            upload_filesystem=cfg["upload_filesystem"],
            resume_from=cfg["resume_from"],
            release_after_fit_s=cfg["release_after_fit_s"],
            replication=cf_ray.config.Replication(
                copies=cfg["replicas"], label=cfg["replica_label"], every=cfg["replica_every"]
            ),
        ),
    )
    resume = ckpt.restore()
    out = cfg["out_dir"]
    os.makedirs(out, exist_ok=True)
    gen = resume.generation
    with open(f"{out}/resume_rank{rank}_gen{gen}.json", "w") as f:
        json.dump(
            {
                "source": resume.source,
                "step": resume.step,
                "epoch": resume.epoch,
                "seconds": resume.seconds,
                "read_bytes": resume.read_bytes,
                "world_size": world,
                "saved_world_size": resume.saved_world_size,
                "time": time.time(),
            },
            f,
        )
    ids_log = open(f"{out}/ids_rank{rank}_gen{gen}.jsonl", "w", buffering=1)  # a line per step, even if killed
    loss = torch.tensor(0.0)
    for epoch in range(resume.epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            ckpt.step(optimizer, loss=loss)  # the loss is checked in the first steps after a restore
            optimizer.zero_grad()
            ids_log.write(json.dumps({"step": ckpt.step_count, "epoch": epoch, "ids": ids.tolist()}) + "\n")
            if cfg["step_sleep"]:
                time.sleep(cfg["step_sleep"])
            if (
                cfg["kill_at"] is not None
                and rank == cfg["kill_rank"]
                and ckpt.step_count == cfg["kill_at"]
                and not os.path.exists(f"{out}/killed")
            ):
                ids_log.flush()
                if cfg["kill_after_handoff"]:
                    ckpt.wait_snapshot()
                with open(f"{out}/killed", "w") as f:
                    json.dump({"step": ckpt.step_count, "time": time.time()}, f)
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.end_epoch()
    ids_log.close()
    ckpt.metrics["loss"] = float(loss.detach())
    summary = ckpt.finish()
    if rank == 0:
        torch.save(
            {
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict(),
            },
            f"{out}/final_state.pt",
        )
        with open(f"{out}/result.json", "w") as f:
            json.dump(
                {
                    "final_path": summary.final_path,
                    "committed_steps": summary.committed_steps,
                    "failures": summary.failures,
                    "checkpoints_taken": ckpt.checkpoints_taken,
                    "stall_s_total": ckpt.stall_s_total,
                    "steps": ckpt.step_count,
                    "profile": ckpt.profile_rows(),
                    "events": ckpt.events(),
                },
                f,
                default=str,
            )


def run(
    name: str,
    root: str,
    config: dict,
    *,
    workers: int = 2,
    max_failures: int = 3,
    storage_path: str | None = None,
    storage_filesystem=None,
):
    """One ``TorchTrainer.fit()`` of :func:`train_loop_per_worker`; returns Ray's Result."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=dict(config, out_dir=os.path.join(root, "out", name)),
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path or os.path.join(root, "storage"),
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def states_equal(a_path: str, b_path: str) -> bool:
    """Bitwise equality of the model and optimizer state saved by two runs."""
    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    return _equal(a, b)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


#: The file that marks a directory as made by ``cf-ray demo``: only such a directory is emptied.
MARKER = ".cf_ray_demo"


def prepare_dir(root: str) -> str | None:
    """Make ``root`` an empty directory marked as the demo's, or say why not (the message to print).

    The demo deletes only what it made: a directory it created before (it holds :data:`MARKER`) is
    emptied, a missing or empty one is created and marked; anything else (a file, a directory with
    other contents) is refused and left untouched, so ``--dir .`` or ``--dir ~/runs`` never loses a file.
    """
    if os.path.lexists(root) and not os.path.isdir(root):
        return f"--dir {root} is not a directory: choose a new or empty directory (e.g. --dir ./cf_ray_runs/demo)"
    if os.path.isdir(root) and os.listdir(root):
        if not os.path.isfile(os.path.join(root, MARKER)):
            return (
                f"--dir {root} is not empty and was not made by cf-ray demo: nothing was deleted; choose a "
                "new or empty directory (e.g. --dir ./cf_ray_runs/demo)"
            )
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, MARKER), "w") as f:
        f.write("made by cf-ray demo: `cf-ray demo --dir` empties this directory before each run\n")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cf-ray demo", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--dir",
        default=os.path.join(os.getcwd(), "cf_ray_runs", "demo"),
        help="everything is written under this directory (default: ./cf_ray_runs/demo): a new or empty one, or one "
        "an earlier cf-ray demo made (it is emptied first); any other is refused, never emptied",
    )
    p.add_argument("--interval", type=int, default=5, help="checkpoint every this many steps (default 5)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=1003)
    p.add_argument(
        "--kill-at", type=int, default=None, help="step at which rank 1 is SIGKILLed (default: 60%% of the run)"
    )
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args(argv)
    import ray

    root = os.path.realpath(os.path.expanduser(args.dir))
    refused = prepare_dir(root)
    if refused:
        print(f"cf-ray demo: {refused}", file=sys.stderr)
        return 2
    samples_per_rank = -(-args.samples // 2)  # ceil(samples / 2 workers)
    steps_per_epoch = -(-samples_per_rank // DEFAULTS["batch_size"])
    total = steps_per_epoch * args.epochs
    kill_at = args.kill_at or max(2, int(total * 0.6) + 2)
    cfg = {"interval": args.interval, "epochs": args.epochs, "samples": args.samples, "hidden": args.hidden}
    t0 = time.time()
    started = not ray.is_initialized()  # in a process already connected to Ray (a test), use that cluster
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        print(
            f"cf_ray demo: 2 workers, {total} steps, checkpoint every {args.interval} steps; "
            f"rank 1 is SIGKILLed at step {kill_at}. Writing under {root}"
        )
        t1 = time.time()
        print("  1/2 uninterrupted reference run ...", end=" ", flush=True)
        run("reference", root, cfg)
        t2 = time.time()
        print(f"{t2 - t1:.0f} s", flush=True)
        print(f"  2/2 the same run, rank 1 SIGKILLed at step {kill_at} ...\n{KILL_NOTE}", flush=True)
        run("interrupted", root, dict(cfg, kill_at=kill_at))
        print(
            f"  2/2 done in {time.time() - t2:.0f} s: Ray Train restarted the workers, cf_ray restored them", flush=True
        )
    finally:
        if started:
            ray.shutdown()
    text, equal = closing_table(
        os.path.join(root, "out", "interrupted"),
        os.path.join(root, "out", "reference"),
        os.path.join(root, "storage", "interrupted"),
        interval=args.interval,
        wall_s=time.time() - t0,
    )
    print()
    print(text)
    return 0 if equal else 1


#: Said before the kill: Ray's own report of the worker's death follows, and is no crash of the demo.
KILL_NOTE = (
    "      Ray will report the killed worker's death next (\"A worker died or was killed while executing a task "
    'by an unexpected system error ..."): that is this SIGKILL, expected.'
)


def closing_table(out: str, reference_out: str, run_dir: str, *, interval: int, wall_s: float) -> tuple[str, bool]:
    """The demo's closing table and the next commands, from the interrupted run's records (``out``,
    as :func:`train_loop_per_worker` writes them), and whether its final state equals the reference's.

    Every count comes from one source, the run's profile table (one row per checkpoint, both
    attempts), so that no row contradicts another: taken, of which committed to storage, the others
    held in memory only or failed, split by the attempt before and after the restart.
    """
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    resumes = []
    for n in os.listdir(out):
        if n.startswith("resume_rank0_"):
            with open(os.path.join(out, n)) as f:
                resumes.append(json.load(f))
    restart = max(resumes, key=lambda r: r["time"])
    with open(os.path.join(out, "killed")) as f:
        killed = json.load(f)
    rows_ = result["profile"]
    last_gen = max((r.get("generation") or 0 for r in rows_), default=0)
    after = [r for r in rows_ if r.get("generation") == last_gen]
    committed = [r for r in rows_ if r.get("committed")]
    held = [r for r in rows_ if not r.get("committed") and r.get("where") == "memory-only"]
    failed = [r for r in rows_ if not r.get("committed") and r.get("where") == "failed"]
    unfinished = len(rows_) - len(committed) - len(held) - len(failed)  # in flight when the worker died
    missing = [f"{len(held)} held in memory only (superseded, or by the schedule)"] if held else []
    missing += [f"{unfinished} unfinished when the worker was killed"] if unfinished else []
    missing += [f"{len(failed)} failed"] if failed else []
    stalls = sorted(r["stall_s"] for r in rows_ if r.get("stall_s") is not None)
    equal = states_equal(os.path.join(reference_out, "final_state.pt"), os.path.join(out, "final_state.pt"))
    rows = [
        ("run directory", run_dir),
        (
            "checkpoints taken (both attempts)",
            f"{len(rows_)}: {len(rows_) - len(after)} before the kill, {len(after)} after the restart",
        ),
        ("  of them committed to storage", f"{len(committed)}" + (f"; not: {', '.join(missing)}" if missing else "")),
        ("  of them failed to save", str(len(failed))),
        ("interval (steps)", str(interval)),
        ("stall per checkpoint (median)", f"{1000 * stalls[len(stalls) // 2]:.1f} ms" if stalls else "-"),
        ("worker SIGKILLed at step", str(killed["step"])),
        ("restored from", f"{restart['source']} (step {restart['step']}, {restart['seconds']:.2f} s)"),
        ("steps redone after the restart", str(killed["step"] - restart["step"])),
        ("final weights == uninterrupted run", "yes (bitwise, model and optimizer)" if equal else "NO"),
        ("final model", result["final_path"] or "-"),
        ("wall time", f"{wall_s:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'what'.ljust(width)} | value", f"|-{'-' * width}-|------"]
    lines += [f"| {k.ljust(width)} | {v}" for k, v in rows]
    run_arg = shlex.quote(run_dir)
    exported = shlex.quote(os.path.join(os.path.dirname(os.path.dirname(run_dir)), "exported"))
    lines += [
        "",
        "next, on this run (its checkpoints; every file checked; the profile; the final model for other tools):",
        f"  cf-ray ls {run_arg}",
        f"  cf-ray verify {run_arg}",
        f"  cf-ray profile {run_arg}",
        f"  cf-ray export {run_arg} --to safetensors {exported}",
    ]
    return "\n".join(lines), equal


if __name__ == "__main__":
    sys.exit(main())
