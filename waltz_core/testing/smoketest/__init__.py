"""``waltz smoketest``: a chaos smoke test with a history checker (see :mod:`.runner`)."""

from .runner import SmokeOptions, SmokeResult, run_smoketest

__all__ = ["SmokeOptions", "SmokeResult", "run_smoketest"]
