"""The consolidated model at the end of training, as ``model.safetensors``: written one tensor at a
time by rank 0 (:func:`write_final_model`; a sharded FSDP2 model with every rank gathering one
tensor at a time, :func:`write_sharded_final_model`), read back without unpickling anything
(:func:`read_safetensors`, for ``cf_ray.load_state``)."""

from __future__ import annotations

import json
import math
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from cf_ray._engine.format.commit import Manifest
from cf_ray._engine.format.layout import MANIFEST, RESUME_KEY
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CorruptCheckpointError

#: torch dtype -> the dtype name safetensors stores in its header.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: The other way round, for reading.
_ST_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


def write_final_model(
    storage: Storage, directory: str, module: torch.nn.Module, *, step: int, epoch: int, resume: str | None = None
) -> None:
    """Write ``module``'s weights as ``model.safetensors`` + a manifest, one tensor at a time.

    Each tensor is brought to the host and written in turn, so rank 0 never holds a second full
    copy of the model (Caffe2's "download group" at the end of training, without its memory cost).

    Args:
        resume: the directory of the newest committed full checkpoint (model, optimizer, RNG, data
            position), recorded in the manifest's ``extra`` so that a run started with
            ``resume_from`` this final model continues from it.
    """
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):  # DDP / compile wrappers
        module = module.module
    sd = module.state_dict()
    specs = _specs(sd)
    tensors = iter(sd.values())
    _write_model(storage, directory, specs, lambda: next(tensors), step=step, epoch=epoch, resume=resume)


def write_sharded_final_model(
    storage: Storage,
    directory: str,
    state_dict: dict[str, Any],
    *,
    rank: int,
    step: int,
    epoch: int,
    resume: str | None = None,
) -> None:
    """Write a sharded (FSDP2 / DTensor) model as ``model.safetensors`` + a manifest, tensor by tensor,
    without gathering the whole model in one process. Every rank calls it with the same state dict
    (``torch.distributed.checkpoint.state_dict.get_model_state_dict``: DTensors, global shapes).

    The header (names, dtypes, global shapes, offsets) is known before any data, so rank 0 writes it
    first; then, for each tensor in order, every rank takes part in ``DTensor.full_tensor()`` (a
    collective on the tensor's mesh) and rank 0 streams the whole tensor into the file and drops it
    before the next one is gathered: the extra memory on a rank is one whole tensor at a time (plus
    the collective's own buffers). The other ranks drop each tensor at once. When rank 0's write
    fails part-way, it still takes part in the collectives left, so no rank hangs; the error is
    raised on rank 0 only.

    Raises:
        TypeError: a dtype that safetensors cannot store (on every rank, before any collective).
    """
    specs = _specs(state_dict)  # every rank: the same check, before any collective
    gathered = _Gathered(list(state_dict.values()))
    try:
        if rank == 0:
            _write_model(
                storage, directory, specs, gathered.take, step=step, epoch=epoch, resume=resume, one_at_a_time=True
            )
    finally:
        gathered.drain()


class _Gathered:
    """Each tensor of a (sharded) state dict in turn, whole and on the host: a DTensor through
    ``full_tensor()`` (a collective: every rank calls :meth:`take` or :meth:`drain` for every tensor,
    in the same order)."""

    def __init__(self, values: list[Any]):
        self._values = values
        self._next = 0

    def take(self) -> torch.Tensor:
        from cf_ray._engine.format.codec import is_dtensor

        v = self._values[self._next]
        self._next += 1
        whole = v.full_tensor() if is_dtensor(v) else v
        host = whole.detach().to("cpu").contiguous()
        del whole
        return host

    def drain(self) -> None:
        while self._next < len(self._values):
            self.take()


