"""cf_ray's actor processes (controller, holder) start in every fit(); they must stay light."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import cf_ray

ACTOR_ROOMS = ("_engine/node", "_engine/driver", "_engine/memory", "_engine/protocol")
"""Folders of ``cf_ray`` whose modules run in the actor processes: nothing there imports torch."""


def _python(code: str) -> str:
    """What ``code`` prints, run by a fresh interpreter (what it imports is its own); fails the test,
    showing its stderr, when it does not exit 0."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_actor_modules_do_not_import_torch_or_pandas():
    code = (
        "import sys, cf_ray._engine.driver.controller, cf_ray._engine.node.holder, cf_ray.report, "
        "cf_ray._engine.format.layout, cf_ray._engine.format.commit, cf_ray._engine.format.sections, "
        "cf_ray._engine.format.blocks, cf_ray._engine.format.catalog; "
        "print(sorted(m for m in ('torch', 'pandas', 'pyarrow.parquet') if m in sys.modules))"
    )
    out = _python(code)
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
    out = _python(code)
    assert out.strip() == "[]"


def test_a_holder_checking_a_sections_bytes_never_imports_torch():
    """The writer checks a slot's bytes against the index's block CRCs and a peer checks a copy's:
    both read the blocks only. Parsing the whole index imports torch for an entry of kind "torch"
    (RNG state): in the holder, on its writer's thread, that import held a just-in-time checkpoint
    past its deadline (test_spot). Checked where it runs: a process of the node room only."""
    code = (
        "import sys, zlib\n"
        "from cf_ray._engine.node import writer, replicator\n"
        "from cf_ray._engine.node.slot_store import Held\n"
        "data = memoryview(bytearray(b'x' * 5000))\n"
        "crc = zlib.crc32(data)\n"
        'index = (\'{"entries":[{"name":"rng.torch","dtype":"uint8","shape":[5000],"offset":0,\'\n'
        '         \'"nbytes":5000,"kind":"torch"}],"tree":{},"blocks":{"bytes":262144,"crc32":[%d]}}\' % crc).encode()\n'
        "h = Held(1, 5, 'rank_00000', None, index, crc, None)\n"
        "writer._check_blocks(h, data)\n"
        "print('torch' in sys.modules)"
    )
    out = _python(code)
    assert out.strip() == "False"


def test_the_ray_data_split_modules_do_not_import_torch():
    # They run in Ray Train's dataset manager and in the block-stream actor (Ray Data imports pandas there).
    code = "import sys, cf_ray._engine.data.block_stream; print('torch' in sys.modules)"
    out = _python(code)
    assert out.strip() == "False"


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


#: Documents whose ``cf_ray.<name>`` expressions a user may type after ``import cf_ray`` (ARCHITECTURE.md
#: names actors and internal modules, not attributes, and is left out).
_USER_DOCS = ("README.md", "docs/**/*.md", "examples/*.py", "notebooks/make_notebook.py", "benchmarks/README.md")
#: Dotted names in those documents that are not Python attributes: JSON schema ids and actor names.
_NOT_EXPRESSIONS = ("cf_ray.bench", "cf_ray.holder", "cf_ray.controller")


def _documented_expressions() -> list[str]:
    import re

    repo = pathlib.Path(__file__).resolve().parents[1]
    found: set[str] = set()
    for pattern in _USER_DOCS:
        for path in repo.glob(pattern):
            if path.name == "ARCHITECTURE.md":
                continue
            for m in re.finditer(r"\bcf_ray(?:\.[A-Za-z_][A-Za-z0-9_]*)+", path.read_text()):
                expr = m.group(0)
                if not expr.startswith("cf_ray._") and not expr.startswith(_NOT_EXPRESSIONS):
                    found.add(expr)
    return sorted(found)


def test_every_documented_dotted_expression_works_after_import_cf_ray_alone():
    exprs = _documented_expressions()
    # The README's own examples (issue 29): they must be among what is checked.
    assert {"cf_ray.preemption.CheckpointBeforeResize", "cf_ray.data.ordered_data_config"} <= set(exprs)
    code = (
        "import sys, cf_ray\n"
        "eager = sorted(m for m in ('cf_ray.data', 'cf_ray.policy', 'cf_ray.preemption', 'cf_ray.report', 'torch')"
        " if m in sys.modules)\n"
        "assert eager == [], f'import cf_ray alone imported {eager}'\n"
        "bad = []\n"
        f"for e in {exprs!r}:\n"
        "    try:\n"
        "        eval(e)\n"
        "    except AttributeError as x:\n"
        "        bad.append(f'{e}: {x}')\n"
        "print(bad)\n"
    )
    out = _python(code)
    assert out.strip() == "[]", out


def test_public_submodules_are_attributes_of_the_package():
    for name in ("config", "data", "policy", "preemption", "report"):
        assert name in dir(cf_ray)
        assert getattr(cf_ray, name).__name__ == f"cf_ray.{name}"


def test_cf_ray_and_its_integrations_package_import_no_trainer_framework():
    """The framework comes with its integration module (``cf_ray.integrations.huggingface`` /
    ``.lightning``), never with ``import cf_ray``: a loop without Hugging Face or Lightning does not
    pay for them (seconds of CPU per worker)."""
    code = (
        "import sys, cf_ray, cf_ray.integrations, cf_ray.checkpointer, cf_ray.data; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    out = _python(code)
    assert out.strip() == "[]"
