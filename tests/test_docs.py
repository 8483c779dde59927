"""The generated reference pages match the code (datasette-style documentation tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_reference_pages_are_up_to_date() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_every_hook_and_config_key_is_documented() -> None:
    import attrs

    from waltz_core import hookspecs
    from waltz_core.config import PROCESS_CONFIGS, schema

    hooks_page = (ROOT / "docs" / "hooks.md").read_text()
    for name in dir(hookspecs):
        if name.startswith("waltz_"):
            assert f"## `{name}(" in hooks_page, name
    config_page = (ROOT / "docs" / "configuration.md").read_text()
    for cls in PROCESS_CONFIGS.values():
        for entry in schema(cls):
            assert f"`{entry.key}`" in config_page, entry.key
            assert entry.doc, f"{entry.key} has no documentation"
    assert attrs.has(PROCESS_CONFIGS["server"])
    from waltz_core.plugins import PLUGIN_ENVIRONMENT

    plugin_guide = (ROOT / "docs" / "plugin-authors.md").read_text()
    for variable in PLUGIN_ENVIRONMENT:  # the plugin manager's switches: reference and guide
        assert f"| `{variable}` |" in config_page and f"`{variable}" in plugin_guide, variable


def test_readme_has_exactly_the_two_setup_commands_and_ci_calls_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "./demo.sh" in readme and "./test.sh" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./test.sh" in ci
