"""``cf-ray export``: one checkpoint's model as a file other tools read (safetensors or torch).

The model's state comes from a committed checkpoint through :func:`cf_ray.load_state` (every
file verified against its manifest before a byte is parsed; nothing unpickled) and is written as

- ``model.safetensors``: the safetensors format (an 8-byte little-endian header length, a JSON
  header of dtypes, shapes and offsets, then the raw little-endian tensors), readable by
  ``safetensors.torch.load_file``, Hugging Face ``from_pretrained(..., use_safetensors=True)`` and
  ``cf_ray.load_state``-free tools alike; nested state is flattened to dotted names;
- ``model.pt``: ``torch.save`` of the state dict, for ``torch.load(path, weights_only=True)``;
- ``--to dcp``: every tracked object (or ``--object``) as a PyTorch Distributed Checkpoint directory
  (``.metadata`` + ``__<rank>_0.distcp``) for ``torch.distributed.checkpoint.load``, sharded
  (FSDP2) checkpoints included: each rank's shards become DCP chunks at their global offsets, so
  DCP loads it at any number of ranks (``cf_ray/_engine/format/dcp.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from cf_ray._engine.format.catalog import list_committed
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.safetensors import _SAFETENSORS_DTYPES
from cf_ray._engine.storage.base import Storage
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.errors import CfRayError, CheckpointNotFoundError, ConfigError
from cf_ray.load import load_state

FORMATS = ("safetensors", "torch")
#: ``--to dcp``: a directory for torch.distributed.checkpoint (:func:`export_dcp_dir`).
DCP = "dcp"
_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}


@dataclass(frozen=True, slots=True)
class Exported:
    """What :func:`export_model` wrote."""

    path: str
    """The file written."""
    source: str
    """The checkpoint it came from (its URI)."""
    step: int
    """That checkpoint's step."""
    kind: str
    """That checkpoint's kind (``final`` for the consolidated model)."""
    tensors: int
    """Number of tensors written."""
    size_bytes: int
    """Their total size."""


def choose(storage: Storage, directory: str | None, step: int | None, obj: str) -> str:
    """The checkpoint directory to export: ``directory`` when given, else the newest committed one
    (of ``step``, when given); for the same step the final model wins when ``obj`` is ``model``
    (it holds nothing else)."""
    if directory is not None:
        if step is not None and not directory.rstrip("/").endswith(f"_{step:012d}"):
            raise CheckpointNotFoundError(f"{storage.uri(directory)} is not a checkpoint of step {step}")
        return directory
    kinds = ("step", "final") if obj == "model" else ("step",)
    committed = [c for c in list_committed(storage, kinds=kinds) if step is None or c.step == step]
    if not committed:
        at = "" if step is None else f" at step {step}"
        raise CheckpointNotFoundError(
            f"no committed checkpoint{at} under {storage.uri()}" + ("" if obj == "model" else f" that holds {obj!r}")
        )
    return max(committed, key=lambda c: (c.step, c.kind == "final")).path


def export_model(
    storage: FsStorage, directory: str | None, out_dir: str, *, to: str, step: int | None = None, obj: str = "model"
) -> Exported:
    """Write the state of the tracked object ``obj`` (default ``model``) of a checkpoint to ``out_dir``.

    Args:
        storage: the run's cf_ray root (``cf_ray.load.open_run``).
        directory: one checkpoint directory under it, or ``None`` to choose by ``step``.
        out_dir: a local directory (created if missing); the file is ``<obj>.safetensors`` or ``<obj>.pt``.
        to: ``safetensors`` or ``torch``.
        step: which checkpoint (default: the newest; the final model when the run finished).
        obj: the tracked object's name, as given to ``Checkpointer({...})``.

    Raises:
        CheckpointNotFoundError: no such checkpoint, or it does not hold ``obj``.
        CorruptCheckpointError: a file of it fails verification.
        CfRayError: the checkpoint holds per-rank shards (``replicated=False`` with several ranks),
            or (safetensors) a value that is not a tensor or a dtype safetensors cannot store.
        ConfigError: ``obj`` cannot name a file in ``out_dir`` (:func:`check_object_name`).
    """
    if to not in FORMATS:
        raise ValueError(f"to={to!r}: use one of {FORMATS}")
    check_object_name(obj)
    path = choose(storage, directory, step, obj)
    manifest = read_manifest(storage, path)
    if not manifest.replicated and manifest.world_size > 1:
        raise CfRayError(
            f"{storage.uri(path)} holds per-rank shards of the state (replicated=False, "
            f"{manifest.world_size} ranks): export needs one consolidated state; export the final "
            "model (written at the end of a run) or a checkpoint of a replicated (DDP) run, or export this one "
            "for torch.distributed.checkpoint with --to dcp (it assembles the shards)"
        )
    state = load_state(posixpath.join(storage.root, path), objects=[obj], filesystem=storage.fs)[obj]
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, obj + _SUFFIX[to])
    if to == "safetensors":
        tensors = flatten(state)
        metadata = {
            "format": "pt",
            "cf_ray_step": str(manifest.step),
            "cf_ray_epoch": str(manifest.epoch),
            "cf_ray_kind": manifest.kind,
            "cf_ray_source": storage.uri(path),
        }
        _atomic_write(target, lambda f: write_safetensors(f, tensors, metadata))
    else:
        tensors = {k: v for k, v in flatten(state, strict=False).items() if isinstance(v, torch.Tensor)}
        _atomic_write(target, lambda f: torch.save(state, f))
    return Exported(
        path=target,
        source=storage.uri(path),
        step=manifest.step,
        kind=manifest.kind,
        tensors=len(tensors),
        size_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )


