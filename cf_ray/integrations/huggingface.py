"""cf_ray for a Hugging Face ``transformers.Trainer`` inside ``TorchTrainer``: one callback.

.. code-block:: python

    from cf_ray.integrations.huggingface import CfRayCallback

    trainer = transformers.Trainer(model=model, args=args, train_dataset=train_dataset)
    trainer.add_callback(CfRayCallback(cf_ray.CheckpointConfig(policy=cf_ray.Adaptive())))
    trainer.train()     # a restarted worker group resumes where the last snapshot was taken

What it does, by Trainer event (all ranks):

* ``on_train_begin`` (optimizer and LR scheduler exist, the model is wrapped): puts cf_ray's
  resumable sampler into the Trainer's train ``DataLoader``, builds a :class:`cf_ray.Checkpointer`
  over the model, the optimizer, the LR scheduler, AMP's grad scaler (if any), the Trainer's
  progress (``TrainerState``) and the data position, and restores the newest snapshot (memory,
  else storage). After a restore the Trainer goes on from the restored global step, in the middle
  of the restored epoch.
* ``on_pre_optimizer_step`` .. ``on_step_end``: the optimizer step runs inside
  ``with ckpt.update():`` (the weight-update guard), and the policy's checkpoint is taken at the
  end of the step (after the LR scheduler's step and the global step's increment).
* ``on_substep_end`` / ``on_step_end``: a micro-batch consumed (the data position).
* ``on_epoch_end``: ``ckpt.end_epoch()``; ``on_evaluate``: the training RNG put back (below);
  ``on_train_end``: ``ckpt.finish()`` (final checkpoint, durability, the final model as the run's
  result). :attr:`CfRayCallback.summary` holds what it returned.

The data: the Trainer's training sampler is replaced by a
:class:`cf_ray.data.ResumableDistributedSampler` (shuffled by ``args.data_seed`` or ``args.seed``
and the epoch, as torch's ``DistributedSampler``; not shuffled with
``train_sampling_strategy="sequential"``), padded to an equal count per rank like torch's (with a
dataset whose size the world size divides, every sample once per epoch). Its position counts what
the Trainer consumed, never what the DataLoader's workers or accelerate's look-ahead drew.

The Trainer numbers its epochs from 0 in every ``train()`` call (it skips batches only for its own
``resume_from_checkpoint``); after a restore cf_ray's sampler maps the Trainer's epoch ``i`` to the
restored epoch ``+ i`` and the Trainer stops at its ``max_steps`` as in an uninterrupted run.
``TrainerState.epoch`` is set from the true epoch at every step.

Evaluations between steps draw from the global torch RNG (their DataLoader's seed); an evaluation
the restored run does not repeat would shift every random number after it. So the training RNG is
kept at each step's end and put back after each evaluation (``on_evaluate``), in every run.

Refused with :class:`cf_ray.ConfigError`, before training: a second ``CfRayCallback`` in the same
Trainer (before anything is built or restored), DeepSpeed, FSDP (through the Trainer),
``train_sampling_strategy`` ``group_by_length``/``batch_rebalance``, an ``IterableDataset``,
accelerate's ``split_batches``/``dispatch_batches``, a ``gradient_accumulation_steps`` that does not
divide the batches of an epoch, and ``trainer.train(resume_from_checkpoint=...)`` (cf_ray restores
the run itself). A restart on another number of workers raises
:class:`cf_ray.ElasticResumeError` (the Trainer's step counts depend on the world size).
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from cf_ray._engine.worker.restore.checks import dry_run
from cf_ray.checkpointer import Checkpointer, FinishSummary, Resume
from cf_ray.config import CheckpointConfig
from cf_ray.data.sampler import ResumableDistributedSampler
from cf_ray.errors import ConfigError
from cf_ray.integrations._common import ResumableBatches, RngHold, UpdateScope, install_batches, refuse_another

logger = logging.getLogger("cf_ray")

#: The ``TrainerState`` fields a snapshot carries: the Trainer's progress. The fields the Trainer
#: computes from its arguments at every ``train()`` (``max_steps``, ``logging_steps``, ...) are not
#: restored, so a run continued with more epochs gets its new ``max_steps``.
PROGRESS_FIELDS = (
    "global_step",
    "epoch",
    "total_flos",
    "num_input_tokens_seen",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)


class CfRayCallback(TrainerCallback):
    """Add to a ``transformers.Trainer`` (``trainer.add_callback(...)`` or ``callbacks=[...]``) to
    checkpoint it with cf_ray; one per Trainer, on every rank. See the module's documentation.

    Args:
        config: how and when to checkpoint (``None``: ``CheckpointConfig()``).
    """

    def __init__(self, config: CheckpointConfig | None = None) -> None:
        self.config = config or CheckpointConfig()
        self.checkpointer: Checkpointer | None = None
        """The rank's Checkpointer, from ``on_train_begin``."""
        self.resume: Resume | None = None
        """Where this attempt resumed (``on_train_begin``)."""
        self.summary: FinishSummary | None = None
        """What ``finish()`` returned (``on_train_end``)."""
        self._batches: ResumableBatches | None = None
        self._steps_in_epoch = 0
        self._update = UpdateScope()
        self._rng = RngHold()

    # -- the start: data, tracked objects, restore ---------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.checkpointer is not None:
            raise ConfigError(
                "CfRayCallback: train() was called twice with the same callback; add a new CfRayCallback per train()"
            )
        refuse_another(_handler_callbacks(), self, "the Trainer's callbacks (Trainer(callbacks=[...]), add_callback)")
        model, optimizer, scheduler, loader = (
            kwargs.get(k) for k in ("model", "optimizer", "lr_scheduler", "train_dataloader")
        )
        _refuse(args, state, loader)
        assert loader is not None  # _refuse says so otherwise
        self._steps_in_epoch = len(loader)
        self._batches = _batches_for(args, loader, self._steps_in_epoch, epoch_of=self._epoch)
        install_batches(loader, self._batches, expose_sampler=False)
        tracked: dict[str, Any] = {
            "model": model,
            "optimizer": getattr(optimizer, "optimizer", optimizer),  # accelerate's AcceleratedOptimizer wraps it
            "lr_scheduler": getattr(scheduler, "scheduler", scheduler),
            "trainer_state": _TrainerProgress(state),
        }
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            tracked["scaler"] = scaler
        ckpt = self.checkpointer = Checkpointer(tracked, data={"train": _TrainData(self._batches)}, config=self.config)
        self.resume = ckpt.restore()
        if not self.resume.fresh:
            self._resumed(state)
        return control

    def _resumed(self, state) -> None:
        assert self.checkpointer is not None and self._batches is not None
        ckpt, batches = self.checkpointer, self._batches
        if batches.epoch_complete and ckpt.epoch == batches.resumable.epoch:
            ckpt.end_epoch()  # the snapshot was the epoch's last step: its on_epoch_end did not run
        if state.global_step >= state.max_steps:
            batches.stopped = True
        if ckpt.rank == 0:
            logger.info(
                "cf_ray: the Trainer resumes at global step %d, epoch %d, %d batches into it (%s)",
                state.global_step,
                ckpt.epoch,
                0 if batches.epoch_complete else batches.batches_done,
                self.resume.source if self.resume else "?",
            )

    def _epoch(self, _trainer_epoch: int) -> int:
        """The epoch cf_ray's sampler iterates when the Trainer starts its epoch ``_trainer_epoch``."""
        return self.checkpointer.epoch if self.checkpointer is not None else _trainer_epoch

    # -- every step ---------------------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._update.enter(self._ckpt())
        return control

    def on_substep_end(self, args, state, control, **kwargs):
        self._consumed()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        batches = self._consumed()
        # The Trainer's own value counts its epochs from 0 again after a restore.
        state.epoch = self._ckpt().epoch + batches.batches_done / self._steps_in_epoch
        self._update.leave()  # agreement, decision, snapshot: after the scheduler's step
        self._rng.keep()
        return control

    def _consumed(self) -> ResumableBatches:
        if self._batches is None:
            raise RuntimeError("CfRayCallback: a training step before on_train_begin")
        self._batches.consumed()
        return self._batches

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._batches is not None:
            self._batches.end_epoch()
            self._ckpt().end_epoch()
            self._rng.keep()
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        self._rng.put_back()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.checkpointer is not None:
            self._update.leave()
            self.summary = self.checkpointer.finish()
        return control

    def _ckpt(self) -> Checkpointer:
        if self.checkpointer is None:
            raise RuntimeError("CfRayCallback: a training step before on_train_begin")
        return self.checkpointer


