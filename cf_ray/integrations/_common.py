"""What the trainer integrations share: the batches cf_ray puts into a trainer's train
``DataLoader``, the optimizer-step guard held open between two callback events, and the training
RNG kept out of an evaluation's reach.

None of this imports a trainer framework; :mod:`cf_ray.integrations.huggingface` and
:mod:`cf_ray.integrations.lightning` wire it to their framework's events.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from cf_ray._engine.worker.snapshot.rng import rng_state, set_rng_state
from cf_ray.data.sampler import ResumableDistributedSampler
from cf_ray.errors import ConfigError


class ResumableBatches:
    """The batch sampler cf_ray puts into a trainer's train ``DataLoader``: batches of a
    :class:`~cf_ray.data.ResumableDistributedSampler`, whose position advances only when the
    trainer *consumed* a batch (:meth:`consumed`), never when a prefetcher (the DataLoader's
    workers, accelerate's one-batch look-ahead) drew it.

    Args:
        sampler: the per-rank sampler that holds the epoch and the position.
        batch_size: indices per batch.
        drop_last: drop the epoch's last incomplete batch (its indices count as consumed at the end
            of the epoch).
        epoch_of: maps the epoch number a trainer passes to ``set_epoch`` to the epoch to iterate
            (the identity for Lightning; the Hugging Face Trainer numbers its epochs from 0 again
            after a restore).
        seed: the seed of the DataLoader's own generator, re-seeded with ``seed + epoch`` at each
            pass, so that a pass never draws from the global torch RNG (a snapshot restores that
            one) and worker seeds depend on the epoch only.
    """

    def __init__(
        self,
        sampler: ResumableDistributedSampler,
        batch_size: int,
        *,
        drop_last: bool,
        epoch_of: Callable[[int], int] = lambda e: e,
        seed: int = 0,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"the train DataLoader's batch_size={batch_size!r} must be an int >= 1")
        sampler._attach_consumer(f"cf_ray.integrations@{id(self):#x}")
        self.resumable = sampler
        """The sampler (``resumable``, not ``sampler``: a trainer that finds a ``sampler`` attribute
        calls its ``set_epoch`` with its own epoch number)."""
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.generator = torch.Generator()
        self.stopped = False
        """Set when the trainer has nothing left to train: a pass then yields nothing."""
        self.exhausted = False
        """The current pass drew its last batch."""
        self._epoch_of = epoch_of
        self._seed = seed
        self._sizes: deque[int] = deque()

    def set_epoch(self, epoch: int) -> None:
        self.resumable.set_epoch(self._epoch_of(epoch))

    def __iter__(self) -> Iterator[list[int]]:
        # A fresh queue per pass: batches drawn ahead by an abandoned pass are never counted.
        self._sizes = deque()
        self.exhausted = False
        self.generator.manual_seed(self._seed + self.resumable.epoch)
        return self._batches(self._sizes)

    def _batches(self, sizes: deque[int]) -> Iterator[list[int]]:
        if self.stopped:
            return
        batch: list[int] = []
        for index in self.resumable:
            batch.append(index)
            if len(batch) == self.batch_size:
                sizes.append(len(batch))
                yield batch
                batch = []
        if batch and not self.drop_last:
            sizes.append(len(batch))
            yield batch
        self.exhausted = True

    def __len__(self) -> int:
        """Batches of the current epoch on this rank (consumed ones included)."""
        n = len(self.resumable)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch the trainer has consumed."""
        return math.ceil(self.resumable.consumed / self.batch_size)

    @property
    def epoch_complete(self) -> bool:
        return self.resumable.consumed >= len(self.resumable)

    def consumed(self) -> None:
        """The trainer consumed the oldest batch drawn and not yet counted."""
        if not self._sizes:
            raise RuntimeError(
                "cf_ray: the trainer reported a consumed batch that cf_ray's sampler never handed out; "
                "is the train DataLoader iterated outside the trainer?"
            )
        self.resumable._advance(self._sizes.popleft())

    def end_epoch(self) -> None:
        """At the trainer's end of an epoch: a pass that drew everything and whose batches were all
        consumed completes the epoch (a tail dropped by ``drop_last`` counts as consumed)."""
        if self.exhausted and not self._sizes:
            self.resumable._finish_pass()


