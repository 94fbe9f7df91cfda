"""torchdata's StatefulDataLoader registered as it is: exactly once at every interrupt point (its
state through cf_ray's own codec, as a checkpoint stores it), what cf_ray refuses to store or load,
and a changed world size (accepted at epoch boundaries only, refused mid-epoch, said clearly)."""

from __future__ import annotations

import pytest
import torch
from conftest import IdDataset
from torch.utils.data import DistributedSampler

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.sections import parse_index
from cf_ray.data.stateful_loader import StatefulDataLoaderSource, adapt_sources
from cf_ray.errors import ConfigError, ElasticResumeError

from data_harness import check_every_interrupt_point
from storage_helpers import arena_of

sdl = pytest.importorskip("torchdata.stateful_dataloader")

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def codec_rt(state: dict) -> dict:
    """A state as it comes back from a checkpoint: cf_ray's codec (JSON tree + raw tensor bytes)."""
    buf, index = arena_of({"s": state})
    tree, entries = parse_index(index, "test")
    return _codec.unflatten(tree, lambda i, e: _codec.view(buf, e, copy=True), entries)["s"]


class Rank:
    """One rank's loop objects: a StatefulDataLoader (optionally over a DistributedSampler of
    ``world`` replicas) and its cf_ray source."""

    def __init__(self, rank=0, world=1, n=23, batch=3, num_workers=0, sampler="distributed", **kw):
        ds = IdDataset(n)
        self.sampler = None
        if sampler == "distributed":
            self.sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=False)
            kw["sampler"] = self.sampler
        elif sampler == "shuffle":  # torchdata's own stateful RandomSampler, seeded
            kw.update(shuffle=True, generator=torch.Generator().manual_seed(3))
        self.loader = sdl.StatefulDataLoader(ds, batch_size=batch, num_workers=num_workers, **kw)
        self.source = StatefulDataLoaderSource(self.loader, rank=rank, world_size=world)

    def set_epoch(self, epoch):
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        return iter(self.loader)

    def state_dict(self):
        return self.source.state_dict()

    def load_state_dict(self, state):
        self.source.load_state_dict(state)


@pytest.mark.parametrize("sampler", ["distributed", "sequential"])
def test_exactly_once_at_every_interrupt_point(sampler):
    # A finished pass starts the next (torchdata's rule): the engine resumes an end_epoch() state at the next epoch.
    n = check_every_interrupt_point(
        lambda: Rank(sampler=sampler), lambda b: b.tolist(), epochs=2, end_same_epoch=False, rt=codec_rt
    )
    assert n == 2 * (8 + 1)


def test_torchdata_shuffle_resumes_its_epoch_exactly_and_later_epochs_once():
    """torchdata's own shuffle (its RandomSampler with a generator): the interrupted epoch goes on in
    its order; a later epoch is still every sample once, but not the order an uninterrupted run draws
    (torchdata's generator advances differently after a load; torchdata 0.11). A DistributedSampler's
    order is a function of (seed, epoch): bitwise equal, above."""
    ref = Rank(sampler="shuffle")
    expected = [[b.tolist() for b in ref] for _ in range(2)]
    a = Rank(sampler="shuffle")
    it = iter(a)
    first = [next(it).tolist() for _ in range(3)]
    b = Rank(sampler="shuffle")
    b.load_state_dict(codec_rt(a.state_dict()))
    assert first + [x.tolist() for x in b] == expected[0]
    assert sorted(i for x in b for i in x.tolist()) == list(range(23))


def test_exactly_once_with_worker_processes():
    # Worker processes prefetch; torchdata's snapshots follow what the loop received.
    check_every_interrupt_point(
        lambda: Rank(rank=1, world=2, num_workers=2, batch=2),
        lambda b: b.tolist(),
        epochs=2,
        single=False,
        end_same_epoch=False,
        rt=codec_rt,
    )


def test_pending_state_is_reported_without_starting_the_loader():
    a = Rank(num_workers=0)
    it = iter(a)
    next(it), next(it)
    saved = codec_rt(a.state_dict())
    b = Rank(num_workers=0)
    b.load_state_dict(saved)
    assert b.state_dict() is not None and b.loader._iterator is None  # verification did not start a pass
    assert b.state_dict()["loader"]["_num_yielded"] == 2
    assert [x.tolist() for x in b] == [x.tolist() for x in it]


