"""cf_ray for a Lightning job inside ``TorchTrainer``: one callback, beside Ray's strategy and
environment as Ray documents them (``ray.train.lightning``).

.. code-block:: python

    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer
    from cf_ray.integrations.lightning import CfRayCallback

    trainer = pl.Trainer(
        strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
        callbacks=[CfRayCallback(cf_ray.CheckpointConfig(policy=cf_ray.Adaptive()))],
        enable_checkpointing=False, ...)
    trainer = prepare_trainer(trainer)
    trainer.fit(model, datamodule=dm)   # a restarted worker group resumes where the last snapshot was taken

A Lightning callback, not a ``CheckpointIO`` plugin: a ``CheckpointIO`` writes the dictionary
Lightning assembles when *Lightning* decides to save, whereas cf_ray decides when (its policy),
guards the optimizer step and copies the state in the background. What it does, by hook:

* ``on_fit_start`` (the optimizers and schedulers exist, the model is wrapped, the fit loop has not
  started): builds a :class:`cf_ray.Checkpointer` over the LightningModule, the optimizer, the LR
  schedulers, AMP's grad scaler (if any), the fit loop's progress (as Lightning's own checkpoints
  hold it: epoch, batch and optimizer-step counters, so ``trainer.global_step`` and
  ``trainer.current_epoch``) and the data position, and restores the newest snapshot (memory, else
  storage). Lightning's own restart logic then continues the fit loop mid-epoch.
* ``on_train_start`` (the train ``DataLoader`` exists): puts cf_ray's resumable sampler into it, with
  the settings of the ``DistributedSampler`` Lightning gave it (same order), and the restored
  position; so a restored epoch yields only the batches no rank had consumed.
* ``on_before_optimizer_step`` .. ``on_train_batch_end``: the optimizer step runs inside
  ``with ckpt.update():``; the policy's checkpoint is taken at the batch's end, where Lightning's
  ``ModelCheckpoint`` saves too. ``on_train_epoch_end``: ``ckpt.end_epoch()``. ``on_fit_end``:
  ``ckpt.finish()`` (:attr:`CfRayCallback.summary`). ``on_exception``: ``ckpt.close()``.
* ``on_validation_start``/``_end``: validation inside ``fit()`` draws from the global RNG (its
  DataLoader's seed); the training RNG is put back after it, as Lightning already does around its
  sanity check, so a restored run that does not repeat a validation replays the same numbers.

Refused with :class:`cf_ray.ConfigError`: a second ``CfRayCallback`` in the same Trainer (before
anything is built or restored), DeepSpeed and FSDP strategies, manual optimization,
several optimizers, several train DataLoaders, an ``IterableDataset``, a custom train sampler,
``reload_dataloaders_every_n_epochs``, and ``trainer.fit(ckpt_path=...)`` (cf_ray restores the run
itself). A restart on another number of workers raises :class:`cf_ray.ElasticResumeError`.
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
import warnings
from collections.abc import Mapping, Sized
from typing import Any, cast

import lightning.pytorch as pl  # the package ray.train.lightning uses first
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from cf_ray._engine.worker.snapshot.rng import rng_state, set_rng_state
from cf_ray.checkpointer import Checkpointer, FinishSummary, Resume
from cf_ray.config import CheckpointConfig
from cf_ray.data.sampler import ResumableDistributedSampler
from cf_ray.errors import ConfigError
from cf_ray.integrations._common import ResumableBatches, RngHold, UpdateScope, install_batches, refuse_another


class CfRayCallback(pl.Callback):
    """Add to ``pl.Trainer(callbacks=[...])`` to checkpoint the fit with cf_ray; one per Trainer, on
    every rank. See the module's documentation.

    Args:
        config: how and when to checkpoint (``None``: ``CheckpointConfig()``).
    """

    def __init__(self, config: CheckpointConfig | None = None) -> None:
        super().__init__()
        self.config = config or CheckpointConfig()
        self.checkpointer: Checkpointer | None = None
        """The rank's Checkpointer, from ``on_fit_start``."""
        self.resume: Resume | None = None
        """Where this attempt resumed (``on_fit_start``)."""
        self.summary: FinishSummary | None = None
        """What ``finish()`` returned (``on_fit_end``)."""
        self._train = _TrainData()
        self._update = UpdateScope()
        self._rng = RngHold()
        self._restored_rng: dict | None = None

    # -- the start ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        if self.checkpointer is not None:
            raise ConfigError("CfRayCallback: fit() was called twice with the same callback; use one per fit()")
        callbacks = trainer.callbacks  # pyright: ignore[reportAttributeAccessIssue] - set by its callback connector
        refuse_another(callbacks, self, "pl.Trainer(callbacks=[...])")
        _refuse(trainer, pl_module)
        tracked: dict[str, Any] = {"model": pl_module, "optimizer": trainer.optimizers[0]}
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            tracked["lr_scheduler" if i == 0 else f"lr_scheduler_{i}"] = cfg.scheduler
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            tracked["scaler"] = scaler
        data = {"loops": _FitLoopProgress(trainer), "train": self._train}
        ckpt = self.checkpointer = Checkpointer(tracked, data=data, config=self.config)
        self.resume = ckpt.restore()
        if not self.resume.fresh:
            # cf_ray resumes the data itself; Lightning cannot see that and would warn otherwise.
            warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch")
            # Lightning draws DataLoader seeds from the global RNG before training starts; the
            # restored state is put back once the train DataLoader is ready (on_train_start).
            self._restored_rng = rng_state()

    def on_train_start(self, trainer, pl_module) -> None:
        ckpt = self._ckpt()
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            raise ConfigError(
                f"CfRayCallback supports one train DataLoader, got {type(loader).__name__}; return a single DataLoader"
            )
        batches = _batches_for(trainer, loader)
        install_batches(loader, batches, expose_sampler=True, drop_iterator=True)
        self._train.attach(batches)
        # The fit loop made its first iterator before this hook: make it again, over cf_ray's batches.
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is None:
            raise ConfigError(
                f"CfRayCallback: this Lightning ({importlib.metadata.version('lightning')}) has no fit_loop._data_fetcher; cf_ray was tested "
                "with lightning 2.6"
            )
        iter(fetcher)
        if batches.epoch_complete and ckpt.epoch == batches.resumable.epoch and not self.resume_fresh:
            ckpt.end_epoch()  # the snapshot was the epoch's last batch: Lightning skips its epoch-end hooks
        if self._restored_rng is not None:
            set_rng_state(self._restored_rng)
            self._restored_rng = None

    @property
    def resume_fresh(self) -> bool:
        return self.resume is None or self.resume.fresh

    # -- every step ---------------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._update.enter(self._ckpt())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        batches = self._train.batches_or_raise()
        batches.consumed()
        if batches.batches_done < len(batches):
            self._update.leave()  # agreement, decision, snapshot (a batch that accumulates has no step)
        # The epoch's last batch: its step ends at on_train_epoch_end, after the epoch-end validation,
        # so that a snapshot of it holds the fit loop as Lightning's epoch-end checkpoints do, which
        # Lightning restarts from with a clean next epoch (its epoch-start hooks and counters); from a
        # batch-end state of the last batch it would skip them.

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._train.batches_or_raise().end_epoch()
        self._update.leave()
        self._ckpt().end_epoch()

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:  # Lightning isolates the sanity check's RNG itself
            self._rng.keep()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._rng.put_back()

    # -- the end ------------------------------------------------------------------------------------------
    def on_fit_end(self, trainer, pl_module) -> None:
        if self.checkpointer is not None:
            self._update.leave()
            self.summary = self.checkpointer.finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()

    def _ckpt(self) -> Checkpointer:
        if self.checkpointer is None:
            raise RuntimeError("CfRayCallback: a training step before on_fit_start")
        return self.checkpointer


