"""The consolidated model at the end of training, as ``model.safetensors``: written one tensor at a
time by rank 0 (:func:`write_final_model`), read back without unpickling anything
(:func:`read_safetensors`, for ``cf_ray.load_state``)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import torch

from cf_ray._engine.format import manifest as mf
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


#: Key in a final model's manifest ``extra``: the run's full checkpoint (``checkpoints/step_<n>``)
#: at the end of training, which ``resume_from=result.checkpoint`` follows.
RESUME_KEY = "resume"


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
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "cf_ray_step": str(step), "cf_ray_epoch": str(epoch)}}
    offset = 0
    items = []
    for name, t in sd.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"final model tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        items.append(t)
        offset += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)

    def chunks():
        yield len(hbytes).to_bytes(8, "little")
        yield hbytes
        for t in items:
            host = t.detach().to("cpu").contiguous()
            if host.numel():
                yield (
                    host.view(torch.uint8).reshape(-1).numpy()
                    if host.dtype != torch.bool
                    else host.numpy().view(np.uint8)
                )

    info = storage.write_file(f"{directory}/model.safetensors", chunks())
    extra: dict[str, Any] = {}
    if resume is not None:
        extra = {RESUME_KEY: resume, "resume_step": int(resume.rsplit("_", 1)[1])}
    m = mf.Manifest(
        step=step,
        epoch=epoch,
        world_size=1,
        generation=0,
        replicated=True,
        kind="final",
        milestone=True,
        sections={"model": {"data": "model.safetensors"}},
        files={"model.safetensors": info},
        created_unix=time.time(),
        extra=extra,
    )
    storage.write_file(f"{directory}/{mf.MANIFEST}", [m.to_bytes()])


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
