"""The runtime of a Waltz process: its plugin manager and the backend registries filled from it.

One :class:`Runtime` is built at each entry point and passed down explicitly to everything that
resolves a backend or calls a hook; no module falls back to a process-wide default. The entry
points are:

* the ``waltz`` command line (:func:`waltz_core.cli.main.main`), whose commands find it in the
  click context (:func:`waltz_core.cli.context.current_runtime`), including ``waltz server
  start`` and ``waltz storage start``, which hand it to the server and the storage node;
* a local cluster (:class:`waltz_core.app.local_cluster.ClusterSpec`, ``runtime=``), which hands it to
  the nodes it runs in process;
* a client (``AsyncWaltzClient(..., runtime=...)``): built with ``Runtime.load()`` when none is
  given, so an application that makes many clients should build one runtime and pass it;
* tests, test kits and scripts (``Runtime.load(autoload=False, extra=[my_plugin])``).

Everything a process does with plugins goes through its runtime: backends are built from
:attr:`Runtime.registries` by name (``open_transport(config, runtime.registries)``), and
lifecycle hooks are called with ``runtime.hook.waltz_process_started(...)``, so one process has
one plugin manager and a plugin registered for a test (``extra=``) sees every hook of that test.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import attrs
import pluggy

from .plugins import Registries, get_plugin_manager, load_registries, unsafe_plugins


@attrs.frozen(eq=False)  # identity: two loads are two runtimes, even of the same plugins
class Runtime:
    """A plugin manager and the registries its ``waltz_register_*`` hooks filled, built once."""

    plugin_manager: pluggy.PluginManager
    registries: Registries
    #: plugin name -> what it breaks, for plugins that declare ``WALTZ_UNSAFE`` (test-only sabotage)
    unsafe: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def load(cls, *, autoload: bool | None = None, extra: Iterable[object] = ()) -> Runtime:
        """Build the plugin manager (built-ins, entry points, ``WALTZ_PLUGINS``, ``extra``), then
        fill the registries through its registration hooks.

        :param autoload: load entry-point plugins; default: unless ``WALTZ_DISABLE_PLUGIN_AUTOLOAD`` is set
        :param extra: plugin objects (modules or instances) to register too, for tests
        :raises waltz_core.errors.PluginError: a plugin fails to import, has a bad hook
            implementation or registers something invalid
        """
        pm = get_plugin_manager(autoload=autoload, extra=extra)
        return cls(pm, load_registries(pm), unsafe_plugins(pm))

    @property
    def hook(self) -> pluggy.HookRelay:
        """The hooks of this runtime's plugin manager: ``runtime.hook.waltz_process_started(...)``."""
        return self.plugin_manager.hook

    def warn_unsafe(self, logger: logging.Logger, process: str) -> None:
        """Log one loud ``UNSAFE:`` warning per unsafe plugin; every server and storage process
        calls it at start, so a log shows when a node ran with a safety property switched off."""
        for name, why in self.unsafe.items():
            logger.warning("UNSAFE: plugin %s is loaded into %s: %s. For negative-control tests only; "
                           "never run it in production.", name, process, why)
