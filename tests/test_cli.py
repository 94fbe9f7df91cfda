"""``cf-ray``: one way to name a run (RUN) for every command, ``verify`` and ``export`` on real
checkpoints written by the engine's own phase-2 functions, and ``--help`` with an example."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from cf_ray import cli
from cf_ray._engine.format.commit import Manifest, commit
from cf_ray._engine.format.layout import MANIFEST, SHARED, rank_section, section_files, step_dir
from cf_ray._engine.format.safetensors import read_safetensors, write_final_model
from cf_ray._engine.format.sections import write_section
from cf_ray._engine.storage.fs import FsStorage

from storage_helpers import arena_of, write_checkpoint

COMMANDS = ("ls", "profile", "verify", "export")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def run_dir(tmp_path):
    """``<tmp>/runs/r``: committed step checkpoints 5 and 10 (the model of seed 5 and 10), an uncommitted
    step 15, and the final model at step 12 (seed 12). Returns (run directory, its cf_ray storage)."""
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r/cf_ray")
    for step in (5, 10):
        write_checkpoint(storage, step, _model(step))
    write_checkpoint(storage, 15, _model(15), commit=False)
    write_final_model(storage, step_dir(12, "final"), _model(12), step=12, epoch=1)
    return tmp_path / "runs" / "r", storage


#: A line Ray's log monitor forwards to this process's stderr from an actor of an earlier test (this
#: process is a Ray driver; a user's shell running ``cf-ray`` is not): ``(Holder pid=1234) ...``,
#: ``(raylet) ...``, possibly coloured.
_RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\((raylet|[\w.]+ pid=\d+[^)]*)\)")


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()  # what earlier calls left is not this command's
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    err = "".join(line for line in out.err.splitlines(keepends=True) if not _RAY_FORWARDED.match(line))
    return rc, out.out, err


def _lines(out: str) -> dict[int, str]:
    """verify's checkpoint lines by step (a step may have two: a resumable checkpoint and the final model)."""
    lines: dict[int, str] = {}
    for line in out.splitlines()[1:-1]:
        step = int(line.split()[0])
        lines[step] = lines.get(step, "") + line
    return lines


# -- verify -----------------------------------------------------------------------------------------------------


def test_verify_reports_every_committed_checkpoint_intact(run_dir, capsys):
    run, _ = run_dir
    rc, out, _ = _cli(capsys, "verify", run)
    assert rc == 0, out
    lines = _lines(out)
    assert sorted(lines) == [5, 10, 12]  # the uncommitted step 15 is no checkpoint
    assert "scheduled" in lines[5] and "OK (4 files" in lines[5]  # shared + rank 0: a data and an index file each
    assert "final" in lines[12] and "OK (1 file," in lines[12]
    assert out.splitlines()[-1].endswith("3 intact, 0 damaged")
    for where in (run / "cf_ray", f"file://{run}"):  # its cf_ray folder, a URI: the same run
        assert _cli(capsys, "verify", where)[1] == out


def test_verify_exits_1_and_names_the_file_when_a_byte_is_flipped(run_dir, capsys):
    run, storage = run_dir
    data = os.path.join(storage.fs_path(step_dir(10)), section_files(1, SHARED)[0])
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    rc, out, _ = _cli(capsys, "verify", run)
    assert rc == 1
    lines = _lines(out)
    assert "DAMAGED" in lines[10] and "g0001.shared.bin" in lines[10] and "checksum" in lines[10]
    assert str(storage.fs_path()) not in lines[10], "the file is named relative to its checkpoint"
    assert "OK" in lines[5] and "OK" in lines[12]
    assert out.splitlines()[-1].endswith("2 intact, 1 damaged")
    # The exit status of the command itself, as a shell script sees it.
    proc = subprocess.run([sys.executable, "-m", "cf_ray.cli", "verify", str(run)], capture_output=True, text=True)
    assert proc.returncode == 1 and "g0001.shared.bin" in proc.stdout
    assert _cli(capsys, "verify", run, "--step", 5)[0] == 0  # only that one


