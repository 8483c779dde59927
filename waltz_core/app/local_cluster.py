"""A whole Waltz cluster on one machine: for ``waltz up``, tests and benchmarks.

:class:`ClusterSpec` decides ports and directories, writes one TOML file per process and
bootstraps coordination (cluster, storage nodes, replica assignment) exactly as an operator
would with ``waltz cluster ...``. Two runners start the processes:

* :class:`InProcessCluster` runs storage nodes and servers as tasks of the caller's event loop
  (fast; for tests that do not need to kill a process);
* :class:`ProcessCluster` runs each as a real ``waltz storage start`` / ``waltz server start``
  subprocess (for kill -9 tests, ``waltz up`` and benchmarks).

A cluster is an entry point: the spec holds the :class:`~waltz_core.runtime.Runtime` (given, or
built with ``Runtime.load()``) that its own tools (bootstrap, admin connections, offline reads)
and the nodes :class:`InProcessCluster` runs use. Subprocesses build their own, from the same
environment (``WALTZ_PLUGINS``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Self

import attrs

from ..config import (
    ClientProcessConfig,
    CoordinationConfig,
    ServerProcessConfig,
    StorageProcessConfig,
    TransportConfig,
    build,
)
from ..coordination import open_coordination
from ..coordination.recipes import StoreMetadata, create_cluster, get_cluster_params
from ..errors import ClusterNotFoundError, WaltzError
from ..ports import PortReservation, free_ports, reserve_ports
from ..protocol.wire import Record
from ..retry import RetryPolicy
from ..runtime import Runtime
from ..storage import open_layout
from ..storage.client import StorageAdminClient
from ..transport import listen_address, open_transport


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    """Two-level tables (plus [section.backend] option tables) as TOML text."""
    out: list[str] = []
    for section, values in data.items():
        out.append(f"[{section}]")
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        for k, v in values.items():
            if not isinstance(v, dict):
                out.append(f"{k} = {_toml_value(v)}")
        out.append("")
        for name, table in nested.items():
            out.append(f"[{section}.{name}]")
            out.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
            out.append("")
    return "\n".join(out)


@attrs.define
class NodeSpec:
    name: str
    config_file: Path
    address: str
    http_port: int = 0


@attrs.define
class ClusterSpec:
    """Everything about a local cluster that is decided before any process starts."""

    directory: Path
    num_partitions: int = 4
    num_storages: int = 3
    num_servers: int = 1
    transport: str = "tcp"
    transport_options: dict[str, Any] = attrs.Factory(dict)
    #: ``[transport] max_frame_size`` of every process, the client's included; None: the default
    max_frame_size: int | None = None
    #: ``[transport] max_frame_size`` of the storage nodes alone (tests of mismatched limits); None: as above
    storage_max_frame_size: int | None = None
    coordination: CoordinationConfig | None = None
    cluster_name: str = "waltz-local"
    server_overrides: dict[str, Any] = attrs.Factory(dict)
    #: ``[storage]`` keys of every storage node, e.g. ``{"layout": "memory"}`` for application tests
    storage_overrides: dict[str, Any] = attrs.Factory(dict)
    http: bool = False
    host: str = "127.0.0.1"
    #: bind-and-advertise address per node name ("storage-0", "server-1"), for clusters whose
    #: processes run on hosts of their own (network namespaces); others use ``host``
    node_hosts: dict[str, str] = attrs.Factory(dict)
    #: storage nodes and servers may listen in plaintext off loopback ([security] insecure)
    insecure: bool = False
    #: the transport options of client.toml (a client certificate with TLS); default: transport_options
    client_transport_options: dict[str, Any] | None = None
    storages: list[NodeSpec] = attrs.Factory(list)
    servers: list[NodeSpec] = attrs.Factory(list)
    #: plugins and registries of this cluster's tools and in-process nodes (not part of the spec's value)
    runtime: Runtime = attrs.field(factory=Runtime.load, eq=False, repr=False)
    #: the ports picked by write_configs, held until the cluster stops (see waltz_core.ports)
    _reservation: PortReservation | None = attrs.field(default=None, init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.directory = Path(self.directory)
        if self.coordination is None:
            self.coordination = CoordinationConfig(name="local", connect=str(self.directory / "coordination"), root="/waltz",
                                                   session_timeout=3.0)

    @classmethod
    def load(cls, directory: Path | str, runtime: Runtime | None = None) -> ClusterSpec | None:
        """The spec of a cluster whose configs were written in ``directory`` earlier (same ports,
        same coordination), or None if there is none. ``num_partitions`` comes from ``spec.toml``."""
        import tomllib

        directory = Path(directory)
        marker = directory / "spec.toml"
        if not marker.exists():
            return None
        meta = tomllib.loads(marker.read_text()).get("cluster", {})

        binds: dict[str, tuple[str, int]] = {}

        def nodes(prefix: str, section: str) -> list[NodeSpec]:
            out = []
            for path in sorted(directory.glob(f"{prefix}-*.toml"), key=lambda f: int(f.stem.rsplit("-", 1)[1])):
                data = tomllib.loads(path.read_text())
                binds[path.stem] = (str(data[section]["host"]), int(data[section]["port"]))
                out.append(NodeSpec(path.stem, path, "", data.get("http", {}).get("port", 0)))
            return out

        storages, servers = nodes("storage", "storage"), nodes("server", "server")
        client = build(ClientProcessConfig, tomllib.loads((directory / "client.toml").read_text()))
        first = tomllib.loads(storages[0].config_file.read_text()) if storages else {}
        node_options = dict(first.get("transport", {}).get(client.transport.name, {}))
        client_options = dict(client.transport.options.get(client.transport.name, {}))
        spec = cls(directory, num_partitions=int(meta.get("num_partitions", 4)), num_storages=len(storages),
                   num_servers=len(servers), transport=client.transport.name, transport_options=node_options,
                   client_transport_options=client_options if client_options != node_options else None,
                   coordination=client.coordination, cluster_name=str(meta.get("cluster_name", "waltz-local")),
                   http=any(n.http_port for n in storages + servers), host=str(first.get("storage", {}).get("host", "127.0.0.1")),
                   insecure=bool(first.get("security", {}).get("insecure", False)),
                   storages=storages, servers=servers, runtime=runtime or Runtime.load())
        address = spec._address_format()
        for node in storages + servers:
            node.address = address(*binds[node.name])
        return spec

    # ---------------------------------------------------------------------------- config files

    def _common(self, client: bool = False, storage: bool = False) -> dict[str, dict[str, Any]]:
        coord = self.coordination
        assert coord is not None
        transport: dict[str, Any] = {"name": self.transport}
        max_frame_size = self.storage_max_frame_size if storage and self.storage_max_frame_size else self.max_frame_size
        if max_frame_size is not None:
            transport["max_frame_size"] = max_frame_size
        options = self.client_transport_options if client and self.client_transport_options is not None \
            else self.transport_options
        if options:
            transport[self.transport] = dict(options)
        coordination: dict[str, Any] = {"name": coord.name, "connect": coord.connect, "root": coord.root,
                                        "session_timeout": coord.session_timeout}
        for name, opts in coord.options.items():
            coordination[name] = dict(opts)
        return {"transport": transport, "coordination": coordination}

    def write_configs(self) -> None:
        """Pick ports, write ``storage-N.toml`` / ``server-N.toml`` / ``client.toml`` under the directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.storages and self.servers:
            return
        count = 3 * self.num_storages + 2 * self.num_servers
        if self.node_hosts:  # nodes on hosts of their own cannot collide with ours: any free number will do
            ports = iter(free_ports(count))
        else:
            # Held until the cluster stops: another picker (a cluster starting beside this one)
            # cannot take a port before its node binds it, nor while a killed node restarts.
            self.release_ports()
            self._reservation = reserve_ports(count, self.host)
            ports = iter(self._reservation.ports)
        self.storages, self.servers = [], []
        address = self._address_format()
        for i in range(self.num_storages):
            name, (port, admin, http) = f"storage-{i}", (next(ports), next(ports), next(ports))
            host = self.node_hosts.get(name, self.host)
            path = self.directory / f"{name}.toml"
            data = {"storage": {"host": host, "port": port, "admin_port": admin,
                                "directory": str(self.directory / name), **self.storage_overrides},
                    "http": self._http_section(host, http), **self._common(storage=True), **self._security()}
            path.write_text(to_toml(data))
            self.storages.append(NodeSpec(name, path, address(host, port), http if self.http else 0))
        for i in range(self.num_servers):
            name, (port, http) = f"server-{i}", (next(ports), next(ports))
            host = self.node_hosts.get(name, self.host)
            path = self.directory / f"{name}.toml"
            data = {"server": {"host": host, "port": port, **self.server_overrides},
                    "http": self._http_section(host, http), **self._common(), **self._security()}
            path.write_text(to_toml(data))
            self.servers.append(NodeSpec(name, path, address(host, port), http if self.http else 0))
        (self.directory / "client.toml").write_text(to_toml({"client": {}, **self._common(client=True)}))
        (self.directory / "spec.toml").write_text(to_toml({"cluster": {
            "num_partitions": self.num_partitions, "cluster_name": self.cluster_name}}))

    def release_ports(self) -> None:
        """Let the ports reserved by :meth:`write_configs` go (the cluster's stop does)."""
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None

    def _security(self) -> dict[str, dict[str, Any]]:
        return {"security": {"insecure": True}} if self.insecure else {}

    def _http_section(self, host: str, port: int) -> dict[str, Any]:
        if not self.http:
            return {"port": 0}
        # A node on a host of its own serves HTTP on that host's address (its loopback is its own).
        return {"port": port} if host == self.host else {"port": port, "host": host}

    def _address_format(self) -> Callable[[str, int], str]:
        """Addresses belong to the transport (``host:port``, ``unix:/path``): ask it. Only to
        format addresses: a transport allocates nothing before its first connect or listen."""
        transport = open_transport(build(TransportConfig, self._common()["transport"], "transport"),
                                   self.runtime.registries)
        return lambda host, port: listen_address(transport, host, port)

    def admin_address(self, i: int) -> str:
        cfg = self.storage_config(i)
        return self._address_format()(cfg.storage.host, cfg.storage.admin_port)

    def storage_config(self, i: int) -> StorageProcessConfig:
        import tomllib

        return build(StorageProcessConfig, tomllib.loads(self.storages[i].config_file.read_text()))

    def server_config(self, i: int) -> ServerProcessConfig:
        import tomllib

        return build(ServerProcessConfig, tomllib.loads(self.servers[i].config_file.read_text()))

    def client_config(self, **client: Any) -> ClientProcessConfig:
        import tomllib

        data = tomllib.loads((self.directory / "client.toml").read_text())
        data["client"] = {**data.get("client", {}), **client}
        return build(ClientProcessConfig, data)

    @property
    def transport_config(self) -> TransportConfig:
        """The transport of tools and tests talking to this cluster (a client's, with TLS)."""
        return build(TransportConfig, self._common(client=True)["transport"], "transport")

    # ---------------------------------------------------------------------------- bootstrap

    async def bootstrap(self) -> bool:
        """Create the cluster and its replica assignment if absent. True if it was created now."""
        assert self.coordination is not None
        backend = open_coordination(self.coordination, self.runtime.registries)
        await backend.start()
        try:
            try:
                await get_cluster_params(backend, self.coordination.root)
                return False
            except ClusterNotFoundError:
                pass
            await create_cluster(backend, self.coordination.root, self.cluster_name, self.num_partitions)
            sm = StoreMetadata(backend, self.coordination.root)
            for i, node in enumerate(self.storages):
                await sm.add_storage_node(node.address, self.admin_address(i), 0)
            for node in self.storages:
                await sm.assign_partitions(node.address, range(self.num_partitions))
            return True
        finally:
            await backend.close()

    async def store_params(self) -> tuple[uuid.UUID, int]:
        """The cluster key and partition count from coordination (what every storage node checks)."""
        from ..storage.process import store_params_from_coordination

        assert self.coordination is not None
        return await store_params_from_coordination(self.coordination, self.runtime.registries)

    def read_replica(self, i: int, key: uuid.UUID, num_partitions: int,
                     partitions: Iterable[int] | None = None) -> dict[int, list[Record]]:
        """Every record of storage node ``i``, per partition, read offline through its layout.

        The node must be stopped (the layout takes its files); for comparing replicas in tests.
        """
        cfg = self.storage_config(i).storage
        layout = open_layout(cfg, self.runtime.registries)
        layout.open(key, num_partitions)
        out: dict[int, list[Record]] = {}
        try:
            for p in range(num_partitions) if partitions is None else partitions:
                store = layout.open_partition(p)
                records: list[Record] = []
                txn = 0
                while batch := store.read_records(txn, 1000):
                    records.extend(batch)
                    txn = batch[-1].transaction_id + 1
                store.close()
                out[p] = records
        finally:
            layout.close()
        return out

    async def assign_on_storage(self, i: int, timeout: float = 60.0) -> None:
        """Tell storage node ``i`` (admin port) to hold every partition the metadata gives it."""
        assert self.coordination is not None
        backend = open_coordination(self.coordination, self.runtime.registries)
        await backend.start()
        try:
            sm = StoreMetadata(backend, self.coordination.root)
            params = await sm.get_store_params()
            partitions = (await sm.get_replica_assignments()).get(self.storages[i].address, [])
        finally:
            await backend.close()
        transport = open_transport(self.transport_config, self.runtime.registries)
        try:
            # The node may still be starting: any failure (refused, not listening yet) is retried
            # every 50 ms (jittered) until ``timeout``, then the last one propagates.
            admin = await RetryPolicy(initial=0.05, maximum=0.05, deadline=timeout).call(
                lambda: StorageAdminClient.connect(transport, self.admin_address(i), params.cluster_key,
                                                   params.num_partitions),
                retry_if=lambda exc: True)
            try:
                if partitions:
                    await admin.set_assignment(sorted(partitions), True)
            finally:
                await admin.close()
        finally:
            await transport.aclose()