def export_dcp_dir(
    storage: Storage,
    directory: str | None,
    out_dir: str,
    *,
    step: int | None = None,
    objects: list[str] | None = None,
) -> Exported:
    """Write a committed checkpoint (all tracked objects, or ``objects``) as a DCP directory ``out_dir``.

    Raises:
        CheckpointNotFoundError: no such checkpoint. CorruptCheckpointError: a file fails verification.
    """
    from cf_ray._engine.format.dcp import export_dcp

    path = choose(storage, directory, step, objects[0] if objects else "the tracked objects")
    done = export_dcp(storage, path, out_dir, objects=objects)
    return Exported(
        path=out_dir,
        source=storage.uri(path),
        step=done.step,
        kind="step",
        tensors=done.chunks,
        size_bytes=done.size_bytes,
    )


def dcp_reader(source: Any, *, step: int | None = None, objects: list[str] | None = None, filesystem=None):
    """A ``torch.distributed.checkpoint`` storage reader over a committed cf_ray checkpoint, no export:
    ``dcp.load(state_dict, storage_reader=dcp_reader("cf_ray_runs/my-run", step=1200))``.

    Args:
        source: the run (or one checkpoint's directory), as :func:`cf_ray.load.open_run` takes it.
        step: which checkpoint (default: the newest full one); objects: tracked names (default: all).
    """
    from cf_ray._engine.format.dcp import CfRayReader
    from cf_ray.load import open_run

    storage, directory = open_run(source, filesystem)
    return CfRayReader(storage, choose(storage, directory, step, "the tracked objects"), objects=objects)


def flatten(state: Any, *, strict: bool = True, prefix: str = "") -> dict[str, Any]:
    """A state tree as ``{dotted name: leaf}``: a model's state dict stays as it is, nested dicts
    (and lists) are joined with dots. With ``strict``, every leaf must be a tensor."""
    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else None
    if items is None:
        if strict and not isinstance(state, torch.Tensor):
            raise CfRayError(
                f"{prefix or 'the state'} is a {type(state).__name__}, not a tensor: safetensors stores "
                "tensors only; export with --to torch"
            )
        return {prefix: state}
    for k, v in items:
        out.update(flatten(v, strict=strict, prefix=f"{prefix}.{k}" if prefix else str(k)))
    return out


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to the binary file ``f`` in the safetensors format, one tensor at a time.

    The layout is the one ``write_final_model`` writes (and safetensors' own library): the header
    length (8 bytes, little-endian), the JSON header padded with spaces to a multiple of 8, then the
    tensors' bytes back to back in the header's order.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CfRayError(
                f"tensor {name} has dtype {t.dtype}, which safetensors cannot store; export with --to torch"
            )
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for t in tensors.values():
        if t.numel():
            host = t.detach().to("cpu").contiguous().reshape(-1)
            f.write(host.view(torch.uint8).numpy().data)


def check_object_name(obj: str) -> str:
    """``obj`` if it can name a tracked object's file in the export directory, else a ConfigError.

    The name becomes ``<out_dir>/<obj>.safetensors``: a separator, ``.``/``..``, a leading dot or a
    NUL would write elsewhere than the directory given (or hide the file), so such a name is refused
    before it is joined into a path.
    """
    bad = (
        not obj
        or obj in (".", "..")
        or obj.startswith(".")
        or "\0" in obj
        or "/" in obj
        or "\\" in obj
        or (os.altsep is not None and os.altsep in obj)
        or os.path.isabs(obj)
    )
    if bad:
        raise ConfigError(
            f"--object {obj!r} is not a tracked object's name: give the name used in Checkpointer({{...}}), "
            "e.g. --object model (no path separators, no leading dot)"
        )
    return obj


def _atomic_write(target: str, write) -> None:
    """Write through a temporary file next to ``target``, renamed over it when complete (so a
    reader never sees half a file).

    The temporary file has an unpredictable name and is created with ``O_CREAT | O_EXCL``: it is
    a new file, never one (or a symbolic link) someone placed there, so nothing outside the
    directory can be written through it; ``os.replace`` then replaces ``target`` itself, a link
    included, without following it. Mode 0o666 less the umask, as ``open`` would give.
    """
    directory, name = os.path.split(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.partial")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"could not create a temporary file next to {target}")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
