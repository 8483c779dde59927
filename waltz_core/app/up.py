"""``waltz up``: a whole local cluster (3 storage nodes, servers, coordination) with one command.

Everything lives under one data directory::

    <data-dir>/spec.toml            partitions, cluster name (the directory is reused on restart)
    <data-dir>/client.toml          what applications pass to WaltzClient
    <data-dir>/storage-N.toml, server-N.toml, storage-N/, coordination/, logs/
    <data-dir>/waltz-up.pids        pids of a --background cluster (removed by --stop)

Processes are real ``waltz storage start`` / ``waltz server start`` subprocesses in their own
sessions, so Ctrl-C in a terminal reaches only ``waltz up``, which then stops them in order
(servers first, SIGTERM, then storage nodes).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from ..client.api import Transaction, WaltzClientCallbacks
from ..client.core import AsyncWaltzClient
from ..config import ClientProcessConfig, CoordinationConfig
from ..errors import ClientError, ConfigError, WaltzError
from ..retry import RetryPolicy
from ..runtime import Runtime
from .local_cluster import ClusterSpec, ProcessCluster

PID_FILE = "waltz-up.pids"


@attrs.frozen
class UpOptions:
    """What ``waltz up`` was asked for (a reused data directory keeps its own shape)."""

    data_dir: Path
    partitions: int = 4
    servers: int = 1
    storages: int = 3
    coordination: str = "local"
    connect: str | None = None
    root: str = "/waltz"
    #: transport backend by name; None: the one the cluster was created with (``tcp`` for a new one)
    transport: str | None = None
    ready_timeout: float = 60.0
    #: every link with mutual TLS: a CA, a node and a client certificate under <data-dir>/certs
    secure: bool = False


def _coordination(options: UpOptions) -> CoordinationConfig:
    if options.coordination == "local":
        return CoordinationConfig(name="local", connect=str(options.data_dir / "coordination"), root=options.root,
                                  session_timeout=3.0)
    if not options.connect:
        raise ConfigError(f"--coordination {options.coordination} needs --connect host:port[,host:port...]")
    return CoordinationConfig(name=options.coordination, connect=options.connect, root=options.root,
                              session_timeout=6.0)


def _secure_options(data_dir: Path, options: UpOptions) -> tuple[dict[str, object], dict[str, object]]:
    """A development CA and certificates under ``<data-dir>/certs``; the ``[transport.tcp]`` tables
    of the nodes (mutual TLS: every listener requires a certificate of this CA) and of clients."""
    if options.transport != "tcp":
        raise ConfigError(f"--secure sets up the tcp transport's TLS; the {options.transport} transport has its own "
                          "settings (docs/security.md)")
    try:
        from waltz_transport_tcp.certs import create_test_ca
    except ImportError:
        raise ConfigError("--secure needs the tcp transport (pip install 'waltz-core[tcp]')") from None
    certs = create_test_ca(data_dir / "certs", hosts=("127.0.0.1", "localhost"), clients=("client",), days=365,
                           ca_name="waltz-up-ca")
    return dict(certs.server_options(mutual=True)), dict(certs.client_options("client"))


def running_pids(data_dir: Path) -> dict[str, int]:
    """Processes of a ``--background`` cluster in ``data_dir`` that are still alive."""
    path = data_dir / PID_FILE
    if not path.exists():
        return {}
    try:
        pids = {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (ValueError, AttributeError) as exc:
        raise WaltzError(f"{path} is not a pid file of waltz up: {exc}") from exc
    return {name: pid for name, pid in pids.items() if _is_ours(pid, data_dir / f"{name}.toml")}


_NODE_CONFIG = re.compile(r"(storage|server)-\d+\.toml")


def cluster_processes(data_dir: Path) -> list[tuple[str, int]]:
    """Live ``waltz storage start`` / ``waltz server start`` processes whose ``--config`` is one of
    the node configs in ``data_dir``, as (node name, pid), found in /proc whatever started them: a
    foreground ``waltz up``, or a background one whose pid file was lost. Empty without /proc."""
    data_dir = data_dir.resolve()
    found: list[tuple[str, int]] = []
    try:
        entries = [e for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return found
    for entry in entries:
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "start" not in args or "--config" not in args[:-1]:
            continue
        config = Path(args[args.index("--config") + 1])
        if config.parent == data_dir and _NODE_CONFIG.fullmatch(config.name) and _alive(int(entry.name)):
            found.append((config.stem, int(entry.name)))
    return sorted(found)


def _is_ours(pid: int, config_file: Path) -> bool:
    """True if ``pid`` is alive and is the waltz process started with ``config_file`` (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True  # no /proc (macOS): trust the pid file
    return str(config_file).encode() in cmdline


class LocalCluster:
    """The cluster of one ``waltz up`` (blocking API, for the CLI and the quickstart)."""

    def __init__(self, options: UpOptions, echo: Callable[[str], None] = print, runtime: Runtime | None = None) -> None:
        self.options = options
        self.echo = echo
        #: the runtime of the calling command (`waltz up`), or one of its own (the quickstart, tests)
        self.runtime = runtime or Runtime.load()
        data_dir = options.data_dir.resolve()
        self.data_dir = data_dir
        loaded = ClusterSpec.load(data_dir, self.runtime)
        self.reused = loaded is not None
        if loaded is None:
            transport = "tcp" if options.transport is None else options.transport
            options = attrs.evolve(options, transport=transport)
            # Backends are named, not listed: any installed one, a plugin's too; a clear error otherwise.
            registries = self.runtime.registries
            registries.resolve("transport", transport)
            registries.resolve("coordination", options.coordination)
            node_tls, client_tls = _secure_options(data_dir, options) if options.secure else ({}, None)
            self.spec = ClusterSpec(data_dir, num_partitions=options.partitions, num_storages=options.storages,
                                    num_servers=options.servers, transport=transport,
                                    transport_options=node_tls, client_transport_options=client_tls,
                                    coordination=_coordination(attrs.evolve(options, data_dir=data_dir)),
                                    runtime=self.runtime)
        else:
            if options.secure and not loaded.transport_options.get("tls_ca"):
                raise ConfigError(f"the cluster in {data_dir} was created without --secure; give another --data-dir "
                                  "(or delete this one) for a cluster with TLS")
            if options.transport is not None and options.transport != loaded.transport:
                raise ConfigError(f"the cluster in {data_dir} was created with the {loaded.transport} transport; give "
                                  f"another --data-dir (or delete this one) for a cluster on {options.transport}")
            self.spec = loaded
            if (loaded.num_partitions, loaded.num_servers) != (options.partitions, options.servers):
                echo(f"reusing the cluster in {data_dir} as it was created: {loaded.num_partitions} partitions, "
                     f"{loaded.num_servers} server(s) (delete the directory for a new one)")
        self.processes = ProcessCluster(self.spec, log_dir=data_dir / "logs")

    @property
    def client_config_path(self) -> Path:
        return self.data_dir / "client.toml"

    def client_config(self, **client: object) -> ClientProcessConfig:
        return self.spec.client_config(**client)

    def start(self) -> None:
        """Start every process and wait until every partition is served (mountable)."""
        running = running_pids(self.data_dir)
        if running:
            raise WaltzError(f"a cluster is already running in {self.data_dir} (pids {sorted(running.values())}); "
                             f"stop it with: waltz up --stop --data-dir {self.data_dir}")
        # Without a pid file too: a new process would find its node's directory locked and exit,
        # while the running one answered in its place, and this cluster would look started.
        unlisted = cluster_processes(self.data_dir)
        if unlisted:
            listed = ", ".join(f"{name} (pid {pid})" for name, pid in unlisted)
            raise WaltzError(f"processes of the cluster in {self.data_dir} are running: {listed}, with no pid file of "
                             f"a background waltz up (a foreground waltz up runs them, or {PID_FILE} was lost); "
                             f"stop them with: waltz up --stop --data-dir {self.data_dir}")
        t0 = time.monotonic()
        try:
            asyncio.run(self._start())
        except BaseException:
            self.stop()
            raise
        self.echo(f"cluster ready in {time.monotonic() - t0:.1f}s: {self.spec.num_storages} storage nodes, "
                  f"{self.spec.num_servers} server(s), {self.spec.num_partitions} partitions "
                  f"({'reused' if self.reused else 'new'}, data in {self.data_dir})")

    async def _start(self) -> None:
        await self.processes.start()
        await wait_served(self.spec.client_config(), self.spec.num_partitions, self.options.ready_timeout,
                          self.dead_process)
        problem = self.dead_process()  # served, but maybe by someone else's process on the same ports
        if problem:
            raise WaltzError(problem)

    def dead_process(self) -> str | None:
        """A description of the first process that exited, with the end of its log, or None."""
        for kind, procs in (("storage", self.processes.storages), ("server", self.processes.servers)):
            for i, p in procs.items():
                if p.poll() is not None:
                    log = self.processes.log_dir / f"{kind}-{i}.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    return f"{kind}-{i} exited with status {p.returncode}; end of {log}:\n{tail}"
        return None

    def pids(self) -> dict[str, int]:
        out = {f"storage-{i}": p.pid for i, p in self.processes.storages.items()}
        out.update({f"server-{i}": p.pid for i, p in self.processes.servers.items()})
        return out

    def write_pid_file(self) -> Path:
        path = self.data_dir / PID_FILE
        path.write_text(json.dumps(self.pids(), indent=1) + "\n")
        return path

    def stop(self) -> None:
        """Stop servers, then storage nodes (SIGTERM, SIGKILL after 10 s)."""
        self.processes.stop()
        (self.data_dir / PID_FILE).unlink(missing_ok=True)

    def connect_help(self) -> str:
        return connect_help(self.client_config_path)


def connect_help(config_path: Path) -> str:
    return (f"client config: {config_path}\n"
            "connect from Python:\n"
            "    from waltz_core import WaltzClient, config\n"
            f"    cfg = config.load(config.ClientProcessConfig, {str(config_path)!r})\n"
            "    client = WaltzClient(my_callbacks, cfg)  # see docs/user-guide.md\n"
            f"try the demo bank:  waltz demo bank --config {config_path}")


def stop_background(data_dir: Path, timeout: float = 10.0, echo: Callable[[str], None] = print) -> int:
    """Stop the ``--background`` cluster of ``data_dir``; returns how many processes were stopped."""
    data_dir = data_dir.resolve()
    pids = running_pids(data_dir)
    unlisted = [(name, pid) for name, pid in cluster_processes(data_dir) if pid not in pids.values()]
    # servers first: they flush to the storage nodes and leave coordination cleanly
    everyone = [(name, pid, "") for name, pid in pids.items()]
    everyone += [(name, pid, f", not in {PID_FILE}") for name, pid in unlisted]
    for name, pid, note in sorted(everyone, key=lambda e: (not e[0].startswith("server"), e[0], e[1])):
        _terminate(pid, timeout)
        echo(f"stopped {name} (pid {pid}{note})")
    (data_dir / PID_FILE).unlink(missing_ok=True)
    return len(everyone)


def _terminate(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        # reap it if it is our child (the foreground runner); else it is init's
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for us
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


class _Mounter(WaltzClientCallbacks):
    """Callbacks that mount at given high-water marks and ignore the feed."""

    def __init__(self, hwms: dict[int, int]) -> None:
        self.hwms = hwms

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwms.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        pass


async def wait_served(config: ClientProcessConfig, num_partitions: int, timeout: float,
                      dead: Callable[[], str | None] = lambda: None) -> None:
    """Wait until a client can mount every partition (each is owned by a server that recovered it).

    ``dead()`` is polled: a process that exited ends the wait with its description.
    Raises :class:`~waltz_core.errors.WaltzError` on timeout.
    """
    cfg = attrs.evolve(config, client=attrs.evolve(config.client, auto_mount=False, rpc_timeout=1.0))
    deadline = time.monotonic() + timeout
    hwms: dict[int, int] = {}
    client = AsyncWaltzClient(_Mounter(hwms), cfg)
    # every 200 ms (jittered) while the cluster is being created; no deadline in the policy:
    # _check keeps the one deadline of the three waits and says which one ran out
    delays = RetryPolicy(initial=0.2, maximum=0.2).delays()
    while True:
        try:
            await client.start()
            break
        except WaltzError as exc:
            _check(deadline, dead, f"cluster not found: {exc}")
            client = AsyncWaltzClient(_Mounter(hwms), cfg)
            await asyncio.sleep(next(delays))
    try:
        for pid in range(num_partitions):
            while True:
                try:
                    hwms[pid] = await client.high_water_mark(pid)
                    break
                except ClientError as exc:
                    _check(deadline, dead, f"partition {pid} has no server: {exc}")
        await client.set_partitions(range(num_partitions))
        while True:
            try:
                await client.wait_mounted(0.5)
                return
            except ClientError:
                _check(deadline, dead, "partitions not mounted")
    finally:
        await client.close()


def _check(deadline: float, dead: Callable[[], str | None], what: str) -> None:
    problem = dead()
    if problem is not None:
        raise WaltzError(problem)
    if time.monotonic() > deadline:
        raise WaltzError(f"the cluster is not ready: {what}")
