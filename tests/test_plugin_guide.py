"""docs/plugin-authors.md stays true: its files build a distribution that passes the conformance kits.

The guide's ``File: `path``` blocks are written to a temp dir, the example distribution is
installed with pip into a separate target directory (its dist-info carries the entry point), and
its own tests run in a pytest subprocess with that directory on PYTHONPATH. The shared venv is
never modified, so other tests running at the same time do not see the demo plugins.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugin-authors.md"
FILE_BLOCK = re.compile(r"^File: `([^`]+)`\n\n```[a-z]*\n(.*?)^```$", re.MULTILINE | re.DOTALL)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def extract(directory: Path) -> dict[str, Path]:
    files = {}
    for name, body in FILE_BLOCK.findall(GUIDE.read_text()):
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        files[name] = path
    return files


def test_guide_names_the_required_pieces() -> None:
    text = GUIDE.read_text()
    for needle in ("[project.entry-points.waltz]", "@hookimpl", "TransportConformance", "CoordinationConformance",
                   'name = "uds"', 'name = "sqlite-dir"'):
        assert needle in text, needle
    names = [n for n, _ in FILE_BLOCK.findall(text)]
    assert len(names) == len(set(names)), "a file is defined twice"


def test_guide_plugin_builds_installs_and_passes_the_kits(tmp_path: Path) -> None:
    files = extract(tmp_path / "src")
    project = tmp_path / "src" / "waltz-demo-plugins"
    assert {"waltz-demo-plugins/pyproject.toml", "waltz-demo-plugins/waltz_demo/plugin.py",
            "waltz-demo-plugins/tests/test_conformance.py"} <= set(files)
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--target", str(target), str(project)],
        capture_output=True, text=True, timeout=240)
    assert install.returncode == 0, install.stdout + install.stderr
    assert list(target.glob("waltz_demo_plugins-*.dist-info")), "the entry point travels in the dist-info"

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)
    # The plugin is found by name through its entry point, like any installed plugin.
    listed = subprocess.run([sys.executable, "-m", "waltz_core.cli", "plugins", "--json"], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert '"uds"' in listed.stdout and '"sqlite-dir"' in listed.stdout, listed.stdout

    # A whole cluster on the guide's backends, by name: every process loads the plugin through its
    # entry point, listens on Unix sockets and registers those addresses in sqlite-dir coordination.
    # (Sockets in the transport's default directory, named after the free ports `waltz up` took.)
    data, sockets = tmp_path / "cluster", Path(tempfile.gettempdir())

    def waltz(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "waltz_core.cli", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=120)

    up = waltz("up", "--background", "--data-dir", str(data), "--partitions", "2", "--transport", "uds",
               "--coordination", "sqlite-dir", "--connect", str(tmp_path / "coord"))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        bank = waltz("demo", "bank", "--auto", "40", "--data-dir", str(data))
        assert bank.returncode == 0, bank.stdout + bank.stderr
        listing = waltz("cluster", "list", "--coordination", "sqlite-dir", "--connect", str(tmp_path / "coord"),
                        "--json")
        assert listing.returncode == 0, listing.stderr
        registered = json.loads(listing.stdout)["replica_assignments"]
        assert len(registered) == 3 and all(a.startswith(f"unix:{sockets}/") for a in registered), registered
    finally:
        stop = waltz("up", "--stop", "--data-dir", str(data))
    assert "stopped 4 processes" in stop.stdout, stop.stdout + stop.stderr

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(project),
         "-c", str(project / "pyproject.toml"), str(project / "tests")],
        capture_output=True, text=True, env=env, cwd=project, timeout=240)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    passed = int(re.search(r"(\d+) passed", run.stdout).group(1))  # type: ignore[union-attr]
    assert passed >= 40, run.stdout[-2000:]  # both kits ran, not just collected
    assert " failed" not in run.stdout
