"""The layering of ``waltz_core`` (docs/design.md, "Layers and what ships in the core").

The log (protocol, transport, coordination, storage, locks, server, client and the modules they
share) never imports the tools built on it (``app``, ``perf``, ``testing``): the tools ship in the
same distribution so that a plain install runs ``waltz up`` and the demo, but deleting them must
leave a working log. The command line (``cli``) is imported only by the modules that add commands
(``*/plugin.py``, ``*/cli.py``), never by the code those commands run.
"""

from __future__ import annotations

import ast
import pathlib

import waltz_core

ROOT = pathlib.Path(waltz_core.__file__).parent
TOOLS = frozenset({"app", "perf", "testing"})
COMMAND_MODULES = frozenset({"plugin", "cli"})


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """Every waltz_core module ``path`` imports (at module level or inside functions), with its line."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(target, node.lineno)] + [(f"{target}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return [(t, line) for t, line in found if t.startswith("waltz_core.")]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _log_modules() -> list[pathlib.Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if _layer(_module_name(p)) not in TOOLS | {"cli"}]


def test_the_log_never_imports_the_tools() -> None:
    modules = _log_modules()
    assert len(modules) > 50, "the walk found too few modules to mean anything"
    wrong = [f"{_module_name(p)}:{line} imports {target}"
             for p in modules for target, line in _imports(p) if _layer(target) in TOOLS]
    assert wrong == []


def test_only_command_modules_import_the_command_line() -> None:
    wrong = [f"{_module_name(p)}:{line} imports {target}"
             for p in _log_modules() if p.stem not in COMMAND_MODULES
             for target, line in _imports(p) if _layer(target) == "cli"]
    assert wrong == []


def test_the_checks_see_a_violation() -> None:
    """The walk resolves relative imports: a known tool import is found where it is."""
    assert "waltz_core.perf.cluster" in {target for target, _ in _imports(ROOT / "perf" / "plugin.py")}
    assert any(target.startswith("waltz_core.cli") for target, _ in _imports(ROOT / "server" / "plugin.py"))


def test_the_command_line_imports_no_tool_until_a_tool_command_runs() -> None:
    """``waltz --help`` builds every command group, yet imports no tool, nor the client: their
    commands import what they run inside their callbacks (docs/design.md, "What ships in the core")."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "waltz_core.cli", "--help"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "WALTZ_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "smoketest" in result.stdout  # the tools' command groups are there
    imported = {line.rpartition("|")[2].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "waltz_core.cli.main" in imported
    heavy = sorted(name for name in imported
                   if (_layer(name) in TOOLS and not name.endswith(".plugin") and name not in {f"waltz_core.{t}" for t in TOOLS})
                   or name.startswith("waltz_core.client"))
    assert heavy == []
