"""A spot node reclaimed for real: Ray's drain path on a cluster of several Ray nodes on this machine.

The script starts a small Ray cluster on loopback (``ray.cluster_utils.Cluster``: a head with no
CPUs and two worker "nodes" of one CPU each, each its own raylet, object store and node id) and
runs a Ray Train ``TorchTrainer`` job with 2 workers, one per node, that uses cf_ray (the training
loop is ordinary: a ``Checkpointer``, a resumable sampler, ``ckpt.step``).

1. **An uninterrupted run**, the reference.
2. **The same run, preempted.** At step ``--notice-at`` the cloud reclaims the node of rank 1 the way
   Ray's autoscaler does it for a spot instance: ``ray drain-node`` with reason *preemption* and a
   deadline ``--grace`` seconds ahead. A replacement node joins, and the drained node is removed at
   the deadline. Nothing in the job is simulated: Ray Train's ``PreemptionWatcher`` sees the drain
   and brings its preemption information to every worker; cf_ray takes a just-in-time checkpoint at
   the next step all ranks reach, persists it first and holds training until the node goes; Ray
   Train restarts the group on the surviving and the new node (``max_preemption_failures``), and
   cf_ray restores it — the lost rank's state from the copy a holder on the surviving node keeps
   (``replication``, peer memory) when that copy is as new as storage, else from storage.

Printed: when the notice came, the checkpoint's step, whether it was durable before the deadline,
the steps lost (0 expected), where the restart restored from, and whether the final model and
optimizer state are bitwise equal to the uninterrupted run's.

Growing back (``ScalingConfig(num_workers=(1, 2))``) is the same path; ``tests/test_spot.py`` runs it.

Run: ``python examples/spot_training.py`` (a minute or two on 2 CPU cores); sizes through flags or
``CF_RAY_SPOT_*`` environment variables (``--help``). On a real cluster, leave out the cluster start
and the drain below: the cloud and Ray's autoscaler do them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
            final_model=None,
            # replication's copies=None (the default): one copy on another node, since the cluster has several.
        ),
    )
    resume = ckpt.restore()

    # The example's only instrumentation: who runs where and how far each attempt got (a file).
    log = cfg["log"]
    _log(
        log,
        event="start",
        rank=rank,
        node=ray.get_runtime_context().get_node_id(),
        resume=resume.step,
        source=resume.source,
    )
    for epoch in range(resume.epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        for _, x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            if rank == 0:
                _log(log, event="step", step=ckpt.step_count + 1)  # computed: its update is the next step()'s
            ckpt.step(optimizer)  # on a notice: the just-in-time checkpoint, held here until the node goes
            optimizer.zero_grad()
            time.sleep(cfg["step_s"])
        ckpt.end_epoch()
    if rank == 0:
        for row in ckpt.profile_rows():
            if row.get("kind") == "preempt":
                _log(
                    log,
                    event="jit",
                    **{k: row.get(k) for k in ("step", "made_deadline", "notice_unix", "durable_unix")},
                )
        module = getattr(model, "module", model)
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict()}, cfg["final"])
    ckpt.finish()


def _log(path: str, **rec) -> None:
    with open(path, "a") as f:  # O_APPEND: the lines of the two workers do not interleave
        f.write(json.dumps(dict(rec, t=time.time())) + "\n")


def _read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


# -- the cloud: a cluster on this machine, and Ray's drain -------------------------------------------------------


def start_cluster(object_store_bytes: int):
    """A head with no CPUs and two 1-CPU worker nodes on loopback; this process is the driver."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Ray turns 127.0.0.1 into the machine's own IP unless this is "0"; the processes the cluster
    # starts read the variable, this one read it at import.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
            "object_store_memory": object_store_bytes,
        },
    )
    for _ in range(2):
        add_node(cluster, object_store_bytes)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address  # what the job's processes connect to, if they ask
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1")
    return cluster


def add_node(cluster, object_store_bytes: int):
    return cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=object_store_bytes)


def drain(address: str, node_id: str, deadline_s: float) -> None:
    """``ray drain-node``: the call Ray's autoscaler makes for a preempted node (reason preemption,
    a deadline after which the node is gone)."""
    subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", address, "--node-id", node_id]
        + ["--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed"]
        + ["--deadline-remaining-seconds", str(max(1, round(deadline_s)))],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _fit(args, name: str) -> str:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = {k: getattr(args, k) for k in ("samples", "dim", "hidden", "batch_size", "epochs", "interval", "step_s")}
    cfg.update(
        storage=os.path.join(args.dir, "checkpoints"),
        run=name,
        log=os.path.join(args.dir, f"{name}.jsonl"),
        final=os.path.join(args.dir, f"{name}.final.pt"),
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=name,
            storage_path=os.path.join(args.dir, "ray"),
            # The drained node's loss is a preemption. Ray Train ends the attempt at the deadline
            # (a PreemptionError, charged to max_preemption_failures); the node's removal at that very
            # moment may reach it first, as a dead worker (charged to max_failures): either restarts.
            failure_config=FailureConfig(max_failures=1, max_preemption_failures=1),
        ),
    )
    trainer.fit()
    return "finished"


