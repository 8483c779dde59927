"""``waltz smoketest``: a chaos smoke test with a history checker (see :mod:`.runner`).

The names below are imported on first use: the command's plugin module sits in this package, and
``waltz --help`` must not import the runner (a process cluster, fault tools, the checker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runner import SmokeOptions, SmokeResult, run_smoketest

__all__ = ["SmokeOptions", "SmokeResult", "run_smoketest"]

if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        if name in __all__:
            from . import runner

            return getattr(runner, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
