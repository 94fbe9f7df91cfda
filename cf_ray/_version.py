"""cf_ray's version, the Ray versions it was tested with, and the check of the installed Ray at import.

cf_ray reaches into Ray Train internals that change between minor releases (the run's storage
context, the checkpoint registration, the worker group's restarts), so it supports exactly the Ray
minor versions its test suite ran with: ``RAY_SUPPORTED`` (the ``ray[train]`` pin in
``pyproject.toml`` says the same; ``tests/test_public_api.py`` checks that the two agree). Importing
``cf_ray`` with another Ray raises an ``ImportError`` that names the range; setting
``CF_RAY_ALLOW_UNTESTED_RAY=1`` skips the check (at your own risk: run the test suite first).

The check is cheap, as every cf_ray actor process imports ``cf_ray``: the version of an already
imported ``ray`` module, else the installed distribution's metadata; nothing is imported from Ray.
"""

from __future__ import annotations

import os
import re
import sys

# ``CF_RAY_ALLOW_UNTESTED_RAY``: set to ``1`` to import cf_ray with a Ray outside RAY_SUPPORTED anyway
# (named with the other environment variables, in the one list of them).
from cf_ray._engine.env import ALLOW_UNTESTED_RAY

__version__ = "0.1.0"

#: The Ray versions cf_ray was tested with, as a pip specifier (``pyproject.toml``'s ``ray[train]`` pin).
RAY_SUPPORTED = ">=2.60,<2.61"
#: The same as ``(major, minor)`` bounds: lowest supported (inclusive), first unsupported (exclusive).
RAY_LOWEST = (2, 60)
RAY_BELOW = (2, 61)

_RELEASE = re.compile(r"^(\d+)\.(\d+)")


def installed_ray_version() -> str | None:
    """The version of the Ray that ``import ray`` finds (``None``: not installed)."""
    ray = sys.modules.get("ray")
    version = getattr(ray, "__version__", None)
    if isinstance(version, str):
        return version
    from importlib import metadata

    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


def check_ray_version(version: str | None = None) -> None:
    """Refuse a Ray that cf_ray was not tested with, unless ``CF_RAY_ALLOW_UNTESTED_RAY=1``.

    Args:
        version: the Ray version to check (default: the installed one).

    Raises:
        ImportError: Ray is missing, or its version is outside :data:`RAY_SUPPORTED`; the message
            names the supported range and how to override the check.
    """
    if os.environ.get(ALLOW_UNTESTED_RAY, "").strip().lower() in ("1", "true", "yes"):
        return
    version = installed_ray_version() if version is None else version
    how = (
        f"install a supported one (pip install 'ray[train]{RAY_SUPPORTED}'), or set {ALLOW_UNTESTED_RAY}=1 "
        "to use this one anyway, untested"
    )
    if version is None:
        raise ImportError(f"cf_ray needs Ray (ray[train]{RAY_SUPPORTED}), and none is installed: {how}")
    m = _RELEASE.match(version)
    release = (int(m.group(1)), int(m.group(2))) if m else None
    if release is None or not RAY_LOWEST <= release < RAY_BELOW:
        raise ImportError(
            f"cf_ray {__version__} was tested with Ray {RAY_SUPPORTED}, and Ray {version} is installed: "
            f"cf_ray relies on Ray Train internals that change between Ray versions. {how[0].upper()}{how[1:]}"
        )