class _FitLoopProgress:
    """The fit loop's progress, as Lightning's own checkpoints hold it (``fit_loop.state_dict()``),
    as a per-rank data object: taken at the snapshot's batch end (where ``ModelCheckpoint`` takes it,
    which is what Lightning's restart logic expects), the same on every rank. No elastic load: the
    loop's batch counts depend on the number of workers."""

    FORMAT = "cf_ray.lightning.FitLoop/1"

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        loop = copy.deepcopy(self.trainer.fit_loop.state_dict())
        loop.get("state_dict", {}).pop("combined_loader", None)  # the data position is cf_ray's own
        return {"format": self.FORMAT, "fit_loop": loop}

    def validate_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != self.FORMAT:
            raise ConfigError(f"the saved fit loop progress is not a {self.FORMAT} state: {str(state_dict)[:200]}")
        if not isinstance(state_dict.get("fit_loop"), Mapping):
            raise ConfigError("the saved fit loop progress has no fit_loop state")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.validate_state_dict(state_dict)
        self.trainer.fit_loop.load_state_dict(copy.deepcopy(dict(state_dict["fit_loop"])))


class _TrainData:
    """The data position as a per-rank data object. The train DataLoader does not exist yet when
    cf_ray restores (``on_fit_start``): a restored position waits here until the sampler is attached
    (``on_train_start``), where a state that does not fit the data raises ``ConfigError``."""

    def __init__(self) -> None:
        self.batches: ResumableBatches | None = None
        self._pending: dict[str, Any] | None = None

    def batches_or_raise(self) -> ResumableBatches:
        if self.batches is None:
            raise RuntimeError("CfRayCallback: a training batch before on_train_start")
        return self.batches

    def state_dict(self) -> dict[str, Any]:
        if self.batches is not None:
            return self.batches.resumable.state_dict()
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        raise RuntimeError("cf_ray: a snapshot before the train DataLoader was set up (on_train_start)")

    def validate_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != ResumableDistributedSampler.FORMAT:
            raise ConfigError(
                f"the saved train data position is not a ResumableDistributedSampler state: {state_dict!r}"
            )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.validate_state_dict(state_dict)
        self._pending = copy.deepcopy(dict(state_dict))

    def attach(self, batches: ResumableBatches) -> None:
        self.batches = batches
        pending, self._pending = self._pending, None
        if pending is not None:
            batches.resumable.load_state_dict(pending)


