"""The README and the documentation site stay true: their commands and snippets come from files that
run in CI, their Python blocks run here, and every page is in the site's navigation with its links
resolving.

Every ```python block of the README and of docs/ carries one of these markers on the line above it:

* ``<!-- snippet: PATH -->``: every line of the block (the ``+`` and context lines of a ``diff``)
  is a line of PATH, a file that runs in CI (an example);
* ``<!-- runnable -->``: the page's runnable blocks run in order, in one namespace, in a fresh
  directory that holds ``cf_ray_runs/my-run`` (a run with committed checkpoints of a small model);
* ``<!-- runnable: ray -->``: the same on the tests' local Ray cluster (a ``Checkpointer`` outside
  Ray Train);

or is a whole example included as it is (``--8<-- "examples/train_ddp.py"``, which the site's build
resolves).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = pathlib.Path(ROOT) / "docs"

#: ``<!-- marker -->`` (optional) on the line above a fenced block at any indent, the language, the body.
_BLOCK = re.compile(
    r"(?:^<!-- (?P<marker>[^>]*?) -->\n)?^(?P<indent>[ ]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M
)


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _pages() -> list[pathlib.Path]:
    """The README and every page of the site."""
    return [pathlib.Path(ROOT) / "README.md", *sorted(DOCS.rglob("*.md"))]


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _blocks(path: pathlib.Path):
    """(marker or None, language, body) of every fenced block of a page, in order."""
    for m in _BLOCK.finditer(path.read_text()):
        body = "\n".join(line[len(m.group("indent")) :] for line in m.group("body").splitlines())
        yield m.group("marker"), m.group("lang"), body


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    first_block = re.search(r"```bash\n(.*?)```", _readme(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert "make test" in ci, "CI runs the README's test command"
    assert ci.index("make lint") < ci.index("make docs") < ci.index("make test"), (
        "CI builds the docs after lint, before the tests"
    )
    promises = [i for i, line in enumerate(ci) if line.startswith(("make test-promises", "if ! make test-promises"))]
    assert promises and min(promises) > ci.index("make test"), (
        "CI runs the promise tests (the nightly real runs) after the README's test command"
    )


def test_the_readme_is_a_front_page():
    lines = _readme().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move the detail into docs/"


def _snippets():
    for page in _pages():
        for marker, lang, body in _blocks(page):
            if marker and marker.startswith("snippet: "):
                yield pytest.param(marker.split(": ", 1)[1], lang, body, id=f"{_rel(page)}:{marker[9:]}")


@pytest.mark.parametrize("path, lang, body", list(_snippets()))
def test_snippets_are_taken_from_files_that_run(path, lang, body):
    with open(os.path.join(ROOT, path)) as f:
        source_lines = [line.strip() for line in f]
    for line in body.splitlines():
        if lang == "diff":
            if line.startswith("-") or line.strip() in ("", "..."):
                continue
            line = line[1:]
        if line.strip():
            assert line.strip() in source_lines, f"snippet line not in {path}: {line.strip()!r}"


#: A block that is a whole file of the repository (pymdownx.snippets: ``--8<-- "examples/train_ddp.py"``).
_INCLUDE = re.compile(r'--8<-- "([^"]+)"')


def test_every_python_block_is_a_snippet_or_runs():
    unmarked = [
        f"{_rel(page)}: {body.splitlines()[0] if body else ''!r}"
        for page in _pages()
        for marker, lang, body in _blocks(page)
        if lang == "python"
        and not (marker and re.fullmatch(r"snippet: \S+|runnable(: ray)?", marker))
        and not _INCLUDE.fullmatch(body.strip())
    ]
    assert unmarked == [], "mark each block <!-- snippet: PATH --> or <!-- runnable -->: " + "; ".join(unmarked)


def _runnable_pages():
    for page in _pages():
        blocks = [(marker, body) for marker, lang, body in _blocks(page) if marker and marker.startswith("runnable")]
        if blocks:
            ray = any(marker == "runnable: ray" for marker, _ in blocks)
            # A Checkpointer on Ray starts its controller and holder actors: a few seconds each.
            marks = [pytest.mark.slow] if ray else []
            yield pytest.param(page, [body for _, body in blocks], ray, id=_rel(page), marks=marks)


@pytest.fixture
def docs_workspace(tmp_path, monkeypatch):
    """A directory with ``cf_ray_runs/my-run``: committed checkpoints of steps 5 and 10 of
    ``Sequential(Linear(4, 8), ReLU(), Linear(8, 2))`` and its final model at step 12, as the
    engine writes them, and a profile table."""
    import torch

    from cf_ray import report
    from cf_ray._engine.format.layout import step_dir
    from cf_ray._engine.format.safetensors import write_final_model
    from cf_ray._engine.storage.fs import FsStorage

    from storage_helpers import write_checkpoint

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    storage = FsStorage.from_uri(str(tmp_path / "cf_ray_runs")).child("my-run/cf_ray")
    for step in (5, 10):
        write_checkpoint(storage, step, model(step))
    write_final_model(storage, step_dir(12, "final"), model(12), step=12, epoch=1)
    rows = [
        {"step": s, "epoch": 0, "kind": "scheduled", "generation": 1, "interval": 5, "stall_s": 0.01, "committed": True}
        for s in (5, 10)
    ]
    report.save_profile(storage, rows, [])
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("page, blocks, ray", list(_runnable_pages()))
def test_runnable_blocks_run(page, blocks, ray, docs_workspace, request):
    if ray:
        request.getfixturevalue("ray_cluster")
    namespace: dict = {"__name__": "__docs__"}
    for i, body in enumerate(blocks, 1):
        code = compile(body, f"{_rel(page)} (runnable block {i})", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_the_configuration_page_names_every_field_and_environment_variable():
    import dataclasses

    from cf_ray import _version
    from cf_ray._engine import env
    from cf_ray.config import CheckpointConfig, PreemptionConfig

    page = (DOCS / "guides" / "configuration.md").read_text()
    fields = [f.name for cls in (CheckpointConfig, PreemptionConfig) for f in dataclasses.fields(cls)]
    variables = [v for k, v in vars(env).items() if k.isupper() and isinstance(v, str) and v.startswith("CF_RAY_")]
    variables.append(_version.ALLOW_UNTESTED_RAY)
    missing = [name for name in fields + variables if f"| `{name}` |" not in page]
    assert missing == [], f"docs/guides/configuration.md has no row for {missing}"


def _help_blocks():
    for marker, _, body in _blocks(DOCS / "reference" / "cli.md"):
        if marker and marker.startswith("help: "):
            yield pytest.param(marker[len("help: ") :].split(), body, id=marker)


@pytest.mark.parametrize("argv, body", list(_help_blocks()))
def test_the_command_line_reference_shows_the_current_help(argv, body, monkeypatch, capsys):
    from cf_ray import cli

    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    try:
        cli.main(argv)
    except SystemExit as e:  # argparse's --help
        assert e.code == 0
    assert capsys.readouterr().out.rstrip("\n") == body, f"regenerate docs/reference/cli.md: cf-ray {' '.join(argv)}"


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_nav_once():
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python/name tags; the nav does not need them
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        config = yaml.load(f, Loader=Loader)
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    not_pages, not_in_nav = sorted(set(nav) - set(pages)), sorted(set(pages) - set(nav))
    assert sorted(set(nav)) == pages, f"in the nav, not a page: {not_pages}; a page, not in the nav: {not_in_nav}"
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_resolves():
    """Links between pages and to the repository's files (the README's; the site's own pages link only
    inside docs/, which mkdocs --strict checks with their anchors)."""
    broken = []
    for page in _pages():
        text = re.sub(r"^([ ]*)```.*?^\1```", "", page.read_text(), flags=re.S | re.M)  # not inside code blocks
        for target in _LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            inside = DOCS.resolve() in path.parents or page.name == "README.md" and page.parent == pathlib.Path(ROOT)
            if not path.exists() or not inside:
                broken.append(f"{_rel(page)} -> {target}")
    assert broken == [], broken


@pytest.mark.slow
def test_example_train_ddp_runs_and_resumes(tmp_path):
    env = dict(
        os.environ,
        CF_RAY_EXAMPLE_EPOCHS="2",
        CF_RAY_EXAMPLE_SAMPLES="256",
        RAY_ADDRESS="local",
        CF_RAY_CONTROLLER_LINGER_S="2",
    )
    cmd = [
        sys.executable,
        os.path.join(ROOT, "examples", "train_ddp.py"),
        "--storage-path",
        str(tmp_path),
        "--hidden",
        "32",
        "--name",
        "ex",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "final model:" in out.stdout and "final_" in out.stdout
    assert "checkpoints:" in out.stdout


@pytest.mark.slow
def test_example_spot_training_runs(tmp_path):
    """The spot example on its own multi-node cluster: a real drain of rank 1's node through Ray's
    drain path (reason preemption, a deadline that fits), the just-in-time checkpoint durable before
    the deadline, no step lost, the final state bitwise equal to the uninterrupted run (it exits 1
    otherwise)."""
    env = dict(os.environ, RAY_ADDRESS="local", CF_RAY_CONTROLLER_LINGER_S="2")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "spot_training.py"), "--dir", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "`ray drain-node` (preemption)" in out.stdout
    # The just-in-time checkpoint is durable before the deadline, at most one step is lost (none
    # expected), and the restarted group's final state is bitwise the uninterrupted run's.
    assert re.search(r"\| yes, [0-9.]+ s after the notice \| [01] \(done \d+, resumed at \d+\) \|", out.stdout), (
        out.stdout
    )
    assert re.search(r"\| (memory|storage) \| yes \|", out.stdout), out.stdout


@pytest.mark.slow
def test_example_train_fsdp_runs_and_resumes_resharded(tmp_path):
    """The FSDP2 example: a run with 2 workers, then the same run again with 1 worker, which
    resumes from its storage with the shards re-split."""
    env = dict(
        os.environ,
        CF_RAY_EXAMPLE_EPOCHS="1",
        CF_RAY_EXAMPLE_SAMPLES="256",
        RAY_ADDRESS="local",
        CF_RAY_CONTROLLER_LINGER_S="2",
    )
    base = [sys.executable, os.path.join(ROOT, "examples", "train_fsdp.py"), "--storage-path", str(tmp_path)]
    base += ["--hidden", "32", "--name", "fs"]
    first = subprocess.run(base, env=env, capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "final model:" in first.stdout
    env["CF_RAY_EXAMPLE_EPOCHS"] = "2"
    second = subprocess.run(base + ["--workers", "1"], env=env, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert re.search(r"resumed at step \d+ from storage, saved by 2 workers", out), out[-3000:]


def test_the_architecture_layout_names_every_module():
    """docs/ARCHITECTURE.md's layout section lists every module of cf_ray/ (issue 24): a module added
    or moved without its line there fails here."""
    text = (DOCS / "ARCHITECTURE.md").read_text()
    start = text.index("## Package layout")
    layout = text[start : text.index("\n## ", start + 1)]
    modules = sorted(p for p in (pathlib.Path(ROOT) / "cf_ray").rglob("*.py") if p.name != "__init__.py")
    missing = [str(p.relative_to(ROOT)) for p in modules if not re.search(rf"\b{re.escape(p.name)}\b", layout)]
    assert missing == [], f"docs/ARCHITECTURE.md's layout has no line for {missing}"


#: What a page says of a feature it calls missing.
_MISSING = r"\bno\b[^.;]*\byet\b|\bnot yet (?:supported|available|implemented|shipped)\b|\bbeing built\b|\bnot supported\b|\bunsupported\b|\bnot implemented\b|\bcoming soon\b"

#: Features that ship: the module and public name that provide each (checked in the source, so the table
#: itself stays true without importing a trainer framework), the words that name the feature on a page,
#: what would be false of it, and the words of a sentence about another variant of it, which may be true
#: (Ray Data under Ray's own split does resume another world size only at an epoch boundary).
_SHIPPED = [
    ("cf_ray.integrations.huggingface", "CfRayCallback", r"Hugging Face|transformers\.Trainer|\bHF\b", _MISSING, None),
    ("cf_ray.integrations.lightning", "CfRayCallback", r"Lightning", _MISSING, None),
    (
        "cf_ray.data.ray_elastic",
        "elastic_data_config",
        r"Ray Data",
        _MISSING + r"|\bonly at (?:an )?epoch boundar",
        r"Ray's (?:own )?split|ordered_data_config",
    ),
    ("cf_ray.data.stateful_loader", "is_stateful_dataloader", r"StatefulDataLoader|torchdata", _MISSING, None),
    ("cf_ray.data.dali", "ResumableDALIIterator", r"\bDALI\b", _MISSING, None),
    ("cf_ray.preemption", "CheckpointBeforeResize", r"elastic group|resize", _MISSING, None),
    ("cf_ray._export", "export_dcp_dir", r"\bDCP\b", _MISSING, None),
]


def _sentences(text: str):
    """The sentences of a page outside code blocks: a bullet, a table row and a paragraph are split at
    each full stop that ends a sentence."""
    text = re.sub(r"^([ ]*)```.*?^\1```", "", text, flags=re.S | re.M)
    for unit in re.split(r"\n\s*\n|\n(?=\s*(?:[-*] |\d+\. |\|))", text):
        yield from re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", " ".join(unit.split()))


def _defines(module: str, name: str) -> bool:
    """Whether the module's source (read, not imported: no trainer framework is loaded) defines it."""
    path = pathlib.Path(ROOT, *module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    source = path.read_text() if path.exists() else ""
    return re.search(rf"^(class|def) {name}\b|^{name} = ", source, re.M) is not None


def test_the_shipped_features_table_names_what_cf_ray_defines():
    missing = [f"{module}.{name}" for module, name, *_ in _SHIPPED if not _defines(module, name)]
    assert missing == [], f"tests/test_docs.py _SHIPPED names what cf_ray does not define: {missing}"


def test_no_page_calls_a_shipped_feature_missing():
    wrong = []
    for page in _pages():
        for sentence in _sentences(page.read_text()):
            for module, name, words, false, other_variant in _SHIPPED:
                if not (re.search(words, sentence) and re.search(false, sentence, re.I)):
                    continue
                if not (other_variant and re.search(other_variant, sentence)):
                    wrong.append(f"{_rel(page)}: {sentence[:160]!r} ({module}.{name} ships)")
    assert wrong == [], "a page calls a shipped feature missing: " + "; ".join(wrong)


#: A test cited on a page: ``tests/PATH.py::test_name`` (a parametrized id may follow).
_TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)(?:\[[^\]]*\])?`")


def _limits() -> list[str]:
    """The bullets of docs/limitations.md, each joined into one line."""
    text = (DOCS / "limitations.md").read_text()
    return [" ".join(b.split()) for b in re.findall(r"^- (.*?)(?=^- |^#|\Z)", text, re.S | re.M)]


def test_every_limitation_cites_the_test_that_shows_it_or_the_designs_known_limits():
    """A limit is a claim about the code: it names a test that exists (the refusal, the behaviour), the
    benchmark that measured the figure it quotes, or the design's known limits, which explain what no
    test here can show."""
    limits = _limits()
    assert limits, "docs/limitations.md has no bullets"
    uncited, absent = [], []
    for limit in limits:
        tests = _TEST_ID.findall(limit)
        measured = "](benchmarks/" in limit and re.search(r"\d %", limit)  # figures: the README's (below)
        if not tests and not measured and "ARCHITECTURE.md#known-limits" not in limit:
            uncited.append(limit[:80])
        for path, name in tests:
            file = pathlib.Path(ROOT) / path
            if not file.exists() or not re.search(rf"^def {name}\(", file.read_text(), re.M):
                absent.append(f"{path}::{name}")
    assert uncited == [], f"docs/limitations.md: limits that cite neither a test nor the design: {uncited}"
    assert absent == [], f"docs/limitations.md cites tests that do not exist: {absent}"


def test_the_limitations_quote_the_readmes_figures():
    """An overhead the limitations page quotes is one the README quotes (the same run, the same number)."""
    readme = _readme()
    figures = re.findall(r"[+-]\d+(?:\.\d+)? ?%", (DOCS / "limitations.md").read_text())
    assert [f for f in figures if f not in readme] == []


def _cost_rows(text: str) -> list[str]:
    """The rows of the cost table (the one whose header starts ``| setting (state) |``)."""
    start = text.index("| setting (state) |")
    return text[start : text.index("\n\n", start)].splitlines()


def test_the_docs_home_and_the_package_page_show_the_readmes_cost_table():
    readme = _cost_rows(_readme())
    assert len(readme) >= 4, "README.md's cost table has no rows"
    assert _cost_rows((DOCS / "index.md").read_text()) == readme, "docs/index.md's cost table is not the README's"
    assert _cost_rows((pathlib.Path(ROOT) / "README.pypi.md").read_text()) == readme, (
        "README.pypi.md's cost table is not the README's"
    )


def test_the_package_page_works_without_the_repository():
    """README.pypi.md is the long description an index shows, where no file of the repository is:
    no relative link, and its diff is the example's, like the README's."""
    page = pathlib.Path(ROOT) / "README.pypi.md"
    text = page.read_text()
    relative = [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    assert relative == [], f"README.pypi.md links where an index page cannot: {relative}"
    (diff,) = [body for _, lang, body in _blocks(page) if lang == "diff"]
    readme_diffs = [body for _, lang, body in _blocks(pathlib.Path(ROOT) / "README.md") if lang == "diff"]
    assert diff in readme_diffs, "README.pypi.md's diff is not the README's (which tests/test_docs.py checks)"


#: The Checkpointer's members that are handles of cf_ray's internals (its actors, its storage, its
#: preemption watcher) or a benchmark's diagnostic: public attributes, not part of the documented API.
_CHECKPOINTER_INTERNAL = {"controller", "holder", "storage", "preemption", "cpu_budget"}


def test_the_checkpointer_reference_leads_with_the_training_loops_calls_and_hides_internal_handles():
    import inspect

    import yaml

    from cf_ray import Checkpointer

    text = (DOCS / "reference" / "package.md").read_text()
    m = re.search(r"^::: cf_ray\.Checkpointer\n((?:[ ]{4}.*\n)+)", text, re.M)
    assert m, "docs/reference/package.md has no '::: cf_ray.Checkpointer' block"
    options = yaml.safe_load("\n".join(line[4:] for line in m.group(1).splitlines()))["options"]
    listed = options.get("members")
    assert isinstance(listed, list), "the Checkpointer block lists its members in order (options: members:)"
    assert listed[:5] == ["restore", "step", "end_epoch", "finish", "save"], listed
    assert options.get("group_by_category") is False, "grouped by category, the list's order is lost"
    public = {n for n, _ in inspect.getmembers(Checkpointer) if not n.startswith("_")}
    public |= {n for n in vars(Checkpointer).get("__annotations__", {}) if not n.startswith("_")}
    source = inspect.getsource(Checkpointer)
    public |= set(re.findall(r"^        self\.([a-z]\w*)\b[^=\n]*=", source, re.M))  # instance attributes
    assert sorted(set(listed) - public) == [], "the reference lists members the Checkpointer does not have"
    shown_internal = sorted(set(listed) & _CHECKPOINTER_INTERNAL)
    assert shown_internal == [], f"internal handles in the reference: {shown_internal}"
    documented = {n for n in public - _CHECKPOINTER_INTERNAL if (getattr(Checkpointer, n, None).__doc__ or "")}
    unlisted = sorted(n for n in documented if n not in listed and callable(getattr(Checkpointer, n, None)))
    assert unlisted == [], f"a documented method of Checkpointer left out of the reference: {unlisted}"


def test_no_initializer_code_in_the_api_reference():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        config = yaml.load(f, Loader=Loader)
    (handler,) = [p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p]
    options = handler["handlers"]["python"]["options"]
    assert options.get("show_attribute_values") is False
    # A signature's defaults as the site's build computes them, with mkdocs.yml's griffe extensions:
    # a dataclass field's default_factory is shown as its value, not as the lambda griffe writes.
    import griffe

    extensions = griffe.load_extensions(*(os.path.join(ROOT, e) if ".py:" in e else e for e in options["extensions"]))
    package = griffe.load("cf_ray", search_paths=[ROOT], extensions=extensions)
    code = []

    def walk(obj):
        for name, member in obj.members.items():
            if member.is_alias or (name.startswith("_") and name != "__init__"):  # the reference shows public names
                continue
            if isinstance(member, griffe.Function):
                code.extend(
                    f"{member.path}({p.name}={p.default})" for p in member.parameters if "lambda" in str(p.default)
                )
            walk(member)

    walk(package)
    assert code == [], f"initializer code in the API reference's signatures: {code}"


#: Development history on a page for users: an issue of the project's tracker (``#25``, ``issue 24``;
#: another project's ``PR #N`` is a citation), a commit (``at 2a6e9b0``, ``(c560c69)``), a scratch directory.
_HISTORY = re.compile(
    r"(?<!PR )(?<![\w/&])#\d{1,3}\b|\bissues? \d+\b|/tmp/|\b(?:at|in|since|of) [0-9a-f]{7,40}\b|\([0-9a-f]{7,40}[;,)]"
)

#: Where the development history is kept: the benchmarks' history page and the design document.
_HISTORY_PAGES = {"docs/benchmarks/history.md", "docs/ARCHITECTURE.md"}


def test_user_pages_carry_no_development_history():
    found = []
    for page in _pages():
        if _rel(page) in _HISTORY_PAGES:
            continue
        text = re.sub(r"^([ ]*)```.*?^\1```", "", page.read_text(), flags=re.S | re.M)  # outside code blocks
        for line in text.splitlines():
            found += [f"{_rel(page)}: {m.group(0)!r} in {line.strip()[:100]!r}" for m in _HISTORY.finditer(line)]
    assert found == [], "development history on a user's page (it goes to docs/benchmarks/history.md): " + "; ".join(
        found
    )


def test_every_benchmark_page_opens_with_its_current_figures():
    """A reader meets what holds for the code as it is first; dated sessions are on the history page."""
    wrong = []
    for page in sorted((DOCS / "benchmarks").glob("*.md")):
        if page.name in ("history.md", "json-keys.md"):
            continue
        sections = re.findall(r"^## (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M)
        if not sections or sections[0] != "Current figures":
            wrong.append(f"{page.name}: first section {sections[:1]}")
    assert wrong == [], wrong


def test_the_benchmark_pages_quote_the_readmes_figures():
    """Every figure of the README's cost table is on the benchmark page of its row, as the README has it."""
    pages = {
        "2 CPU cores, a core free": "single-node.md",
        "2 CPU cores, both training (302 MB)": "single-node.md",
        "FSDP2": "fsdp2.md",
        "H200": "gpu.md",
    }
    missing = []
    for row in _cost_rows(_readme())[2:]:
        (page,) = [p for key, p in pages.items() if key in row]
        text = (DOCS / "benchmarks" / page).read_text()
        for figure in re.findall(r"[+−-]?\d+\.\d+ % \[[^\]]+\]", row):
            if figure not in text:
                missing.append(f"{page}: {figure}")
    assert missing == [], f"figures of the README's cost table missing from their pages: {missing}"
