"""cf_ray's actor processes (controller, holder) start in every fit(); they must stay light."""

from __future__ import annotations

import subprocess
import sys

import cf_ray


def test_actor_modules_do_not_import_torch_or_pandas():
    code = ("import sys, cf_ray._engine.driver.controller, cf_ray._engine.node.holder, cf_ray.report, cf_ray._engine.format.manifest; "
            "print(sorted(m for m in ('torch', 'pandas', 'pyarrow.parquet') if m in sys.modules))")
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
