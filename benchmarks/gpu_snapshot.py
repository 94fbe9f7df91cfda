"""The CUDA path of phase 1 (#14), on a machine with a GPU: a model's state copied by DMA into the
holder's pinned shared-memory slot on the device's side stream while training goes on, against a
plain ``.cpu()`` of the same state. Prints its figures.

    python benchmarks/gpu_snapshot.py [--width 4096 --layers 12 --batch 256]

It needs torch with CUDA, and cf_ray's snapshotter and slots, which use no Ray: where Ray is not
installed (the lent GPU machines have none), a stand-in module takes its place, as the hand-off to a
holder actor is replaced here by an in-process one. Measured on an H100 (2026-11-25): see
docs/benchmarks/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import types


def _without_ray() -> None:
    """Import cf_ray's engine modules where Ray is not installed (they need it only to talk to actors)."""
    if importlib.util.find_spec("ray") is not None:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pkg = types.ModuleType("cf_ray")
    pkg.__path__ = [os.path.join(root, "cf_ray")]  # skip cf_ray/__init__ (it checks Ray's version)
    sys.modules["cf_ray"] = pkg
    ray = types.ModuleType("ray")
    ray.__path__ = []
    exceptions = types.ModuleType("ray.exceptions")
    exceptions.RayActorError = RuntimeError  # type: ignore[attr-defined]
    ray.exceptions = exceptions  # type: ignore[attr-defined]
    sys.modules.update({"ray": ray, "ray.exceptions": exceptions})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--checkpoints", type=int, default=4)
    args = p.parse_args(argv)
    _without_ray()
    import torch

    from cf_ray._engine.format import blocks as _blocks
    from cf_ray._engine.node.slot_store import SlotStore
    from cf_ray._engine.worker.snapshot import copy_engine
    from cf_ray._engine.worker.snapshot.snapshotter import Snapshotter

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device="cuda")
    store = SlotStore("gpu-bench")  # the holder's slots, in process
    handed: dict = {}
    snap = Snapshotter(0, lambda _job, sections: handed.update(sections), arena_source=store.arena)

    def guarded(t) -> bool:
        ptrs = {q.data_ptr() for q in model.parameters()}
        ptrs |= {v.data_ptr() for st in opt.state.values() for v in st.values() if v.dim() > 0}
        return t.data_ptr() in ptrs

    def step() -> None:
        model(x).square().mean().backward()
        snap.wait_copy()  # the weight-update guard
        opt.step()
        opt.zero_grad()

    def sections() -> dict:
        return {"s": {"model": model.state_dict(), "opt": opt.state_dict()}}

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    step()
    state = 3 * sum(q.numel() * q.element_size() for q in model.parameters())  # weights + Adam's two moments
    timed(3)
    it = timed(10) / 10
    print(f"{torch.cuda.get_device_name()}: state {state / 1e9:.2f} GB (model + Adam), iteration {it * 1e3:.1f} ms")
    t = time.perf_counter()
    snap.prepare(sections())
    snap.wait_done()
    print(
        f"prepare (ahead of the first checkpoint: both slots allocated, faulted in, registered): {time.perf_counter() - t:.2f} s"
    )
    for k in range(args.checkpoints):
        t0 = time.perf_counter()
        begin = snap.begin(k + 1, sections(), guarded, {})
        timed(10)  # 10 iterations with the copy in flight
        with_ckpt = time.perf_counter() - t0
        snap.wait_done()
        tm = snap.last_timings
        arena = snap.arenas.of("s")
        assert arena is not None
        pinned = arena.tensor.is_pinned()
        # The CRCs the threads took are those one thread reading the sealed slot finds.
        _, index_crcs = _blocks.split_blocks(handed["s"].index)
        same = index_crcs is not None and list(index_crcs) == _blocks.block_crcs(arena.numpy())
        print(
            f"checkpoint {k + 1}: training thread {begin * 1e3:.1f} ms; DMA into the pinned slot "
            f"{tm['copy_s'] * 1e3:.0f} ms = {state / tm['copy_s'] / 1e9:.1f} GB/s (pinned: {pinned}); "
            f"copied {tm['copied_bytes'] / state:.2f}x the state, read again to checksum "
            f"{tm.get('crc_read_bytes', 0) / state:.2f}x (after the guard) in {tm.get('crc_dma_s', 0) * 1e3:.0f} ms "
            f"on {copy_engine.crc_threads()} threads (the index's CRCs are one thread's: {same}); 10 iterations with it "
            f"{with_ckpt * 1e3:.0f} ms vs {10 * it * 1e3:.0f} ms without"
        )
    torch.cuda.synchronize()
    t = time.perf_counter()
    _ = {k: v.cpu() for k, v in model.state_dict().items()}
    _ = [v.cpu() for st in opt.state.values() for v in st.values() if v.dim() > 0]
    torch.cuda.synchronize()
    plain = time.perf_counter() - t
    print(
        f"plain .cpu() of the same state (pageable, on the training thread): {plain * 1e3:.0f} ms = {state / plain / 1e9:.1f} GB/s"
    )
    snap.close()
    snap.release_buffers()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
