"""A Ray Train TorchTrainer script with a sharded model (FSDP2, or FSDP1) and cf_ray.

    python examples/train_fsdp.py                      # FSDP2 (fully_shard), 2 CPU workers, gloo
    python examples/train_fsdp.py --wrapper fsdp1      # FSDP1 (FullyShardedDataParallel)
    python examples/train_fsdp.py --workers 1 --name cf_ray_fsdp   # the same run again, resharded 2 -> 1

Every worker checkpoints only its own shards; a run started again with another number of workers
(same --name) resumes with the shards re-split. Sizes are flags so CI runs it small.
"""

import argparse
import os

import ray
import ray.train
import ray.train.torch
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.distributed.device_mesh import init_device_mesh

import cf_ray
from cf_ray.data import ResumableDistributedSampler


def build_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def shard(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    world_size = ray.train.get_context().get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    # FSDP2:
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    # or FSDP1: give it the device mesh, so that its sharded state dict holds DTensors (cf_ray refuses
    # FSDP1 without one). Ray's prepare_model wraps it so on GPUs; it refuses to run without them.
    if torch.cuda.is_available():
        return ray.train.torch.prepare_model(
            model, parallel_strategy="fsdp", parallel_strategy_kwargs={"device_mesh": mesh, "use_orig_params": True}
        )
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_mesh=mesh, use_orig_params=True, device_id=torch.device("cpu"))


def train_loop_per_worker(config):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(config["samples"], 64), torch.randn(config["samples"], 1))
    sampler = ResumableDistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=32, sampler=sampler)
    model = shard(build_model(config["hidden"]), config["wrapper"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # cf_ray: the same three calls as with DDP; sharded state is detected and saved shard by shard.
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": optimizer},
        data={"sampler": sampler},
        config=cf_ray.CheckpointConfig(policy=cf_ray.Adaptive(budget_pct=5.0)),
    )
    resume = ckpt.restore()
    if ray.train.get_context().get_world_rank() == 0 and not resume.fresh:
        print(f"resumed at step {resume.step} from {resume.source}, saved by {resume.saved_world_size} workers")

    for epoch in range(resume.epoch, config["epochs"]):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            ckpt.step(optimizer)
            optimizer.zero_grad()
        ckpt.end_epoch()
        ckpt.metrics["loss"] = loss.item()

    ckpt.finish()  # model.safetensors: the whole model, gathered tensor by tensor


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="cf_ray_fsdp")
    p.add_argument("--storage-path", default=os.path.abspath("cf_ray_runs"))
    p.add_argument("--wrapper", choices=["fsdp2", "fsdp1"], default="fsdp2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_EPOCHS", 3)))
    p.add_argument("--samples", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_SAMPLES", 4096)))
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), num_cpus=max(2, args.workers))
    config = {"epochs": args.epochs, "samples": args.samples, "hidden": args.hidden, "wrapper": args.wrapper}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(
            name=args.name, storage_path=args.storage_path, failure_config=FailureConfig(max_failures=3)
        ),
    )
    result = trainer.fit()
    print("final model:", result.checkpoint.path)
    model = build_model(args.hidden)
    cf_ray.load_into(result.checkpoint, {"model": model})  # the whole model, for evaluation on one process
    run = cf_ray.Run(args.storage_path, args.name)
    print("checkpoints:", [(c.step, c.kind) for c in run.checkpoints()])
    print("committed steps:", run.summary()["committed_steps"])


if __name__ == "__main__":
    main()
