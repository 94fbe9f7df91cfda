"""Reading checkpoints outside training: list them, load chosen entries from a chosen one.

Caffe2's ``load_blobs_from_checkpoints`` for cf_ray: evaluation or fine-tuning code loads only the
model weights (or a few tensors of them) from any committed checkpoint, without building the
optimizer, the samplers or a Ray cluster. Nothing is unpickled: every file is checked against its
manifest's size and CRC-32 before it is parsed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.catalog import (
    full_checkpoint_of_final,
    list_committed,
    load_quarantine,
    open_run,
    resumable_checkpoint,
)
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import (
    FINAL_SECTION,
    OBJECTS,
    RESUME_KEY,
    SHARED,
    STATE,
    rank_section,
)
from cf_ray._engine.format.safetensors import read_safetensors
from cf_ray._engine.format.sections import Section, load_section, read_verified
from cf_ray.errors import CheckpointNotFoundError, CorruptCheckpointError


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One committed checkpoint of a run."""

    step: int
    epoch: int
    kind: str
    milestone: bool
    world_size: int
    path: str


def list_checkpoints(source: Any, filesystem: pafs.FileSystem | None = None) -> list[CheckpointInfo]:
    """Every committed checkpoint of a run (resumable ones and the final model), oldest first. A
    checkpoint that a restore found corrupt and quarantined is not listed (:func:`quarantined_checkpoints`).
    The full checkpoint of the final step that the final model names (``Checkpointer.finish()``) is
    listed once, as the final model (kind ``final``), whose path resumes the run through it."""
    run, _ = open_run(source, filesystem)
    found = []
    for c in list_committed(run, kinds=("step", "final"), skip_quarantined=True):
        try:
            found.append((c, read_manifest(run, c.path)))
        except CorruptCheckpointError:
            continue
    folded = {m.extra.get(RESUME_KEY) for c, m in found if c.kind == "final" and m.extra.get("resume_step") == m.step}
    return [
        CheckpointInfo(
            step=m.step,
            epoch=m.epoch,
            kind=m.kind,
            milestone=m.milestone,
            world_size=m.world_size,
            path=run.uri(c.path),
        )
        for c, m in found
        if c.path not in folded
    ]


def quarantined_checkpoints(source: Any, filesystem: pafs.FileSystem | None = None) -> dict[int, str]:
    """The steps of a run's checkpoints that a restore found corrupt, and why: they stay on storage
    for inspection and are never restored from, listed or counted by keep-last again."""
    run, _ = open_run(source, filesystem)
    return load_quarantine(run)


def load_state(
    source: Any,
    *,
    step: int | None = None,
    objects: Iterable[str] | None = None,
    keys: Iterable[str] | None = None,
    filesystem: pafs.FileSystem | None = None,
    rank: int = 0,
) -> dict[str, Any]:
    """Chosen entries of a chosen checkpoint, as state dicts with CPU tensors.

    Args:
        source: see :func:`open_run`.
        step: which checkpoint (default: the newest resumable one; the final model if ``source``
            names it).
        objects: tracked object names to load (default: all), e.g. ``["model"]``.
        keys: within each object, only these state-dict keys (e.g. ``["fc.weight"]``).
        rank: whose per-rank state (``data``, ``rng``) to include when ``objects`` asks for them.

    Raises:
        CheckpointNotFoundError: no such committed checkpoint.
        CorruptCheckpointError: a file fails verification.
    """
    run, directory = open_run(source, filesystem)
    if directory is None:
        committed = list_committed(run)
        quarantined = load_quarantine(run)
        if step is not None and step in quarantined and any(c.step == step for c in committed):
            raise CorruptCheckpointError(
                f"checkpoint step {step} under {run.uri()} is quarantined: a restore found it corrupt "
                f"({quarantined[step]}); `cf-ray verify` shows the damage"
            )
        committed = [c for c in committed if c.step not in quarantined]
        if step is not None:
            committed = [c for c in committed if c.step == step]
        if not committed:
            raise CheckpointNotFoundError(
                f"no committed checkpoint{'' if step is None else f' at step {step}'} under {run.uri()}"
            )
        directory = committed[-1].path
    elif step is not None and not directory.endswith(f"{step:012d}"):
        raise CheckpointNotFoundError(f"{run.uri(directory)} is not the checkpoint of step {step}")
    m = read_manifest(run, directory)
    wanted = None if objects is None else set(objects)
    keyset = None if keys is None else set(keys)
    if m.final_model and wanted is not None and wanted - {FINAL_SECTION} and RESUME_KEY in m.extra:
        # Objects besides the model: from the full checkpoint the final model names (same step).
        directory = full_checkpoint_of_final(run, directory, m)
        m = read_manifest(run, directory)
    if m.final_model:
        buf = read_verified(run, directory, m, "model.safetensors")
        state = {"model": read_safetensors(buf, keyset)}
        missing = (wanted or set()) - set(state)
        if missing:
            raise CheckpointNotFoundError(
                f"checkpoint {run.uri(directory)} holds only the final model, not {sorted(missing)}"
            )
        return {k: v for k, v in state.items() if wanted is None or k in wanted}
    out: dict[str, Any] = {}
    if m.replicated:
        shared = load_section(run, directory, m, SHARED)
        objs = _select(shared, (OBJECTS,), wanted, keyset)
    else:
        sec = load_section(run, directory, m, rank_section(rank))
        objs = _select(sec, (STATE,), wanted, keyset)
    out.update(objs)
    if wanted is not None and wanted - set(out):
        sec = load_section(run, directory, m, rank_section(rank))
        out.update(_select(sec, (OBJECTS,), wanted - set(out), keyset))
    missing = (wanted or set()) - set(out)
    if missing:
        raise CheckpointNotFoundError(f"checkpoint {run.uri(directory)} has no objects {sorted(missing)}")
    return out


def load_into(
    source: Any,
    objects: Mapping[str, Any],
    *,
    step: int | None = None,
    strict: bool = True,
    filesystem: pafs.FileSystem | None = None,
) -> bool:
    """Load the named objects (e.g. ``{"model": model}``) from a checkpoint.

    Returns:
        False when no such checkpoint exists (Caffe2's contract), True once loaded.
    """
    try:
        states = load_state(source, step=step, objects=list(objects), filesystem=filesystem)
    except CheckpointNotFoundError:
        return False
    for name, obj in objects.items():
        target = (
            obj.module if hasattr(obj, "module") and isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj
        )
        if isinstance(target, torch.nn.Module):
            target.load_state_dict(states[name], strict=strict)
        else:
            target.load_state_dict(states[name])
    return True


def _select(section: Section, path: tuple[str, ...], wanted, keyset) -> dict:
    tree = section.tree
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            raise CorruptCheckpointError(
                f"a section of the checkpoint has no {'.'.join(path)!r} (malformed state tree)"
            )
        tree = tree[p]
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"the checkpoint's {'.'.join(path)!r} is not a mapping (malformed state tree)")
    out = {}
    for name, sub in tree.items():
        if wanted is not None and name not in wanted:
            continue
        if keyset is not None:
            sub = _codec.select_keys(sub, keyset)
        out[name] = _codec.unflatten(sub, lambda _i, e: _codec.view(section.buf, e, copy=True), section.entries)
    return out


# open_run and resumable_checkpoint are defined in the format room's catalog (the engine finds a run
# there too) and are part of this module's public face.
__all__ = [
    "CheckpointInfo",
    "list_checkpoints",
    "load_into",
    "load_state",
    "open_run",
    "quarantined_checkpoints",
    "resumable_checkpoint",
]
