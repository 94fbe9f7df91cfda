"""What verifying a restore costs (#23): seconds per GB of the checks a restore makes before it uses
a byte, side by side with what it costs to read those bytes at all.

    python -m benchmarks.integrity                 # 1 GiB, 3 rounds (run it on an idle machine)
    python -m benchmarks.integrity --mib 64 --rounds 1   # a smoke run

Rows (best of ``--rounds``, seconds per GB of state):

* ``memcpy``: one copy of the bytes (what loading them into a model costs at least);
* ``crc32 whole``: ISA-L's CRC-32 over the buffer in one call (what a storage read checks);
* ``verify_blocks``: the CRC-32 of every 256 KiB block checked against the index (what a restore from
  memory checks, ``manifest.verify_blocks``);
* ``check_finite``: the NaN/infinity check of the saved parameters and optimizer state
  (``integrity.check_finite``: one ``aminmax`` per tensor, float32 here);
* ``fingerprints``: the sampled fingerprint of the objects (what the restore always did).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from cf_ray._engine.format.blocks import BLOCK_BYTES, Blocks, block_crcs, verify_blocks
from cf_ray._engine.storage.base import crc32_of
from cf_ray._engine.worker.restore import integrity
from cf_ray._engine.worker.snapshot import fingerprint as fp


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(mib: int, rounds: int) -> dict[str, float]:
    """Seconds per GB of each check over ``mib`` MiB of float32 state (tensors of 16 MiB)."""
    n = mib * (1 << 20) // 4
    per = 4 << 20  # elements per tensor: 16 MiB
    state = {f"w{i}": torch.randn(min(per, n - i)) for i in range(0, n, per)}
    buf = np.concatenate([t.numpy().view(np.uint8) for t in state.values()])
    blocks = Blocks(BLOCK_BYTES, tuple(block_crcs(buf)))
    dst = np.empty_like(buf)
    model = torch.nn.Module()
    for name, t in state.items():
        model.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    gb = buf.nbytes / 1e9
    rows = {
        "memcpy": _best(lambda: np.copyto(dst, buf), rounds),
        "crc32 whole": _best(lambda: crc32_of(buf), rounds),
        "verify_blocks": _best(lambda: verify_blocks(buf, blocks, "bench"), rounds),
        "check_finite": _best(lambda: integrity.check_finite({"model": state}, {"model": model}), rounds),
        "fingerprints": _best(lambda: fp.object_fingerprint(state), rounds),
    }
    return {k: v / gb for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="MiB of state (default 1024)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    got = measure(args.mib, args.rounds)
    print(f"| check ({args.mib} MiB of float32 state, best of {args.rounds}) | s/GB | GB/s |")
    print("|---|---|---|")
    for name, s in got.items():
        print(f"| {name} | {s:.3f} | {1 / s:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "rounds": args.rounds, "s_per_gb": got}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
