"""A Lightning job inside Ray Train's TorchTrainer, checkpointed by cf_ray.

    python examples/train_lightning.py                # 2 CPU workers on a local Ray cluster
    python examples/train_lightning.py --workers 4 --storage-path s3://bucket/runs

The Trainer is set up as Ray's guide sets it up (``RayDDPStrategy``, ``RayLightningEnvironment``,
``prepare_trainer``); the one object cf_ray adds is ``CfRayCallback(...)`` in ``callbacks`` (where
Ray's guide adds ``RayTrainReportCallback``). A worker that dies is restarted by Ray Train and the
fit goes on from the newest snapshot (memory, else storage): same weights, optimizer, LR schedule,
RNG, loop counters and data position as if nothing had happened. Sizes are flags so CI runs it small.
"""

import argparse
import os

import lightning.pytorch as pl
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer
from ray.train.torch import TorchTrainer

import cf_ray
from cf_ray.integrations.lightning import CfRayCallback


class Regression(torch.utils.data.Dataset):
    """``(id, x, y)``, with ``y`` a fixed noisy function of ``x``."""

    def __init__(self, samples: int, dim: int = 16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, dim, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(dim, 1, generator=g)) + 0.1 * torch.randn(samples, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


class Model(pl.LightningModule):
    def __init__(self, hidden: int, samples: int, batch_size: int):
        super().__init__()
        self.samples, self.batch_size = samples, batch_size
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        # Lightning gives it a DistributedSampler; cf_ray's callback makes that sampler resumable.
        return torch.utils.data.DataLoader(Regression(self.samples), batch_size=self.batch_size, shuffle=True)


def build_trainer(config) -> tuple[pl.Trainer, Model, CfRayCallback]:
    """The Lightning Trainer of one worker, with cf_ray's callback; what ``train_loop_per_worker`` fits."""
    pl.seed_everything(0, verbose=False)
    model = Model(config["hidden"], config["samples"], config["batch_size"])
    # cf_ray: one callback, in place of Ray's RayTrainReportCallback.
    callback = CfRayCallback(cf_ray.CheckpointConfig(policy=cf_ray.FixedInterval(every=config["interval"])))
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        devices="auto",
        accelerator="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[callback],
        enable_checkpointing=False,  # cf_ray checkpoints
        enable_progress_bar=False,
        logger=False,
    )
    return prepare_trainer(trainer), model, callback


def train_loop_per_worker(config):
    trainer, model, callback = build_trainer(config)
    trainer.fit(model)  # a restarted worker resumes here from cf_ray's newest snapshot
    if callback.checkpointer is not None and callback.checkpointer.rank == 0:
        print("resumed from:", callback.resume.source if callback.resume else None, "| final:", callback.summary)


def fit(train_loop, config, *, name, storage_path, workers=2, max_failures=3):
    """One ``TorchTrainer.fit()`` of ``train_loop``; returns Ray's Result."""
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=name, storage_path=storage_path, failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    return trainer.fit()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="cf_ray_lightning_example")
    p.add_argument("--storage-path", default=os.path.abspath("cf_ray_runs"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_EPOCHS", 2)))
    p.add_argument("--samples", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_SAMPLES", 512)))
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--interval", type=int, default=5, help="checkpoint every this many steps")
    args = p.parse_args()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), num_cpus=max(2, args.workers))
    config = {
        "epochs": args.epochs,
        "samples": args.samples,
        "hidden": args.hidden,
        "batch_size": 16,
        "interval": args.interval,
    }
    result = fit(train_loop_per_worker, config, name=args.name, storage_path=args.storage_path, workers=args.workers)
    print("final model:", result.checkpoint.path)
    model = Model(config["hidden"], config["samples"], config["batch_size"])
    cf_ray.load_into(result.checkpoint, {"model": model})  # the trained weights, without the optimizer
    run = cf_ray.Run(args.storage_path, args.name)
    print("checkpoints:", [(c.step, c.kind) for c in run.checkpoints()])


if __name__ == "__main__":
    main()
