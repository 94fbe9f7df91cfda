"""The state-tree codec: everything a training loop checkpoints round-trips bit for bit, with no pickle."""

import random

import numpy as np
import pytest
import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.sections import parse_index

from storage_helpers import arena_of


def _roundtrip(tree):
    buf, index = arena_of(tree)  # the bytes and JSON index, laid out as a snapshot lays them out
    tree_json, entries = parse_index(index, "test")
    return _codec.unflatten(tree_json, lambda i, e: _codec.view(buf, e, copy=True), entries)


def _assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)


def test_optimizer_scheduler_and_rng_states_roundtrip():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched.step()
    tree = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    }
    out = _roundtrip(tree)
    _assert_same(tree["model"], out["model"])
    assert out["model"]._metadata == tree["model"]._metadata  # module versions kept for load_state_dict
    _assert_same(tree["opt"], out["opt"])  # int keys of optimizer state survive
    assert out["sched"] == tree["sched"]
    random.setstate(out["rng"]["python"])
    np.random.set_state(out["rng"]["numpy"])
    torch.set_rng_state(out["rng"]["torch"])
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    random.setstate(tree["rng"]["python"])
    np.random.set_state(tree["rng"]["numpy"])
    torch.set_rng_state(tree["rng"]["torch"])
    assert a == (random.random(), np.random.rand(), torch.rand(1).item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.complex64])
def test_dtypes_roundtrip(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype) if dtype != torch.complex64 else torch.randn(3, 5, dtype=dtype)
    out = _roundtrip({"t": t, "empty": torch.empty(0, dtype=dtype), "scalar": t[0, 0].clone()})
    assert torch.equal(out["t"], t) and out["empty"].shape == (0,) and torch.equal(out["scalar"], t[0, 0])


def test_special_values_roundtrip():
    tree = {
        "nan": float("nan"),
        "inf": float("-inf"),
        "tuple": (1, "a", None),
        "ints": (3, 2**40, -1),  # a tuple of ints only (Python's RNG state) is stored as a whole
        "int_and_bools": [1, True, 0],
        "bytes": b"\x00\xff",
        "np": np.float32(1.5),
        "dtype": torch.float16,
        "dev": torch.device("cpu"),
        "mixed_keys": {1: "a", (2, 3): "b"},
        "__cf_tensor__": "a user key that looks like a tag",
    }
    out = _roundtrip(tree)
    assert out["inf"] == float("-inf") and out["nan"] != out["nan"]
    assert out["tuple"] == (1, "a", None) and out["bytes"] == b"\x00\xff"
    assert out["ints"] == (3, 2**40, -1) and isinstance(out["ints"], tuple)
    assert [type(x) for x in out["int_and_bools"]] == [int, bool, int]
    assert out["np"] == np.float32(1.5) and isinstance(out["np"], np.float32)
    assert out["dtype"] is torch.float16 and out["dev"] == torch.device("cpu")
    assert out["mixed_keys"] == {1: "a", (2, 3): "b"}
    assert out["__cf_tensor__"] == "a user key that looks like a tag"


def test_unsupported_value_is_refused_with_its_path():
    class Custom:
        pass

    with pytest.raises(TypeError, match=r"opt\.extra\[1\].*Custom.*never pickles"):
        _codec.flatten({"opt": {"extra": [1, Custom()]}})
    with pytest.raises(TypeError, match="object"):
        _codec.flatten({"a": np.array([object()], dtype=object)})


def test_index_from_a_file_cannot_name_arbitrary_dtypes():
    with pytest.raises(ValueError, match="unsupported tensor dtype"):
        _codec.TensorEntry.from_json(
            {"name": "x", "dtype": "load", "shape": [1], "offset": 0, "nbytes": 1, "kind": "torch"}
        )
    with pytest.raises(ValueError, match="needs 16 bytes"):
        _codec.TensorEntry.from_json(
            {"name": "x", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 8, "kind": "torch"}
        )


def test_a_damaged_state_tree_raises_corrupt_checkpoint_error():
    from cf_ray.errors import CorruptCheckpointError

    entries = [_codec.TensorEntry("t", "float32", (2,), 0, 8, "torch")]
    buf = np.zeros(8, dtype=np.uint8)

    def get(i, e):
        return _codec.view(buf, e, copy=True)

    for tree in (
        {"__cf_tensor__": 1},
        {"__cf_tensor__": True},
        {"__cf_tensor__": "0"},
        {"__cf_tuple__": 5},
        {"__cf_dict__": [[{"a": 1}, 2]]},
        {"__cf_dict__": [[1]]},
        {"__cf_dict__": 3},
        {"__cf_bytes__": "!!not base64"},
        {"__cf_bytes__": 5},
        {"__cf_device__": "warp-drive:9"},
        {"__cf_dtype__": ["float32"]},
        {"__cf_dtype__": "object"},
        {"__cf_float__": "1e400"},
        {"__cf_npscalar__": "<f8"},
        {"__cf_npscalar__": ["<f8"], "v": 1},
        {"__cf_npscalar__": "|i1", "v": 1000},
        {"__cf_npscalar__": "<f8", "v": "x"},
        {"__cf_state_dict__": 5, "meta": {}},
        {"__cf_state_dict__": {}, "meta": 5},
        [{"ok": {"__cf_tuple__": None}}],
    ):
        with pytest.raises(CorruptCheckpointError, match="malformed state tree"):
            _codec.unflatten(tree, get, entries)
    assert torch.equal(_codec.unflatten({"__cf_tensor__": 0}, get, entries), torch.zeros(2))


def test_an_index_cannot_name_a_negative_shape():
    with pytest.raises(ValueError, match="malformed tensor entry"):
        _codec.TensorEntry.from_json(
            {"name": "x", "dtype": "float32", "shape": [-1, -2], "offset": 0, "nbytes": 8, "kind": "torch"}
        )
