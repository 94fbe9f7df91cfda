"""End to end: a real TorchTrainer run (2 workers, 1003 samples with ids, 2 epochs) with failures
injected at random iterations. Every id is trained exactly once per epoch, in the order of a
failure-free run."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from collections import Counter

import pytest
import ray.cloudpickle

pytestmark = pytest.mark.slow

# The training function is shipped to the workers by value (tests/data is not on their path).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, EPOCHS, BATCH, WORKERS = 1003, 2, 16, 2
PER_WORKER = -(-N // WORKERS)  # 502 and 501 samples, pad=False: the larger shard (ceiling division)
STEPS_PER_EPOCH = -(-PER_WORKER // BATCH)  # 32


def train_loop(config):
    import ray.train
    import ray.train.torch
    import torch

    import cf_ray
    from cf_ray.data import ResumableDataLoader, ResumableDistributedSampler

    torch.manual_seed(0)
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    ids = torch.arange(N)
    xs = torch.randn(N, 8, generator=torch.Generator().manual_seed(1))
    dataset = torch.utils.data.TensorDataset(ids, xs)
    # pad=False: uneven shards (502/501) in which every id is used exactly once per epoch.
    sampler = ResumableDistributedSampler(dataset, rank=rank, world_size=world, seed=7, pad=False)
    # A worker process and prefetching: the sampler's saved position must still be what the loop
    # consumed. The sampler (not the loader) is registered, as in the engine's contract.
    loader = ResumableDataLoader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=1,
        prefetch_factor=4,
        generator=torch.Generator().manual_seed(0),
    )
    model = ray.train.torch.prepare_model(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        data={"sampler": sampler},
        config=cf_ray.CheckpointConfig(policy=cf_ray.FixedInterval(every=config["every"])),
    )
    resume = ckpt.restore()
    out = config["out"]
    gen = resume.generation
    with open(f"{out}/resume_r{rank}_g{gen}.json", "w") as f:
        json.dump({"step": resume.step, "epoch": resume.epoch, "source": resume.source}, f)
    log = open(f"{out}/ids_r{rank}_g{gen}.jsonl", "w")
    for epoch in range(resume.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch_ids, x in loader:
            model(x).sum().backward()
            ckpt.step(opt)
            opt.zero_grad()
            log.write(json.dumps({"step": ckpt.step_count, "epoch": epoch, "ids": batch_ids.tolist()}) + "\n")
            log.flush()
            for i, (fail_step, fail_rank) in enumerate(config["failures"]):
                marker = f"{out}/failed_{i}"
                if ckpt.step_count == fail_step and rank == fail_rank and not os.path.exists(marker):
                    open(marker, "w").close()
                    if i % 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise RuntimeError(f"injected failure {i} at step {fail_step}")
        ckpt.end_epoch()
    log.close()
    ckpt.finish()


def _fit(root, name, failures, every=7):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(root, "out", name)
    os.makedirs(out)
    TorchTrainer(
        train_loop,
        train_loop_config={"out": out, "failures": failures, "every": every},
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(
            name=name,
            storage_path=os.path.join(root, "storage"),
            failure_config=FailureConfig(max_failures=len(failures) + 1),
        ),
    ).fit()
    return out


def _effective(out, rank):
    """Per step, the ids of the last attempt that trained it: replayed steps replace rolled-back
    ones, as the restored weights do."""
    by_step = {}
    gens = sorted(int(n.split("_g")[1].split(".")[0]) for n in os.listdir(out) if n.startswith(f"ids_r{rank}_"))
    for g in gens:
        with open(f"{out}/ids_r{rank}_g{g}.jsonl") as f:
            for line in f:
                rec = json.loads(line)
                by_step[rec["step"]] = (rec["epoch"], rec["ids"])
    return [by_step[s] for s in sorted(by_step)], gens


def _failure_free(rank):
    """What a failure-free run trains on ``rank``, step by step: the same sampler and loader as
    ``train_loop``, iterated in this process (no Ray, no checkpoint)."""
    import torch

    from cf_ray.data import ResumableDataLoader, ResumableDistributedSampler

    dataset = torch.utils.data.TensorDataset(torch.arange(N), torch.zeros(N, 1))
    sampler = ResumableDistributedSampler(dataset, rank=rank, world_size=WORKERS, seed=7, pad=False)
    loader = ResumableDataLoader(dataset, batch_size=BATCH, sampler=sampler)
    steps = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        steps += [(epoch, batch_ids.tolist()) for batch_ids, _ in loader]
    return steps


def test_exactly_once_per_epoch_across_injected_failures(ray_cluster, tmp_path):
    pytest.importorskip("cf_ray.checkpointer")
    total = STEPS_PER_EPOCH * EPOCHS
    rng = random.Random(20240611)
    steps = sorted(rng.sample(range(3, total - 1), 2))
    failures = [(steps[0], 0), (steps[1], 1)]  # an exception on rank 0, a SIGKILL of rank 1

    interrupted = _fit(str(tmp_path), "interrupted", failures)

    assert all(os.path.exists(f"{interrupted}/failed_{i}") for i in range(len(failures)))
    resumes = [json.load(open(f"{interrupted}/{n}")) for n in os.listdir(interrupted) if n.startswith("resume_r0_")]
    assert sum(r["source"] != "fresh" for r in resumes) == len(failures)
    for rank in range(WORKERS):
        got, gens = _effective(interrupted, rank)
        assert len(gens) == len(failures) + 1
        assert len(got) == total
        assert got == _failure_free(rank)  # same ids, same order, same epochs as a failure-free run
    for epoch in range(EPOCHS):
        ids = [
            i for rank in range(WORKERS) for e, batch in _effective(interrupted, rank)[0] if e == epoch for i in batch
        ]
        assert Counter(ids) == Counter(range(N))  # every id exactly once per epoch


def ray_data_loop(config):
    import ray.train
    import ray.train.torch
    import torch

    import cf_ray
    from cf_ray.data import ResumableRayDataIterator

    torch.manual_seed(0)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    it = ResumableRayDataIterator(
        ray.train.get_dataset_shard("train"),
        batch_size=BATCH,
        rank=rank,
        world_size=ctx.get_world_size(),
        id_column="id",
    )
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        data={"train": it},
        config=cf_ray.CheckpointConfig(policy=cf_ray.FixedInterval(every=config["every"])),
    )
    resume = ckpt.restore()
    out = config["out"]
    log = open(f"{out}/ids_r{rank}_g{resume.generation}.jsonl", "w")
    for epoch in range(resume.epoch, EPOCHS):
        it.set_epoch(epoch)
        for batch in it:
            model(torch.as_tensor(batch["id"], dtype=torch.float32)[:, None]).sum().backward()
            ckpt.step(opt)
            opt.zero_grad()
            log.write(json.dumps({"step": ckpt.step_count, "epoch": epoch, "ids": batch["id"].tolist()}) + "\n")
            log.flush()
            fail_step, fail_rank = config["failure"]
            marker = f"{out}/failed"
            if ckpt.step_count == fail_step and rank == fail_rank and not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError(f"injected failure at step {fail_step}")
        ckpt.end_epoch()
    log.close()
    ckpt.finish()


def test_ray_data_shards_exactly_once_across_a_failure(ray_cluster, tmp_path):
    pytest.importorskip("cf_ray.checkpointer")
    import ray.data
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from cf_ray.data import ordered_data_config

    out = str(tmp_path / "out")
    os.makedirs(out)
    rng = random.Random(7)
    failure = (rng.randrange(3, STEPS_PER_EPOCH - 2), 1)  # in the middle of epoch 0
    TorchTrainer(
        ray_data_loop,
        train_loop_config={"out": out, "failure": failure, "every": 5},
        datasets={"train": ray.data.range(N, override_num_blocks=8)},
        dataset_config=ordered_data_config(),
        # Half a CPU per worker leaves one of the cluster's two CPUs to Ray Data's read tasks.
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(
            name="ray_data", storage_path=str(tmp_path / "storage"), failure_config=FailureConfig(max_failures=2)
        ),
    ).fit()
    assert os.path.exists(f"{out}/failed")
    per_epoch = [[] for _ in range(EPOCHS)]
    for rank in range(WORKERS):
        got, gens = _effective(out, rank)
        assert len(gens) == 2
        for epoch, ids in got:
            per_epoch[epoch] += ids
    for ids in per_epoch:
        # streaming_split(equal=True) drops N % WORKERS rows per epoch; the rest exactly once.
        assert len(ids) == len(set(ids)) == N - N % WORKERS
