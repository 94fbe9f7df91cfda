"""Spot instances and an elastic group, simulated on one machine.

The driver plays the cloud and the scheduler around a Ray Train ``TorchTrainer`` job that uses
cf_ray (the training loop is ordinary: a ``Checkpointer``, a resumable sampler, ``ckpt.step``):

1. **Preemption, 2 -> 1 workers.** 2 workers train. The cloud reclaims the node of rank 1: it sends
   Ray Train's own preemption signal, exactly as Ray's ``PreemptionWatcher`` does when a node is
   drained (``mark_preempt(PreemptionInfo(deadline_ms, ...))`` on every worker), with a deadline
   ``--grace`` seconds ahead, and SIGKILLs rank 1's process at the deadline. Ray Train (its
   ``PREEMPTING`` state) ends the attempt at the deadline; the node is gone, so the job is
   re-submitted with 1 worker, as Ray's elastic policy would decide.
2. **Growing back, 1 -> 2 workers.** A node joins. Before the scheduler resizes the group, it tells
   the job through cf_ray (``cf_ray.Run(...).notify_preemption``, with a deadline), then tears
   the group down at the deadline and starts it again with 2 workers.

Each time, cf_ray takes a just-in-time checkpoint at the next step all ranks reach, persists it
first, and the new group resumes from it with the data position re-split over the new number of
workers (every sample still exactly once per epoch) and the controller re-profiling the new group.
Printed per event: when the notice came, the checkpoint's step, whether it was durable before the
deadline, the iterations lost, and the world size before and after.

On a real cluster none of the orchestration below exists: Ray Core's drain, Ray Train's watcher
and its elastic policy (``ScalingConfig(num_workers=(1, 2))``) do it. It is simulated here because
the real path needs several Ray nodes and takes minutes (node start, a 20 s resource tick, the
worker-group start timeout); the job's side, cf_ray's, is the same.

Run: ``python examples/spot_training.py`` (about a minute on 2 CPU cores); sizes through flags or
``CF_RAY_SPOT_*`` environment variables (``--help``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import torch

# -- the job: an ordinary training loop with cf_ray -----------------------------------------------------------


class SyntheticDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, dim: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(dim, 1, generator=g))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def train_loop_per_worker(cfg: dict) -> None:
    import ray
    import ray.train
    import ray.train.torch

    import cf_ray
    from cf_ray.data import ResumableDistributedSampler

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    dataset = SyntheticDataset(cfg["samples"], cfg["dim"])
    sampler = ResumableDistributedSampler(dataset, rank=rank, world_size=world, shuffle=True, seed=0, pad=False)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=cfg["batch_size"], sampler=sampler, generator=torch.Generator().manual_seed(0)
    )
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(
            torch.nn.Linear(cfg["dim"], cfg["hidden"]), torch.nn.ReLU(), torch.nn.Linear(cfg["hidden"], 1)
        )
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": optimizer},
        data={"sampler": sampler},
        config=cf_ray.CheckpointConfig(
            policy=cf_ray.FixedInterval(every=cfg["interval"]),
            storage_path=cfg["storage"],
            run_name=cfg["run"],
            register_with_ray=False,
        ),
    )
    resume = ckpt.restore()

    # The simulation's only hook: tell the "cloud" who we are and how far we got.
    cloud = ray.get_actor("spot-cloud")
    cloud.register.remote(
        rank,
        world,
        os.getpid(),
        ray.get_runtime_context().current_actor,
        {"step": resume.step, "source": resume.source, "saved_world_size": resume.saved_world_size},
    )
    for epoch in range(resume.epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        for _, x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            ckpt.step(optimizer)
            optimizer.zero_grad()
            cloud.progress.remote(rank, ckpt.step_count)
            time.sleep(cfg["step_s"])
        ckpt.end_epoch()
    ckpt.finish()


# -- the simulated cloud and scheduler ----------------------------------------------------------------------


class Cloud:
    """Who runs where and how far they got (a named actor the workers report to)."""

    def __init__(self):
        self.workers: dict[int, dict] = {}
        self.steps: dict[int, int] = {}
        self.resumes: list[dict] = []

    def register(self, rank, world, pid, actor, resume):
        self.workers[rank] = {"pid": pid, "actor": actor, "world": world}
        self.steps[rank] = resume["step"]
        if rank == 0:
            self.resumes.append(dict(resume, world_size=world, time=time.time()))

    def progress(self, rank, step):
        self.steps[rank] = max(self.steps.get(rank, 0), step)

    def state(self):
        return {
            "workers": {r: {k: w[k] for k in ("pid", "world")} for r, w in self.workers.items()},
            "steps": dict(self.steps),
            "resumes": list(self.resumes),
        }

    def send_ray_preemption(self, deadline_ms, preempted_ranks):
        """What Ray Train's PreemptionWatcher does when Ray Core reports a node draining."""
        from ray.train.v2.api.preemption import PreemptionInfo

        info = PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={"spot-node-1": list(preempted_ranks)})
        for w in self.workers.values():
            w["actor"].mark_preempt.remote(info)

    def forget(self):
        self.workers.clear()
        self.steps.clear()


