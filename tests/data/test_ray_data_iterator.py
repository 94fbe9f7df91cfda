"""ResumableRayDataIterator on a real local Ray (2 CPUs): exact resume of Ray Data shards."""

from __future__ import annotations

import threading

import pytest

from cf_ray.data import DataOrderError, ResumableRayDataIterator, ordered_data_config
from cf_ray.errors import ConfigError, ElasticResumeError

from data_harness import check_every_interrupt_point, roundtrip, run_segments


def _ordered(ds):
    ds.context.execution_options.preserve_order = True
    return ds


def _ids(batch):
    return batch["id"].tolist()


def test_resume_at_every_interrupt_point(ray_local):
    ds = _ordered(ray_local.data.range(7, override_num_blocks=2))
    make = lambda: ResumableRayDataIterator(ds.iterator(), batch_size=4, id_column="id")  # noqa
    check_every_interrupt_point(make, _ids, epochs=2)


def test_resume_inside_a_locally_shuffled_epoch(ray_local):
    ds = _ordered(
        ray_local.data.range(40, override_num_blocks=4).map_batches(lambda b: {"id": b["id"], "y": b["id"] * 2})
    )

    def make():
        return ResumableRayDataIterator(
            ds.iterator(), batch_size=6, id_column="id", seed=3, local_shuffle_buffer_size=12
        )

    expected = run_segments(make, _ids, 2, [])
    assert sorted(sum(expected[:7], [])) == list(range(40))
    assert sum(expected[:7], []) != list(range(40))  # it did shuffle
    assert sum(expected[:7], []) != sum(expected[7:], [])  # differently per epoch
    assert run_segments(make, _ids, 2, [3, 6]) == expected


def _consume_split(its, states, stop_after, epoch=0):
    """Both ranks of a streaming split, each in its own thread as in a Train run."""
    out = [[] for _ in its]

    def rank(r):
        it = its[r]
        if states is not None:
            it.load_state_dict(states[r])
        it.set_epoch(epoch)
        for k, batch in enumerate(it):
            out[r].append(_ids(batch))
            if stop_after is not None and k + 1 == stop_after:
                break

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(its))]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    return out


def test_two_rank_streaming_split_resumes_exactly(ray_local):
    ds = _ordered(ray_local.data.range(43, override_num_blocks=5))

    def split():
        return [
            ResumableRayDataIterator(s, batch_size=5, rank=r, world_size=2, id_column="id")
            for r, s in enumerate(ds.streaming_split(2, equal=True))
        ]

    full = _consume_split(split(), None, None)
    its = split()
    before = _consume_split(its, None, 2)
    states = [roundtrip(it.state_dict()) for it in its]
    after = _consume_split(split(), states, None)  # a restart: new split, new executions
    for r in range(2):
        assert before[r] + after[r] == full[r]
    rows = [i for r in range(2) for b in full[r] for i in b]
    assert len(rows) == len(set(rows)) == 42  # equal=True drops 43 % 2 rows, in every run


def test_nondeterministic_order_is_detected(ray_local):
    ds = _ordered(ray_local.data.range(30, override_num_blocks=3))
    it = ResumableRayDataIterator(ds.iterator(), batch_size=5, id_column="id")
    gen = iter(it)
    next(gen), next(gen)
    state = roundtrip(it.state_dict())
    # The "same" dataset in another order (as an unseeded shuffle would give after a restart).
    other = ds.random_shuffle(seed=1)
    resumed = ResumableRayDataIterator(other.iterator(), batch_size=5, id_column="id")
    resumed.load_state_dict(state)
    with pytest.raises(DataOrderError, match="not deterministic"):
        list(resumed)


def test_elastic_only_at_epoch_boundaries(ray_local):
    ds = _ordered(ray_local.data.range(12, override_num_blocks=2))

    def states(consumed, complete):
        return [
            {
                "format": ResumableRayDataIterator.FORMAT,
                "batch_size": 4,
                "id_column": None,
                "seed": 0,
                "local_shuffle_buffer_size": None,
                "epoch": 3,
                "world_size": 2,
                "rank": r,
                "consumed": c,
                "complete": complete,
                "ids_digest": None,
            }
            for r, c in enumerate(consumed)
        ]

    fresh = lambda: ResumableRayDataIterator(ds.iterator(), batch_size=4, rank=0, world_size=1)  # noqa
    it = fresh()
    it.load_elastic_state(states([6, 6], True), 0, 1)  # the epoch had ended on both ranks
    it.set_epoch(3)
    assert list(it) == []
    it.set_epoch(4)
    assert sum((_ids(b) for b in it), []) == list(range(12))
    it = fresh()
    it.load_elastic_state(states([0, 0], False), 0, 1)  # nothing consumed yet
    assert sum((_ids(b) for b in it), []) == list(range(12))
    with pytest.raises(ElasticResumeError, match="middle of the epoch"):
        fresh().load_elastic_state(states([4, 4], False), 0, 1)


def test_bad_input(ray_local):
    ds = _ordered(ray_local.data.range(12, override_num_blocks=2))
    it = ResumableRayDataIterator(ds.iterator(), batch_size=4)
    next(iter(it))
    state = roundtrip(it.state_dict())
    with pytest.raises(ConfigError, match="batch_size=4 but this ResumableRayDataIterator has batch_size=3"):
        ResumableRayDataIterator(ds.iterator(), batch_size=3).load_state_dict(state)
    with pytest.raises(ConfigError, match="neither a ray.data.DataIterator"):
        ResumableRayDataIterator([1, 2], batch_size=3)
    with pytest.raises(ConfigError, match="local_shuffle_seed"):
        ResumableRayDataIterator(ds.iterator(), batch_size=3, local_shuffle_seed=1)
    assert ordered_data_config()._user_execution_options.preserve_order is True
