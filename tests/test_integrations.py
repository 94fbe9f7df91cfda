"""The trainer integrations in process, where Ray is not the point: the batches cf_ray puts into a
trainer's DataLoader, and what each callback refuses, with a real ``transformers.Trainer`` and a real
Lightning ``Trainer`` on one CPU process (refused before any cf_ray actor is made). The end-to-end
runs under ``TorchTrainer`` are in ``test_integrations_e2e.py``."""

from __future__ import annotations

import pytest
import torch

from cf_ray.data import ResumableDistributedSampler
from cf_ray.errors import ConfigError
from cf_ray.integrations._common import ResumableBatches, install_batches

# -- the batches (no framework) ---------------------------------------------------------------------------


def _batches(n=10, batch_size=4, drop_last=False, rank=0, world=1, epoch_of=lambda e: e):
    sampler = ResumableDistributedSampler(range(n), rank=rank, world_size=world, shuffle=True, seed=3)
    return ResumableBatches(sampler, batch_size, drop_last=drop_last, epoch_of=epoch_of, seed=3)


def test_the_position_counts_what_the_trainer_consumed_not_what_a_loader_drew_ahead():
    b = _batches()
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    install_batches(loader, b, expose_sampler=False)
    it = iter(loader)
    first, _second = next(it), next(it)  # drawn two ahead, as accelerate's look-ahead does
    assert b.resumable.consumed == 0
    b.consumed()
    assert b.resumable.consumed == len(first) == 4 and b.batches_done == 1
    state = b.resumable.state_dict()
    # A fresh object at that state yields the rest of the epoch, and only that.
    again = _batches()
    again.resumable.load_state_dict(state)
    rest = [i for batch in again for i in batch]
    whole = [i for batch in _batches() for i in batch]
    assert rest == whole[4:] and len(again) == 3


def test_an_epoch_with_a_dropped_tail_completes_at_its_end_and_the_trainer_epoch_is_mapped():
    b = _batches(drop_last=True, epoch_of=lambda e: e + 5)
    b.set_epoch(0)  # the trainer's epoch 0 is the restored epoch 5
    assert b.resumable.epoch == 5
    seen = list(b)
    assert [len(x) for x in seen] == [4, 4] and len(b) == 2
    for _ in seen:
        b.consumed()
    assert not b.epoch_complete  # two indices were dropped
    b.end_epoch()
    assert b.epoch_complete
    with pytest.raises(RuntimeError, match="never handed out"):
        b.consumed()


def test_batches_go_into_a_dataloader_only_before_it_has_live_workers():
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    install_batches(loader, _batches(n=8, batch_size=2), expose_sampler=True)
    assert isinstance(loader.sampler, ResumableDistributedSampler)
    assert isinstance(loader.generator, torch.Generator)  # a pass draws no seed from the global RNG
    state = torch.get_rng_state()
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(8))
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ConfigError, match="batch_size=None"):
        install_batches(torch.utils.data.DataLoader(list(range(8)), batch_size=None), _batches(), expose_sampler=False)


# -- what the Hugging Face callback refuses -----------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=20):
        self.x = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from _Tokens()


def _hf_trainer(tmp_path, dataset=None, **args):
    transformers = pytest.importorskip("transformers")
    from cf_ray.integrations.huggingface import CfRayCallback

    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    )
    targs = dict(per_device_train_batch_size=4, use_cpu=True, report_to="none", save_strategy="no", max_steps=3)
    targs.update(args)
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(output_dir=str(tmp_path), **targs),
        train_dataset=dataset if dataset is not None else _Tokens(),
    )
    trainer.add_callback(CfRayCallback())
    return trainer


@pytest.mark.parametrize(
    "dataset, args, match",
    [
        (None, {"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2 does not divide the 5 batches"),
        (None, {"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
        (_Stream(), {}, "IterableDataset is not supported"),
    ],
    ids=["accumulation", "group_by_length", "iterable"],
)
def test_hf_callback_refuses_what_it_cannot_resume_exactly_before_training(tmp_path, dataset, args, match):
    trainer = _hf_trainer(tmp_path, dataset, **args)
    with pytest.raises(ConfigError, match=match):
        trainer.train()
    assert trainer.state.global_step == 0


def test_hf_callback_refuses_deepspeed_and_the_trainers_own_resume(tmp_path):
    from cf_ray.integrations.huggingface import _refuse

    trainer = _hf_trainer(tmp_path)
    loader = trainer.get_train_dataloader()
    trainer.args.deepspeed = "ds_config.json"  # DeepSpeed is not installed here: the check reads the argument
    with pytest.raises(ConfigError, match="does not support DeepSpeed"):
        _refuse(trainer.args, trainer.state, loader)
    trainer.args.deepspeed = None
    trainer.state.global_step = 7  # what train(resume_from_checkpoint=...) leaves at on_train_begin
    with pytest.raises(ConfigError, match="resumed from its own checkpoint"):
        _refuse(trainer.args, trainer.state, loader)


# -- what the Lightning callback refuses -------------------------------------------------------------------


def test_lightning_callback_refuses_manual_optimization_before_training():
    pl = pytest.importorskip("lightning.pytorch")
    from cf_ray.integrations.lightning import CfRayCallback

    class Manual(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)

    trainer = pl.Trainer(
        max_epochs=1, callbacks=[CfRayCallback()], accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="automatic optimization only"):
        trainer.fit(Manual())
    assert trainer.global_step == 0
