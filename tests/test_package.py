"""The package as pip sees it: one version, its license, its changelog."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import memsentry

tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML")

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("memsentry") == memsentry.__version__


def test_the_license_and_the_changelog_ship_with_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause"
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {memsentry.__version__}" in changelog
