"""The distributions as an adopter gets them: wheels of the core and every plugin, built from this
tree and installed from those files into a fresh venv.

The monorepo's editable install hides what a plain ``pip install waltz-core`` lacks (it once lacked
the default ``tcp`` transport, so ``waltz up`` and the demo failed). Third-party dependencies come
from the package index (pip's cache makes reruns fast). About a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = (ROOT / "VERSION").read_text().strip()
PLUGIN_DIRS = sorted(p.parent.relative_to(ROOT) for p in ROOT.glob("plugins/*/pyproject.toml"))
#: extra -> the entry-point plugin it brings (spark is left out: pyspark alone is ~300 MB)
EXTRAS = {"zmq": "transport-zmq", "zookeeper": "coord-zookeeper", "etcd": "coord-etcd"}

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheels")]


def run(args: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 240) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of waltz-core and every plugin, built from a copy of the tree (an in-tree build
    would leave build/ folders behind and race with a developer's own build)."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".tox", ".hypothesis", ".pytest_cache", "__pycache__", "*.egg-info", "build", "dist",
        "waltz-data"))
    out = tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w", out,
         src, *(src / d for d in PLUGIN_DIRS)], cwd=tmp)
    return out


def test_every_wheel_has_the_version_license_readme_and_pins(wheelhouse: Path) -> None:
    wheels = sorted(wheelhouse.glob("*.whl"))
    assert len(wheels) == 1 + len(PLUGIN_DIRS), wheels
    license_text = (ROOT / "LICENSE").read_text()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            dist_info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = zf.read(f"{dist_info}/METADATA").decode()
            assert zf.read(f"{dist_info}/licenses/LICENSE").decode() == license_text, wheel.name
            assert any(n.endswith("/py.typed") and n.count("/") == 1 for n in zf.namelist()), wheel.name
        headers = metadata.split("\n\n", 1)[0].splitlines()
        assert f"Version: {VERSION}" in headers, wheel.name
        assert {"License-Expression: Apache-2.0", "License-File: LICENSE",
                "Description-Content-Type: text/markdown"} <= set(headers), wheel.name
        assert "Classifier: Programming Language :: Python :: 3.11" in headers, wheel.name
        assert metadata.split("\n\n", 1)[1].startswith("# "), f"{wheel.name}: no readme as description"
        major, minor, _ = VERSION.split(".")
        pin = f"<{major}.{int(minor) + 1},>={major}.{minor}"
        ours = [h for h in headers if h.startswith("Requires-Dist: waltz-")]
        assert ours and all(pin in h for h in ours), (wheel.name, ours)


def test_plain_core_install_runs_the_demo_and_each_extra_adds_its_plugin(wheelhouse: Path,
                                                                         tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    bindir = venv / "bin"
    # The fresh venv only: nothing of the developer's venv, shell or test run (WALTZ_TEST_*) leaks in.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("WALTZ_")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    pip = [bindir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", "--find-links", wheelhouse]
    # cwd is tmp_path, never the checkout: `python -m waltz_core...` child processes would import the tree
    run([*pip, "waltz-core"], cwd=tmp_path, env=env)
    where = run([bindir / "python", "-c", "import waltz_core, waltz_transport_tcp; print(waltz_core.__file__)"],
                cwd=tmp_path, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv)

    waltz = bindir / "waltz"
    data = tmp_path / "cluster"
    run([waltz, "up", "--background", "--data-dir", data], cwd=tmp_path, env=env, timeout=120)
    try:
        bank = run([waltz, "demo", "bank", "--data-dir", data, "--auto", "60", "--seed", "7"], cwd=tmp_path, env=env)
    finally:
        run([waltz, "up", "--stop", "--data-dir", data], cwd=tmp_path, env=env, timeout=120)
    assert "OK" in bank.stdout, bank.stdout
    quickstart = run([waltz, "demo", "quickstart", "--operations", "60", "--seed", "7"], cwd=tmp_path, env=env)
    assert "OK" in quickstart.stdout, quickstart.stdout

    listed = json.loads(run([waltz, "plugins", "--json"], cwd=tmp_path, env=env).stdout)
    assert {p["name"] for p in listed["plugins"]} & set(EXTRAS.values()) == set()
    run([*pip, f"waltz-core[{','.join(EXTRAS)}]"], cwd=tmp_path, env=env)
    listed = json.loads(run([waltz, "plugins", "--json"], cwd=tmp_path, env=env).stdout)
    by_name = {p["name"]: p["distribution"] for p in listed["plugins"]}
    for plugin in ["transport-tcp", *EXTRAS.values()]:
        assert by_name.get(plugin, "").endswith(f" {VERSION}"), (plugin, by_name)
