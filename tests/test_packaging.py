"""What the package says of itself when it is built: its license as an SPDX expression with the
license file shipped (a license table makes setuptools print a deprecation banner on every
install), its typing marker shipped, and a long description an index can show."""

from __future__ import annotations

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_the_license_is_an_spdx_expression_with_its_file():
    project = _project()["project"]
    assert project["license"] == "MIT", "project.license must be an SPDX string, not a table"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "cf_ray developers" in text
    requires = _project()["build-system"]["requires"]
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in requires), (
        "setuptools reads an SPDX license from 77 on"
    )


def test_the_typing_marker_ships():
    assert (ROOT / "cf_ray" / "py.typed").exists()
    assert "py.typed" in _project()["tool"]["setuptools"]["package-data"]["cf_ray"]
    assert "Typing :: Typed" in _project()["project"]["classifiers"]


def test_the_long_description_is_the_package_page_and_the_project_has_urls():
    project = _project()["project"]
    assert project["readme"] == "README.pypi.md" and (ROOT / project["readme"]).exists()
    assert project["urls"] and all(u.startswith("https://") for u in project["urls"].values())
