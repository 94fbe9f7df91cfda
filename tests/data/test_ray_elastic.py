"""Ray Data under cf_ray's own split (elastic_data_config): a real local Ray, the real block-stream
actor, ranks simulated in this process (each its own iterator over its own shard, batch by batch in
lockstep). Every row of an epoch once across world-size changes mid-epoch, and what is refused."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest

from cf_ray.data import DataOrderError, ResumableRayDataIterator, elastic_data_config
from cf_ray.data.ray_elastic import ElasticRayDataIterator
from cf_ray.errors import ConfigError

from data_harness import roundtrip

N, BATCH = 203, 5


def make_ds(n=N, blocks=7, offset=0):
    import ray.data

    ds = ray.data.range(n, override_num_blocks=blocks)
    return ds if not offset else ds.map_batches(lambda b: {"id": b["id"] + offset})


def segment(ds, world, states, batches, *, epoch=0, **cfg):
    """One worker group of ``world`` ranks: load ``states`` (as the engine does), take ``batches``
    per rank (None: to the end), return (ids read, states saved, iterators)."""
    its_cfg = {k: cfg.pop(k) for k in ("id_column", "drop_last") if k in cfg}
    shards = [s["train"] for s in elastic_data_config(**cfg).configure({"train": ds}, world, None, None)]
    its = [ResumableRayDataIterator(sh, batch_size=BATCH, **its_cfg) for sh in shards]
    for r, it in enumerate(its):
        if states is not None:
            if len(states) == world:
                it.load_state_dict(states[r])
                assert roundtrip(it.state_dict()) == states[r]  # what the restore's verification compares
            else:
                it.load_elastic_state(states, r, world)
        it.set_epoch(epoch)
    gens = [iter(it) for it in its]
    seen, live, step = [], set(range(world)), 0
    while live and (batches is None or step < batches):  # lockstep: one batch per rank per step
        for r in sorted(live):
            try:
                seen += next(gens[r])["id"].tolist()
            except StopIteration:
                live.discard(r)
        step += 1
    for g in gens:
        g.close()  # the "crash": nothing after the save reaches the loop
    return seen, [roundtrip(it.state_dict()) for it in its], its


def test_every_row_once_across_world_size_changes_mid_epoch(ray_local, monkeypatch):
    """2 -> 1 -> 2 workers within one epoch (equal=False: every row), then the next epoch is a
    plain epoch of the new world size; at the end the group's actor holds no block."""
    from cf_ray._engine.data import block_stream

    class CountingStream(block_stream.BlockStream):
        """The real actor, plus a count of the block refs it still holds over all passes (a local
        class: Ray ships it to the actor's process by value)."""

        def held(self) -> int:
            with self._lock:
                return sum(sum(e is not None for e in p.entries) for p in self._passes.values())

    monkeypatch.setattr(block_stream, "BlockStream", CountingStream)
    seen, states = [], None
    for world, batches in [(2, 6), (1, 9), (2, None)]:
        got, states, its = segment(make_ds(), world, states, batches, chunk_rows=8, equal=False)
        seen += got
    assert Counter(seen) == Counter(range(N))
    assert all(type(it) is ElasticRayDataIterator and it._complete for it in its)
    for it in its:
        it.set_epoch(1)
    assert Counter(i for it in its for b in it for i in b["id"].tolist()) == Counter(range(N))
    # Every rank ended its passes: the group's actor lets go of every block (done() is sent without
    # waiting for it, and the actor is threaded: poll).
    import time

    import ray

    deadline = time.monotonic() + 30
    while ray.get(its[0].shard.stream.held.remote()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(its[0].shard.stream.held.remote()) == 0


def test_equal_split_and_resumes_with_other_block_boundaries(ray_local):
    # equal=True (the default): every rank as many rows; the remainder (< world size) is dropped.
    # The restarts' pipelines yield other blocks: the same rows in the same order is what counts.
    seen, states, _ = segment(make_ds(), 2, None, 7)
    got, states, _ = segment(make_ds(blocks=3), 2, states, 4)  # the same world size
    seen += got
    got, states, its = segment(make_ds(blocks=11), 3, states, None)
    seen += got
    assert len(seen) == len(set(seen)) and N - len(seen) < 3
    assert len({it.consumed for it in its}) == 1


def test_a_pipeline_that_changed_is_refused(ray_local):
    _, states, _ = segment(make_ds(), 2, None, 3, id_column="id")
    with pytest.raises(DataOrderError, match="not deterministic"):  # other rows where the old ranks stopped
        segment(make_ds(offset=1000), 1, states, 1, id_column="id")
    with pytest.raises(DataOrderError, match="fewer rows than the checkpoint had consumed"):
        segment(make_ds(n=20), 1, states, None, id_column="id")


def test_settings_and_unsupported_arguments_are_refused(ray_local):
    (shard,) = [s["train"] for s in elastic_data_config().configure({"train": make_ds()}, 1, None, None)]
    with pytest.raises(ConfigError, match="local_shuffle_buffer_size is not supported"):
        ResumableRayDataIterator(shard, batch_size=4, local_shuffle_buffer_size=10)
    with pytest.raises(ConfigError, match="collate_fn"):
        ResumableRayDataIterator(shard, batch_size=4, collate_fn=lambda b: b)
    with pytest.raises(ConfigError, match="chunk_rows"):
        elastic_data_config(chunk_rows=0)
    with pytest.raises(TypeError, match="ResumableRayDataIterator"):
        shard.iter_batches()
    it = ResumableRayDataIterator(shard, batch_size=4)
    state = roundtrip(it.state_dict())
    with pytest.raises(ConfigError, match="batch_size"):
        ResumableRayDataIterator(shard, batch_size=5).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"malformed state \(history entry .* has 1 counts for 2 ranks\)"):
        it.load_state_dict(dict(state, history=[{"world_size": 2, "consumed": [1]}]))
    plain = ResumableRayDataIterator(make_ds(), batch_size=4, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="format"):
        plain.load_state_dict(state)  # switching the config between runs is said clearly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = next(iter(ResumableRayDataIterator(shard, batch_size=4, torch_batches=True)))
    assert batch["id"].tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- real TorchTrainer runs