def test_adapt_sources_wraps_only_stateful_loaders():
    r = Rank()
    other = object()
    got = adapt_sources({"loader": r.loader, "other": other}, 1, 2)
    assert isinstance(got["loader"], StatefulDataLoaderSource) and got["loader"].loader is r.loader
    assert (got["loader"].rank, got["loader"].world_size) == (1, 2)
    assert got["other"] is other
    with pytest.raises(ConfigError, match="not a torchdata StatefulDataLoader"):
        StatefulDataLoaderSource(torch.utils.data.DataLoader(IdDataset(3)), rank=0, world_size=1)


class BytesState(IdDataset):
    """A map-style dataset whose state is a pickled blob, as some datasets return."""

    def state_dict(self):
        import pickle

        return {"blob": pickle.dumps({"seen": 3})}

    def load_state_dict(self, state):
        raise AssertionError("never called: cf_ray refuses the state first")


def test_bytes_and_objects_in_a_state_are_refused_with_their_path():
    loader = sdl.StatefulDataLoader(BytesState(6), batch_size=2)
    src = StatefulDataLoaderSource(loader, rank=0, world_size=1)
    next(iter(loader))
    with pytest.raises(ConfigError, match=r"\['dataset_state'\]\['blob'\] is bytes .*pickled object"):
        src.state_dict()
    good = Rank(num_workers=0)
    next(iter(good))
    state = good.state_dict()
    # A checkpoint crafted (or damaged) to carry bytes is refused before torchdata sees it.
    bad = dict(state, loader=dict(state["loader"], dataset_state={"blob": b"\x80\x04..."}))
    with pytest.raises(ConfigError, match="blob"):
        Rank(num_workers=0).load_state_dict(bad)
    with pytest.raises(ConfigError, match="is a object"):
        good.source.validate_state_dict(dict(state, loader={"x": object()}))


def test_other_settings_rank_or_shape_are_refused_before_loading():
    a = Rank(num_workers=0)
    next(iter(a))
    state = codec_rt(a.state_dict())
    with pytest.raises(ConfigError, match="num_workers=2.*num_workers of the run"):
        Rank(num_workers=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="batch_size"):
        Rank(batch=4).load_state_dict(state)
    with pytest.raises(ConfigError, match="belongs to rank 0, this is rank 1"):
        Rank(rank=1, world=2).source.validate_state_dict(dict(state, world_size=2))
    with pytest.raises(ConfigError, match="not a single-process"):
        Rank().load_state_dict(dict(state, loader={"_num_yielded": "two"}))
    with pytest.raises(ConfigError, match="cannot load a state of format"):
        Rank().load_state_dict({"format": "cf_ray.ResumableDistributedSampler/1"})
    fresh = Rank()
    with pytest.raises(ConfigError):
        fresh.load_state_dict(dict(state, loader={"_num_yielded": "two"}))
    assert fresh.loader.next_iter_state is None  # nothing reached the loader


def _states(world, batches, num_workers=0):
    """Every rank's state after ``batches`` batches (None: after the loop ended)."""
    out = []
    for r in range(world):
        rank = Rank(rank=r, world=world, num_workers=num_workers)
        it = iter(rank)
        if batches is None:
            list(it)
        else:
            for _ in range(batches):
                next(it)
        out.append(codec_rt(rank.state_dict()))
    return out


def test_changed_world_size_mid_epoch_is_refused_saying_what_to_do():
    states = _states(2, 2)
    new = Rank(rank=0, world=3)
    with pytest.raises(ElasticResumeError, match=r"saved by 2 \(old ranks had yielded \[2, 2\].*num_workers=2.*"):
        new.source.validate_elastic_state(states, 0, 3)
    with pytest.raises(ElasticResumeError, match="ResumableDataLoader"):
        new.source.load_elastic_state(states, 0, 3)
    assert new.loader.next_iter_state is None


