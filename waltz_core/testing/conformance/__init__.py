"""Conformance kits: subclass one, override its factory fixture, and run it with pytest.

Every kit builds backends through a :class:`~waltz_core.runtime.Runtime`, as a Waltz process
does: the ``runtime`` fixture (class scope) of :class:`KitRuntime` loads the built-ins, the
installed entry-point plugins and the class's :attr:`~KitRuntime.extra_plugins` (a backend under
test that is not installed). Override the fixture to build it another way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from ...runtime import Runtime


class KitRuntime:
    """The ``runtime`` fixture shared by the kits."""

    #: plugin objects registered besides the installed ones (modules or instances)
    extra_plugins: ClassVar[Sequence[object]] = ()

    @pytest.fixture(scope="class")
    @classmethod
    def runtime(cls) -> Runtime:
        """The runtime the kit resolves backends in (built once per test class)."""
        return Runtime.load(extra=cls.extra_plugins)
