"""Elastic resume: the unconsumed part of the epoch is re-split over a new number of ranks, the
epoch still sees every item exactly once, and later epochs follow the new world size.

Ranks are simulated in one process: each rank is its own object, as in a real run."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import IdDataset

from cf_ray.data import ResumableDistributedSampler, ResumableParquetReader
from cf_ray.errors import ElasticResumeError

from data_harness import roundtrip


def run_schedule(make, ids_of, schedule, epoch=0):
    """Run one epoch through ``schedule``: a list of ``(world_size, steps)`` where ``steps`` is
    the number of batches each rank takes (an int, a per-rank list, or None for "to the end").
    Between entries every rank saves, the next world size is built and loads the old states the
    way the engine does. Returns the ids seen and the last ranks' objects."""
    seen, states = [], None
    for world, steps in schedule:
        objs = [make(r, world) for r in range(world)]
        for r, obj in enumerate(objs):
            if states is not None:
                if len(states) == world:
                    obj.load_state_dict(states[r])
                else:
                    obj.load_elastic_state(states, r, world)
            obj.set_epoch(epoch)
        its = [iter(obj) for obj in objs]
        for r, it in enumerate(its):
            n = steps[r] if isinstance(steps, list) else steps
            for _ in range(10**9 if n is None else n):
                try:
                    seen += ids_of(next(it))
                except StopIteration:
                    break
        states = [roundtrip(obj.state_dict()) for obj in objs]
    return seen, objs


class SamplerSource:
    """A rank's sampler iterated in batches (as a DataLoader with num_workers=0 would)."""

    def __init__(self, rank, world, n=23, batch=3, **kw):
        self.sampler = ResumableDistributedSampler(IdDataset(n), rank=rank, world_size=world, seed=11, **kw)
        self.batch = batch

    def __iter__(self):
        it = iter(self.sampler)
        while True:
            chunk = [i for _, i in zip(range(self.batch), it)]
            if not chunk:
                return
            yield chunk

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def _list(x):
    return list(x)


SCHEDULES = {
    "2->1->2": [(2, 2), (1, 3), (2, None)],
    "1->2": [(1, 2), (2, None)],
    "2->3": [(2, 2), (3, None)],
    "3->2->3->1": [(3, 1), (2, 1), (3, 1), (1, None)],
    "uneven 2->3": [(2, [3, 2]), (3, None)],
    "right after a rank ran out": [(2, [4, 3]), (1, None)],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_sampler_exactly_once_across_world_size_changes(name):
    make = lambda r, w: SamplerSource(r, w, pad=False)  # noqa: E731
    seen, last = run_schedule(make, _list, SCHEDULES[name], epoch=4)
    assert Counter(seen) == Counter(range(23))
    # The next epoch is a plain epoch of the new world size.
    world = len(last)
    for r, src in enumerate(last):
        src.set_epoch(5)
        fresh = ResumableDistributedSampler(IdDataset(23), rank=r, world_size=world, seed=11, pad=False)
        fresh.set_epoch(5)
        assert list(src.sampler) == list(fresh)


def test_sampler_elastic_keeps_drop_last_and_pad_semantics():
    # drop_last: the tail dropped by the first world size stays dropped; the rest exactly once.
    make = lambda r, w: SamplerSource(r, w, drop_last=True)  # noqa: E731
    seen, _ = run_schedule(make, _list, [(2, 1), (3, None)])
    ref = ResumableDistributedSampler(IdDataset(23), rank=0, world_size=2, seed=11, drop_last=True)
    ref2 = ResumableDistributedSampler(IdDataset(23), rank=1, world_size=2, seed=11, drop_last=True)
    assert Counter(seen) == Counter(list(ref) + list(ref2))
    # pad (torch's default): every rank still gets the same count after the re-split.
    make = lambda r, w: SamplerSource(r, w)  # noqa: E731
    seen, last = run_schedule(make, _list, [(2, 1), (3, 0)])
    assert len({len(src.sampler) for src in last}) == 1
    assert set(range(23)) <= set(seen + [i for src in last for i in src.sampler])


def test_sampler_elastic_at_epoch_boundaries():
    make = lambda r, w: SamplerSource(r, w, pad=False)  # noqa: E731
    # Saved before anything was consumed: the epoch runs as a fresh epoch of the new size.
    seen, last = run_schedule(make, _list, [(2, 0), (3, 0)])
    for r, src in enumerate(last):
        fresh = ResumableDistributedSampler(IdDataset(23), rank=r, world_size=3, seed=11, pad=False)
        assert list(src.sampler) == list(fresh)
    # Saved at the end of the epoch: nothing of it is replayed on the new size.
    seen, last = run_schedule(make, _list, [(2, None), (3, None)])
    assert Counter(seen) == Counter(range(23))


def test_elastic_refuses_inconsistent_states():
    states = []
    for r in range(2):
        s = ResumableDistributedSampler(IdDataset(23), rank=r, world_size=2, seed=11)
        states.append(roundtrip(s.state_dict()))
    new = ResumableDistributedSampler(IdDataset(23), rank=0, world_size=3, seed=11)
    with pytest.raises(ElasticResumeError, match="every old rank"):
        new.load_elastic_state(states[:1], 0, 3)  # only one of two old ranks
    bad = [states[0], dict(states[1], epoch=3)]
    with pytest.raises(ElasticResumeError, match="disagree on 'epoch'"):
        new.load_elastic_state(bad, 0, 3)
    with pytest.raises(ElasticResumeError, match="load_elastic_state"):
        new.load_state_dict(states[0])


# --------------------------------------------------------------------------- Parquet


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic_pq")
    paths = []
    for f, (lo, hi) in enumerate([(0, 17), (17, 31)]):
        path = str(root / f"part-{f}.parquet")
        pq.write_table(pa.table({"id": list(range(lo, hi))}), path, row_group_size=5)
        paths.append(path)
    return paths


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("shuffle", [False, True])
def test_parquet_exactly_once_across_world_size_changes(parquet_files, name, shuffle):
    def make(r, w):
        return ResumableParquetReader(parquet_files, batch_size=3, rank=r, world_size=w, shuffle=shuffle, seed=2)

    ids = lambda t: t["id"].to_pylist()  # noqa: E731
    seen, last = run_schedule(make, ids, SCHEDULES[name], epoch=1)
    assert Counter(seen) == Counter(range(31))
    world = len(last)
    nxt = []
    for r, reader in enumerate(last):
        reader.set_epoch(2)
        fresh = make(r, world)
        fresh.set_epoch(2)
        got = [ids(t) for t in reader]
        assert got == [ids(t) for t in fresh]
        nxt += sum(got, [])
    assert Counter(nxt) == Counter(range(31))