@pytest.mark.parametrize("batches", [0, None], ids=["before the first batch", "after end_epoch"])
def test_changed_world_size_at_an_epoch_boundary_starts_fresh_on_the_new_split(batches):
    states = _states(2, batches)
    seen = []
    for r in range(3):
        rank = Rank(rank=r, world=3)
        rank.source.load_elastic_state(states, r, 3)
        rank.set_epoch(1 if batches is None else 0)
        seen += [i for b in rank for i in b.tolist()]
    assert sorted(set(seen)) == list(range(23))  # the new world size's split of a whole epoch
    same = Rank(rank=1, world=2)
    same.source.load_elastic_state(states, 1, 2)  # same world size: the rank's own state
    assert same.source.state_dict() == states[1]


# --------------------------------------------------------------------------- a real TorchTrainer run

N, EPOCHS, BATCH, WORKERS = 1000, 2, 16, 2  # 500 samples per rank (no padding): 32 steps per epoch


def sdl_loop(config):
    """2 workers, a StatefulDataLoader (one worker process, prefetching) over a DistributedSampler,
    registered as it is; a SIGKILL of rank 1 mid-epoch 0."""
    import json
    import os
    import signal

    import ray.train
    import ray.train.torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    import cf_ray

    torch.manual_seed(0)
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    dataset = torch.utils.data.TensorDataset(
        torch.arange(N), torch.randn(N, 4, generator=torch.Generator().manual_seed(1))
    )
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=1, prefetch_factor=4)
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        data={"loader": loader},
        config=cf_ray.CheckpointConfig(policy=cf_ray.FixedInterval(every=config["every"])),
    )
    resume = ckpt.restore()
    out, gen = config["out"], resume.generation
    with open(f"{out}/resume_r{rank}_g{gen}.json", "w") as f:
        json.dump({"step": resume.step, "epoch": resume.epoch, "source": resume.source}, f)
    log = open(f"{out}/ids_r{rank}_g{gen}.jsonl", "w")
    for epoch in range(resume.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch_ids, x in loader:
            model(x).sum().backward()
            ckpt.step(opt)
            opt.zero_grad()
            log.write(json.dumps({"step": ckpt.step_count, "epoch": epoch, "ids": batch_ids.tolist()}) + "\n")
            log.flush()
            fail_step, fail_rank = config["failure"]
            if ckpt.step_count == fail_step and rank == fail_rank and not os.path.exists(f"{out}/failed"):
                open(f"{out}/failed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.end_epoch()
    log.close()
    ckpt.finish()


def _failure_free(rank):
    """What rank ``rank`` trains, step by step, in a run without failures: the same sampler and
    loader, iterated here (no Ray, no checkpoint)."""
    dataset = torch.utils.data.TensorDataset(torch.arange(N), torch.zeros(N, 1))
    sampler = DistributedSampler(dataset, num_replicas=WORKERS, rank=rank, shuffle=True, seed=7)
    loader = sdl.StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler)
    steps = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        steps += [(epoch, ids.tolist()) for ids, _ in loader]
    return steps


@pytest.mark.slow
def test_stateful_dataloader_exactly_once_after_a_sigkill(ray_cluster, tmp_path):
    import json
    import os
    import random
    import sys
    from collections import Counter

    import ray.cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from test_e2e_data import _effective

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = tmp_path / "out"
    out.mkdir()
    failure = (random.Random(27).randrange(5, 28), 1)  # mid-epoch 0, between checkpoints (every 6)
    TorchTrainer(
        sdl_loop,
        train_loop_config={"out": str(out), "failure": failure, "every": 6},
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(
            name="sdl", storage_path=str(tmp_path / "storage"), failure_config=FailureConfig(max_failures=1)
        ),
    ).fit()
    assert (out / "failed").exists()
    resumes = [json.load(open(out / n)) for n in os.listdir(out) if n.startswith("resume_r0_")]
    assert len(resumes) == 2 and sum(r["source"] != "fresh" for r in resumes) == 1  # resumed from a checkpoint
    for rank in range(WORKERS):
        got, gens = _effective(str(out), rank)
        assert len(gens) == 2
        assert got == _failure_free(rank)  # same batches, same order, same epochs as a run without failures
    for epoch in range(EPOCHS):
        ids = [i for rank in range(WORKERS) for e, b in _effective(str(out), rank)[0] if e == epoch for i in b]
        assert Counter(ids) == Counter(range(N))  # every sample exactly once per epoch