def _batches_for(trainer, loader: DataLoader) -> ResumableBatches:
    """cf_ray's batches with the settings of the sampler Lightning put into ``loader``."""
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError("CfRayCallback needs a map-style train dataset; an IterableDataset is not supported")
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        shuffle, seed, drop_last = sampler.shuffle, sampler.seed, sampler.drop_last
        rank, world = sampler.rank, sampler.num_replicas
    elif isinstance(sampler, (RandomSampler, SequentialSampler)):  # one worker: Lightning kept the user's
        shuffle, seed, drop_last = isinstance(sampler, RandomSampler), int(os.getenv("PL_GLOBAL_SEED", 0)), False
        rank, world = trainer.global_rank, trainer.world_size
    else:
        raise ConfigError(
            f"CfRayCallback: the train DataLoader has a custom sampler ({type(sampler).__name__}); cf_ray replaces "
            "the sampler with its resumable one, which it can only do for shuffle=True/False DataLoaders"
        )
    if loader.batch_size is None:
        raise ConfigError(
            "CfRayCallback: the train DataLoader has batch_size=None (a batch_sampler); give it a batch_size"
        )
    resumable = ResumableDistributedSampler(
        cast(Sized, loader.dataset), rank=rank, world_size=world, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    batches = ResumableBatches(resumable, loader.batch_size, drop_last=loader.drop_last, seed=seed)
    if len(batches) != len(loader):
        raise ConfigError(
            f"CfRayCallback: Lightning counts {len(loader)} batches per epoch on rank {rank} but cf_ray's sampler "
            f"makes {len(batches)}; use a dataset size the world size divides"
        )
    return batches


def _refuse(trainer, pl_module) -> None:
    """Raise ``ConfigError`` for what the callback cannot resume exactly (before anything changes)."""
    strategy = type(trainer.strategy).__name__
    if "DeepSpeed" in strategy:
        raise ConfigError(
            f"CfRayCallback does not support {strategy}: DeepSpeed's engine owns the optimizer step and "
            "partitions its state, which cf_ray's snapshots do not see. Use RayDDPStrategy"
        )
    if "FSDP" in strategy:
        raise ConfigError(f"CfRayCallback does not support {strategy} yet; use RayDDPStrategy")
    if trainer.ckpt_path is not None:
        raise ConfigError(
            f"CfRayCallback: fit(ckpt_path={trainer.ckpt_path!r}) restores Lightning's own checkpoint; cf_ray restores "
            "the run itself: call fit() without ckpt_path (to start from another run, CheckpointConfig(resume_from=...))"
        )
    if not pl_module.automatic_optimization:
        raise ConfigError("CfRayCallback supports automatic optimization only (automatic_optimization=False is set)")
    if len(trainer.optimizers) != 1:
        raise ConfigError(f"CfRayCallback supports one optimizer, got {len(trainer.optimizers)}")
    if trainer.reload_dataloaders_every_n_epochs:
        raise ConfigError(
            "CfRayCallback does not support reload_dataloaders_every_n_epochs (a new DataLoader every epoch "
            "would lose cf_ray's sampler); remove it"
        )


__all__ = ["CfRayCallback"]