class InProcessCluster:
    """Storage nodes and servers as tasks of the current event loop."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._storage_stops: dict[int, tuple[asyncio.Event, asyncio.Task[None]]] = {}
        self.servers: dict[int, Any] = {}

    async def __aenter__(self) -> Self:
        """Start and wait until every partition is served; stopped again if that fails."""
        await self.start()
        try:
            await self.wait_ready()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start everything; on failure stop what was started, then raise."""
        self.spec.write_configs()
        await self.spec.bootstrap()
        try:
            for i in range(self.spec.num_storages):
                await self.start_storage(i)
            for i in range(self.spec.num_servers):
                await self.start_server(i)
        except BaseException:
            await self.stop()
            raise

    async def start_storage(self, i: int) -> None:
        from ..storage.process import run_storage

        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(run_storage(self.spec.storage_config(i), self.spec.runtime,
                                                                  stop=stop, announce=False))
        self._storage_stops[i] = (stop, task)
        await self.spec.assign_on_storage(i)

    async def stop_storage(self, i: int) -> None:
        stop, task = self._storage_stops.pop(i)
        stop.set()
        await task

    async def start_server(self, i: int) -> Any:
        from ..server.server import WaltzServer

        server = WaltzServer(self.spec.server_config(i), self.spec.runtime)
        await server.start()
        self.servers[i] = server
        return server

    async def stop_server(self, i: int) -> None:
        server = self.servers.pop(i)
        await server.stop()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every partition is owned by a running server and healthy."""
        deadline = time.monotonic() + timeout
        while True:
            owned = {pid for s in self.servers.values() for pid, p in s.partitions.items() if p.healthy}
            if owned >= set(range(self.spec.num_partitions)):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions not ready after {timeout}s: "
                                   f"{sorted(set(range(self.spec.num_partitions)) - owned)}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for i in list(self.servers):
            await self.stop_server(i)
        for i in list(self._storage_stops):
            await self.stop_storage(i)
        self.spec.release_ports()


class ProcessCluster:
    """Storage nodes and servers as real subprocesses (``waltz storage start`` / ``waltz server start``)."""

    def __init__(self, spec: ClusterSpec, log_dir: Path | None = None, python: str = sys.executable,
                 on_host: Callable[[str, list[str]], list[str]] | None = None) -> None:
        self.spec = spec
        self.python = python
        self.log_dir = Path(log_dir or spec.directory / "logs")
        #: (node name, argv) -> the argv that runs it on that node's host (e.g. in its network
        #: namespace: :meth:`waltz_core.testing.faults.netns.Host.command`); default: here
        self.on_host = on_host or (lambda _name, argv: argv)
        self.storages: dict[int, subprocess.Popen[bytes]] = {}
        self.servers: dict[int, subprocess.Popen[bytes]] = {}

    def _spawn(self, args: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        argv = self.on_host(log_name, [self.python, "-m", "waltz_core.cli", *args])
        with open(self.log_dir / f"{log_name}.log", "ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    async def start(self) -> None:
        """Start every process; on failure stop the ones already started (no orphans), then raise."""
        self.spec.write_configs()
        await self.spec.bootstrap()
        try:
            for i in range(self.spec.num_storages):
                await self.start_storage(i)
            for i in range(self.spec.num_servers):
                self.start_server(i)
        except BaseException:
            self.stop()
            raise

    async def start_storage(self, i: int) -> None:
        name = f"storage-{i}"
        proc = self.storages[i] = self._spawn(["-v", "storage", "start", "--config",
                                               str(self.spec.storages[i].config_file)], name)
        # Its admin port is asked until it answers; a node that exited instead (a port taken, a bad
        # config) is reported at once with the end of its log, not after the assignment's timeout.
        assign = asyncio.get_running_loop().create_task(self.spec.assign_on_storage(i))
        try:
            while not assign.done():
                if proc.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise WaltzError(f"{name} exited with status {proc.returncode} while starting; "
                                     f"end of its log:\n{tail}")
                await asyncio.wait({assign}, timeout=0.1)
        finally:
            if not assign.done():
                assign.cancel()
                await asyncio.gather(assign, return_exceptions=True)
        await assign

    def start_server(self, i: int) -> None:
        self.servers[i] = self._spawn(["-v", "server", "start", "--config", str(self.spec.servers[i].config_file)],
                                      f"server-{i}")

    def kill_storage(self, i: int, sig: int = signal.SIGKILL) -> None:
        _signal(self.storages.pop(i), sig)

    def kill_server(self, i: int, sig: int = signal.SIGKILL) -> None:
        _signal(self.servers.pop(i), sig)

    def stop(self) -> None:
        for procs in (self.servers, self.storages):
            for p in procs.values():
                _signal(p, signal.SIGTERM, wait=10.0)
            procs.clear()
        self.spec.release_ports()

    def logs(self) -> str:
        out = []
        for f in sorted(self.log_dir.glob("*.log")):
            out.append(f"===== {f.name}\n{f.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)


def _signal(p: subprocess.Popen[bytes], sig: int, wait: float = 10.0) -> None:
    if p.poll() is None:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            return
    try:
        p.wait(wait)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
