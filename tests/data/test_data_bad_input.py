"""Bad input gives a clear error that says what to change, never a silently wrong order."""

from __future__ import annotations

import pytest
from conftest import IdDataset

import cf_ray.data as cfd
from cf_ray.data import ResumableDistributedSampler, ShardedDataset
from cf_ray.errors import ConfigError

from data_harness import roundtrip


def _saved(**kw):
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    s = ResumableDistributedSampler(IdDataset(kw.pop("n", 10)), **kw)
    it = iter(s)
    next(it), next(it)
    return roundtrip(s.state_dict())


def test_public_names_import():
    for name in cfd.__all__:
        assert getattr(cfd, name) is not None


def test_state_of_another_dataset_length():
    state = _saved(n=10)
    with pytest.raises(ConfigError) as e:
        ResumableDistributedSampler(IdDataset(12), rank=0, world_size=1).load_state_dict(state)
    msg = str(e.value)
    assert "dataset_len=10" in msg and "dataset_len=12" in msg
    assert "same dataset" in msg and "fresh run" in msg
    assert isinstance(e.value, ValueError)


def test_state_of_another_seed_or_shuffle():
    state = _saved(seed=1)
    with pytest.raises(
        ConfigError,
        match="seed=1 but this ResumableDistributedSampler has seed=2; .*Build ResumableDistributedSampler with seed=1",
    ):
        ResumableDistributedSampler(IdDataset(10), rank=0, world_size=1, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="shuffle=True but .* shuffle=False"):
        ResumableDistributedSampler(IdDataset(10), rank=0, world_size=1, seed=1, shuffle=False).load_state_dict(state)


def test_state_of_another_source_rank_or_malformed():
    state = _saved()
    ds = ShardedDataset(10, lambda ids: list(ids), rank=0, world_size=1)
    with pytest.raises(ConfigError, match="format 'cf_ray.ResumableDistributedSampler/1'"):
        ds.load_state_dict(state)
    other_rank = ResumableDistributedSampler(IdDataset(10), rank=1, world_size=2)
    with pytest.raises(ConfigError, match="belongs to rank 0"):
        other_rank.load_state_dict(dict(state, world_size=2))
    s = ResumableDistributedSampler(IdDataset(10), rank=0, world_size=1)
    with pytest.raises(ConfigError, match="malformed state"):
        s.load_state_dict(dict(state, consumed="2"))
    with pytest.raises(ConfigError, match=r"malformed state \(history entry .* has 1 counts for 2 ranks\)"):
        s.load_state_dict(dict(state, history=[{"world_size": 2, "consumed": [1]}]))
    with pytest.raises(ConfigError, match="computes 10"):
        s.load_state_dict(dict(state, consumed=11, epoch_len=11))
    with pytest.raises(ConfigError, match="expects a dict"):
        s.load_state_dict([1, 2])
    # A failed load leaves the sampler as it was.
    assert s.state_dict()["consumed"] == 0 and s.epoch == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rank": 2, "world_size": 2}, "rank=2 must be smaller than world_size=2"),
        ({"rank": 0, "world_size": 0}, "world_size=0 must be an int >= 1"),
        ({"rank": 0, "world_size": 1, "seed": -1}, "seed=-1 must be an int >= 0"),
        ({"rank": 0, "world_size": 1, "shuffle": "yes"}, "shuffle='yes' must be True or False"),
        ({"rank": 0, "world_size": 1, "pad": 1}, "pad=1 must be True, False or None"),
    ],
)
def test_constructor_arguments_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ResumableDistributedSampler(IdDataset(5), **kwargs)


def test_dataset_without_length():
    with pytest.raises(ConfigError, match="has no len"):
        ResumableDistributedSampler(iter(range(3)), rank=0, world_size=1)


def test_pad_with_drop_last_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match="pad is ignored"):
        ResumableDistributedSampler(IdDataset(5), rank=0, world_size=1, drop_last=True, pad=True)


def test_defaults_follow_torch_distributed_else_single_worker():
    s = ResumableDistributedSampler(IdDataset(5))
    assert (s.rank, s.world_size) == (0, 1)


def test_every_source_meets_the_engine_protocols(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cf_ray.data import (
        ElasticStateful,
        ResumableDALIIterator,
        ResumableDataLoader,
        ResumableParquetReader,
        ResumableRayDataIterator,
        Stateful,
    )

    pq.write_table(pa.table({"id": [1, 2]}), str(tmp_path / "a.parquet"))
    sampler = ResumableDistributedSampler(IdDataset(4), rank=0, world_size=1)
    objects = [
        sampler,
        ResumableDataLoader(IdDataset(4), sampler=sampler),
        ShardedDataset(4, lambda ids: list(ids), rank=0, world_size=1),
        ResumableParquetReader(str(tmp_path / "a.parquet"), batch_size=1),
    ]
    for obj in objects:
        assert isinstance(obj, Stateful) and isinstance(obj, ElasticStateful)
        assert callable(obj.set_epoch)
    for cls in (ResumableRayDataIterator, ResumableDALIIterator):
        assert all(
            callable(getattr(cls, m)) for m in ("state_dict", "load_state_dict", "load_elastic_state", "set_epoch")
        )
    assert not isinstance(object(), Stateful)
