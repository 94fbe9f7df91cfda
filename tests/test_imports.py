"""cf_ray's actor processes (controller, holder) start in every fit(); they must stay light."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import cf_ray

ACTOR_ROOMS = ("_engine/node", "_engine/driver")
"""Folders of ``cf_ray`` whose modules run in the actor processes: nothing there imports torch."""


def test_actor_modules_do_not_import_torch_or_pandas():
    code = (
        "import sys, cf_ray._engine.driver.controller, cf_ray._engine.node.holder, cf_ray.report, "
        "cf_ray._engine.format.manifest; "
        "print(sorted(m for m in ('torch', 'pandas', 'pyarrow.parquet') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _modules_under(folder: str) -> list[str]:
    root = pathlib.Path(cf_ray.__file__).parent
    return sorted(
        ".".join(("cf_ray", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for p in (root / folder).rglob("*.py")
    )


def test_no_module_of_the_node_and_driver_rooms_imports_torch_or_pandas():
    modules = [m for folder in ACTOR_ROOMS for m in _modules_under(folder)]
    assert "cf_ray._engine.driver.controller" in modules and "cf_ray._engine.node.holder" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_names_load_on_first_use():
    assert set(cf_ray.__all__) <= set(dir(cf_ray))
    for name in cf_ray.__all__:
        assert getattr(cf_ray, name).__name__ == name
    try:
        cf_ray.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("a missing name must raise AttributeError")


def test_cf_ray_and_its_integrations_package_import_no_trainer_framework():
    """The framework comes with its integration module (``cf_ray.integrations.huggingface`` /
    ``.lightning``), never with ``import cf_ray``: a loop without Hugging Face or Lightning does not
    pay for them (seconds of CPU per worker)."""
    code = (
        "import sys, cf_ray, cf_ray.integrations, cf_ray.checkpointer, cf_ray.data; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
