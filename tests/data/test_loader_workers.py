"""ResumableDataLoader: with worker processes and prefetching, the saved position is what the
loop received, never what the workers read ahead."""

from __future__ import annotations

import pytest
from conftest import IdDataset, tensor_ids
from torch.utils.data import DataLoader

from cf_ray.data import ResumableDataLoader, ResumableDistributedSampler
from cf_ray.errors import ConfigError

from data_harness import check_every_interrupt_point, roundtrip


def _sampler(n=10, **kw):
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return ResumableDistributedSampler(IdDataset(n), **kw)


def test_saved_position_equals_consumed_with_two_workers_and_prefetch():
    ds = IdDataset(40)
    loader = ResumableDataLoader(
        ds, batch_size=3, sampler=_sampler(40, shuffle=False), num_workers=2, prefetch_factor=2
    )
    it = iter(loader)
    got = [next(it).tolist() for _ in range(2)]
    assert got == [[0, 1, 2], [3, 4, 5]]
    # The workers hold prefetch_factor * num_workers batches: the index stream ran ahead ...
    assert len(loader._recorder.sizes) >= 2
    # ... but the position is what the loop received.
    assert loader.state_dict()["consumed"] == 6
    next(it)
    assert loader.sampler.state_dict()["consumed"] == 9
    rest = [b.tolist() for b in it]
    assert rest[-1] == [39]
    assert loader.state_dict()["consumed"] == 40

    # A plain DataLoader over the same sampler would have saved the prefetched position.
    plain_sampler = _sampler(40, shuffle=False)
    plain = iter(DataLoader(ds, batch_size=3, sampler=plain_sampler, num_workers=2, prefetch_factor=2))
    next(plain), next(plain)
    assert plain_sampler.state_dict()["consumed"] > 6


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_at_every_interrupt_point_with_workers(persistent):
    def make():
        return ResumableDataLoader(
            IdDataset(7),
            batch_size=2,
            sampler=_sampler(7, seed=4),
            num_workers=2,
            prefetch_factor=2,
            persistent_workers=persistent,
        )

    # Every point once; with persistent workers (same counting code) the chains of interrupts.
    check_every_interrupt_point(make, tensor_ids, epochs=2, single=not persistent)


def test_batch_drop_last_tail_counts_as_consumed():
    loader = ResumableDataLoader(
        IdDataset(10), batch_size=4, sampler=_sampler(shuffle=False), drop_last=True, num_workers=1
    )
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    state = loader.state_dict()
    assert state["consumed"] == state["epoch_len"] == 10  # complete: the next epoch starts fresh


def test_persistent_workers_across_epochs_and_early_break():
    loader = ResumableDataLoader(
        IdDataset(12),
        batch_size=2,
        sampler=_sampler(12, shuffle=False),
        num_workers=2,
        persistent_workers=True,
        prefetch_factor=3,
    )
    loader.set_epoch(0)
    for i, _ in enumerate(loader):
        if i == 1:
            break  # the loop leaves with prefetched batches in flight
    assert loader.state_dict()["consumed"] == 4
    # Iterating again continues the epoch where the loop stopped.
    assert [b.tolist() for b in loader][0] == [4, 5]
    loader.set_epoch(1)
    assert loader.state_dict()["consumed"] == 0
    assert len([b for b in loader]) == 6
    assert loader.state_dict()["consumed"] == 12


def test_default_sampler_and_registration_of_either_object():
    loader = ResumableDataLoader(IdDataset(8), batch_size=4, shuffle=False)
    assert isinstance(loader.sampler, ResumableDistributedSampler)
    it = iter(loader)
    next(it)
    assert loader.state_dict() == loader.sampler.state_dict()
    other = ResumableDataLoader(IdDataset(8), batch_size=4, shuffle=False)
    other.load_state_dict(roundtrip(loader.state_dict()))
    assert [b.tolist() for b in other] == [[4, 5, 6, 7]]


def test_bad_arguments_are_refused_with_a_clear_message():
    ds = IdDataset(8)
    with pytest.raises(ConfigError, match="in_order"):
        ResumableDataLoader(ds, sampler=_sampler(8), in_order=False)
    with pytest.raises(ConfigError, match="batch_sampler"):
        ResumableDataLoader(ds, batch_sampler=[[0, 1]])
    with pytest.raises(ConfigError, match="not a ResumableSampler"):
        ResumableDataLoader(ds, sampler=list(range(8)))
    with pytest.raises(ConfigError, match="belong to the sampler"):
        ResumableDataLoader(ds, sampler=_sampler(8), shuffle=True)
    shared = _sampler(8)
    ResumableDataLoader(ds, sampler=shared)
    with pytest.raises(ConfigError, match="already driven"):
        ResumableDataLoader(ds, sampler=shared)
