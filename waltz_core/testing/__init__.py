"""Shipped test support: conformance kits every backend runs, server launchers, fakes.

Importing :mod:`waltz_core.testing` does not import pytest; the kits under
:mod:`waltz_core.testing.conformance` do (install ``waltz-core[testing]``).
"""

from __future__ import annotations

import os


def in_ci() -> bool:
    """True under CI (``CI=true``), where a missing server or library is a failure, never a skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(available: bool, what: str) -> None:
    """Skip the calling test when ``what`` is missing, except under CI, where it fails."""
    if available:
        return
    import pytest

    if in_ci():
        pytest.fail(f"{what} is required in CI (CI=true) but is not available", pytrace=False)
    pytest.skip(f"{what} is not available")