class _TrainerProgress:
    """The Trainer's progress (``PROGRESS_FIELDS`` of its ``TrainerState``) as a tracked object.

    Loaded in place: the Trainer and its callbacks hold this very ``TrainerState``. Taken again at the
    next step's start (like an LR scheduler), so what the step's logging and evaluation added to
    ``log_history`` and ``best_metric`` belongs to the step, as the restored run does not repeat them.
    """

    FORMAT = "cf_ray.hf.TrainerState/1"

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.FORMAT}
        for name in PROGRESS_FIELDS:
            if hasattr(self.state, name):
                out[name] = copy.deepcopy(getattr(self.state, name))  # log_history grows after this
        return out

    def validate_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != self.FORMAT:
            raise ConfigError(f"the saved Trainer progress is not a {self.FORMAT} state: {str(state_dict)[:200]}")
        if not isinstance(state_dict.get("global_step"), int):
            raise ConfigError("the saved Trainer progress has no integer global_step")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.validate_state_dict(state_dict)
        for name in PROGRESS_FIELDS:
            if name in state_dict and hasattr(self.state, name):
                setattr(self.state, name, copy.deepcopy(state_dict[name]))


class _TrainData:
    """The data position (the sampler's state) as a per-rank data object, without an elastic load:
    the Trainer's step counts depend on the number of workers, so another world size is refused
    with :class:`cf_ray.ElasticResumeError` by the restore."""

    def __init__(self, batches: ResumableBatches) -> None:
        self.batches = batches

    def state_dict(self) -> dict[str, Any]:
        return self.batches.resumable.state_dict()

    def validate_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        dry_run(self.batches.resumable, "load_state_dict", state_dict)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.batches.resumable.load_state_dict(state_dict)


