"""``cf-ray demo``: it never deletes what it did not create (``--dir``)."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from cf_ray import cli, demo


def _demo(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["demo", *[str(a) for a in argv]])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_directory_the_demo_did_not_make_is_refused_and_left_untouched(tmp_path, capsys):
    mine = tmp_path / "runs"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    (mine / "sub" / "model.pt").write_bytes(b"weights")
    rc, out, err = _demo(capsys, "--dir", mine)
    assert rc == 2 and not out
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "sub" / "model.pt").read_bytes() == b"weights"
    assert sorted(os.listdir(mine)) == ["notes.txt", "sub"], "nothing added either"
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(mine) in err and "not made by cf-ray demo" in err and "choose a new or empty directory" in err


def test_a_file_given_as_the_directory_is_refused(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("precious")
    rc, _, err = _demo(capsys, "--dir", f)
    assert rc == 2 and f.read_text() == "precious"
    assert "is not a directory" in err and len(err.strip().splitlines()) == 1


def test_only_a_directory_the_demo_made_is_emptied(tmp_path):
    fresh = tmp_path / "a" / "demo"
    assert demo.prepare_dir(str(fresh)) is None
    assert os.listdir(fresh) == [demo.MARKER]  # created and marked
    (fresh / "out").mkdir()
    (fresh / "out" / "result.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("keep")
    os.symlink(tmp_path / "elsewhere", fresh / "link")  # a link inside is removed, not followed
    assert demo.prepare_dir(str(fresh)) is None  # a second run: emptied, marked again
    assert os.listdir(fresh) == [demo.MARKER]
    assert (tmp_path / "elsewhere" / "keep.txt").read_text() == "keep"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert demo.prepare_dir(str(empty)) is None and os.listdir(empty) == [demo.MARKER]
    (tmp_path / "elsewhere" / "other").write_text("x")
    assert "not made by cf-ray demo" in (demo.prepare_dir(str(tmp_path / "elsewhere")) or "")
    assert sorted(os.listdir(tmp_path / "elsewhere")) == ["keep.txt", "other"]


@pytest.mark.slow
def test_what_the_demo_prints_is_true_and_its_next_commands_work(ray_cluster, tmp_path, capsys):
    """The whole demo at its smallest (two TorchTrainer runs of 4 steps): the kill is announced on a
    line of its own with what Ray will say about it; the closing table names the run directory, its
    counts agree with each other and with the run's profile, and the commands it prints work."""
    root = tmp_path / "demo"
    argv = ["--dir", root, "--epochs", 1, "--samples", 128, "--hidden", 16, "--interval", 2, "--kill-at", 3]
    rc, out, err = _demo(capsys, *argv)
    assert rc == 0, out + err
    lines = out.splitlines()
    kill = lines.index("  2/2 the same run, rank 1 SIGKILLed at step 3 ...")
    assert lines[kill + 1] == demo.KILL_NOTE and "Ray will report the killed worker's death" in demo.KILL_NOTE
    assert any(line.startswith("  2/2 done in ") for line in lines[kill + 2 :])
    table = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in lines
        if line.startswith("| ") and "|" in line[2:]
    }
    run_dir = str(root / "storage" / "interrupted")
    assert table["run directory"] == run_dir
    taken, before, after = (int(w) for w in re.findall(r"\d+", table["checkpoints taken (both attempts)"]))
    assert taken == before + after and before >= 1 and after >= 1
    committed = int(re.findall(r"\d+", table["of them committed to storage"])[0])
    assert table["of them failed to save"] == "0"
    assert table["final weights == uninterrupted run"].startswith("yes")
    source, step = re.match(r"(\w+) \(step (\d+),", table["restored from"]).groups()
    assert source in ("memory", "storage") and int(table["steps redone after the restart"]) == 3 - int(step)
    rows = json.loads(_cli_out(capsys, "profile", run_dir, "--all", "--json"))
    assert len(rows) == taken and sum(bool(r["committed"]) for r in rows) == committed
    nxt = next(i for i, line in enumerate(lines) if line.startswith("next, on this run"))
    commands = [line.strip() for line in lines[nxt + 1 :] if line.strip()]
    assert [c.split()[1] for c in commands] == ["ls", "verify", "profile", "export"]
    for command in commands:  # as printed, with the real path
        assert cli.main(shlex.split(command)[1:]) == 0, command
        capsys.readouterr()
    assert os.path.exists(root / "exported" / "model.safetensors")


def _cli_out(capsys, *argv) -> str:
    assert cli.main([str(a) for a in argv]) == 0
    return capsys.readouterr().out