def install_batches(
    loader: Any, batches: ResumableBatches, *, expose_sampler: bool, drop_iterator: bool = False
) -> DataLoader:
    """Put ``batches`` into ``loader`` (a ``DataLoader``, or accelerate's wrapper of one) before
    any iterator of it is used. Returns the ``DataLoader`` changed.

    ``DataLoader`` forbids setting ``batch_sampler`` after ``__init__`` (to protect its iterators,
    none of which exists yet here), so the guard is bypassed, as ``cf_ray.data.ResumableDataLoader``
    does. ``expose_sampler`` also makes ``loader.sampler`` cf_ray's sampler, for a trainer that calls
    ``loader.sampler.set_epoch`` itself with the true epoch (Lightning). ``drop_iterator`` forgets the
    persistent workers' iterator a trainer made before training (Lightning makes its first one
    before its train-start hook; the caller makes a new one): they end when it is collected.
    """
    target = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard wraps a DataLoader
    if not isinstance(target, DataLoader):
        raise ConfigError(
            f"cf_ray can resume the train data of a torch DataLoader, got {type(target).__name__}; "
            "give the trainer a map-style dataset (with __len__) and let it build its DataLoader"
        )
    if target.batch_sampler is None:
        raise ConfigError("the train DataLoader has batch_size=None; cf_ray needs batches of a fixed size")
    if getattr(target, "_iterator", None) is not None and drop_iterator:
        target._iterator = None
    elif getattr(target, "_iterator", None) is not None:
        raise ConfigError(
            "the train DataLoader already has live workers (persistent_workers=True and iterated "
            "before training); cf_ray must replace its sampler before the first pass"
        )
    object.__setattr__(target, "batch_sampler", batches)
    if expose_sampler:
        object.__setattr__(target, "sampler", batches.resumable)
    target.generator = batches.generator
    return target


def refuse_another(callbacks: list[Any] | None, me: Any, where: str) -> None:
    """Raise ``ConfigError`` when a trainer's ``callbacks`` hold cf_ray's callback ``me`` (its class)
    more than once, the same instance twice included: each would build a Checkpointer and restore the
    run again, and the second one would then find the first one's sampler in the DataLoader. Called by
    the first of them, before it builds anything.

    Args:
        callbacks: every callback of the trainer, in its order (``None``: not known, nothing checked).
        me: the callback asking.
        where: where the user lists callbacks (the error says so).
    """
    if callbacks is None:
        return
    cls = type(me)
    at = [i for i, cb in enumerate(callbacks) if isinstance(cb, cls)]
    if len(at) > 1:
        raise ConfigError(
            f"{cls.__name__}: this Trainer has {len(at)} cf_ray callbacks ({cls.__name__}) at positions {at} of "
            f"{where}; each would build a Checkpointer and restore the run again. Give one {cls.__name__} per "
            "Trainer: remove the others (the same instance listed twice counts twice)"
        )


class UpdateScope:
    """``with ckpt.update():`` held open between two callback events of a trainer: entered before its
    optimizer step (the weight-update guard), left once the step's bookkeeping is done (the
    agreement, the policy's decision, the snapshot)."""

    def __init__(self) -> None:
        self._cm: contextlib.AbstractContextManager | None = None

    @property
    def open(self) -> bool:
        return self._cm is not None

    def enter(self, ckpt: Any) -> None:
        if self._cm is not None:
            raise RuntimeError(
                "cf_ray: a second optimizer step began before the first one ended; one optimizer "
                "step per training step is supported (no manual optimization with several steps)"
            )
        cm = ckpt.update()
        cm.__enter__()
        self._cm = cm

    def leave(self) -> bool:
        """Leave the scope if open; True when a step was counted."""
        cm, self._cm = self._cm, None
        if cm is None:
            return False
        cm.__exit__(None, None, None)
        return True


class RngHold:
    """The training RNG state kept across something that draws from it but is not replayed after a
    restore (an evaluation between two training steps), so that training sees the same random
    numbers whether or not that thing ran in the attempt that resumed."""

    def __init__(self) -> None:
        self._state: dict | None = None

    def keep(self) -> None:
        self._state = rng_state()

    def put_back(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            set_rng_state(state)
