"""NVIDIA DALI on the CPU: a real pipeline fed by DALIExternalSource, resumed exactly."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import IdDataset

from data_harness import check_every_interrupt_point, roundtrip

pytest.importorskip("nvidia.dali")
from nvidia.dali import fn, pipeline_def  # noqa: E402

from cf_ray.data import DALIExternalSource, ResumableDALIIterator, ResumableDistributedSampler  # noqa: E402
from cf_ray.errors import ConfigError  # noqa: E402

BATCH = 3


def _read(i):
    # A sample and its id: the pipeline transforms the sample, the id tells which one it was.
    return np.full((2, 2), i, dtype=np.float32), np.array([i], dtype=np.int64)


def _build(n=11, rank=0, world=1, batch=BATCH, **kw):
    sampler = ResumableDistributedSampler(IdDataset(n), rank=rank, world_size=world, seed=5, **kw)
    source = DALIExternalSource(sampler, _read, batch_size=batch)

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, prefetch_queue_depth=2)
    def pipe():
        x, ids = fn.external_source(source=source, batch=True, num_outputs=2)
        return x * 2.0, ids

    return ResumableDALIIterator(pipe(), source, output_map=["x", "id"])


def _ids(out):
    ids = out[0]["id"].flatten().tolist()
    assert out[0]["x"][:, 0, 0].tolist() == [2.0 * i for i in ids]  # the pipeline ran on them
    return ids


def test_pipeline_yields_the_sampler_order():
    it = _build()
    sampler = ResumableDistributedSampler(IdDataset(11), rank=0, world_size=1, seed=5)
    for epoch in (0, 1):
        it.set_epoch(epoch)
        sampler.set_epoch(epoch)
        assert sum((_ids(o) for o in it), []) == list(sampler)


def test_position_is_what_the_loop_received_not_what_dali_prefetched():
    it = _build(n=20)
    gen = iter(it)
    next(gen)
    # DALI has asked the source for prefetch_queue_depth batches already ...
    assert it.source._cursor > BATCH
    # ... the state counts the one batch the loop has.
    assert it.state_dict()["consumed"] == BATCH
    next(gen)
    assert it.sampler.state_dict()["consumed"] == 2 * BATCH


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_resume_at_every_interrupt_point(world, rank):
    check_every_interrupt_point(lambda: _build(rank=rank, world=world, pad=False), _ids, epochs=2)


def test_abandoned_pass_then_next_epoch():
    it = _build(n=12)
    it.set_epoch(0)
    for k, _ in enumerate(it):
        if k == 0:
            break
    assert it.state_dict()["consumed"] == BATCH
    # Continuing the same epoch restarts DALI at the first unconsumed sample.
    rest = sum((_ids(o) for o in it), [])
    ref = ResumableDistributedSampler(IdDataset(12), rank=0, world_size=1, seed=5)
    assert rest == list(ref)[BATCH:]
    it.set_epoch(1)
    ref.set_epoch(1)
    assert sum((_ids(o) for o in it), []) == list(ref)


def test_elastic_two_to_one_to_two():
    seen = []
    olds = [_build(n=17, rank=r, world=2, pad=False) for r in range(2)]
    for it in olds:
        gen = iter(it)
        seen += _ids(next(gen))
    states = [roundtrip(it.state_dict()) for it in olds]
    one = _build(n=17, rank=0, world=1, pad=False)
    one.load_elastic_state(states, 0, 1)
    gen = iter(one)
    seen += _ids(next(gen))
    states = [roundtrip(one.state_dict())]
    for r in range(2):
        it = _build(n=17, rank=r, world=2, pad=False)
        it.load_elastic_state(states, r, 2)
        seen += sum((_ids(o) for o in it), [])
    assert Counter(seen) == Counter(range(17))


def test_bad_arguments():
    it = _build()
    with pytest.raises(ConfigError, match="auto_reset"):
        ResumableDALIIterator(
            it.pipeline,
            DALIExternalSource(ResumableDistributedSampler(IdDataset(3), rank=0, world_size=1), _read, batch_size=1),
            ["x", "id"],
            auto_reset=True,
        )
    with pytest.raises(ConfigError, match="exceeds the pipeline's batch_size"):
        ResumableDALIIterator(
            it.pipeline,
            DALIExternalSource(ResumableDistributedSampler(IdDataset(3), rank=0, world_size=1), _read, batch_size=9),
            ["x", "id"],
        )