E2E_N, E2E_BATCH, E2E_EPOCHS = 400, 8, 2  # 2 workers: 25 steps per epoch; 1 worker: 50


def elastic_loop(cfg):
    """One segment of a run whose world size changes mid-epoch: it resumes the run, trains, and at
    ``stop_at`` takes a checkpoint on every rank, waits until it is durable, and ends (the group is
    about to be resized); the last segment runs to the end."""
    import json

    import ray.train
    import ray.train.torch
    import torch

    import cf_ray

    torch.manual_seed(0)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    it = ResumableRayDataIterator(ray.train.get_dataset_shard("train"), batch_size=E2E_BATCH, id_column="id")
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    ck = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        data={"train": it},
        config=cf_ray.CheckpointConfig(
            policy=cf_ray.FixedInterval(every=1000),
            storage_path=cfg["storage"],
            run_name="elastic_ray_data",
            register_with_ray=False,
        ),
    )
    resume = ck.restore()
    seg, out = cfg["segment"], cfg["out"]
    if rank == 0:
        with open(f"{out}/resume_{seg}.json", "w") as f:
            json.dump({"world": world, "step": resume.step, "epoch": resume.epoch, "saved": resume.saved_world_size}, f)
    log = open(f"{out}/ids_{seg}_r{rank}.jsonl", "w")
    for epoch in range(resume.epoch, E2E_EPOCHS):
        it.set_epoch(epoch)
        for batch in it:
            model(torch.as_tensor(batch["id"], dtype=torch.float32)[:, None]).sum().backward()
            ck.step(opt)
            opt.zero_grad()
            log.write(json.dumps({"step": ck.step_count, "epoch": epoch, "ids": batch["id"].tolist()}) + "\n")
            log.flush()
            if ck.step_count == cfg["stop_at"]:
                ck.save()
                assert not ck.wait(), "the resize checkpoint did not commit"
                log.close()
                return
        ck.end_epoch()
    log.close()
    ck.finish()


@pytest.mark.slow
def test_ray_data_two_one_two_workers_mid_epoch_reads_every_row_once(ray_cluster, tmp_path):
    """Real TorchTrainer fits on one run: 2 workers to step 5, 1 worker to step 15, 2 workers to the
    end (each change in the middle of epoch 0): every row once per epoch."""
    import glob
    import json
    import sys

    import ray.cloudpickle
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = tmp_path / "out"
    out.mkdir()
    for seg, (workers, stop_at) in enumerate([(2, 5), (1, 15), (2, None)]):
        result = TorchTrainer(
            elastic_loop,
            train_loop_config={"out": str(out), "storage": str(tmp_path / "ckpt"), "segment": seg, "stop_at": stop_at},
            datasets={"train": ray.data.range(E2E_N, override_num_blocks=6)},
            dataset_config=elastic_data_config(),
            # Half a CPU per worker leaves one of the cluster's two CPUs to Ray Data's read tasks.
            scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name=f"seg{seg}", storage_path=str(tmp_path / "ray")),
        ).fit()
        assert result.error is None
    resumes = [json.load(open(out / f"resume_{seg}.json")) for seg in range(3)]
    assert [(r["world"], r["step"], r["saved"]) for r in resumes] == [(2, 0, None), (1, 5, 2), (2, 15, 1)]
    assert all(r["epoch"] == 0 for r in resumes)
    per_epoch = [[] for _ in range(E2E_EPOCHS)]
    for path in glob.glob(str(out / "ids_*.jsonl")):
        for line in open(path):
            rec = json.loads(line)
            per_epoch[rec["epoch"]] += rec["ids"]
    for ids in per_epoch:
        assert Counter(ids) == Counter(range(E2E_N))  # 400 = 80 + 80 + 240 rows in epoch 0, each once
    # The first two fits' block-stream actors are gone with their groups; the last fit's lives as long
    # as Ray keeps that fit's controller and dataset manager (as Ray's own split coordinators do), and
    # holds no block once its ranks ended their passes (checked in process above).
    import ray._private.state

    alive = [a for a in ray._private.state.actors().values() if a["ActorClassName"] == "BlockStream"]
    assert len([a for a in alive if a["State"] != "DEAD"]) <= 1, alive
