"""What cf_ray's elastic Ray Data split costs, side by side with plain Ray Data iteration.

    python -m benchmarks.ray_data_split --smoke      # seconds: checks that it runs
    python -m benchmarks.ray_data_split              # the figures (a quiet 2+ core machine, ~2-4 min)

Each rank is a Ray actor (as Ray Train's workers are) reading one epoch of the same dataset
(``ray.data.range`` plus a float32 payload column made by ``map_batches``; ``preserve_order`` in
every variant) in numpy batches and doing nothing else. Variants:

* ``ray``: Ray Train's split, ``streaming_split(W, equal=True)`` + ``iter_batches`` (what
  ``TorchTrainer(datasets=...)`` gives a worker);
* ``cf_ray chunk=batch``: ``elastic_data_config()`` (chunks of one batch: the default);
* ``cf_ray chunk=block``: ``elastic_data_config(chunk_rows=rows per block)``.

Printed per variant: seconds for the epoch (the slowest rank; each variant's start included: Ray's
split coordinator actor, cf_ray's stream actor, the pipeline's first tasks), rows/s, seconds to
the first batch.
Then the resume: the epoch is read to its middle, and a new group resumes there; the figure is the
seconds from the new group's start to its first batch and to the end of the epoch:

* ``ray, same W``: ``ResumableRayDataIterator`` over Ray's split at the same world size (re-reads
  and drops the consumed rows);
* ``cf_ray, same W`` and ``cf_ray, W -> W-1`` (elastic; Ray's split cannot do this mid-epoch).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import ray

PRESETS = {
    "smoke": {"rows": 4_000, "blocks": 8, "width": 8, "batch": 100, "world": 2},
    "default": {"rows": 2_000_000, "blocks": 64, "width": 64, "batch": 512, "world": 2},
}


def dataset(p: dict) -> Any:
    import ray.data

    width = p["width"]
    ds = ray.data.range(p["rows"], override_num_blocks=p["blocks"])
    return ds.map_batches(lambda b: {"id": b["id"], "x": np.ones((len(b["id"]), width), np.float32)})


@ray.remote(num_cpus=0)
class Rank:
    """One worker: reads batches of its shard and times them."""

    def read(self, shard: Any, kind: str, batch: int, rank: int, world: int, state=None, states=None, stop=None):
        from cf_ray.data import ResumableRayDataIterator

        t0 = time.perf_counter()
        if kind == "ray":
            it = shard.iter_batches(batch_size=batch, batch_format="numpy")
            obj = None
        else:
            obj = ResumableRayDataIterator(shard, batch_size=batch, rank=rank, world_size=world)
            if state is not None:
                obj.load_state_dict(state)
            elif states is not None:
                obj.load_elastic_state(states, obj.rank, obj.world_size)
            it = iter(obj)
        first, rows, n = None, 0, 0
        for b in it:
            if first is None:
                first = time.perf_counter() - t0
            rows += len(b["id"])
            n += 1
            if stop is not None and n == stop:
                break
        return {
            "first": first or 0.0,
            "total": time.perf_counter() - t0,
            "rows": rows,
            "state": obj.state_dict() if obj is not None else None,
        }


def _shards(p: dict, kind: str, world: int, chunk: int | None) -> list[Any]:
    from ray.train import DataConfig

    from cf_ray.data import elastic_data_config, ordered_data_config

    cfg: DataConfig = elastic_data_config(chunk_rows=chunk) if kind == "cf_ray" else ordered_data_config()
    return [d["train"] for d in cfg.configure({"train": dataset(p)}, world, None, None)]


def run_group(p: dict, ranks: list, kind: str, world: int, chunk: int | None = None, **kw) -> list[dict]:
    shards = _shards(p, "cf_ray" if kind.startswith("cf_ray") else "ray", world, chunk)
    refs = []
    for r in range(world):
        extra = dict(kw)
        if "states" in extra and extra["states"] is not None and len(extra["states"]) == world:
            extra["state"], extra["states"] = extra["states"][r], None
        mode = "cf_ray" if kind.startswith("cf_ray") else kind
        refs.append(ranks[r].read.remote(shards[r], mode, p["batch"], r, world, **extra))
    return ray.get(refs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = ap.parse_args(argv)
    p = PRESETS["smoke" if args.smoke else "default"]
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    world = p["world"]
    ranks = [Rank.remote() for _ in range(world)]
    run_group(p, ranks, "cf_ray", world, stop=1)  # warm: imports in the actors, first tasks
    block_rows = p["rows"] // p["blocks"]
    print(
        f"Ray Data split: {p['rows']:,} rows x {p['width']} float32, {p['blocks']} blocks, batch {p['batch']}, "
        f"{world} ranks (Ray actors), numpy batches"
    )
    print(f"{'variant':<26}{'epoch s':>10}{'rows/s':>14}{'first batch s':>16}")
    variants = [
        ("ray (streaming_split)", "ray", None),
        ("cf_ray chunk=batch", "cf_ray", None),
        (f"cf_ray chunk=block ({block_rows})", "cf_ray", block_rows),
    ]
    for name, kind, chunk in variants:
        t0 = time.perf_counter()
        res = run_group(p, ranks, kind, world, chunk)
        wall = time.perf_counter() - t0
        rows = sum(r["rows"] for r in res)
        print(f"{name:<26}{wall:>10.2f}{rows / wall:>14,.0f}{max(r['first'] for r in res):>16.2f}")
    half = p["rows"] // world // p["batch"] // 2
    print(f"\nresume at the middle of the epoch ({half} batches per rank read first)")
    print(f"{'variant':<26}{'first batch s':>16}{'rest of epoch s':>18}")
    for name, kind, new_world in [
        ("ray, same W", "plain", world),
        ("cf_ray, same W", "cf_ray", world),
        (f"cf_ray, W -> {max(world - 1, 1)}", "cf_ray", max(world - 1, 1)),
    ]:
        first = run_group(p, ranks, kind, world, stop=half)
        states = [r["state"] for r in first]
        t0 = time.perf_counter()
        res = run_group(p, ranks, kind, new_world, states=states)
        wall = time.perf_counter() - t0
        print(f"{name:<26}{max(r['first'] for r in res):>16.2f}{wall:>18.2f}")


if __name__ == "__main__":
    main()
