"""Log lines of the ``waltz`` command on stderr: ``text`` for people, ``json`` for log collectors.

``waltz --log-format json ...``, ``waltz server start --log-format json`` (every long-running
command takes the option too) or ``WALTZ_LOG_FORMAT=json`` writes one JSON object per line:
``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, ``exc`` when there is a traceback, and the
record's ``extra`` fields. The chosen format is exported in ``WALTZ_LOG_FORMAT``, so the
processes a command starts (the storage nodes and servers of ``waltz up``, ``waltz perf``,
``waltz smoketest``) log the same way.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

LOG_FORMAT_ENV = "WALTZ_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

# What every record has; any other attribute came from ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback is the ``exc`` string, not more lines)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, Any] = {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS:
                out.setdefault(key, value)  # an extra field never hides a standard one
        return json.dumps(out, default=str)


def _formatter(log_format: str) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure_logging(level: int, log_format: str) -> None:
    """Log to stderr at ``level`` in ``log_format`` and export the format to child processes."""
    handler = logging.StreamHandler()
    handler.setFormatter(_formatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])
    _use(log_format)


def _use(log_format: str) -> None:
    if log_format == "json":
        logging.captureWarnings(True)  # a Python warning is a log record too, not a plain stderr line
    os.environ[LOG_FORMAT_ENV] = log_format


def _set_log_format(_ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """The subcommand's ``--log-format``: switch the stderr handlers the group installed."""
    if value is None:
        return
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:  # ours, not a test framework's capture handler
            handler.setFormatter(_formatter(value))
    _use(value)


F = TypeVar("F", bound=Callable[..., Any])


def log_format_option(command: F) -> F:
    """``--log-format`` on a long-running command as well as on ``waltz`` itself, where people look."""
    return click.option("--log-format", type=click.Choice(LOG_FORMATS), default=None, expose_value=False,
                        callback=_set_log_format,
                        help="Log lines on stderr: text or json (overrides `waltz --log-format` and "
                             "WALTZ_LOG_FORMAT).")(command)


def json_logging() -> bool:
    """True when the root logger writes JSON (then the command's own error lines are JSON too)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