def _specs(sd: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, global shape) of each tensor, in order; DTensors by their global shape."""
    out = []
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"final model entry {name} is a {type(t).__name__}, not a tensor")
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"final model tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        out.append((name, t.dtype, tuple(t.shape)))
    return out


def _write_model(
    storage: Storage,
    directory: str,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    next_tensor: Callable[[], torch.Tensor],
    *,
    step: int,
    epoch: int,
    resume: str | None,
    one_at_a_time: bool = False,
) -> None:
    """Write ``model.safetensors``: the header from ``specs``, then each tensor ``next_tensor()``
    returns (called once per spec, in order), then the final model's manifest. ``one_at_a_time``
    (gathered tensors, each a new allocation): the next is asked for only once the previous one's
    bytes are released by the writer (at most 1 s each); views of live parameters cost nothing to
    keep, so the unsharded path does not wait."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "cf_ray_step": str(step), "cf_ray_epoch": str(epoch)}}
    offset = 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * _itemsize(dtype)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)

    def chunks() -> Iterator[Any]:
        yield len(hbytes).to_bytes(8, "little")
        yield hbytes
        previous = None
        for name, dtype, shape in specs:
            if one_at_a_time:
                _wait_released(previous)
            host = next_tensor().detach().to("cpu").contiguous()
            if host.dtype != dtype or tuple(host.shape) != shape:
                raise RuntimeError(
                    f"final model tensor {name} is {tuple(host.shape)} {host.dtype}, its header says {shape} {dtype}"
                )
            if not host.numel():
                continue
            arr = (
                host.view(torch.uint8).reshape(-1).numpy() if host.dtype != torch.bool else host.numpy().view(np.uint8)
            )
            del host
            previous = weakref.ref(arr)
            yield arr
            del arr
            # An empty chunk: the writer's loop variable would otherwise hold this tensor's bytes
            # while the next tensor is gathered.
            yield b""

    info = storage.write_file(f"{directory}/model.safetensors", chunks())
    extra: dict[str, Any] = {}
    if resume is not None:
        extra = {RESUME_KEY: resume, "resume_step": int(resume.rsplit("_", 1)[1])}
    m = Manifest(
        step=step,
        epoch=epoch,
        world_size=1,
        generation=0,
        replicated=True,
        kind="final",
        milestone=False,
        sections={"model": {"data": "model.safetensors"}},
        files={"model.safetensors": info},
        created_unix=time.time(),
        extra=extra,
    )
    storage.write_file(f"{directory}/{MANIFEST}", [m.to_bytes()])


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _wait_released(ref: weakref.ref | None, timeout_s: float = 1.0) -> None:
    """Wait (briefly) until the storage's writer has let go of the previous tensor's bytes.

    ``Storage.write_file`` hands each chunk to its CRC-32 thread (a short queue) and to the file; the
    chunk stays alive until both are done with it, which is normally already the case when the
    write returns. Waiting here keeps a single whole tensor alive at a time on rank 0; after
    ``timeout_s`` (a writer that buffers, e.g. an object store's background upload) it goes on.
    """
    if ref is None or ref() is None:
        return
    deadline = time.monotonic() + timeout_s
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.0002)


def read_safetensors(buf: np.ndarray, keyset) -> dict[str, torch.Tensor]:
    """The tensors of a verified ``model.safetensors`` buffer (only those in ``keyset`` when given).

    Raises:
        CorruptCheckpointError: anything that does not parse as safetensors (a header that is not
            JSON, a bad entry, a tensor whose bytes do not fit its shape); never a bare
            ``UnicodeDecodeError``/``KeyError``/``RuntimeError``.
    """
    if buf.nbytes < 8:
        raise CorruptCheckpointError("model.safetensors is shorter than its header length")
    n = int.from_bytes(bytes(buf[:8]), "little")
    if n <= 0 or 8 + n > buf.nbytes:
        raise CorruptCheckpointError("model.safetensors has a bad header length")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptCheckpointError(
            f"model.safetensors has a header that is not JSON: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"model.safetensors has a header that is a {type(header).__name__}, not an object")
    base = 8 + n
    out = {}
    for name, spec in header.items():
        if name == "__metadata__" or (keyset is not None and name not in keyset):
            continue
        try:
            out[name] = _tensor(buf, base, name, spec)
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise CorruptCheckpointError(
                f"tensor {name!r} of model.safetensors is malformed: {type(e).__name__}: {e}"
            ) from None
    return out


def _tensor(buf: np.ndarray, base: int, name: str, spec: Any) -> torch.Tensor:
    if not isinstance(spec, dict):
        raise TypeError(f"its entry is a {type(spec).__name__}")
    dtype = _ST_DTYPES.get(spec["dtype"])
    if dtype is None:
        raise CorruptCheckpointError(f"unsupported safetensors dtype {spec['dtype']!r}")
    begin, end = (int(x) for x in spec["data_offsets"])
    if not 0 <= begin <= end <= buf.nbytes - base:
        raise CorruptCheckpointError(f"tensor {name} lies outside model.safetensors")
    shape = [int(d) for d in spec["shape"]]
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    raw = buf[base + begin : base + end].copy()
    t = torch.from_numpy(raw).view(dtype) if end > begin else torch.empty(0, dtype=dtype)
    return t.reshape(shape)
