"""Exactly-once, resumable data with cf_ray.data: one short example per source.

Each example does what a failure does to a run: train a few steps, save the data state (the
engine does it for you inside ``cf_ray.Checkpointer``), throw everything away, rebuild, load the
state and continue. The ids seen must equal those of an uninterrupted run.

Run on a CPU in a few seconds (the Ray Data part starts a local 2-CPU Ray)::

    python examples/data_sources.py                 # every source
    python examples/data_sources.py sampler parquet # some of them

Inside ``train_loop_per_worker`` you do not call ``state_dict``/``load_state_dict`` yourself::

    ckpt = cf_ray.Checkpointer({"model": model, "optimizer": opt}, data={"sampler": sampler})
    resume = ckpt.restore()
    for epoch in range(resume.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...
            ckpt.step(opt)
        ckpt.end_epoch()
"""

from __future__ import annotations

import json
import sys
import tempfile

import numpy as np
import torch

from cf_ray.data import (
    DALIExternalSource,
    ResumableDALIIterator,
    ResumableDataLoader,
    ResumableDistributedSampler,
    ResumableParquetReader,
    ResumableRayDataIterator,
    ShardedDataset,
)


def checkpoint(state: dict) -> dict:
    """What a checkpoint does to a state: JSON out, JSON in."""
    return json.loads(json.dumps(state))


class Ids(torch.utils.data.Dataset):
    """Item i is the id i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


# --------------------------------------------------------------------------------------------------
def sampler_example():
    """A map-style dataset with a plain DataLoader (num_workers=0)."""
    dataset = Ids(100)

    def build():
        sampler = ResumableDistributedSampler(
            dataset, rank=0, world_size=2, shuffle=True, seed=0, pad=False
        )  # pad=False: every item exactly once
        return sampler, torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)

    sampler, loader = build()
    sampler.set_epoch(3)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(2)]
    state = checkpoint(sampler.state_dict())  # {"epoch": 3, "consumed": 16, ...}

    sampler, loader = build()  # a restarted worker
    sampler.load_state_dict(state)
    sampler.set_epoch(3)  # keeps the restored position
    seen += [b.tolist() for b in loader]

    reference, ref_loader = build()
    reference.set_epoch(3)
    assert seen == [b.tolist() for b in ref_loader]
    print(f"sampler:    resumed epoch 3 at item {state['consumed']}; same order as no failure")


# --------------------------------------------------------------------------------------------------
def loader_example():
    """Worker processes and prefetching: the position is what the loop received."""
    dataset = Ids(100)

    def build():
        sampler = ResumableDistributedSampler(dataset, rank=0, world_size=1, seed=1)
        return ResumableDataLoader(
            dataset, batch_size=10, sampler=sampler, num_workers=2, prefetch_factor=2, persistent_workers=True
        )

    loader = build()
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    state = checkpoint(loader.state_dict())
    assert state["consumed"] == 30  # the workers had read further ahead
    del it, loader

    loader = build()
    loader.load_state_dict(state)
    seen += [b.tolist() for b in loader]
    assert sorted(sum(seen, [])) == list(range(100))
    print("loader:     2 workers, prefetch 2: saved 30 consumed items, resumed exactly there")


# --------------------------------------------------------------------------------------------------
def sharded_example():
    """A dataset too large for one worker: each rank loads only its shard; elastic 2 -> 3 ranks."""

    def load(ids):  # e.g. read these records from storage
        return [{"id": i, "x": float(i)} for i in ids]

    old = [ShardedDataset(60, load, rank=r, world_size=2, seed=0) for r in range(2)]
    seen = []
    for ds in old:
        loader = ResumableDataLoader(ds, batch_size=5, sampler=ds.sampler)
        it = iter(loader)
        seen += [i for _ in range(3) for i in next(it)["id"].tolist()]
    states = [checkpoint(ds.state_dict()) for ds in old]

    for r in range(3):  # the run comes back with 3 workers
        ds = ShardedDataset(60, load, rank=r, world_size=3, seed=0)
        ds.load_elastic_state(states, r, 3)  # the engine calls this for you
        loader = ResumableDataLoader(ds, batch_size=5, sampler=ds.sampler)
        seen += [i for b in loader for i in b["id"].tolist()]
    assert sorted(seen) == list(range(60))
    print(f"sharded:    ranks held {[len(d) for d in old]} items each; 2 -> 3 workers mid-epoch, every item once")


# --------------------------------------------------------------------------------------------------
def parquet_example():
    """Parquet through pyarrow: row-level resume that skips the row groups already consumed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tempfile.mkdtemp()
    for f in range(3):
        ids = list(range(f * 40, (f + 1) * 40))
        pq.write_table(pa.table({"id": ids, "x": [i / 10 for i in ids]}), f"{root}/part-{f}.parquet", row_group_size=16)

    def build():
        return ResumableParquetReader(root, batch_size=25, columns=["id", "x"], shuffle=True, seed=0)

    reader = build()
    reader.set_epoch(1)
    it = iter(reader)
    seen = [next(it)["id"].to_pylist() for _ in range(2)]
    state = checkpoint(reader.state_dict())

    reader = build()
    reader.load_state_dict(state)
    seen += [t["id"].to_pylist() for t in reader]
    reference = build()
    reference.set_epoch(1)
    assert seen == [t["id"].to_pylist() for t in reference]
    print(f"parquet:    resumed at row {state['consumed']} of {reader.num_rows}")


