"""The README's commands and snippets stay true: snippets come from files that run in CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    first_block = re.search(r"```bash\n(.*?)```", _readme(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "make test" in f.read()


def _snippets():
    for m in re.finditer(r"<!-- snippet: (\S+) -->\n```(\w+)\n(.*?)```", _readme(), re.S):
        yield m.group(1), m.group(2), m.group(3)


def _guide_snippets():
    guides = os.path.join(ROOT, "docs", "guides")
    for name in sorted(os.listdir(guides)) if os.path.isdir(guides) else []:
        with open(os.path.join(guides, name)) as f:
            text = f.read()
        for m in re.finditer(r"<!-- snippet: (\S+) -->\n```(\w+)\n(.*?)```", text, re.S):
            yield pytest.param(m.group(1), m.group(2), m.group(3), id=f"{name}:{m.group(1)}")


@pytest.mark.parametrize("path, lang, body", [*_snippets(), *_guide_snippets()])
def test_readme_snippets_are_taken_from_files_that_run(path, lang, body):
    with open(os.path.join(ROOT, path)) as f:
        source_lines = [line.strip() for line in f]
    for line in body.splitlines():
        if lang == "diff":
            if line.startswith("-") or line.strip() in ("", "..."):
                continue
            line = line[1:]
        if line.strip():
            assert line.strip() in source_lines, f"README line not in {path}: {line.strip()!r}"


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