def test_verify_finds_a_truncated_file_a_missing_one_and_a_damaged_manifest(run_dir, capsys):
    run, storage = run_dir
    index = os.path.join(storage.fs_path(step_dir(5)), section_files(1, SHARED)[1])
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) - 3)
    os.unlink(os.path.join(storage.fs_path(step_dir(12, "final")), "model.safetensors"))
    manifest = os.path.join(storage.fs_path(step_dir(10)), MANIFEST)
    raw = open(manifest).read()
    with open(manifest, "w") as f:
        f.write(raw.replace('"epoch":0', '"epoch":7'))
    rc, out, _ = _cli(capsys, "verify", run)
    assert rc == 1
    lines = _lines(out)
    assert "DAMAGED" in lines[5] and "g0001.shared.json" in lines[5] and "truncated" in lines[5]
    assert "DAMAGED" in lines[12] and "model.safetensors is missing" in lines[12]
    assert "DAMAGED" in lines[10] and "MANIFEST.json" in lines[10] and "checksum" in lines[10]
    assert out.splitlines()[-1].endswith("0 intact, 3 damaged")


def test_verify_of_one_checkpoint_directory_and_of_nothing(run_dir, tmp_path, capsys):
    _, storage = run_dir
    rc, out, _ = _cli(capsys, "verify", storage.fs_path(step_dir(10)))
    assert rc == 0 and sorted(_lines(out)) == [10]
    rc, _, err = _cli(capsys, "verify", run_dir[0], "--step", 7)
    assert rc == 2 and "no committed checkpoint at step 7" in err
    rc, _, err = _cli(capsys, "verify", tmp_path / "nowhere")
    assert rc == 2 and "no run at" in err


# -- export -----------------------------------------------------------------------------------------------------


def _read_safetensors(path) -> tuple[dict, dict]:
    buf = np.fromfile(path, dtype=np.uint8)
    n = int.from_bytes(bytes(buf[:8]), "little")
    header = json.loads(bytes(buf[8 : 8 + n]))
    return read_safetensors(buf, None), header["__metadata__"]


def test_export_safetensors_equals_the_model_of_that_step(run_dir, tmp_path, capsys):
    run, _ = run_dir
    rc, out, err = _cli(capsys, "export", run, "--step", 10, "--to", "safetensors", tmp_path / "out")
    assert rc == 0, err
    assert "model.safetensors" in out and "step 10" in out
    tensors, meta = _read_safetensors(tmp_path / "out" / "model.safetensors")
    assert _equal(tensors, _model(10).state_dict())
    assert meta["cf_ray_step"] == "10" and meta["format"] == "pt" and meta["cf_ray_kind"] == "scheduled"
    # Without --step: the newest checkpoint, here the final model (step 12) that the run wrote at its end.
    rc, out, _ = _cli(capsys, "export", run, "--to", "safetensors", tmp_path / "newest")
    assert rc == 0 and "final" in out
    assert _equal(_read_safetensors(tmp_path / "newest" / "model.safetensors")[0], _model(12).state_dict())


def test_export_safetensors_is_read_by_the_safetensors_library(run_dir, tmp_path, capsys):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    assert _cli(capsys, "export", run_dir[0], "--step", 5, "--to", "safetensors", tmp_path)[0] == 0
    assert _equal(safetensors_torch.load_file(str(tmp_path / "model.safetensors")), _model(5).state_dict())


def test_export_torch_loads_with_weights_only(run_dir, tmp_path, capsys):
    run, _ = run_dir
    rc, out, err = _cli(capsys, "export", run, "--step", 5, "--to", "torch", tmp_path)
    assert rc == 0, err
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert _equal(dict(loaded), _model(5).state_dict())
    model = _model(99)
    model.load_state_dict(loaded)  # what a user does with it
    assert _equal(model.state_dict(), _model(5).state_dict())


