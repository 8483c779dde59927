"""The plugin manager: built-ins plus entry-point plugins, and the backend registries they fill.

Built-ins are registered through the same hooks as outside plugins (tox's ``internal_plugins``).
Environment switches:

``WALTZ_DISABLE_PLUGIN_AUTOLOAD=1``
    do not load entry-point plugins (built-ins still load).
``WALTZ_DISABLED_PLUGINS=name1,name2``
    block plugins by name: an entry-point name (``transport-zmq``) or a built-in module name.
``WALTZ_TRACE_PLUGINS=1``
    log every hook call (pluggy tracing) to the ``waltz.plugins`` logger.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError
from .hookspecs import NAME
from .registry import BackendInfo, Registry

log = logging.getLogger("waltz.plugins")

#: Built-in plugin modules, registered like any other plugin.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "waltz_core.transport.plugin",
    "waltz_core.coordination.plugin",
    "waltz_core.storage.plugin",
    "waltz_core.locks.plugin",
    "waltz_core.server.plugin",
    "waltz_core.client.plugin",
    "waltz_core.cli.commands",
    "waltz_core.app.plugin",
    "waltz_core.testing.smoketest.plugin",
    "waltz_core.perf.plugin",
)

#: Registry kinds in display order: kind -> hook that fills it.
REGISTRY_HOOKS: dict[str, str] = {
    "transport": "waltz_register_transports",
    "coordination": "waltz_register_coordination_backends",
    "storage_layout": "waltz_register_storage_layouts",
    "lock_table": "waltz_register_lock_tables",
}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def get_plugin_manager(*, autoload: bool | None = None, extra: Iterable[object] = ()) -> pluggy.PluginManager:
    """Build a fresh plugin manager: hookspecs, built-ins, entry points, ``extra`` plugins.

    :param autoload: load entry-point plugins; default: unless ``WALTZ_DISABLE_PLUGIN_AUTOLOAD`` is set
    :param extra: plugin objects (modules or instances) to register explicitly, for tests
    """
    pm = pluggy.PluginManager(NAME)
    pm.add_hookspecs(hookspecs)
    blocked = [n.strip() for n in os.environ.get("WALTZ_DISABLED_PLUGINS", "").split(",") if n.strip()]
    for name in blocked:
        pm.set_blocked(name)
    for modname in BUILTIN_PLUGINS:
        if pm.is_blocked(modname):
            continue
        pm.register(importlib.import_module(modname), name=modname)
    if autoload is None:
        autoload = not _env_flag("WALTZ_DISABLE_PLUGIN_AUTOLOAD")
    if autoload:
        try:
            pm.load_setuptools_entrypoints(NAME)
        except Exception as exc:  # an installed plugin that fails to import must name itself
            raise PluginError(f"loading entry-point plugins of group {NAME!r} failed: {exc!r}") from exc
        warn_incompatible_plugins(pm)
    for plugin in extra:
        try:
            pm.register(plugin)
        except pluggy.PluginValidationError as exc:  # a hookimpl whose arguments the hookspec lacks
            raise PluginError(str(exc)) from exc
    pm.hook.waltz_addhooks.call_historic(kwargs={"pluginmanager": pm})
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(str(exc)) from exc
    if _env_flag("WALTZ_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda msg: log.info("%s", msg.rstrip()))
        pm.enable_tracing()
    return pm


def plugin_distribution(pm: pluggy.PluginManager, plugin: object) -> str:
    """``"name version"`` of the distribution a plugin came from, or ``"built-in"``."""
    for plug, dist in pm.list_plugin_distributions():
        if plug is plugin:
            return f"{dist.metadata['name']} {dist.version}"
    modname = getattr(plugin, "__name__", "")
    if modname.startswith("waltz_core."):
        return f"waltz-core {core_version()} (built-in)"
    return "unknown (registered directly)"


#: What :func:`core_version` answers when waltz-core runs from a source tree that was never installed.
UNKNOWN_VERSION = "0+unknown"


def core_version() -> str:
    try:
        return importlib.metadata.version("waltz-core")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return UNKNOWN_VERSION


def incompatible_plugins(pm: pluggy.PluginManager, version: str) -> list[tuple[str, str]]:
    """``(distribution, requirement)`` of each loaded plugin distribution whose ``waltz-core``
    requirement excludes core ``version`` (docs/plugin-authors.md, hook compatibility).

    Empty when ``packaging`` is not installed: the check is advice, not worth a dependency.
    """
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        return []
    found: dict[str, str] = {}
    for _plugin, dist in pm.list_plugin_distributions():
        name = dist.metadata["name"]
        for text in dist.requires or ():
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue  # pip would have refused it; not this check's business
            if canonicalize_name(req.name) != "waltz-core":
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # e.g. waltz-core[testing] of the plugin's own "test" extra
            if not req.specifier.contains(version, prereleases=True):
                found[f"{name} {dist.version}"] = str(req)
    return sorted(found.items())


def warn_incompatible_plugins(pm: pluggy.PluginManager) -> None:
    """One warning per plugin distribution that declares it does not support this core.

    A warning, not an error: the plugin may still work, and a crash would take down every
    command for a plugin that the configuration might not even use.
    """
    version = core_version()
    if version == UNKNOWN_VERSION:
        return
    for dist, requirement in incompatible_plugins(pm, version):
        log.warning("plugin distribution %s requires %s, but waltz-core %s is running: "
                    "upgrade the plugin or pin waltz-core", dist, requirement, version)


@attrs.frozen
class Registries:
    """Every backend registry, filled once from a plugin manager."""

    transport: Registry[Any]
    coordination: Registry[Any]
    storage_layout: Registry[Any]
    lock_table: Registry[Any]

    def of(self, kind: str) -> Registry[Any]:
        try:
            return getattr(self, kind)  # type: ignore[no-any-return]
        except AttributeError:
            raise PluginError(f"unknown backend kind {kind!r}; kinds: {', '.join(REGISTRY_HOOKS)}") from None

    def resolve(self, kind: str, name: str) -> BackendInfo[Any]:
        """The backend of ``kind`` registered as ``name``; a clear error otherwise."""
        return self.of(kind).get(name)

    def all(self) -> list[BackendInfo[Any]]:
        return [info for kind in REGISTRY_HOOKS for info in self.of(kind)]


def load_registries(pm: pluggy.PluginManager) -> Registries:
    """Call every ``waltz_register_*`` implementation once and return the filled registries.

    Implementations are called one by one (not through ``pm.hook``) so that each registration
    records which plugin and distribution made it, for ``waltz plugins`` and for errors.
    """
    regs: dict[str, Registry[Any]] = {}
    for kind, hook_name in REGISTRY_HOOKS.items():
        registry: Registry[Any] = Registry(kind)
        caller = getattr(pm.hook, hook_name)
        # get_hookimpls() is in registration order (pluggy *calls* them reversed, LIFO); walking it
        # forwards registers built-ins first, so a duplicate name blames the later plugin.
        for impl in caller.get_hookimpls():
            registry._current_plugin = impl.plugin_name
            registry._current_distribution = plugin_distribution(pm, impl.plugin)
            kwargs = {"registry": registry}
            impl.function(**{k: kwargs[k] for k in impl.argnames})
        regs[kind] = registry
    return Registries(**regs)


_DEFAULT: tuple[pluggy.PluginManager, Registries] | None = None


def default_registries() -> Registries:
    """Registries of the process-wide default plugin manager (built once, on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        pm = get_plugin_manager()
        _DEFAULT = (pm, load_registries(pm))
    return _DEFAULT[1]


def default_plugin_manager() -> pluggy.PluginManager:
    default_registries()
    assert _DEFAULT is not None
    return _DEFAULT[0]
