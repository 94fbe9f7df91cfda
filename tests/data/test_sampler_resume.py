"""ResumableDistributedSampler: torch's order, and exact resume at every interrupt point."""

from __future__ import annotations

import json

import pytest
from conftest import IdDataset, tensor_ids
from torch.utils.data import DataLoader, DistributedSampler

from cf_ray.data import ResumableDistributedSampler

from data_harness import check_every_interrupt_point, roundtrip


class SamplerAndLoader:
    """What a user writes: the sampler is registered, a plain DataLoader (num_workers=0) iterates."""

    def __init__(self, sampler, batch_size, drop_last=False):
        self.sampler = sampler
        self.loader = DataLoader(
            IdDataset(sampler.dataset_len), batch_size=batch_size, sampler=sampler, drop_last=drop_last
        )

    def __iter__(self):
        return iter(self.loader)

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def state_dict(self):
        return self.sampler.state_dict()

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_order_as_torch_distributed_sampler(world_size, shuffle, drop_last):
    ds = IdDataset(23)
    for epoch in (0, 1, 5):
        for rank in range(world_size):
            theirs = DistributedSampler(
                ds, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            ours = ResumableDistributedSampler(
                ds, rank=rank, world_size=world_size, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_order_is_a_pure_function_of_seed_and_epoch():
    def order(seed, epoch):
        s = ResumableDistributedSampler(IdDataset(50), rank=0, world_size=1, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(3, 2) == order(3, 2)
    assert order(3, 2) != order(3, 1)
    assert order(3, 2) != order(4, 2)
    assert sorted(order(3, 2)) == list(range(50))


@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize(
    "shuffle,drop_last,pad",
    [
        (True, False, None),  # torch's default: pads uneven shards
        (True, False, False),  # uneven shards, exactly once
        (False, True, None),  # drops the tail
    ],
)
@pytest.mark.parametrize("batch_drop_last", [False, True])
def test_resume_at_every_interrupt_point(world_size, rank, shuffle, drop_last, pad, batch_drop_last):
    def make():
        sampler = ResumableDistributedSampler(
            IdDataset(11), rank=rank, world_size=world_size, shuffle=shuffle, seed=1, drop_last=drop_last, pad=pad
        )
        return SamplerAndLoader(sampler, batch_size=2, drop_last=batch_drop_last)

    assert check_every_interrupt_point(make, tensor_ids, epochs=2) >= 6


def test_position_counts_the_batch_the_loop_holds():
    sampler = ResumableDistributedSampler(IdDataset(10), rank=0, world_size=1, shuffle=False)
    loader = DataLoader(IdDataset(10), batch_size=4, sampler=sampler)
    it = iter(loader)
    assert sampler.state_dict()["consumed"] == 0
    assert next(it).tolist() == [0, 1, 2, 3]
    assert sampler.state_dict()["consumed"] == 4
    next(it)
    next(it)
    assert sampler.state_dict()["consumed"] == 10  # the partial last batch, too


def test_epoch_boundary_states():
    """After the last batch the state says "complete"; set_epoch(e+1) starts at 0; a restored
    complete epoch is not replayed, whichever epoch the engine resumes at."""
    ds = IdDataset(6)
    s = ResumableDistributedSampler(ds, rank=0, world_size=1, seed=2)
    s.set_epoch(4)
    first = list(s)
    end_state = roundtrip(s.state_dict())
    assert (end_state["epoch"], end_state["consumed"], end_state["epoch_len"]) == (4, 6, 6)
    s.set_epoch(5)
    assert (s.state_dict()["epoch"], s.state_dict()["consumed"]) == (5, 0)

    same = ResumableDistributedSampler(ds, rank=0, world_size=1, seed=2)
    same.load_state_dict(end_state)
    same.set_epoch(4)
    assert list(same) == []  # epoch 4 was finished: nothing replayed
    same.set_epoch(5)
    expected = ResumableDistributedSampler(ds, rank=0, world_size=1, seed=2)
    expected.set_epoch(5)
    assert list(same) == list(expected)

    # Without a load, a second pass over a finished epoch repeats it, as torch does.
    assert list(s) != [] and list(s) == list(s)
    again = ResumableDistributedSampler(ds, rank=0, world_size=1, seed=2)
    again.set_epoch(4)
    assert list(again) == first and list(again) == first


def test_set_epoch_same_epoch_keeps_restored_position_and_other_epoch_warns():
    ds = IdDataset(10)
    s = ResumableDistributedSampler(ds, rank=0, world_size=1, shuffle=False)
    it = iter(s)
    [next(it) for _ in range(3)]
    state = roundtrip(s.state_dict())
    r = ResumableDistributedSampler(ds, rank=0, world_size=1, shuffle=False)
    r.load_state_dict(state)
    r.set_epoch(0)
    assert list(r) == [3, 4, 5, 6, 7, 8, 9]
    r2 = ResumableDistributedSampler(ds, rank=0, world_size=1, shuffle=False)
    r2.load_state_dict(state)
    with pytest.warns(UserWarning, match="abandons the restored position 3"):
        r2.set_epoch(1)
    assert list(r2) == list(range(10))


def test_state_is_small_json():
    s = ResumableDistributedSampler(IdDataset(10_000), rank=1, world_size=4)
    text = json.dumps(s.state_dict())
    assert len(text) < 400
