"""examples/data_sources.py runs (README snippets are taken from it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*names):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "data_sources.py"), *names],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [ln.split(":")[0] for ln in proc.stdout.splitlines() if ln.strip()]


def test_data_sources_example_runs():
    assert _run("sampler", "loader", "sharded", "parquet", "dali") == [
        "sampler",
        "loader",
        "sharded",
        "parquet",
        "dali",
    ]


@pytest.mark.slow  # starts its own local Ray cluster
def test_data_sources_example_ray_data_runs():
    assert _run("ray_data") == ["ray data"]
