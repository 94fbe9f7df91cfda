"""Test helpers that write checkpoints with the engine's own phase-2 functions (no Ray)."""

from __future__ import annotations

import numpy as np
import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.commit import Manifest
from cf_ray._engine.format.commit import commit as commit_manifest
from cf_ray._engine.format.layout import SHARED, rank_section, section_files, step_dir
from cf_ray._engine.format.sections import encode_index, write_section


def arena_of(tree) -> tuple[np.ndarray, bytes]:
    flat = _codec.flatten(tree)
    buf = np.zeros(flat.nbytes, dtype=np.uint8)
    for e, leaf in zip(flat.entries, flat.leaves):
        raw = buf[e.offset : e.offset + e.nbytes]
        if e.kind == "numpy":
            raw[:] = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
        elif leaf.numel():
            raw[:] = leaf.contiguous().reshape(-1).view(torch.uint8).numpy()
    return buf, encode_index(flat)


def write_checkpoint(
    storage,
    step: int,
    model: torch.nn.Module,
    *,
    generation: int = 1,
    commit: bool = True,
    milestone: bool = False,
    world_size: int = 1,
) -> Manifest:
    """A replicated checkpoint of ``model`` at ``step``, written like the holder + controller do:
    one rank by default; with ``world_size`` > 1 every rank's section also holds a per-rank object
    ``data`` = ``{"rank": r, "position": 1000 * r + step}`` (what a data loader's position looks like)."""
    directory = step_dir(step)
    files = {}
    sections = {}
    trees = {SHARED: {"objects": {"model": model.state_dict()}}}
    for r in range(world_size):
        objects = {"data": {"rank": r, "position": 1000 * r + step}} if world_size > 1 else {}
        trees[rank_section(r)] = {"objects": objects, "counters": {"step": step, "epoch": 0}}
    for sec, tree in trees.items():
        arena, index = arena_of(tree)
        files.update(write_section(storage, directory, generation, sec, arena, index))
        data, idx = section_files(generation, sec)
        sections[sec] = {"data": data, "index": idx}
    m = Manifest(
        step=step,
        epoch=0,
        world_size=world_size,
        generation=generation,
        replicated=True,
        sections=sections,
        files=files,
        milestone=milestone,
    )
    if commit:
        commit_manifest(storage, directory, m)
    return m
