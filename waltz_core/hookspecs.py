"""Hook specifications for Waltz plugins.

Plugins are discovered through the ``waltz`` entry-point group, for example in a pyproject.toml::

    [project.entry-points.waltz]
    transport-zmq = "waltz_transport_zmq.plugin"

and implement hooks with the marker exported here::

    from waltz_core import hookimpl

    @hookimpl
    def waltz_register_transports(registry):
        registry.add("zmq", zmq_factory, config_cls=ZmqOptions, description="ZeroMQ DEALER/ROUTER")

Rules every hook follows:

* hooks are called with keyword arguments only; an implementation may accept fewer arguments
  than the spec lists (pluggy's opt-in arguments), so new arguments can be added later;
* every hook here runs at start-up or on a lifecycle edge, never per transaction: backends are
  resolved by name once and then called directly;
* hooks are called on the plugin manager of the process's :class:`~waltz_core.runtime.Runtime`
  (one per process, built at its entry point), so a plugin registered for a test sees them all;
* the ``waltz_register_*`` hooks are fan-out hooks that fill a :class:`~waltz_core.registry.Registry`;
  choosing a backend is done by the name in the configuration, not by hook order. They are called
  once per implementing plugin, in registration order, so each registration names its plugin
  (:func:`waltz_core.plugins.load_registries`). Every backend kind has the same factory signature,
  ``factory(config, options)``: ``config`` is the configuration section that names the backend,
  ``options`` an instance of the ``config_cls`` given to ``registry.add``, built from the table
  ``[<section>.<name>]`` (None without a ``config_cls``); see :mod:`waltz_core.registry`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

NAME = "waltz"  #: pluggy project name == entry-point group == hook prefix

hookspec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)  #: re-exported as ``waltz_core.hookimpl`` for plugin authors

if TYPE_CHECKING:
    from collections.abc import Callable

    import click

    from .registry import CoordinationFactory, LockTableFactory, Registry, StorageLayoutFactory, TransportFactory

# --------------------------------------------------------------------------------------- bootstrap


@hookspec(historic=True)
def waltz_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Add hookspecs of a plugin's own with ``pluginmanager.add_hookspecs(module)``.

    Historic: plugins registered later still receive it. Called once, on the thread that builds
    the plugin manager. Must not block.
    """


# ------------------------------------------------------------------- backend registries (fan-out)


@hookspec
def waltz_register_transports(registry: Registry[TransportFactory]) -> None:
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
def waltz_register_coordination_backends(registry: Registry[CoordinationFactory]) -> None:
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
def waltz_register_storage_layouts(registry: Registry[StorageLayoutFactory]) -> None:
    """Register storage layouts used by storage nodes (built-in: ``segmented`` on disk, ``memory``
    for application tests).

    ``factory(config, options)`` returns a :class:`waltz_core.storage.layout.StorageLayout` on
    ``config.directory`` (not yet opened); ``config`` is the node's
    :class:`waltz_core.config.StorageNodeConfig` (directory, segment size threshold, segment cache
    capacity, index checkpoint interval), from which a layout takes what it needs, and
    ``options`` an instance of ``config_cls`` built from the ``[storage.<name>]`` table. A storage
    node touches its files only through the layout. Layouts must pass the conformance kit
    :class:`waltz_core.testing.conformance.storage_layout.StorageLayoutConformance`, declaring
    the durability capabilities they have (crash points, torn tails, index rebuild, control-file
    twins). Same threading rules as ``waltz_register_transports``.

    .. versionchanged:: 0.2 the factory was ``factory(directory, config)``.
    """


@hookspec
def waltz_register_lock_tables(registry: Registry[LockTableFactory]) -> None:
    """Register lock-table strategies used by server partitions (built-in: ``hashed``, ``exact``).

    ``factory(config, options)`` returns a new :class:`waltz_core.locks.base.LockTable` for one
    partition; ``config`` is the server's :class:`waltz_core.config.ServerConfig` (the built-in
    ``hashed`` table takes ``lock_table_size`` and ``lock_hash_count`` from it) and ``options``
    an instance of ``config_cls`` built from the ``[server.<name>]`` table. The server then calls
    ``table.reset(high_water_mark)`` with the partition's high-water mark before its first append.
    A strategy must never report "safe" where the exact model reports a conflict; it must pass
    :class:`waltz_core.testing.conformance.lock_table.LockTableConformance`.

    .. versionchanged:: 0.2 the factory was ``factory(options, high_water_mark)``, with options
       filled from ``[server]``.
    """


# ------------------------------------------------------------------------------------- policies


@hookspec(firstresult=True)
def waltz_commit_quorum(server_name: str, partition_id: int) -> Callable[[int], int] | None:
    """The commit rule of a partition's replicated store: return ``rule(replicas) -> acks``, the
    number of storage replicas (out of the partition's ``replicas``) whose acknowledgement
    commits a transaction.

    Called once per partition the server opens, when it creates the partition's store, on the
    server's event loop; the rule is then called once per store session, never per transaction.
    Stops at the first non-None result; when every implementation returns None (no plugin has
    one) the rule is the majority, :func:`waltz_core.server.vote.quorum_of`, as in the Waltz
    design. Recovery always votes by majority, so a rule below the majority can lose acknowledged
    transactions (the negative control ``waltz_core.testing.sabotage:ack_before_quorum`` does
    exactly that). A rule must return ``1 <= acks <= replicas``.

    .. versionadded:: 0.2
    """


# -------------------------------------------------------------------------------------------- CLI


@hookspec
def waltz_add_commands(cli: click.Group) -> None:
    """Add subcommands to the ``waltz`` command line: ``cli.add_command(my_group)``.

    Called once when the command line is built, before arguments are parsed, on the main
    thread. Must not block or import heavy libraries at module level: import them inside the
    command's callback so ``waltz --help`` stays fast. The built-ins add theirs last, so a
    plugin cannot replace a built-in command by reusing its name. A command reaches the runtime
    of the invocation (plugin manager and registries) with
    :func:`waltz_core.cli.context.current_runtime`.
    """


# ------------------------------------------------------------------ lifecycle notifications


@hookspec
def waltz_process_started(kind: str, name: str, address: str) -> None:
    """A Waltz process (``kind`` is ``"server"``, ``"storage"``) finished starting.

    :param name: the process's human-readable identity (for example ``"server-3"``)
    :param address: the ``host:port`` it listens on

    Called on the process's event loop thread after its listeners are bound, through the hooks of
    the runtime the process was started with (a server or storage node run in process by a test
    calls its test's plugins). Must not block; hand long work to a thread.
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
