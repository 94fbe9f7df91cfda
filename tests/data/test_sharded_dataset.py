"""ShardedDataset: each rank loads and holds only its shard; resumable; elastic."""

from __future__ import annotations

from collections import Counter

import pytest

from cf_ray.data import ResumableDataLoader, ShardedDataset
from cf_ray.errors import ConfigError

from data_harness import check_every_interrupt_point, roundtrip


class Loader:
    """load_fn that records which ids it was asked for."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def __call__(self, ids):
        self.calls.append(list(ids))
        return [{"id": i, "x": float(i)} for i in ids]


def _ids(batch):
    return batch["id"].tolist()


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_rank_holds_only_its_part(shuffle):
    loaders = [Loader() for _ in range(3)]
    shards = [ShardedDataset(20, loaders[r], rank=r, world_size=3, shuffle=shuffle, seed=5) for r in range(3)]
    held = [set(ds.held_ids()) for ds in shards]
    assert set().union(*held) == set(range(20))
    assert sum(len(h) for h in held) == 20  # disjoint
    for r in range(3):
        assert loaders[r].calls == [sorted(held[r])]  # loaded once, only its shard
        shards[r].set_epoch(0)
        assert sorted(shards[r].sampler) == sorted(held[r])
    if not shuffle:
        assert shards[0].held_ids() == list(range(0, 6))  # contiguous blocks


def test_epochs_reshuffle_within_the_shard():
    ds = ShardedDataset(30, Loader(), rank=1, world_size=2, seed=3)
    ds.set_epoch(0)
    e0 = list(ds.sampler)
    ds.set_epoch(1)
    e1 = list(ds.sampler)
    assert e0 != e1 and sorted(e0) == sorted(e1) == ds.held_ids()


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_at_every_interrupt_point(rank):
    def make():
        ds = ShardedDataset(13, Loader(), rank=rank, world_size=2, seed=9)
        return ResumableDataLoader(ds, batch_size=2, sampler=ds.sampler)

    check_every_interrupt_point(make, _ids, epochs=2)


def test_elastic_resume_loads_only_what_the_new_rank_needs():
    n = 24
    old = [ShardedDataset(n, Loader(), rank=r, world_size=2, seed=1) for r in range(2)]
    seen = []
    its = [iter(ds.sampler) for ds in old]
    for _ in range(5):
        for it in its:
            seen.append(next(it))
    seen.append(next(its[0]))  # rank 0 is one item ahead
    states = [roundtrip(ds.state_dict()) for ds in old]
    assert [s["consumed"] for s in states] == [6, 5]  # uneven consumption

    new_loaders = [Loader() for _ in range(3)]
    new = [ShardedDataset(n, new_loaders[r], rank=r, world_size=3, seed=1) for r in range(3)]
    for r, ds in enumerate(new):
        ds.load_elastic_state(states, r, 3)
        seen += list(ds.sampler)
    assert Counter(seen) == Counter(range(n))  # the epoch: exactly once
    for r, ds in enumerate(new):
        own = set(ds.shard_ids().tolist())
        extra = [i for call in new_loaders[r].calls[1:] for i in call]
        assert not own & set(extra)  # only missing items were loaded
        assert all(call == sorted(call) for call in new_loaders[r].calls)
        ds.set_epoch(1)  # next epoch: the new shards only
        assert ds.held_ids() == sorted(own)
        assert sorted(ds.sampler) == sorted(own)


def test_index_outside_the_shard_is_a_clear_error():
    ds = ShardedDataset(10, Loader(), rank=0, world_size=2, shuffle=False)
    with pytest.raises(IndexError, match="not held by rank 0"):
        ds[9]
    with pytest.raises(ConfigError, match="one item per id"):
        ShardedDataset(10, lambda ids: [], rank=0, world_size=2)
