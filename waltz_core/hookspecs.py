"""Hook specifications for Waltz plugins.

Plugins are discovered through the ``waltz`` entry-point group, for example in a pyproject.toml::

    [project.entry-points.waltz]
    transport-zmq = "waltz_transport_zmq.plugin"

and implement hooks with the marker exported here::

    from waltz_core import hookimpl

    @hookimpl
    def waltz_register_transports(registry):
        registry.add("zmq", ZmqTransport, config_cls=ZmqOptions, description="ZeroMQ DEALER/ROUTER")

Rules every hook follows:

* hooks are called with keyword arguments only; an implementation may accept fewer arguments
  than the spec lists (pluggy's opt-in arguments), so new arguments can be added later;
* every hook here runs at start-up or on a lifecycle edge, on the thread that built the plugin
  manager, never per transaction: backends are resolved by name once and then called directly;
* the ``waltz_register_*`` hooks are fan-out hooks that fill a :class:`~waltz_core.registry.Registry`;
  choosing a backend is done by the name in the configuration, not by hook order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

NAME = "waltz"  #: pluggy project name == entry-point group == hook prefix

hookspec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)  #: re-exported as ``waltz_core.hookimpl`` for plugin authors

if TYPE_CHECKING:
    import click

    from .registry import Registry

# --------------------------------------------------------------------------------------- bootstrap


@hookspec(historic=True)
def waltz_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Add hookspecs of a plugin's own with ``pluginmanager.add_hookspecs(module)``.

    Historic: plugins registered later still receive it. Called once, on the thread that builds
    the plugin manager. Must not block.
    """


# ------------------------------------------------------------------- backend registries (fan-out)


@hookspec
def waltz_register_transports(registry: Registry[Any]) -> None:
    """Register frame transports.

    Call ``registry.add(name, factory, config_cls=..., description=...)`` once per transport.
    ``factory(config, options)`` must return an object implementing
    :class:`waltz_core.transport.base.Transport`; ``config`` is the
    :class:`~waltz_core.config.TransportConfig` (``max_frame_size``, ``connect_timeout``) and
    ``options`` an instance of ``config_cls`` built from the ``[transport.<name>]`` table.

    Called once per plugin manager, on the thread that builds it, before any event loop work.
    Must not block or open sockets: the factory does that later, when it is called.
    """


@hookspec
def waltz_register_coordination_backends(registry: Registry[Any]) -> None:
    """Register coordination backends (built-in: ``local``; plugins: ``zookeeper``, ``etcd``).

    Call ``registry.add(name, factory, config_cls=..., description=...)`` once per backend.
    ``factory(config, options)`` must return a
    :class:`waltz_core.coordination.base.CoordinationBackend` that is not yet connected (the
    caller awaits ``start()`` on its event loop). ``config`` is the
    :class:`waltz_core.config.CoordinationConfig` (``name``, ``connect``, ``root``,
    ``session_timeout``); ``options`` is an instance of ``config_cls`` built from the
    ``[coordination.<name>]`` table (``None`` when ``config_cls`` is None). Backends are built
    through :func:`waltz_core.coordination.open_coordination`, and must pass the conformance kit
    :class:`waltz_core.testing.conformance.coordination.CoordinationConformance`.
    Same threading rules as ``waltz_register_transports``.
    """


@hookspec
def waltz_register_storage_layouts(registry: Registry[Any]) -> None:
    """Register storage layouts used by storage nodes (built-in: ``segmented`` on disk, ``memory``
    for application tests).

    ``factory(directory, config)`` returns a :class:`waltz_core.storage.layout.StorageLayout`
    (not yet opened); ``config`` is the node's :class:`waltz_core.config.StorageNodeConfig`
    (segment size threshold, segment cache capacity, index checkpoint interval), from which a
    layout takes what it needs. A storage node touches its files only through the layout.
    Layouts must pass the conformance kit
    :class:`waltz_core.testing.conformance.storage_layout.StorageLayoutConformance`, declaring
    the durability capabilities they have (crash points, torn tails, index rebuild, control-file
    twins). Same threading rules as ``waltz_register_transports``.
    """


@hookspec
def waltz_register_lock_tables(registry: Registry[Any]) -> None:
    """Register lock-table strategies used by server partitions (built-in: ``hashed``, ``exact``).

    ``factory(options, high_water_mark)`` returns a :class:`waltz_core.locks.base.LockTable`
    for one partition, initialised so that every lock's estimate is ``high_water_mark``.
    A strategy must never report "safe" where the exact model reports a conflict.
    """


# -------------------------------------------------------------------------------------------- CLI


@hookspec
def waltz_add_commands(cli: click.Group) -> None:
    """Add subcommands to the ``waltz`` command line: ``cli.add_command(my_group)``.

    Called once when the command line is built, before arguments are parsed, on the main
    thread. Must not block or import heavy libraries at module level: import them inside the
    command's callback so ``waltz --help`` stays fast.
    """


# ------------------------------------------------------------------ lifecycle notifications


@hookspec
def waltz_process_started(kind: str, name: str, address: str) -> None:
    """A Waltz process (``kind`` is ``"server"``, ``"storage"``) finished starting.

    :param name: the process's human-readable identity (for example ``"server-3"``)
    :param address: the ``host:port`` it listens on

    Called on the process's event loop thread after its listeners are bound. Must not block;
    hand long work to a thread.
    """


@hookspec
def waltz_process_stopping(kind: str, name: str) -> None:
    """A Waltz process is about to stop (same arguments and threading rules as started)."""


@hookspec
def waltz_partition_opened(server_name: str, partition_id: int, high_water_mark: int) -> None:
    """A server finished recovery of a partition and accepts appends for it.

    Called on the server's event loop. Must not block.
    """


@hookspec
def waltz_partition_closed(server_name: str, partition_id: int) -> None:
    """A server stopped serving a partition (moved away or shut down). Must not block."""
