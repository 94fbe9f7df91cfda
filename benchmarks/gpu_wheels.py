"""Builds ``.whl/``: the wheels a lent GPU machine needs to run ``benchmarks/gpu_run.sh``.

That machine (an H100/H200, Python 3.12, torch 2.11+cu130) has no Ray and no internet, and one call
carries at most 64 MiB of working tree. Ray 2.60.0's wheel alone is 79 MB, so a slimmed copy is
made: everything TorchTrainer does not import is dropped (the Java jars, the dashboard's web client,
RLlib, Serve, the LLM and Tune examples), and its RECORD rewritten to match. Beside it, the pure-Python and cp312
dependencies the image lacks (Ray core's jsonschema family, Ray Train's pydantic family and
tensorboardX, cf_ray's isal), at the versions of this project's environment.

    python benchmarks/gpu_wheels.py                    # .whl/ for the GPU machine (cp312)
    python benchmarks/gpu_wheels.py --python-version 3.11 --dest /tmp/whl311   # the same set for here

Never commit the wheels (``/.whl/`` is in ``.git/info/exclude``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RAY = "ray==2.60.0"
#: What the GPU image lacks of Ray core's, Ray Train's and cf_ray's dependencies (KINDS.md's package list).
EXTRA = (
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "tensorboardX==2.6.5",
    "isal==1.9.1",
)
#: Parts of the Ray wheel that TorchTrainer, ray.train.report and a local cluster never import.
DROP = (
    "ray/jars/",
    "ray/dashboard/client/",
    "ray/rllib/",
    "ray/serve/",
    "ray/llm/",
    "ray/tune/examples/",
    "ray/train/examples/",
    "ray/data/examples/",
    "ray/util/spark/",
    "ray/util/dask/",
    "ray/util/joblib/",
    "ray/util/multiprocessing/",
    "ray/tests/",
)


def _download(spec: str, dest: Path, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp"]
    for plat in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"):
        cmd += ["--platform", plat]
    subprocess.run([*cmd, "-d", str(dest), spec], check=True)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim(src: Path, dest_dir: Path) -> Path:
    """A copy of the wheel ``src`` without the ``DROP`` parts (same name), its RECORD rewritten."""
    out = dest_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        kept = []
        for info in zin.infolist():
            name = info.filename
            if name == record_name or name.startswith(DROP):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            kept.append(f"{name},{_record_hash(data)},{len(data)}")
        kept.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(kept) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", default=str(Path(__file__).resolve().parents[1] / ".whl"))
    p.add_argument("--python-version", default="3.12")
    args = p.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        _download(RAY, Path(tmp), args.python_version)
        (ray_whl,) = Path(tmp).glob("ray-*.whl")
        got = slim(ray_whl, dest)
        print(f"{got.name}: {ray_whl.stat().st_size / 2**20:.1f} MiB -> {got.stat().st_size / 2**20:.1f} MiB")
    for spec in EXTRA:
        _download(spec, dest, args.python_version)
    total = sum(f.stat().st_size for f in dest.glob("*.whl"))
    for f in sorted(dest.glob("*.whl")):
        print(f"  {f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    print(f"{dest}: {total / 2**20:.1f} MiB in {len(list(dest.glob('*.whl')))} wheels")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
