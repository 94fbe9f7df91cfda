"""The RNG states a snapshot carries (this rank's Python, NumPy, torch and CUDA generators): taken
at the checkpoint's step, checked on throw-away generators before a restore touches anything, and
put back."""

from __future__ import annotations

import random

import numpy as np
import torch

from cf_ray.errors import CorruptCheckpointError


def rng_state() -> dict:
    """This process's RNG states (Python, NumPy, torch, and CUDA when initialised)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned (as a snapshot stores it)."""
    random.setstate(_tuplify(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].clone().contiguous())
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.clone(), i)


def check_rng_state(state: object, where: str = "") -> None:
    """Whether :func:`set_rng_state` would accept ``state``, tried on throw-away generators (this
    process's generators are not touched).

    Raises:
        CorruptCheckpointError: a state that does not parse (e.g. a forged ``mt19937`` state).
    """
    where = f" ({where})" if where else ""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise CorruptCheckpointError(f"the RNG state{where} is malformed: expected python, numpy and torch states")
    try:
        random.Random().setstate(_tuplify(state["python"]))
        np.random.RandomState().set_state(state["numpy"])
        t = state["torch"]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise TypeError(f"the torch state is a {type(t).__name__}, not a uint8 tensor")
        torch.Generator().set_state(t.clone().contiguous())
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or not all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda):
            raise TypeError("the CUDA states are not a list of uint8 tensors")
        if cuda and torch.cuda.is_available() and torch.cuda.device_count():
            expected = torch.cuda.get_rng_state(0).numel()
            if any(c.numel() != expected for c in cuda):
                raise ValueError(f"a CUDA state has the wrong size (expected {expected} bytes)")
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the generators refuse
        raise CorruptCheckpointError(f"the RNG state{where} does not parse: {type(e).__name__}: {e}") from None


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


__all__ = ["check_rng_state", "rng_state", "set_rng_state"]