def _write_full(storage, step: int, objects: dict, *, world_size: int = 1, replicated: bool = True):
    """A checkpoint holding ``objects`` (replicated), or ``objects`` per rank as shards (``replicated=False``)."""
    directory, files, sections = step_dir(step), {}, {}
    trees = {SHARED: {"objects": objects}} if replicated else {}
    for r in range(world_size):
        trees[rank_section(r)] = (
            {"objects": {}, "counters": {"step": step, "epoch": 0}}
            if replicated
            else {"state": objects, "objects": {}, "counters": {"step": step, "epoch": 0}}
        )
    for sec, tree in trees.items():
        arena, index = arena_of(tree)
        files.update(write_section(storage, directory, 1, sec, arena, index))
        data, idx = section_files(1, sec)
        sections[sec] = {"data": data, "index": idx}
    commit(
        storage,
        directory,
        Manifest(
            step=step,
            epoch=0,
            world_size=world_size,
            generation=1,
            replicated=replicated,
            sections=sections,
            files=files,
        ),
    )


def test_export_of_another_object_and_what_safetensors_cannot_hold(tmp_path, capsys):
    model = _model(3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r/cf_ray")
    _write_full(storage, 4, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    run = tmp_path / "runs" / "r"
    rc, _, err = _cli(capsys, "export", run, "--object", "optimizer", "--to", "safetensors", tmp_path / "o")
    assert rc == 2 and "not a tensor" in err and "--to torch" in err
    assert not os.path.exists(tmp_path / "o" / "optimizer.safetensors")
    assert _cli(capsys, "export", run, "--object", "optimizer", "--to", "torch", tmp_path / "o")[0] == 0
    loaded = torch.load(tmp_path / "o" / "optimizer.pt", weights_only=True)
    assert loaded["param_groups"][0]["lr"] == optimizer.state_dict()["param_groups"][0]["lr"]
    assert torch.equal(loaded["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    rc, _, err = _cli(capsys, "export", run, "--object", "scheduler", "--to", "torch", tmp_path / "o")
    assert rc == 2 and "scheduler" in err


def test_export_refuses_per_rank_shards(tmp_path, capsys):
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r/cf_ray")
    _write_full(storage, 4, {"model": _model(1).state_dict()}, world_size=2, replicated=False)
    rc, _, err = _cli(capsys, "export", tmp_path / "runs" / "r", "--to", "safetensors", tmp_path / "o")
    assert rc == 2 and "per-rank shards" in err


def test_export_of_a_missing_step(run_dir, tmp_path, capsys):
    rc, _, err = _cli(capsys, "export", run_dir[0], "--step", 7, "--to", "torch", tmp_path)
    assert rc == 2 and "no committed checkpoint at step 7" in err


# -- the command ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: cf-ray {command}" in out and "example:" in out
    assert f"cf-ray {command} cf_ray_runs/my-run" in out, "the example names a run the one way: RUN"


def test_the_top_level_help_lists_every_command(capsys):
    rc, out, _ = _cli(capsys, "--help")
    assert rc == 0 and all(f"  {c} " in out for c in (*COMMANDS, "demo", "bench", "soak")) and "RUN" in out
    rc, _, err = _cli(capsys, "nonsense")
    assert rc == 2 and "unknown command" in err


def test_ls_and_profile_take_the_run_the_same_way(run_dir, capsys):
    run, storage = run_dir
    from cf_ray import report

    report.save_profile(storage, [{"step": 5, "kind": "scheduled", "generation": 1, "committed": True}], [])
    rc, out, _ = _cli(capsys, "ls", run)
    assert rc == 0 and "step_000000000010" in out and "final_000000000012" in out
    rc, one, err = _cli(capsys, "profile", run)
    assert rc == 0 and "scheduled" in one and not err
    with pytest.raises(SystemExit) as exit_:  # one RUN, not a storage path and a name
        cli.main(["profile", str(run.parent), run.name])
    assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_the_command_line_reference_parses():
    import re
    import shlex

    with open(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "reference", "cli.md")
    ) as f:
        block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
    seen = set()
    for line in block.splitlines():
        argv = shlex.split(line.split("#")[0])
        assert argv[0] == "cf-ray" and argv[1] in cli.COMMANDS, line
        seen.add(argv[1])
        if argv[1] in cli.PARSERS:
            args = cli.PARSERS[argv[1]]().parse_args(argv[2:])
            assert (getattr(args, "run", None) or args.where[0]) == "cf_ray_runs/my-run", "RUN, the one way"
    assert seen == set(cli.COMMANDS), "every command is in the reference"


# -- bad input: one line, exit 2, in every command ---------------------------------------------------------------


def _argv(command: str, run, tmp_path) -> list:
    return {"export": ["export", run, "--to", "torch", tmp_path / "exported"]}.get(command, [command, run])


def _said_once(rc: int, err: str) -> str:
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_run_is_said_in_one_line_with_exit_2_by_every_command(command, run_dir, tmp_path, capsys):
    run, storage = run_dir
    (tmp_path / "runs" / "other" / "cf_ray").mkdir(parents=True)  # a second run beside r
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "plain").mkdir()
    cases = {
        tmp_path / "nowhere": "no run at",
        tmp_path / "a-file": "is a file, not a run",
        tmp_path / "runs": "holds 2 runs (other, r)",
        tmp_path / "plain": "is not a cf_ray run",
    }
    for where, said in cases.items():
        rc, out, err = _cli(capsys, *_argv(command, where, tmp_path))
        assert said in _said_once(rc, err) and f"cf-ray {command}: " in err and not out, (where, err)
    assert "e.g. " + str(tmp_path / "runs" / "other") in _cli(capsys, *_argv(command, tmp_path / "runs", tmp_path))[2]


def test_an_unreachable_s3_run_is_said_in_one_line(capsys, monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = _cli(capsys, "ls", f"s3://bucket/runs/r?endpoint_override=127.0.0.1:{port}&scheme=http")
    assert "cannot reach s3://bucket/runs/r" in _said_once(rc, err)


def test_a_run_on_s3_and_a_bucket_path_holding_runs(s3_endpoint, s3_bucket, tmp_path, capsys):
    """The same answers on a real S3 server (moto, loopback) as on local disk."""
    fs, bucket = s3_bucket
    for name in ("a", "b"):
        write_checkpoint(FsStorage(fs, f"{bucket}/runs/{name}/cf_ray"), 5, _model(5))
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    rc, out, err = _cli(capsys, "ls", f"s3://{bucket}/runs/a{query}")
    assert rc == 0 and "step_000000000005" in out, err
    assert _cli(capsys, "verify", f"s3://{bucket}/runs/a{query}")[0] == 0
    rc, _, err = _cli(capsys, "verify", f"s3://{bucket}/runs{query}")
    assert "holds 2 runs (a, b)" in _said_once(rc, err)
    rc, _, err = _cli(capsys, "ls", f"s3://{bucket}/runs/nothing-here{query}")
    assert "no run at" in _said_once(rc, err)


def test_a_run_without_checkpoints_or_profile_exits_2_everywhere(tmp_path, capsys):
    (tmp_path / "r" / "cf_ray").mkdir(parents=True)  # started, nothing committed, no profile yet
    for argv in (["ls"], ["verify"], ["profile"], ["export", "--to", "torch", tmp_path / "o"]):
        rc, _, err = _cli(capsys, argv[0], tmp_path / "r", *argv[1:])
        _said_once(rc, err)


def test_version(capsys):
    import cf_ray

    rc, out, _ = _cli(capsys, "--version")
    assert rc == 0 and out.startswith(f"cf-ray {cf_ray.__version__} (ray ") and "torch " in out


def test_a_reader_that_goes_away_is_no_error(run_dir):
    """``cf-ray ls RUN | head``: the reader closed the pipe; no BrokenPipeError, no traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before cf-ray writes a byte
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "cf_ray.cli", "ls", str(run_dir[0])], stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    assert proc.returncode == cli.BROKEN_PIPE and proc.stderr == "", proc.stderr


# -- ls: what it leaves out -------------------------------------------------------------------------------------


def test_ls_says_which_damaged_checkpoints_it_skipped(run_dir, capsys):
    run, storage = run_dir
    manifest = os.path.join(storage.fs_path(step_dir(10)), MANIFEST)
    raw = open(manifest).read()
    with open(manifest, "w") as f:
        f.write(raw.replace('"epoch":0', '"epoch":7'))
    rc, out, _ = _cli(capsys, "ls", run)
    assert rc == 0 and "step_000000000005" in out and "final_000000000012" in out
    skipped = [line for line in out.splitlines() if "step_000000000010" in line]
    assert len(skipped) == 1 and "damaged" in skipped[0] and "checksum" in skipped[0], out
    assert f"1 damaged checkpoint not listed: cf-ray verify {run}" in out


# -- export: the names it writes --------------------------------------------------------------------------------


@pytest.mark.parametrize("obj", ["../escaped", "/tmp/abs", "a/b", "..", ".hidden", ""])
def test_export_refuses_an_object_name_that_is_a_path(obj, run_dir, tmp_path, capsys):
    out_dir = tmp_path / "out" / "inner"
    rc, _, err = _cli(capsys, "export", run_dir[0], "--object", obj, "--to", "torch", out_dir)
    assert "is not a tracked object's name" in _said_once(rc, err)
    assert not os.path.exists(tmp_path / "out"), "nothing written, not even the directory"


def test_export_writes_through_no_file_placed_in_its_directory(run_dir, tmp_path, capsys):
    """A link planted where a temporary file used to be named (``<target>.partial-<pid>``) is neither
    followed nor left behind as the result."""
    out_dir, victim = tmp_path / "out", tmp_path / "victim"
    out_dir.mkdir()
    victim.write_bytes(b"not yours")
    os.symlink(victim, out_dir / f"model.pt.partial-{os.getpid()}")
    os.symlink(victim, out_dir / "model.pt")  # the target itself a link: replaced, not written through
    rc, _, err = _cli(capsys, "export", run_dir[0], "--step", 5, "--to", "torch", out_dir)
    assert rc == 0, err
    assert victim.read_bytes() == b"not yours"
    assert not os.path.islink(out_dir / "model.pt")
    assert _equal(dict(torch.load(out_dir / "model.pt", weights_only=True)), _model(5).state_dict())
    assert sorted(os.listdir(out_dir)) == sorted(["model.pt", f"model.pt.partial-{os.getpid()}"]), "no temporary left"


# -- verify: memory --------------------------------------------------------------------------------------------


def test_verify_reads_a_file_in_chunks_not_whole(tmp_path, capsys):
    import tracemalloc

    from cf_ray import _verify

    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("big/cf_ray")
    torch.manual_seed(0)
    big = torch.nn.Linear(2048, 4096)  # 32 MiB of weights in one data file
    write_checkpoint(storage, 1, big)
    data = os.path.join(storage.fs_path(step_dir(1)), section_files(1, SHARED)[0])
    assert os.path.getsize(data) > 4 * _verify.CHUNK_BYTES
    tracemalloc.start()
    try:
        rc, out, _ = _cli(capsys, "verify", tmp_path / "runs" / "big")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 0 and "1 intact" in out
    assert peak < 2 * _verify.CHUNK_BYTES, f"verify held {peak} bytes at once for a {os.path.getsize(data)}-byte file"
