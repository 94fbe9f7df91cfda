"""Faults the end-to-end tests inject from inside demo's training loop, from outside cf_ray's code.

A test runs one of the ``*_loop`` functions below in place of :func:`cf_ray.demo.train_loop_per_worker`
(``monkeypatch.setattr(demo, "train_loop_per_worker", trust_faults.flip_then_kill_loop)`` before
``demo.run``): each sets its fault up in the Ray Train worker's process and then runs demo's own loop,
so the job trained is the same as the reference's. This module is importable by Ray's worker
processes (tests/ is on their PYTHONPATH), so the loop travels to them by name."""

from __future__ import annotations

import json
import os
import signal

import ray

from cf_ray import demo
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


#: demo's own training loop, taken at import (a test replaces ``demo.train_loop_per_worker`` in the
#: driver's process; a worker's process imports demo afresh).
_DEMO_LOOP = demo.train_loop_per_worker


def _after_every_step(fault, config: dict) -> None:
    """Run ``fault(ckpt, rank, cfg)`` right after every ``Checkpointer.step`` of this process (the
    step's update applied and its snapshot, if any, handed to the holder)."""
    import ray.train

    from cf_ray.checkpointer import Checkpointer

    cfg = {**demo.DEFAULTS, **config}
    rank = ray.train.get_context().get_world_rank()
    step = Checkpointer.step

    def stepped(self, *optimizers, **kwargs):
        taken = step(self, *optimizers, **kwargs)
        fault(self, rank, cfg)
        return taken

    Checkpointer.step = stepped  # type: ignore[method-assign]


def flip_then_kill_loop(config: dict) -> None:
    """demo's loop with :func:`flip_then_kill` after every step."""
    _after_every_step(flip_then_kill, config)
    _DEMO_LOOP(config)


def soak_probes_loop(config: dict) -> None:
    """demo's loop in a process with the soak's probes (``benchmarks/soak/probes.py``) installed
    before it starts: they fire where the control directory that ``SOAK_CONTROL_DIR`` (from
    ``config["env"]``, set here first, as the loop sets it) names arms them."""
    from benchmarks.soak import probes

    os.environ.update(config.get("env", {}))
    probes.install()
    _DEMO_LOOP(config)
