"""Faults the end-to-end trust tests inject from inside a training loop (``demo``'s ``fault_hook``):
importable by Ray's worker processes (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import signal

import ray

from cf_ray._engine.format.blocks import BLOCK_BYTES
from cf_ray._engine.format.layout import SHARED
from cf_ray._engine.format.sections import parse_index
from cf_ray._engine.memory import slots as shm
from cf_ray._engine.protocol.messages import SlotDesc


def flip_in_slot(ckpt, step: int, section: str, entry: str, where: str) -> int:
    """Flip one bit of tracked tensor ``entry`` in this node's holder's slot of ``step`` (through the
    slot's memfd, as a stray write or a bad DIMM would). ``where``: ``"middle"`` of the tensor (no
    fingerprint window samples it) or ``"first"`` (its first floats). Returns the byte's offset."""
    node = ray.get_runtime_context().get_node_id()
    at = ray.get(ckpt.holder.get_section.remote(ckpt.generation, step, section, node), timeout=60)
    desc, index = at.where, at.index
    if not isinstance(desc, SlotDesc):
        raise RuntimeError(f"step {step}'s {section} is not in a slot of this node's holder: {desc!r}")
    _, entries = parse_index(index, "fault")
    e = next(e for e in entries if e.name.endswith(entry))
    at = e.offset + (e.nbytes // 2 + 5 if where == "middle" else 1)
    fd = os.open(desc.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, shm.HEADER_BYTES + at)
        os.pwrite(fd, bytes([byte[0] ^ 0x08]), shm.HEADER_BYTES + at)
    finally:
        os.close(fd)
    return at


def flip_then_kill(ckpt, rank: int, cfg: dict) -> None:
    """``cfg["flips"]``: ``[{"at": step, "where": "middle"|"first"}, ...]``. At each ``at`` (once),
    rank ``kill_rank`` waits until the newest checkpoint is durable (storage holds it intact), flips a
    bit of the model's weight in the holder's slot of that step, and SIGKILLs itself."""
    out = cfg["out_dir"]
    for i, flip in enumerate(cfg["flips"]):
        marker = os.path.join(out, f"flipped{i}.json")
        if rank != cfg["kill_rank"] or ckpt.step_count != flip["at"] or os.path.exists(marker):
            continue
        ckpt.wait()
        step = ckpt.last_save_step
        at = flip_in_slot(ckpt, step, SHARED, cfg.get("flip_entry", "model.3.weight"), flip["where"])
        with open(marker, "w") as f:
            json.dump({"step": step, "offset": at, "block": at // BLOCK_BYTES, "generation": ckpt.generation}, f)
        os.kill(os.getpid(), signal.SIGKILL)


def soak_probes(ckpt, rank: int, cfg: dict) -> None:
    """Installs the soak's probes (``benchmarks/soak/probes.py``) in this worker process, once: they
    fire where the control directory that ``SOAK_CONTROL_DIR`` (from ``cfg["env"]``) names arms them."""
    from benchmarks.soak import probes

    probes.install()