# --------------------------------------------------------------------------------------------------
def ray_data_example():
    """Ray Data shards (here a whole dataset; in Train: ray.train.get_dataset_shard("train"))."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.range(200, override_num_blocks=4).map_batches(lambda b: {"id": b["id"], "y": b["id"] % 7})
        # Deterministic order is what makes skip-on-resume exact. In a TorchTrainer use
        # TorchTrainer(..., dataset_config=cf_ray.data.ordered_data_config()).
        ds.context.execution_options.preserve_order = True

        def build():
            return ResumableRayDataIterator(ds.iterator(), batch_size=32, id_column="id")

        it = build()
        gen = iter(it)
        seen = [next(gen)["id"].tolist() for _ in range(3)]
        state = checkpoint(it.state_dict())  # rows consumed + a digest of their ids
        gen.close()  # the "failure"

        it = build()
        it.load_state_dict(state)
        seen += [b["id"].tolist() for b in it]  # the digest is checked on resume
        assert sum(seen, []) == list(range(200))
        print(f"ray data:   resumed after {state['consumed']} rows, order verified by id digest")
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------------------------------
def dali_example():
    """NVIDIA DALI through an external source (a CPU pipeline here: device_id=None)."""
    try:
        from nvidia.dali import fn, pipeline_def
    except ImportError:
        print("dali:       skipped (pip install 'cf-ray[dali]')")
        return
    images = np.arange(50 * 4, dtype=np.float32).reshape(50, 2, 2)

    def build():
        sampler = ResumableDistributedSampler(Ids(50), rank=0, world_size=1, seed=0)
        source = DALIExternalSource(sampler, lambda i: (images[i], np.array([i])), batch_size=8)

        @pipeline_def(batch_size=8, num_threads=1, device_id=None)
        def pipe():
            image, label = fn.external_source(source=source, batch=True, num_outputs=2)
            return image * 2, label

        return ResumableDALIIterator(pipe(), source, output_map=["image", "id"])

    it = build()
    gen = iter(it)
    seen = [next(gen)[0]["id"].flatten().tolist() for _ in range(2)]
    state = checkpoint(it.state_dict())  # 16, although DALI prefetched more

    it = build()
    it.load_state_dict(state)
    seen += [out[0]["id"].flatten().tolist() for out in it]
    assert sorted(sum(seen, [])) == list(range(50))
    print(f"dali:       resumed at sample {state['consumed']}; DALI's prefetch was not counted")


EXAMPLES = {
    "sampler": sampler_example,
    "loader": loader_example,
    "sharded": sharded_example,
    "parquet": parquet_example,
    "ray_data": ray_data_example,
    "dali": dali_example,
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        sys.exit(f"unknown example(s) {unknown}; choose from {list(EXAMPLES)}")
    for name in names:
        EXAMPLES[name]()
