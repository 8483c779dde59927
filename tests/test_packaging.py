"""Distribution metadata: one version for all, pins in its minor series, license and readme everywhere.

A release bump that forgets a pin, or a plugin folder that loses its LICENSE, fails here rather
than on an adopter's machine. tests/test_wheels.py builds and installs the real wheels.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
VERSION = (ROOT / "VERSION").read_text().strip()
DIST_DIRS = [ROOT, *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))]
GUIDE = Path("docs") / "plugin-authors.md"


def project(folder: Path) -> dict[str, Any]:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


OUR_NAMES = {canonicalize_name(project(d)["name"]) for d in DIST_DIRS}


def series(version: str) -> SpecifierSet:
    """The minor series of ``version``: what every pin between our distributions must say."""
    major, minor, _ = version.split(".")
    return SpecifierSet(f">={major}.{minor},<{major}.{int(minor) + 1}")


def pins(root: Path) -> list[tuple[str, Requirement]]:
    """``(where, requirement)`` of every requirement on one of our distributions under ``root``."""
    found: list[tuple[str, Requirement]] = []
    for pyproject in [root / "pyproject.toml", *sorted(root.glob("plugins/*/pyproject.toml"))]:
        proj = tomllib.loads(pyproject.read_text())["project"]
        groups = {"dependencies": proj.get("dependencies", []), **proj.get("optional-dependencies", {})}
        for group, reqs in groups.items():
            found += [(f"{pyproject.relative_to(root)} {group}", Requirement(r)) for r in reqs]
    # the plugin guide's example pyproject is what third-party authors copy
    quoted = re.findall(r'"(waltz-[a-z-]+(?:\[[a-z,]+\])?(?:[<>=!~][^"]*)?)"', (root / GUIDE).read_text())
    found += [(str(GUIDE), Requirement(r)) for r in quoted]
    return [(where, req) for where, req in found if canonicalize_name(req.name) in OUR_NAMES]


def test_the_version_is_a_release_and_every_distribution_reads_it_from_the_one_file() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    for folder in DIST_DIRS:
        proj = project(folder)
        assert "version" not in proj and proj["dynamic"] == ["version"], folder
        setuptools = tomllib.loads((folder / "pyproject.toml").read_text())["tool"]["setuptools"]
        assert setuptools["dynamic"]["version"] == {"file": "VERSION"}, folder
        if folder != ROOT:  # a link, so that the plugin's sdist gets the file and nothing can diverge
            assert (folder / "VERSION").resolve() == ROOT / "VERSION", folder


def test_every_pin_between_our_distributions_is_the_version_s_minor_series() -> None:
    found = pins(ROOT)
    # the core's extras and tcp dependency, each plugin's core requirement, the guide's example
    assert len(found) >= 5 + len(DIST_DIRS) - 1 + 2
    wrong = [f"{where}: {req}" for where, req in found if req.specifier != series(VERSION)]
    assert not wrong, f"not pinned to {series(VERSION)} (scripts/bump_version.py rewrites them): {wrong}"


def test_a_plain_core_install_brings_the_reference_transport() -> None:
    core_deps = {canonicalize_name(Requirement(r).name) for r in project(ROOT)["dependencies"]}
    assert "waltz-transport-tcp" in core_deps


def test_every_distribution_carries_the_license_a_readme_and_classifiers() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the full text, not a stub
    for folder in DIST_DIRS:
        proj = project(folder)
        assert proj["license"] == "Apache-2.0" and proj["license-files"] == ["LICENSE"], folder
        assert (folder / "LICENSE").read_text() == license_text, folder
        readme = (folder / proj["readme"]).read_text()
        assert readme.startswith("# "), folder
        classifiers = set(proj["classifiers"])
        assert {"Programming Language :: Python :: 3.11", "Development Status :: 3 - Alpha"} <= classifiers, folder


def test_every_distribution_ships_its_type_information() -> None:
    """PEP 561: a ``py.typed`` marker in each package, in the wheel (package data), and the classifier."""
    for folder in DIST_DIRS:
        pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
        [pattern] = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
        package = pattern.rstrip("*")
        assert (folder / package / "py.typed").is_file(), folder
        assert pyproject["tool"]["setuptools"]["package-data"][package] == ["py.typed"], folder
        assert "Typing :: Typed" in pyproject["project"]["classifiers"], folder


def copy_pinned_files(dest: Path) -> None:
    for path in [ROOT / "VERSION", ROOT / "pyproject.toml", ROOT / GUIDE, *ROOT.glob("plugins/*/pyproject.toml")]:
        target = dest / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def bump_version(root: Path, version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bump_version.py"), "--root", str(root), version],
                          capture_output=True, text=True)


def test_bump_version_rewrites_the_version_and_every_pin(tmp_path: Path) -> None:
    copy_pinned_files(tmp_path)
    major, minor, _ = VERSION.split(".")
    new = f"{major}.{int(minor) + 1}.0"
    result = bump_version(tmp_path, new)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "VERSION").read_text() == new + "\n"
    found = pins(tmp_path)
    assert len(found) == len(pins(ROOT))
    assert all(req.specifier == series(new) for _, req in found), found


@pytest.mark.parametrize("bad", ["0.2", "v1.0.0", "1.0.0rc1", "1.0.0 ", VERSION, "0.0.1"])
def test_bump_version_refuses_a_bad_or_older_version_in_one_line(tmp_path: Path, bad: str) -> None:
    copy_pinned_files(tmp_path)
    result = bump_version(tmp_path, bad)
    assert result.returncode == 2
    assert result.stderr.startswith("bump_version: ") and result.stderr.count("\n") == 1, result.stderr
    assert (tmp_path / "VERSION").read_text().strip() == VERSION