def _bitwise_equal(a: str, b: str) -> bool:
    def flat(x, prefix=""):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from flat(v, f"{prefix}{k}.")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from flat(v, f"{prefix}{i}.")
        else:
            yield prefix, x

    sa, sb = (dict(flat(torch.load(p, weights_only=True))) for p in (a, b))
    if sa.keys() != sb.keys():
        return False
    return all(
        torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k]  # bitwise for float tensors
        for k, v in sa.items()
    )


def main(argv=None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=env("CF_RAY_SPOT_DIR"), help="where runs are written (default: a temp dir)")
    p.add_argument("--samples", type=int, default=int(env("CF_RAY_SPOT_SAMPLES", 3072)))
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
        default=float(env("CF_RAY_SPOT_STEP_S", 0.1)),
        help="extra seconds per step (stands in for a bigger model)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=float(env("CF_RAY_SPOT_GRACE_S", 6.0)),
        help="seconds between the drain and the node's removal (spot: 120 on AWS, 30 on GCP)",
    )
    p.add_argument(
        "--notice-at",
        type=int,
        default=int(env("CF_RAY_SPOT_NOTICE_AT", 13)),
        help="step at which the node of rank 1 is drained",
    )
    args = p.parse_args(argv)
    steps = args.samples * args.epochs // (2 * args.batch_size)
    # The notice reaches the workers a second or two after the drain (Ray's watcher polls every second
    # here): the just-in-time checkpoint must come before the run's end.
    if args.notice_at + 4.0 / max(args.step_s, 0.01) >= steps:
        p.error("the run is too short for the drain: raise --samples or --step-s, or lower --notice-at")
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="cf_ray_spot_"))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    # Set before the cluster starts, so that its processes inherit them.
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # Ray Train sees the notice sooner
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")  # Ray's drain watcher (default 5 s)
    os.environ.setdefault("CF_RAY_CONTROLLER_LINGER_S", "5")

    t0 = time.time()
    store = 100 * 1024 * 1024
    cluster = start_cluster(store)
    print(f"cf_ray spot example under {args.dir}: a head (0 CPUs) and 2 worker nodes on 127.0.0.1")
    try:
        _fit(args, "reference")  # uninterrupted
        name = "spot"
        log = os.path.join(args.dir, f"{name}.jsonl")
        result: dict = {}

        def fit():
            try:
                result["end"] = _fit(args, name)
            except Exception as e:  # noqa: BLE001 - printed below
                result["end"] = f"{type(e).__name__}: {e}"

        th = threading.Thread(target=fit, daemon=True)
        th.start()
        deadline = time.time() + 600
        while not any(e["event"] == "step" and e["step"] >= args.notice_at for e in _read(log)):
            if not th.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the run ended before step {args.notice_at}: {result.get('end')}")
            time.sleep(0.05)
        victim = next(e["node"] for e in _read(log) if e["event"] == "start" and e["rank"] == 1)
        notice = time.time()
        drain(cluster.address, victim, args.grace)
        at_deadline = notice + args.grace
        add_node(cluster, store)  # the replacement the autoscaler would start
        time.sleep(max(0.0, at_deadline - time.time()))
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim))  # the spot node is gone
        th.join(600)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()

    ev = _read(log)
    starts = [e for e in ev if e["event"] == "start" and e["rank"] == 0]
    jit = next((e for e in ev if e["event"] == "jit"), {})
    second = starts[1] if len(starts) > 1 else {}
    done = max((e["step"] for e in ev if e["event"] == "step" and (not second or e["t"] < second["t"])), default=0)
    lost = done - second["resume"] if second else None
    made = jit.get("made_deadline")
    durable = f"yes, {jit['durable_unix'] - jit['notice_unix']:.2f} s after the notice" if made else "no"
    same = os.path.exists(os.path.join(args.dir, "spot.final.pt")) and _bitwise_equal(
        os.path.join(args.dir, "reference.final.pt"), os.path.join(args.dir, "spot.final.pt")
    )
    print(
        "\n| event | deadline | JIT checkpoint step | durable before the deadline | steps lost | restart "
        "| restored from | final state bitwise equal to the uninterrupted run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| `ray drain-node` (preemption) of rank 1's node at step {args.notice_at} | +{args.grace:g} s "
        f"| {jit.get('step')} | {durable} | {lost} (done {done}, resumed at {second.get('resume')}) "
        f"| {second.get('t', at_deadline) - at_deadline:.1f} s after the deadline | {second.get('source')} "
        f"| {'yes' if same else 'NO'} |"
    )
    print(f"\nattempts: {len(starts)}; the run {result.get('end')}; wall time {time.time() - t0:.0f} s")
    ok = result.get("end") == "finished" and made is True and lost == 0 and same and len(starts) == 2
    print("OK" if ok else "UNEXPECTED: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
