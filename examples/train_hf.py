"""A Hugging Face ``transformers.Trainer`` job inside Ray Train's TorchTrainer, checkpointed by cf_ray.

    python examples/train_hf.py                       # 2 CPU workers on a local Ray cluster
    python examples/train_hf.py --workers 4 --storage-path s3://bucket/runs

The one line cf_ray adds to a Trainer script is ``trainer.add_callback(CfRayCallback(...))`` (where
Ray's guide adds ``RayTrainReportCallback``). A worker that dies is restarted by Ray Train and the
Trainer goes on from the newest snapshot (memory, else storage): same weights, optimizer, LR
schedule, RNG, global step and data position as if nothing had happened. The model is a tiny GPT-2
built from a config (nothing is downloaded); sizes are flags so CI runs it small.
"""

import argparse
import os

import ray
import torch
import transformers
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import cf_ray
from cf_ray.integrations.huggingface import CfRayCallback

VOCAB = 512  # > samples: the first token of sample i is i (the tests read which samples a step saw)


class TokenDataset(torch.utils.data.Dataset):
    """``samples`` random token sequences; the language model learns to continue them."""

    def __init__(self, samples: int, seq_len: int):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (samples, seq_len), generator=g)
        self.tokens[:, 0] = torch.arange(samples) % VOCAB

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def build_model(config) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=config["seq_len"], n_embd=config["hidden"], n_layer=2, n_head=2
    )
    return transformers.GPT2LMHeadModel(gpt2)


def build_trainer(config) -> tuple[transformers.Trainer, CfRayCallback]:
    """The Trainer of one worker, with cf_ray's callback; what ``train_loop_per_worker`` trains."""
    args = transformers.TrainingArguments(
        output_dir=os.path.join(config.get("scratch", "/tmp"), "hf_output"),
        per_device_train_batch_size=config["batch_size"],
        num_train_epochs=config["epochs"],
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",  # cf_ray checkpoints; the Trainer's own checkpoints are not needed
        report_to="none",
        logging_steps=5,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=build_model(config), args=args, train_dataset=TokenDataset(config["samples"], config["seq_len"])
    )
    # cf_ray: one callback, in place of Ray's RayTrainReportCallback.
    callback = CfRayCallback(cf_ray.CheckpointConfig(policy=cf_ray.FixedInterval(every=config["interval"])))
    trainer.add_callback(callback)
    return trainer, callback


def train_loop_per_worker(config):
    trainer, callback = build_trainer(config)
    trainer.train()  # a restarted worker resumes here from cf_ray's newest snapshot
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
    p.add_argument("--name", default="cf_ray_hf_example")
    p.add_argument("--storage-path", default=os.path.abspath("cf_ray_runs"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_EPOCHS", 2)))
    p.add_argument("--samples", type=int, default=int(os.environ.get("CF_RAY_EXAMPLE_SAMPLES", 256)))
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--interval", type=int, default=5, help="checkpoint every this many steps")
    args = p.parse_args()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), num_cpus=max(2, args.workers))
    config = {
        "epochs": args.epochs,
        "samples": args.samples,
        "hidden": args.hidden,
        "seq_len": 16,
        "batch_size": 8,
        "interval": args.interval,
    }
    result = fit(train_loop_per_worker, config, name=args.name, storage_path=args.storage_path, workers=args.workers)
    print("final model:", result.checkpoint.path)
    model = build_model(config)
    cf_ray.load_into(result.checkpoint, {"model": model})  # the trained weights, without the optimizer
    run = cf_ray.Run(args.storage_path, args.name)
    print("checkpoints:", [(c.step, c.kind) for c in run.checkpoints()])


if __name__ == "__main__":
    main()
