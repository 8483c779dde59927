"""The plugin manager: built-ins plus entry-point plugins, and the backend registries they fill.

Built-ins are registered through the same hooks as outside plugins (tox's ``internal_plugins``).
A process does not use this module's functions directly: it builds one
:class:`~waltz_core.runtime.Runtime` (plugin manager plus registries) at its entry point and
passes it down. Environment switches (:data:`PLUGIN_ENVIRONMENT`, rendered into
docs/configuration.md):

``WALTZ_PLUGINS=module[:object],...``
    register these plugins too, like pytest's ``-p``: a module, or an object in a module
    (``waltz_core.testing.sabotage:no_fsync``). Registered after the entry points, under the text
    given as their name. How tests load test-only plugins into the processes they start.
``WALTZ_DISABLE_PLUGIN_AUTOLOAD=1``
    do not load entry-point plugins (built-ins and ``WALTZ_PLUGINS`` still load).
``WALTZ_DISABLED_PLUGINS=name1,name2``
    block plugins by name: an entry-point name (``transport-zmq``), a built-in module name or a
    ``WALTZ_PLUGINS`` entry.
``WALTZ_TRACE_PLUGINS=1``
    log every hook call (pluggy tracing) to the ``waltz.plugins`` logger.

A plugin that breaks a safety property on purpose (the negative controls of
:mod:`waltz_core.testing.sabotage`) says so with a ``WALTZ_UNSAFE = "what it breaks"``
attribute: :func:`unsafe_plugins` lists them, and every server and storage process logs an
``UNSAFE:`` warning for each at start.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
import types
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError
from .hookspecs import NAME
from .registry import (
    BackendInfo,
    CoordinationFactory,
    LockTableFactory,
    Registry,
    StorageLayoutFactory,
    TransportFactory,
)

log = logging.getLogger("waltz.plugins")

#: Built-in plugin modules, registered like any other plugin.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "waltz_core.transport.plugin",
    "waltz_core.coordination.plugin",
    "waltz_core.storage.plugin",
    "waltz_core.locks.plugin",
    "waltz_core.server.plugin",
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


#: Environment variables the plugin manager reads, and what they do (the configuration reference
#: renders this table; every process reads them when it builds its runtime).
PLUGIN_ENVIRONMENT: dict[str, str] = {
    "WALTZ_PLUGINS": "Comma-separated plugins to register besides the installed ones, like pytest's -p: a module "
                     "(`my_package.waltz_plugin`) or an object in a module (`waltz_core.testing.sabotage:no_fsync`). "
                     "Registered after the entry-point plugins, named by the text given. Processes a command "
                     "starts inherit it: this is how tests load test-only plugins into servers and storage nodes.",
    "WALTZ_DISABLE_PLUGIN_AUTOLOAD": "Set to 1 to skip the entry-point plugins of installed distributions; "
                                     "built-ins and WALTZ_PLUGINS still load.",
    "WALTZ_DISABLED_PLUGINS": "Comma-separated plugin names not to register: an entry-point name (`transport-zmq`), "
                              "a built-in module (`waltz_core.locks.plugin`) or a WALTZ_PLUGINS entry.",
    "WALTZ_TRACE_PLUGINS": "Set to 1 to log every hook call (pluggy tracing) on the `waltz.plugins` logger.",
}

#: The attribute by which a plugin declares that it breaks a safety property on purpose.
UNSAFE_ATTRIBUTE = "WALTZ_UNSAFE"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _env_list(name: str) -> list[str]:
    return [n.strip() for n in os.environ.get(name, "").split(",") if n.strip()]


def import_plugin(spec: str) -> object:
    """The plugin named by ``spec``: a module (``pkg.mod``) or an object in one (``pkg.mod:attr``)."""
    modname, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(modname)
        return getattr(module, attr) if attr else module
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"WALTZ_PLUGINS: cannot load plugin {spec!r}: {exc}") from exc


def get_plugin_manager(*, autoload: bool | None = None, extra: Iterable[object] = ()) -> pluggy.PluginManager:
    """Build a fresh plugin manager: hookspecs, built-ins, entry points, ``WALTZ_PLUGINS``, ``extra``.

    Use :meth:`waltz_core.runtime.Runtime.load`, which also fills the registries.

    :param autoload: load entry-point plugins; default: unless ``WALTZ_DISABLE_PLUGIN_AUTOLOAD`` is set
    :param extra: plugin objects (modules or instances) to register explicitly, for tests
    """
    pm = pluggy.PluginManager(NAME)
    pm.add_hookspecs(hookspecs)
    for name in _env_list("WALTZ_DISABLED_PLUGINS"):
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
    for spec in _env_list("WALTZ_PLUGINS"):
        if pm.is_blocked(spec) or pm.has_plugin(spec):
            continue  # blocked, or named twice in the variable
        try:
            pm.register(import_plugin(spec), name=spec)
        except (pluggy.PluginValidationError, ValueError) as exc:  # bad hookimpl, or registered already
            raise PluginError(f"WALTZ_PLUGINS: plugin {spec!r}: {exc}") from exc
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
    """``"name version"`` of the distribution a plugin came from (``"(built-in)"`` added for the
    core's built-ins), or ``"unknown (registered directly)"``."""
    for plug, dist in pm.list_plugin_distributions():
        if plug is plugin:
            return f"{dist.metadata['name']} {dist.version}"
    # A module, or an object defined in one (a WALTZ_PLUGINS entry such as module:object).
    modname = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__module__
    if modname.startswith("waltz_core."):
        builtin = " (built-in)" if pm.get_name(plugin) in BUILTIN_PLUGINS else ""
        return f"waltz-core {core_version()}{builtin}"
    return "unknown (registered directly)"


#: What :func:`core_version` answers when waltz-core runs from a source tree that was never installed.
UNKNOWN_VERSION = "0+unknown"


@functools.cache
def core_version() -> str:
    """The version of the installed waltz-core, read once: ``importlib.metadata`` scans
    ``sys.path`` and opens a file (0.66 ms a call measured), and a server asked at every client
    connection's handshake, which failed outright in a process out of descriptors."""
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


def unsafe_plugins(pm: pluggy.PluginManager) -> dict[str, str]:
    """Plugin name -> what it breaks, for every registered plugin with a ``WALTZ_UNSAFE`` attribute."""
    found: dict[str, str] = {}
    for name, plugin in pm.list_name_plugin():
        why = getattr(plugin, UNSAFE_ATTRIBUTE, None) if plugin is not None else None
        if why:
            found[name] = str(why)
    return found


@attrs.frozen
class Registries:
    """Every backend registry, filled once from a plugin manager."""

    transport: Registry[TransportFactory]
    coordination: Registry[CoordinationFactory]
    storage_layout: Registry[StorageLayoutFactory]
    lock_table: Registry[LockTableFactory]

    def of(self, kind: str) -> Registry[Any]:
        """The registry of backend ``kind`` (``"transport"``, ..., the keys of :data:`REGISTRY_HOOKS`)."""
        if kind not in REGISTRY_HOOKS:
            raise PluginError(f"unknown backend kind {kind!r}; kinds: {', '.join(REGISTRY_HOOKS)}")
        registry: Registry[Any] = getattr(self, kind)
        return registry

    def resolve(self, kind: str, name: str) -> BackendInfo[Any]:
        """The backend of ``kind`` registered as ``name``; a clear error otherwise."""
        return self.of(kind).get(name)

    def all(self) -> list[BackendInfo[Any]]:
        return [info for kind in REGISTRY_HOOKS for info in self.of(kind)]


def load_registries(pm: pluggy.PluginManager) -> Registries:
    """Fill every registry through its ``waltz_register_*`` hook and return them.

    The hooks are called through pluggy, so tracing (``WALTZ_TRACE_PLUGINS``), call monitoring
    and hook wrappers apply, but once per implementing plugin (``pm.subset_hook_caller`` without
    the others) rather than once for all: pluggy runs every implementation of a call in one loop
    with the same arguments, and only a call of its own tells the registry which plugin (and
    distribution) is registering, for ``waltz plugins`` and for errors. The calls go in
    registration order (built-ins, entry points, ``WALTZ_PLUGINS``, extra), not pluggy's LIFO
    order, so a duplicate name blames the plugin registered later. A hook wrapper of a
    registration hook therefore wraps each plugin's call.
    """
    # The plugin manager's name -> plugin mapping keeps registration order (get_hookimpls() sorts
    # by tryfirst/trylast first, which says nothing about who came first).
    order = {id(plugin): i for i, (_name, plugin) in enumerate(pm.list_name_plugin())}
    regs: dict[str, Registry[Any]] = {}
    for kind, hook_name in REGISTRY_HOOKS.items():
        registry: Registry[Any] = Registry(kind)
        caller: pluggy.HookCaller = getattr(pm.hook, hook_name)
        impls = sorted((impl for impl in caller.get_hookimpls() if not (impl.hookwrapper or impl.wrapper)),
                       key=lambda impl: order[id(impl.plugin)])
        for impl in impls:
            others = [other.plugin for other in impls if other is not impl]
            with registry.registering_plugin(impl.plugin_name, plugin_distribution(pm, impl.plugin)):
                pm.subset_hook_caller(hook_name, remove_plugins=others)(registry=registry)
        regs[kind] = registry
    return Registries(**regs)
