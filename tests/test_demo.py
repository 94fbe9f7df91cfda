"""``cf-ray demo``: it never deletes what it did not create (``--dir``)."""

from __future__ import annotations

import os

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