def _fit(args, world: int, name: str):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = {k: getattr(args, k) for k in ("samples", "dim", "hidden", "batch_size", "epochs", "interval", "step_s")}
    cfg.update(storage=os.path.join(args.dir, "checkpoints"), run="spot")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=world),
        run_config=RunConfig(
            name=name,
            storage_path=os.path.join(args.dir, "ray"),
            failure_config=FailureConfig(max_failures=0, max_preemption_failures=0),
        ),
    )
    try:
        trainer.fit()
        return "finished"
    except Exception as e:  # noqa: BLE001 - the preempted attempt ends with Ray's error
        return type(e).__name__


def _wait_for(cond, what: str, attempt: threading.Thread, timeout: float = 300.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if not attempt.is_alive():
            raise RuntimeError(f"the attempt ended before {what}: make the run longer (--samples, --step-s)")
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def main(argv=None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=env("CF_RAY_SPOT_DIR"), help="where runs are written (default: a temp dir)")
    p.add_argument("--samples", type=int, default=int(env("CF_RAY_SPOT_SAMPLES", 2048)))
    p.add_argument("--dim", type=int, default=int(env("CF_RAY_SPOT_DIM", 32)))
    p.add_argument("--hidden", type=int, default=int(env("CF_RAY_SPOT_HIDDEN", 256)))
    p.add_argument("--batch-size", type=int, default=int(env("CF_RAY_SPOT_BATCH", 16)))
    p.add_argument("--epochs", type=int, default=int(env("CF_RAY_SPOT_EPOCHS", 1)))
    p.add_argument(
        "--interval",
        type=int,
        default=int(env("CF_RAY_SPOT_INTERVAL", 10)),
        help="scheduled checkpoint every this many steps",
    )
    p.add_argument(
        "--step-s",
        type=float,
        default=float(env("CF_RAY_SPOT_STEP_S", 0.05)),
        help="extra seconds per step (stands in for a bigger model)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=float(env("CF_RAY_SPOT_GRACE_S", 2.0)),
        help="seconds between a notice and the kill (spot: 120 on AWS, 30 on GCP)",
    )
    p.add_argument(
        "--notice-at",
        type=int,
        default=int(env("CF_RAY_SPOT_NOTICE_AT", 13)),
        help="step at which the node of rank 1 is reclaimed",
    )
    p.add_argument(
        "--grow-after",
        type=int,
        default=int(env("CF_RAY_SPOT_GROW_AFTER", 12)),
        help="steps with 1 worker before a node joins again",
    )
    args = p.parse_args(argv)
    b = args.batch_size  # samples per step: 2b with 2 workers, b with 1; a few steps of slack after each event
    if (args.notice_at + 2) * 2 * b + (args.grow_after + 2) * b + 4 * 2 * b > args.samples * args.epochs:
        p.error("the run is too short for the events: raise --samples or lower --notice-at/--grow-after")
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="cf_ray_spot_"))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # Ray sees the notice sooner
    # Ray's drain watcher actor has nothing to watch on one node (the cloud below plays it): save its start.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("CF_RAY_CONTROLLER_LINGER_S", "30")  # the driver reads the profile at the end

    import ray

    import cf_ray

    t0 = time.time()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    cloud = ray.remote(num_cpus=0)(Cloud).options(name="spot-cloud").remote()
    run = cf_ray.Run(os.path.join(args.dir, "checkpoints"), "spot")  # the job's storage_path and run_name
    events = []

    def state():
        return ray.get(cloud.state.remote())

    def phase(world, name, event):
        """Run one attempt of the job in the background; ``event`` acts on it; returns the outcome."""
        ray.get(cloud.forget.remote())
        result = {}
        th = threading.Thread(target=lambda: result.update(end=_fit(args, world, name)), daemon=True)
        th.start()
        if event is not None:
            event(th)
        th.join()
        return result["end"]

    def jit_row(since):
        rows = run.profile_rows()
        return next((r for r in rows if r.get("kind") == "preempt" and (r.get("notice_unix") or 0) >= since), None)

    def record(kind, notice_unix, deadline_unix, world_before, world_after):
        time.sleep(0.5)  # progress reports still in flight
        done = max(state()["steps"].values())  # steps completed when the workers were killed
        events.append(
            {
                "event": kind,
                "notice_unix": notice_unix,
                "deadline_unix": deadline_unix,
                "done": done,
                "world_before": world_before,
                "world_after": world_after,
            }
        )

    def kill_all_at(deadline_unix, ranks, attempt):
        time.sleep(max(deadline_unix - time.time(), 0.0))
        if not attempt.is_alive():
            raise RuntimeError("the attempt ended before the deadline: make the run longer (--samples, --step-s)")
        for r in ranks:
            pid = state()["workers"][r]["pid"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reclaim_node_of_rank_1(attempt):
        _wait_for(
            lambda: len(state()["workers"]) == 2 and min(state()["steps"].values()) >= args.notice_at,
            "2 workers at the notice step",
            attempt,
        )
        notice = time.time()
        deadline = notice + args.grace
        ray.get(cloud.send_ray_preemption.remote(int(deadline * 1000), [1]))
        kill_all_at(deadline, [1], attempt)
        record("spot reclaim (Ray signal)", notice, deadline, 2, 1)

    def node_joins(attempt):
        _wait_for(lambda: len(state()["workers"]) == 1, "1 worker running", attempt)
        start = state()["resumes"][-1]["step"]
        _wait_for(lambda: max(state()["steps"].values()) >= start + args.grow_after, "1 worker training", attempt)
        notice = time.time()
        deadline = notice + args.grace
        run.notify_preemption(deadline_unix=deadline, detail="a node joined: resize 1 -> 2")
        kill_all_at(deadline, [0], attempt)  # the scheduler restarts the group with the new size
        record("node joins (cf_ray notice)", notice, deadline, 1, 2)

    print(f"cf_ray spot simulation under {args.dir}")
    ends = [phase(2, "spot-a", reclaim_node_of_rank_1), phase(1, "spot-b", node_joins), phase(2, "spot-c", None)]
    resumes = state()["resumes"]
    for ev, nxt in zip(events, resumes[1:]):
        row = jit_row(ev["notice_unix"]) or {}
        # The just-in-time step itself is done even though its ranks held inside it until the kill.
        done = max(ev["done"], row.get("step") or 0)
        ev.update(
            step=row.get("step"),
            made=row.get("made_deadline"),
            resumed=nxt["step"],
            source=nxt["source"],
            done=done,
            lost=done - nxt["step"],
            restart_s=nxt["time"] - ev["deadline_unix"],
            durable_s=(row.get("durable_unix") or 0) - ev["notice_unix"],
        )
    final = run.summary()
    reprofiles = [e for e in final.get("events", []) if e["event"] == "reprofile"]  # live summaries only
    ray.shutdown()

    print(
        "\n| event | notice at | deadline | JIT checkpoint step | durable before the deadline | "
        "iterations lost | restart | world size |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for ev in events:
        made = {True: f"yes, {ev['durable_s']:.2f} s after the notice", False: "no", None: "n/a"}[ev.get("made")]
        print(
            f"| {ev['event']} | {ev['notice_unix'] - t0:.1f} s | +{ev['deadline_unix'] - ev['notice_unix']:.1f} s | "
            f"{ev.get('step')} | {made} | {ev.get('lost')} (done {ev['done']}, resumed at {ev.get('resumed')} "
            f"from {ev.get('source')}) | {ev.get('restart_s', 0):.1f} s | {ev['world_before']} -> "
            f"{ev['world_after']} |"
        )
    print(
        f"\nattempts: {', '.join(ends)}; re-profiled for world sizes {[e['world_size'] for e in reprofiles]}; "
        f"committed steps {final['committed_steps']}; wall time {time.time() - t0:.0f} s"
    )
    ok = (
        ends[-1] == "finished"
        and len(events) == 2
        and all(ev.get("made") for ev in events)
        and all(0 <= ev["lost"] <= 1 for ev in events)
    )
    print("OK" if ok else "UNEXPECTED: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
