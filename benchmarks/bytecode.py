"""Bytecode for the repository's own modules, written before a run that starts many processes.

cf_ray is installed here in editable mode, so every Ray worker, actor and holder imports it from the
source tree; where ``PYTHONDONTWRITEBYTECODE`` is set (this project's machines, many Docker images)
none of them writes the ``.pyc`` files, and each compiles ~100 modules again at every start: 0.3-0.5 s
on a quiet core, 1.1-1.8 s measured inside a restarted Ray Train worker on a busy one, counted in
cf_ray's restore time by the failure benchmark while Ray's own modules (installed by pip, with
their bytecode) paid nothing. A user's ``pip install cf_ray`` writes the bytecode at install, as
pip does for every package; this does the same for a source checkout. ``compileall`` writes only
what is missing or stale (about 0.1 s when nothing is), whatever the variable says.

    python -m benchmarks.bytecode      # what the Makefile's targets run first
"""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cf_ray", "benchmarks", "tests", "examples")


def precompile(root: Path = ROOT) -> bool:
    """Write the bytecode of the repository's packages that is missing or stale; ``True`` when
    every file compiled (one that does not is left to the import, which reports it)."""
    ok = True
    for name in PACKAGES:
        if (root / name).is_dir():
            ok = bool(compileall.compile_dir(str(root / name), quiet=2)) and ok
    return ok


if __name__ == "__main__":
    precompile()
