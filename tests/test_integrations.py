"""The trainer integrations in process, where ``TorchTrainer`` is not the point: the batches cf_ray
puts into a trainer's DataLoader; what each callback refuses, with a real ``transformers.Trainer`` and
a real Lightning ``Trainer`` on one CPU process (refused before any cf_ray actor is made); and a
restore on one worker (cf_ray's actors on the shared local cluster) through the paths the
end-to-end runs do not take: gradient accumulation with evaluations between steps (Hugging Face), a
snapshot of an epoch's last batch with an epoch-end validation (Lightning). The 2-worker runs with a
SIGKILL under ``TorchTrainer`` are in ``test_integrations_e2e.py``."""

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


def test_hf_refuses_a_second_cf_ray_callback_by_name_before_anything_is_restored(tmp_path):
    """Two CfRayCallbacks (another instance, or the same one added twice) would build two
    Checkpointers and restore twice; the first refuses before it builds anything."""
    from cf_ray.integrations.huggingface import CfRayCallback

    for second in (CfRayCallback(), None):
        trainer = _hf_trainer(tmp_path)
        first = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, CfRayCallback))
        trainer.add_callback(second if second is not None else first)
        with pytest.raises(ConfigError, match=r"2 cf_ray callbacks \(CfRayCallback\).*one CfRayCallback per Trainer"):
            trainer.train()
        assert first.checkpointer is None and first.resume is None  # nothing built, nothing restored
        assert second is None or second.checkpointer is None
        assert trainer.state.global_step == 0


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
            return torch.utils.data.DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(2)), 4)

    trainer = pl.Trainer(
        max_epochs=1, callbacks=[CfRayCallback()], accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="automatic optimization only"):
        trainer.fit(Manual())
    assert trainer.global_step == 0


def _pl_trainer(callbacks, max_epochs=1):
    pl = pytest.importorskip("lightning.pytorch")
    return pl.Trainer(
        max_epochs=max_epochs, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _pl_linear():
    pl = pytest.importorskip("lightning.pytorch")

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(2)), 4)

    return Linear()


def test_lightning_refuses_a_second_cf_ray_callback_by_name_before_anything_is_restored():
    """Two CfRayCallbacks would build two Checkpointers, restore twice, then fail on the sampler the
    first one installed; the first refuses before it builds anything, naming the callbacks."""
    from cf_ray.integrations.lightning import CfRayCallback

    one, two = CfRayCallback(), CfRayCallback()
    for callbacks in ([one, two], [one, one]):
        trainer = _pl_trainer(callbacks)
        with pytest.raises(ConfigError, match=r"2 cf_ray callbacks \(CfRayCallback\).*one CfRayCallback per Trainer"):
            trainer.fit(_pl_linear())
        assert one.checkpointer is None and two.checkpointer is None and one.resume is None
        assert trainer.global_step == 0


# -- a restore in process (one worker, cf_ray's actors on the shared cluster, no TorchTrainer) -------------


class _Stop(Exception):
    """Ends an attempt right after its newest snapshot reached the holder (as a SIGKILL would)."""


def _config(tmp_path, run_name, every):
    import cf_ray

    return cf_ray.CheckpointConfig(
        policy=cf_ray.FixedInterval(every=every), run_name=run_name, storage_path=str(tmp_path / "storage")
    )


def _hf_attempt(tmp_path, run_name, stop_at=None):
    transformers = pytest.importorskip("transformers")
    from cf_ray.integrations.huggingface import CfRayCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=2, eval_strategy="steps", eval_steps=4, logging_steps=3, use_cpu=True,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(20), eval_dataset=_Tokens(4))
    cf = CfRayCallback(_config(tmp_path, run_name, every=3))

    class Stop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                cf.checkpointer.wait_snapshot()
                raise _Stop

    trainer.add_callback(cf)
    trainer.add_callback(Stop())
    try:
        trainer.train()
    except _Stop:
        cf.checkpointer.close()
    return trainer, cf


def test_hf_trainer_with_accumulation_and_evaluation_resumes_mid_epoch_bitwise(ray_cluster, tmp_path):
    """5 updates of 2 micro-batches per epoch, an evaluation every 4 steps (it draws from the RNG); the
    attempt that ends at step 7 resumes from step 6's snapshot in memory, in the middle of epoch 1."""
    ref, _ = _hf_attempt(tmp_path, "hf_ref")
    _hf_attempt(tmp_path, "hf_stop", stop_at=7)
    again, cf = _hf_attempt(tmp_path, "hf_stop")
    assert (cf.resume.source, cf.resume.step, cf.resume.epoch) == ("memory", 6, 1)
    for a, b in zip(ref.model.state_dict().values(), again.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = ref.optimizer.state_dict(), again.optimizer.state_dict()
    assert all(torch.equal(sa["state"][p][k], sb["state"][p][k]) for p in sa["state"] for k in sa["state"][p])
    assert ref.lr_scheduler.state_dict() == again.lr_scheduler.state_dict()
    assert (again.state.global_step, again.state.epoch) == (ref.state.global_step, ref.state.epoch) == (10, 2.0)
    steps = [(h.get("step"), h.get("epoch"), h.get("eval_loss")) for h in ref.state.log_history]
    assert [(h.get("step"), h.get("epoch"), h.get("eval_loss")) for h in again.state.log_history] == steps


def _pl_attempt(tmp_path, run_name, stop_at=None):
    pl = pytest.importorskip("lightning.pytorch")
    from cf_ray.integrations.lightning import CfRayCallback

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val", self.net(batch).pow(2).mean())

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}  # per epoch

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(40, 4, generator=torch.Generator().manual_seed(1)), 4, True)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(2)), 4)

    cf = CfRayCallback(_config(tmp_path, run_name, every=5))

    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == stop_at:
                cf.checkpointer.wait_snapshot()
                raise _Stop

    torch.manual_seed(0)
    model = Model()
    trainer = pl.Trainer(
        max_epochs=2, callbacks=[cf, Stop()], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
    )  # fmt: skip
    try:
        trainer.fit(model)
    except _Stop:
        pass  # the callback closed its Checkpointer (on_exception)
    return trainer, model, cf


def test_lightning_resumes_from_a_snapshot_of_an_epochs_last_batch_bitwise(ray_cluster, tmp_path):
    """10 batches per epoch, a checkpoint every 5 steps: step 10, the last batch of epoch 0, is
    snapshotted after the epoch-end validation, and the attempt ended at step 12 resumes from it (in
    memory) with a clean epoch 1: the fit loop's counters, the model, optimizer and scheduler equal."""
    ref_trainer, ref_model, _ = _pl_attempt(tmp_path, "pl_ref")
    _pl_attempt(tmp_path, "pl_stop", stop_at=12)
    trainer, model, cf = _pl_attempt(tmp_path, "pl_stop")
    assert (cf.resume.source, cf.resume.step) == ("memory", 10)
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = ref_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict()
    assert all(torch.equal(sa["state"][p][k], sb["state"][p][k]) for p in sa["state"] for k in sa["state"][p])
    assert (
        ref_trainer.lr_scheduler_configs[0].scheduler.state_dict()
        == trainer.lr_scheduler_configs[0].scheduler.state_dict()
    )
    assert trainer.fit_loop.state_dict() == ref_trainer.fit_loop.state_dict()
    assert (trainer.global_step, trainer.current_epoch) == (20, 2)
