#!/usr/bin/env python3
"""Set the version of every Waltz distribution: ``scripts/bump_version.py 0.2.0``.

Writes VERSION (the single source: every pyproject reads it) and rewrites each pin between our
own distributions (``waltz-core>=0.1,<0.2``, the core's extras, the plugin guide's example) to the
new minor series, so that a release cannot ship a core whose extras refuse its own plugins.
tests/test_packaging.py checks the result independently. A bad version is one line, exit 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: A release version. No pre-releases: ``>=0.2`` excludes ``0.2.0rc1``, so a pre-release core
#: would refuse its own plugins.
RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)")

#: Our distributions, and a requirement on one of them pinned to a minor series.
OUR_NAMES = r"waltz-(?:core|transport-tcp|transport-zmq|coord-zookeeper|coord-etcd|spark)"
PIN = re.compile(rf"(?P<name>{OUR_NAMES}(?:\[[^\]]*\])?)>=\d+\.\d+,<\d+\.\d+")


def pinned_files(root: Path) -> list[Path]:
    """Every file that pins one of our distributions to the core's minor series."""
    return [root / "pyproject.toml", *sorted(root.glob("plugins/*/pyproject.toml")),
            root / "docs" / "plugin-authors.md"]


def bump(root: Path, new: str) -> list[Path]:
    """Write ``new`` to VERSION and the matching pins everywhere; returns the files changed."""
    major, minor, _ = RELEASE.fullmatch(new).groups()  # type: ignore[union-attr]  # checked by main()
    series = f">={major}.{minor},<{major}.{int(minor) + 1}"
    (root / "VERSION").write_text(new + "\n")
    changed = [root / "VERSION"]
    for path in pinned_files(root):
        text = path.read_text()
        updated = PIN.sub(lambda m: m["name"] + series, text)
        if updated != text:
            path.write_text(updated)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="the new release version, X.Y.Z")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    new: str = args.version
    current = (args.root / "VERSION").read_text().strip()
    if RELEASE.fullmatch(new) is None:
        print(f"bump_version: {new!r} is not a release version X.Y.Z (e.g. 0.2.0)", file=sys.stderr)
        return 2
    if tuple(map(int, new.split("."))) <= tuple(map(int, current.split("."))):
        print(f"bump_version: {new} is not newer than the current version {current}", file=sys.stderr)
        return 2
    for path in bump(args.root, new):
        print(f"updated {path.relative_to(args.root)}")
    print("next: add the release to CHANGELOG.md, run scripts/bootstrap.sh (reinstalls the new metadata), "
          "then .venv/bin/python scripts/gen_docs.py (docs/configuration.md shows versions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
