"""A dataset split across ranks so that each rank loads and holds only its part.

For datasets too large for one worker (cycling_utils' ``DistributedShardedDataset``, done
resumably): the items are dealt once to the ranks, each rank loads its shard through a
user function, and every epoch visits the rank's shard in a fresh order that is a pure function of
``(seed, epoch, rank)``. The position is resumable like :class:`ResumableDistributedSampler`'s.

Because no rank holds the whole dataset, an epoch cannot be permuted across ranks; each rank
shuffles within its shard. When a run resumes on another number of workers in the middle of an
epoch, the items the old ranks had not consumed are re-split over the new ranks, and each new
rank loads the part it lacks, so the epoch is still exactly once; the next epochs use the shards
of the new world size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from cf_ray._engine.data.checks import check_int
from cf_ray._engine.data.cursor import SamplerHeldPosition
from cf_ray.data.sampler import ResumableSampler
from cf_ray.errors import ConfigError

logger = logging.getLogger("cf_ray.data")

LoadFn = Callable[[list[int]], Sequence[Any]]


class ShardedDataset(SamplerHeldPosition, Dataset):
    """A map-style dataset of which this rank holds only its shard, with a resumable sampler.

    Index it with the *global* item ids that :attr:`sampler` yields.

    Example::

        def load(ids):                       # called with this rank's ids, ascending
            return [read_record(i) for i in ids]

        ds = ShardedDataset(num_items=1_000_000, load_fn=load, shuffle=True, seed=0)
        loader = ResumableDataLoader(ds, batch_size=256, sampler=ds.sampler, num_workers=2)
        ckpt = cf_ray.Checkpointer(..., data={"data": ds})
        for epoch in range(resume.epoch, epochs):
            ds.set_epoch(epoch)
            for batch in loader:
                ...

    Args:
        num_items: number of items in the whole dataset (ids ``0 .. num_items - 1``).
        load_fn: ``load_fn(ids) -> items``: loads the items with the given global ids (a sorted
            list) and returns them in that order. Called on this rank only, at construction and
            when an elastic resume hands this rank items of other shards.
        rank: this worker's rank; defaults to torch.distributed's, else 0.
        world_size: number of workers; defaults to torch.distributed's, else 1.
        shuffle: deal items to ranks at random (by ``seed``) and shuffle each shard every epoch;
            if False, rank ``r`` holds the ``r``-th contiguous block and reads it in order.
        seed: seed of the deal and of the per-epoch orders; must be the same on every rank.

    Raises:
        ConfigError: an argument is invalid, or ``load_fn`` returned the wrong number of items.
    """

    sampler: ShardSampler
    """The sampler over this dataset's shards; it holds the position."""

    def __init__(
        self,
        num_items: int,
        load_fn: LoadFn,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        check_int("num_items", num_items, minimum=0)
        check_int("seed", seed, minimum=0)
        if not callable(load_fn):
            raise ConfigError(f"load_fn={load_fn!r} must be a callable: ids -> items")
        if not isinstance(shuffle, bool):
            raise ConfigError(f"shuffle={shuffle!r} must be True or False")
        self.num_items = num_items
        self.load_fn = load_fn
        self.sampler = ShardSampler(self, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed)
        self._items: dict[int, Any] = {}
        self._load(self.shard_ids())

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.sampler.rank

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self.sampler.world_size

    def shard_ids(self) -> np.ndarray:
        """The global ids of this rank's shard for the current world size, ascending."""
        return self.sampler._shard(self.world_size, self.rank)

    def held_ids(self) -> list[int]:
        """The global ids this rank holds in memory now, ascending."""
        return sorted(self._items)

    def __getitem__(self, index: int) -> Any:
        try:
            return self._items[int(index)]
        except KeyError:
            raise IndexError(
                f"item {index} is not held by rank {self.rank}; iterate the ids of ShardedDataset.sampler"
            ) from None

    def __len__(self) -> int:
        """Number of items this rank holds."""
        return len(self._items)

    # Stateful / ElasticStateful: the sampler holds the position (SamplerHeldPosition).

    # internal

    def _load(self, ids: np.ndarray) -> None:
        missing = sorted(i for i in np.asarray(ids).tolist() if i not in self._items)
        if not missing:
            return
        items = self.load_fn(missing)
        if len(items) != len(missing):
            raise ConfigError(
                f"load_fn returned {len(items)} items for {len(missing)} ids; it must "
                "return one item per id, in the order given"
            )
        self._items.update(zip(missing, items))

    def _drop_all_but(self, keep: np.ndarray) -> None:
        keep_set = set(keep.tolist())
        for i in [i for i in self._items if i not in keep_set]:
            del self._items[i]


class ShardSampler(ResumableSampler):
    """The resumable order over a :class:`ShardedDataset`'s shard (its ``.sampler``)."""

    FORMAT = "cf_ray.ShardedDataset/1"

    def __init__(
        self, dataset: ShardedDataset, *, rank: int | None, world_size: int | None, shuffle: bool, seed: int
    ) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._shards: dict[tuple[int, int], np.ndarray] = {}

    def _settings(self) -> dict[str, Any]:
        return {"num_items": self.dataset.num_items, "seed": self.seed, "shuffle": self.shuffle}

    def _setting_hints(self) -> dict[str, str]:
        return {"num_items": "Build the ShardedDataset over the same items (same num_items)"}

    def _shard(self, world_size: int, rank: int) -> np.ndarray:
        key = (world_size, rank)
        if key not in self._shards:
            n = self.dataset.num_items
            if not self.shuffle:
                shard = np.arange(rank * n // world_size, (rank + 1) * n // world_size, dtype=np.int64)
            else:
                # The deal does not depend on the epoch: a rank keeps its shard for the whole run.
                dealt = np.random.default_rng(self.seed).permutation(n)
                shard = np.sort(dealt[rank::world_size])
            self._shards[key] = shard
        return self._shards[key]

    def _base_lists(self, epoch: int, world_size: int) -> list[np.ndarray]:
        lists = []
        for r in range(world_size):
            shard = self._shard(world_size, r)
            if self.shuffle:
                shard = np.random.default_rng([self.seed, epoch, r]).permutation(shard)
            lists.append(shard)
        return lists

    def _plan_changed(self) -> None:
        # After an elastic resume this rank must also hold the part of the interrupted epoch that
        # other shards had not consumed; load it now, before any DataLoader worker forks.
        before = len(self.dataset)
        self.dataset._load(self._plan())
        if len(self.dataset) != before:
            logger.info(
                "rank %d: loaded %d items of other shards for the rest of epoch %d",
                self.rank,
                len(self.dataset) - before,
                self.epoch,
            )

    def _on_epoch_changed(self) -> None:
        # Items taken over for an interrupted epoch are not part of this rank's shard: free them.
        shard = self.dataset.shard_ids()
        if len(self.dataset) > len(shard):
            self.dataset._drop_all_but(shard)
