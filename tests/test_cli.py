"""The ``waltz`` command: help, version, and errors as one line without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import click
import pytest

import waltz_core.cli.main as cli_main
from waltz_core.errors import ConfigError
from waltz_core.hookspecs import hookimpl
from waltz_core.plugins import core_version
from waltz_core.runtime import Runtime


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``waltz`` in-process as the console script does; return (exit code, stdout, stderr)."""
    try:
        cli_main.main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


class BoomCommands:
    """A plugin adding a command that fails with a WaltzError."""

    @hookimpl
    def waltz_add_commands(self, cli: click.Group) -> None:
        @cli.command("boom")
        def boom() -> None:
            raise ConfigError("server.toml: server.port: expected an integer, got 'x'")

        @cli.command("verdict")
        @click.argument("code", type=int)
        def verdict(code: int) -> None:
            """Ends as `waltz smoketest` and `waltz demo quickstart` do when their check fails."""
            click.echo("checked")
            raise click.exceptions.Exit(code)


@pytest.fixture
def with_boom(monkeypatch: pytest.MonkeyPatch) -> None:
    build_cli = cli_main.build_cli

    def cli_with_boom(runtime: Any = None) -> click.Group:
        return build_cli(Runtime.load(autoload=False, extra=[BoomCommands()]))

    monkeypatch.setattr(cli_main, "build_cli", cli_with_boom)
    monkeypatch.delenv("WALTZ_DEBUG", raising=False)


def test_help_lists_the_builtin_commands(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    assert out.startswith("Usage: waltz")
    for command in ("plugins", "config"):
        assert f"\n  {command} " in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0
    assert out.strip() == f"waltz, version {core_version()}"


def test_waltz_error_prints_one_line_and_exits_1(with_boom: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["boom"], capsys)
    assert code == 1
    assert out == ""
    assert err == "error: server.toml: server.port: expected an integer, got 'x'\n"


def test_a_command_s_exit_code_is_the_process_exit_code(with_boom: None, capsys: pytest.CaptureFixture[str]) -> None:
    # Regression: under standalone_mode=False click *returns* an Exit's code, and main() dropped
    # it, so a failed smoketest or quickstart exited 0.
    assert run_main(["verdict", "1"], capsys) == (1, "checked\n", "")
    assert run_main(["verdict", "0"], capsys) == (0, "checked\n", "")


def test_waltz_debug_shows_the_traceback(with_boom: None, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WALTZ_DEBUG", "1")
    with pytest.raises(ConfigError, match="expected an integer"):
        cli_main.main(["boom"])


def test_usage_errors_keep_clicks_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["no-such-command"], capsys)
    assert code == 2
    assert "No such command 'no-such-command'" in err
    assert "Traceback" not in err


BROKEN_PLUGIN = '''
import click
from waltz_core import hookimpl
from waltz_core.errors import ConfigError


@hookimpl
def waltz_add_commands(cli):
    @cli.command("explode")
    def explode():
        """Fails the way a bad config file does."""
        raise ConfigError("cfg.toml: transport.name: expected a string, got 5")
'''


def test_console_script_in_a_subprocess(tmp_path: Path) -> None:
    # The real entry point, with a command contributed by an entry-point plugin.
    (tmp_path / "explode_waltz_plugin.py").write_text(textwrap.dedent(BROKEN_PLUGIN))
    dist_info = tmp_path / "explode_waltz_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: explode_waltz_plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[waltz]\nexplode = explode_waltz_plugin\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", "from waltz_core.cli.main import main; main()", "explode"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == "error: cfg.toml: transport.name: expected a string, got 5\n"
