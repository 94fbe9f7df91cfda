"""Resumable, elastic samplers for map-style datasets.

:class:`ResumableDistributedSampler` is a drop-in for ``torch.utils.data.DistributedSampler`` (same
per-rank order for the same ``seed``, ``epoch``, ``drop_last`` and world size) that also records
how far the training loop got, so a restarted run continues at the next unconsumed index:

* The order of an epoch is a pure function of ``(seed, epoch)`` and the world size; nothing
  random is saved.
* The position advances as the loop takes indices, with no ``advance()`` call to forget. With
  ``num_workers=0`` a plain ``DataLoader`` is enough; with worker processes (which read ahead)
  wrap it in :class:`cf_ray.data.ResumableDataLoader`, which counts the batches the loop received.
* On a different number of workers, :meth:`~ResumableSampler.load_elastic_state` re-splits the
  indices that no old rank had consumed, so the epoch still sees each index exactly once.

:class:`ResumableSampler` is the base of the index samplers (:class:`cf_ray.data.ShardedDataset`
has one too); the position and epoch rules live in :class:`cf_ray._engine.data.cursor.EpochCursor`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from cf_ray._engine.data.checks import check_int
from cf_ray._engine.data.cursor import EpochCursor
from cf_ray.errors import ConfigError, ElasticResumeError

_EMPTY = np.empty(0, dtype=np.int64)


class ResumableSampler(EpochCursor, Sampler[int]):
    """Base class of the resumable index samplers: an :class:`~cf_ray._engine.data.cursor.EpochCursor`
    whose plan is an array of dataset indices.

    Subclasses implement :meth:`_base_lists` (the per-rank lists of a fresh epoch) and
    ``_settings`` (what must match on load), and set ``FORMAT``. The elastic re-split takes the
    indices no old rank had consumed in the epoch's order (position-major, then rank) and gives
    new rank ``r`` every ``world_size``-th of them from the ``r``-th.
    """

    def _base_lists(self, epoch: int, world_size: int) -> list[np.ndarray]:
        """Per-rank index lists of ``epoch`` for ``world_size`` ranks, with no elastic history."""
        raise NotImplementedError

    def _pad_to_even(self) -> bool:
        """Whether an elastic re-split pads the remainder so every rank gets as many indices."""
        return False

    def _lists(self, epoch: int, history: list[dict[str, Any]], world_size: int) -> list[np.ndarray]:
        lists = self._base_lists(epoch, history[0]["world_size"] if history else world_size)
        for i, seg in enumerate(history):
            nxt = history[i + 1]["world_size"] if i + 1 < len(history) else world_size
            rest = _remaining_in_order(lists, seg["consumed"])
            if self._pad_to_even() and len(rest) % nxt:
                rest = _pad_cyclic(rest, math.ceil(len(rest) / nxt) * nxt)
            lists = [rest[r::nxt] for r in range(nxt)]
        return lists

    def __iter__(self) -> Iterator[int]:
        start = self._begin_pass()
        plan = self._plan()
        counting = self._consumer is None
        # Python ints in chunks: fast like a list, without a list of the whole epoch in memory.
        for lo in range(start, len(plan), 4096):
            for i, index in enumerate(plan[lo : lo + 4096].tolist(), lo + 1):
                if counting:
                    # Count before handing the index out: when the loop holds a batch, its
                    # indices are already counted, which is what a state taken after its step
                    # must say.
                    self._position = i
                yield index

    def __len__(self) -> int:
        """Number of indices of the current epoch on this rank (consumed ones included)."""
        return len(self._plan())


class ResumableDistributedSampler(ResumableSampler):
    """A ``DistributedSampler`` that can be saved, restored and resumed on another world size.

    For the same ``seed``, ``epoch``, ``shuffle``, ``drop_last`` and world size it yields exactly
    what ``torch.utils.data.DistributedSampler`` yields, so it can replace one without changing
    a run's order.

    Example::

        sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)  # num_workers=0
        # with worker processes: ResumableDataLoader(dataset, sampler=sampler, num_workers=4, ...)
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                ...
                state = sampler.state_dict()   # what the loop consumed, this batch included

    Args:
        dataset: the map-style dataset (only its length is used; it is read once, here).
        rank: this worker's rank; defaults to torch.distributed's, else 0.
        world_size: number of workers; defaults to torch.distributed's, else 1.
        shuffle: permute the indices every epoch (by ``seed + epoch``, as torch does).
        seed: seed of the permutation; must be the same on every rank.
        drop_last: drop the tail of the epoch so every rank gets the same count (torch's
            semantics).
        pad: when ``drop_last`` is False, repeat indices from the start of the epoch so every
            rank gets the same count (torch's behaviour; the default). ``pad=False`` gives
            uneven shards (counts differ by at most one) in which every index appears exactly once
            per epoch. Ignored when ``drop_last`` is True.

    Raises:
        ConfigError: an argument is invalid.
    """

    FORMAT = "cf_ray.ResumableDistributedSampler/1"

    def __init__(
        self,
        dataset: Sized,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool | None = None,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size)
        try:
            n = len(dataset)
        except TypeError:
            raise ConfigError(
                f"dataset={type(dataset).__name__} has no len(); pass a map-style "
                "dataset, or use ResumableRayDataIterator / ResumableParquetReader "
                "for streams"
            ) from None
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be True or False")
        if pad is not None and not isinstance(pad, bool):
            raise ConfigError(f"pad={pad!r} must be True, False or None (torch's behaviour)")
        if pad is not None and drop_last:
            warnings.warn("pad is ignored when drop_last=True (the tail is dropped, not padded)", stacklevel=2)
        # torch seeds a torch.Generator with seed + epoch, which must fit in 64 bits.
        check_int("seed", seed, minimum=0)
        self.dataset_len = n
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = (not drop_last) if pad is None else (pad and not drop_last)

    def _settings(self) -> dict[str, Any]:
        return {
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
        }

    def _setting_hints(self) -> dict[str, str]:
        return {
            "dataset_len": "Build the sampler over the same dataset as the run that saved the checkpoint (same length)"
        }

    def _pad_to_even(self) -> bool:
        return self.pad

    def _base_lists(self, epoch: int, world_size: int) -> list[np.ndarray]:
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g).numpy()
        else:
            order = np.arange(n, dtype=np.int64)
        # Same arithmetic as torch.utils.data.DistributedSampler, so the orders are identical.
        if self.drop_last and n % world_size:
            per_rank = max(math.ceil((n - world_size) / world_size), 0)
        else:
            per_rank = math.ceil(n / world_size)
        total = per_rank * world_size
        if self.drop_last:
            order = order[:total]
        elif self.pad and n:
            order = _pad_cyclic(order, total)
        return [order[r::world_size] for r in range(world_size)]


def _remaining_in_order(lists: Sequence[np.ndarray], consumed: Sequence[int]) -> np.ndarray:
    """What the ranks had not consumed, in the epoch's order (position-major, then rank)."""
    if len(consumed) != len(lists):
        raise ElasticResumeError(f"history has {len(consumed)} counts for {len(lists)} ranks")
    world = len(lists)
    tails, keys = [], []
    for r, (lst, c) in enumerate(zip(lists, consumed)):
        if c > len(lst):
            raise ElasticResumeError(
                f"rank {r} consumed {c} of {len(lst)} indices; the state does not match this sampler"
            )
        tails.append(lst[c:])
        keys.append(np.arange(c, len(lst), dtype=np.int64) * world + r)
    if not tails:
        return _EMPTY
    order = np.argsort(np.concatenate(keys), kind="stable")
    return np.concatenate(tails)[order]


def _pad_cyclic(values: np.ndarray, total: int) -> np.ndarray:
    """``values`` repeated from its start up to length ``total`` (torch's padding)."""
    if len(values) == 0 or len(values) >= total:
        return values
    reps = math.ceil(total / len(values))
    return np.tile(values, reps)[:total]
