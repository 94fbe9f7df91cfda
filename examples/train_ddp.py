"""A plain Ray Train TorchTrainer script with cf_ray: copy it and change the model and the data.

    python examples/train_ddp.py                       # 2 CPU workers on a local Ray cluster
    python examples/train_ddp.py --storage-path s3://bucket/runs --workers 4

Run it twice with the same --name: the second run resumes where the first one stopped (kill it
part-way with Ctrl-C to see that). Sizes are flags so CI runs it small.
"""

import argparse
import os

import ray
import ray.train
import ray.train.torch
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import cf_ray
from cf_ray.data import ResumableDistributedSampler


def train_loop_per_worker(config):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(config["samples"], 64), torch.randn(config["samples"], 1))
    sampler = ResumableDistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(
        data, batch_size=32, sampler=sampler, generator=torch.Generator().manual_seed(0)
    )
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(
            torch.nn.Linear(64, config["hidden"]), torch.nn.ReLU(), torch.nn.Linear(config["hidden"], 1)
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config["epochs"])

    # cf_ray: track the state, restore it, and step through the checkpointer.
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": optimizer, "scheduler": scheduler},
        data={"sampler": sampler},
        config=cf_ray.CheckpointConfig(policy=cf_ray.Adaptive(budget_pct=5.0)),
    )
    resume = ckpt.restore()  # fresh start, or the newest snapshot (memory) / checkpoint (storage)

    for epoch in range(resume.epoch, config["epochs"]):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            ckpt.step(optimizer)  # in place of optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        ckpt.end_epoch()
        ckpt.metrics["loss"] = loss.item()

    ckpt.finish()  # waits for durability, writes the consolidated model as the run's result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="cf_ray_example")
    p.add_argument("--storage-path", default=os.path.abspath("cf_ray_runs"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_EPOCHS", 3)))
    p.add_argument("--samples", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_SAMPLES", 4096)))
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), num_cpus=max(2, args.workers))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"epochs": args.epochs, "samples": args.samples, "hidden": args.hidden},
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(
            name=args.name, storage_path=args.storage_path, failure_config=FailureConfig(max_failures=3)
        ),
    )
    result = trainer.fit()
    print("final model:", result.checkpoint.path)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1))
    cf_ray.load_into(result.checkpoint, {"model": model})  # evaluation: weights only, no optimizer
    run = cf_ray.Run(args.storage_path, args.name)  # the run seen from the driver: checkpoints, profile, summary
    print("checkpoints:", [(c.step, c.kind) for c in run.checkpoints()])
    print("committed steps:", run.summary()["committed_steps"])


if __name__ == "__main__":
    main()
