"""``benchmarks/gpu_e2e.py``, the GPU run of #25: its logic on the CPU (nightly: ~3-6 min, two Ray
starts), and a clean skip where there is no GPU."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_e2e


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_without_a_gpu_the_gpu_run_says_so_and_measures_nothing(tmp_path, capsys):
    assert gpu_e2e.main(["--out", str(tmp_path / "out"), "--scratch", str(tmp_path / "scratch")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out" / "gpu_e2e.json").exists()


@pytest.mark.nightly
@pytest.mark.timeout(900)
def test_the_gpu_run_on_the_cpu_measures_every_variant_and_restores_bitwise(tmp_path):
    out = tmp_path / "out"
    args = ["--out", str(out), "--scratch", str(tmp_path / "scratch"), "--device", "cpu", "--quick"]
    assert gpu_e2e.main([*args, "--budget-s", "800"]) == 0
    res = json.loads((out / "gpu_e2e.json").read_text())
    ov, rec = res["overhead"], res["recovery"]
    assert ov["status"] == "ok" and ov["error"] is None, ov.get("error")
    ids = {v["id"] for v in ov["variants"]}
    assert ids == {"gpu/none", "gpu/cf_fixed/k1", "gpu/cf_fixed/k10", "gpu/dcp_async/k10", "gpu/ray_async/k10"}
    k1 = next(v for v in ov["variants"] if v["id"] == "gpu/cf_fixed/k1")
    assert (
        k1["rounds"] == 2 and k1["overhead_interval"]["n"] == 2 and k1["cpu_breakdown"]["copy"]["cpu_ms_per_ckpt"] >= 0
    )
    assert {t["target"].split(":")[1].strip().split(" ")[0] for t in ov["targets"]} == {"k=1", "k=10"}
    # A SIGKILLed worker restored from memory and from storage, each time the very bytes of its step.
    assert rec["status"] == "ok", rec
    for source in ("memory", "storage"):
        r = rec["sources"][source]
        assert r["resume_source"] == source and r["resume_step"] == r["step"] and r["bitwise"] is True, r
    assert "| memory |" in (out / "gpu_e2e.md").read_text()