def _batches_for(args, loader, steps_in_epoch: int, *, epoch_of) -> ResumableBatches:
    """cf_ray's batches for the Trainer's train ``loader``, checked to count what the Trainer counts."""
    base = getattr(loader, "base_dataloader", loader)
    dataset = base.dataset
    rank, world = _rank_and_world()
    seed = args.data_seed if args.data_seed is not None else args.seed
    drop_last = bool(args.dataloader_drop_last)
    sampler = ResumableDistributedSampler(
        dataset,
        rank=rank,
        world_size=world,
        shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
        seed=seed,
        drop_last=drop_last,  # the tail cut so every rank gets as many (torch's drop_last), else padded
    )
    batches = ResumableBatches(
        sampler, args.per_device_train_batch_size, drop_last=drop_last, epoch_of=epoch_of, seed=seed
    )
    if len(batches) != steps_in_epoch:
        raise ConfigError(
            f"CfRayCallback: the Trainer counts {steps_in_epoch} batches per epoch on each rank but cf_ray's "
            f"sampler makes {len(batches)} ({len(sampler)} of the {len(dataset)} samples on rank {rank} of "
            f"{world}, batches of {args.per_device_train_batch_size}); use a dataset size that the world size "
            "divides, or dataloader_drop_last=True"
        )
    ga = args.gradient_accumulation_steps
    if steps_in_epoch % ga:
        raise ConfigError(
            f"CfRayCallback: gradient_accumulation_steps={ga} does not divide the {steps_in_epoch} batches of "
            "an epoch on each rank; the Trainer's shorter last accumulation of an epoch cannot be resumed "
            "mid-epoch. Choose a batch size, dataset size or gradient_accumulation_steps so that it divides"
        )
    return batches


def _handler_callbacks() -> list[Any] | None:
    """The callbacks of the Trainer whose event is being called: the ``CallbackHandler`` that calls
    every callback's event in turn (``call_event``) is the caller of the callback's method. An event
    gets no handle on the Trainer or its callbacks otherwise, and the first ``CfRayCallback`` must
    know of a second one before it restores anything. ``None`` when no handler is found (an event
    called directly)."""
    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(1)
    for _ in range(4):  # this function <- on_train_begin <- call_event (<- on_train_begin of the handler)
        frame = frame.f_back
        if frame is None:
            return None
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler):
            return list(handler.callbacks)
    return None


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _refuse(args, state, loader) -> None:
    """Raise ``ConfigError`` for what the callback cannot resume exactly (before anything changes)."""
    if state.global_step > 0:
        raise ConfigError(
            f"CfRayCallback: the Trainer starts at global step {state.global_step}: it resumed from its own "
            "checkpoint (train(resume_from_checkpoint=...)). cf_ray restores the run itself: call train() "
            "without resume_from_checkpoint (to start from another run, use CheckpointConfig(resume_from=...))"
        )
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None):
        raise ConfigError(
            "CfRayCallback does not support DeepSpeed: its engine owns the optimizer step and partitions the "
            "optimizer state, which cf_ray's snapshots do not see. Train with DDP (the default) instead"
        )
    if getattr(args, "fsdp", None):
        raise ConfigError(
            f"CfRayCallback does not support the Trainer's FSDP (fsdp={args.fsdp!r}) yet; train with DDP, or "
            "write the loop with cf_ray.Checkpointer, which saves FSDP2 shards"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        raise ConfigError(
            f"CfRayCallback: train_sampling_strategy={strategy!r} is not supported (cf_ray replaces the training "
            "sampler with its resumable one); use 'random' or 'sequential'"
        )
    acc = getattr(args, "accelerator_config", None)
    for name in ("split_batches", "dispatch_batches"):
        if getattr(acc, name, None):
            raise ConfigError(f"CfRayCallback does not support accelerator_config {name}=True; remove it")
    if loader is None:
        raise ConfigError("CfRayCallback: the Trainer has no train DataLoader (train_dataset=None?)")
    base = getattr(loader, "base_dataloader", loader)
    if isinstance(getattr(base, "dataset", None), torch.utils.data.IterableDataset) or not hasattr(
        base.dataset, "__len__"
    ):
        raise ConfigError(
            "CfRayCallback needs a map-style train_dataset (with __len__ and __getitem__) to resume at an exact "
            "position; an IterableDataset is not supported"
        )


__all__ = ["PROGRESS_FIELDS", "CfRayCallback"]
