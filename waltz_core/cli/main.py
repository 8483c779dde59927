"""Entry point of the ``waltz`` command.

The group is built from plugins: every ``waltz_add_commands`` implementation (built-ins first)
adds its subcommands. :func:`main` builds the process's one :class:`~waltz_core.runtime.Runtime`
before anything else, and the commands get it from the click context
(:func:`waltz_core.cli.context.current_runtime`); ``waltz server start`` and ``waltz storage
start`` run their node with it. A :class:`~waltz_core.errors.WaltzError` ends the command with one clear
line on stderr and exit status 1, never a traceback (``WALTZ_DEBUG=1`` shows it). With
``--log-format json`` that line, and an unexpected error with its traceback, is a JSON log line
like every other line on stderr (see :mod:`.logs`).
"""

from __future__ import annotations

import logging
import os
import sys

import click

from ..errors import WaltzError
from ..plugins import core_version
from ..runtime import Runtime
from .logs import LOG_FORMAT_ENV, LOG_FORMATS, configure_logging, json_logging

log = logging.getLogger("waltz")


def _process_start(argv: list[str] | None) -> None:
    """Process-wide settings, once, before any command runs: the timeline recorder when
    ``WALTZ_TIMELINE_DIR`` is set (docs/performance.md; nothing is imported otherwise)."""
    if os.environ.get("WALTZ_TIMELINE_DIR") is not None:
        from ..perf.timeline import TimelineError, install_from_env

        try:
            install_from_env(sys.argv[1:] if argv is None else argv)
        except TimelineError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


def build_cli(runtime: Runtime | None = None) -> click.Group:
    """The ``waltz`` group with the commands of ``runtime``'s plugins, each run with that runtime
    as its context object. Without one, a runtime is built here (``Runtime.load()``)."""
    runtime = runtime or Runtime.load()

    @click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110,
                                   "obj": runtime})
    @click.version_option(core_version(), prog_name="waltz")
    @click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
    @click.option("--log-format", type=click.Choice(LOG_FORMATS), default="text", show_default=True,
                  envvar=LOG_FORMAT_ENV, show_envvar=True,
                  help="Log lines on stderr: text, or json (one object per line: ts, level, logger, msg, exc and "
                       "extra fields) for log collectors. Processes started by the command inherit it.")
    def cli(verbose: int, log_format: str) -> None:
        """Waltz: a distributed, replicated, partitioned write-ahead log with optimistic locking."""
        configure_logging(logging.WARNING - 10 * min(verbose, 2), log_format)

    # Through pluggy (tracing and wrappers apply). Its LIFO order adds the built-ins' commands last,
    # so a plugin cannot replace one by reusing its name; --help lists commands sorted anyway.
    runtime.hook.waltz_add_commands(cli=cli)
    return cli


def main(argv: list[str] | None = None) -> None:
    _process_start(argv)
    try:
        from .process import configure

        configure()  # WALTZ_GC, WALTZ_GC_THRESHOLD: a bad value is one error line
        cli = build_cli(Runtime.load())
        # Without standalone mode click *returns* the code of a click.exceptions.Exit (how
        # commands report a failed check) instead of exiting with it.
        code = cli.main(args=argv, prog_name="waltz", standalone_mode=False)
        if type(code) is int and code != 0:
            sys.exit(code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except WaltzError as exc:
        if os.environ.get("WALTZ_DEBUG"):
            raise
        if json_logging():
            log.error("%s", exc)
        else:
            click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        if not json_logging():
            raise
        log.critical("unexpected error", exc_info=True)
        sys.exit(1)
