"""Launchers for real coordination servers (ZooKeeper 3.8, etcd 3.4) on loopback, for tests and CI.

Every server binds 127.0.0.1 (or the address given per node, e.g. a network namespace's) on ports
picked by :func:`free_port`, keeps its data and log
files in its own temporary directory and is stopped by the PID this module started (never by
name). The commands follow ``shared/reference/real-servers.md`` §2 and §3::

    zk = ZooKeeperServer(nodes=3).start()       # blocks until every node reports its Mode
    zk.connect_string                            # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
    old = zk.leader(); zk.kill(old)              # SIGKILL the leader; zk.start_node(old) later
    zk.stop()                                    # SIGTERM (then SIGKILL), delete the directory

    etcd = EtcdServer(nodes=3).start()
    etcd.endpoints                               # "127.0.0.1:c1,127.0.0.1:c2,127.0.0.1:c3"

All methods block (they are meant for session-scoped pytest fixtures, which run outside the
event loop). A server that does not become ready raises :class:`ServerStartError` whose message
ends with the tail of the node logs; :meth:`log_tail` prints them for failing tests.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from ..ports import free_ports

ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
#: The Debian jar has slf4j-api but no binding: without these two the server logs nothing.
ZOOKEEPER_LOG_JARS = ("/usr/share/java/slf4j-log4j12.jar", "/usr/share/java/log4j-1.2.jar")
#: what Debian's zookeeper.jar leaves out of its Class-Path and its TLS port (Netty) needs
ZOOKEEPER_NETTY_JARS = ("/usr/share/java/netty-codec.jar", "/usr/share/java/netty-resolver.jar")
ZOOKEEPER_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
#: JVM flags of a test ZooKeeper: quick start-up and small footprint rather than peak speed.
_ZK_TEST_JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

_LOG4J = (
    "log4j.rootLogger=INFO, CONSOLE\n"
    "log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender\n"
    "log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout\n"
    "log4j.appender.CONSOLE.layout.ConversionPattern=%d %-5p [%t] - %m%n\n"
)

# Servers still running at interpreter exit (a fixture that never reached its teardown).
_LIVE: weakref.WeakSet[_ServerGroup] = weakref.WeakSet()


class ServerStartError(RuntimeError):
    """A server process exited or did not become ready in time; the message holds its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it; it may be taken later)."""
    return free_ports(1)[0]


def zookeeper_available() -> bool:
    """True when java and the Debian ZooKeeper jars are installed (for ``waltz_core.testing.require``)."""
    return shutil.which("java") is not None and all(os.path.exists(p) for p in (ZOOKEEPER_JAR, *ZOOKEEPER_LOG_JARS))


def etcd_available() -> bool:
    """True when the ``etcd`` server binary is on PATH (for ``waltz_core.testing.require``)."""
    return shutil.which("etcd") is not None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it dies (Linux only).

    A test run killed by a timeout (SIGTERM skips atexit) then leaves no server behind. Start
    servers from a long-lived thread (the main thread, as pytest fixtures do).
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _no_proxy_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def four_letter_word(port: int, word: str, timeout: float = 1.0, host: str = "127.0.0.1") -> str:
    """Send a ZooKeeper four-letter word to ``host:port`` and return the reply ('' on failure)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(word.encode("ascii"))
            chunks = []
            while True:
                data = sock.recv(4096)
                if not data:
                    break
                chunks.append(data)
        return b"".join(chunks).decode("utf-8", "replace")
    except OSError:
        return ""


class _ServerGroup:
    """Processes of one server group (1 or N nodes), each with a directory and a log file."""

    kind = "server"

    def __init__(self, nodes: int, workdir: str | os.PathLike[str] | None, start_timeout: float,
                 hosts: Sequence[str] | None = None,
                 on_host: Callable[[int, list[str]], list[str]] | None = None) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        if hosts is not None and len(hosts) != nodes:
            raise ValueError(f"{nodes} nodes need {nodes} hosts, got {len(hosts)}")
        self.nodes = nodes
        #: the address each node binds and advertises (default: loopback for all)
        self.hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * nodes
        #: (node, argv) -> the argv that runs it on its host (e.g. inside a network namespace)
        self.on_host = on_host or (lambda _node, argv: argv)
        self.start_timeout = start_timeout
        self._own_dir = workdir is None
        self.directory = Path(tempfile.mkdtemp(prefix=f"waltz-{self.kind}-") if workdir is None else workdir)
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * nodes

    # -- subclass interface
    def _command(self, node: int) -> list[str]:
        raise NotImplementedError

    def _node_ready(self, node: int) -> bool:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Write config files; called once before the first start."""

    # -- shared lifecycle
    def node_dir(self, node: int) -> Path:
        return self.directory / f"node{node}"

    def log_path(self, node: int) -> Path:
        return self.node_dir(node) / "server.log"

    def _launch(self, node: int) -> None:
        self.node_dir(node).mkdir(parents=True, exist_ok=True)
        with open(self.log_path(node), "ab") as log:
            self._procs[node] = subprocess.Popen(
                self.on_host(node, self._command(node)), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.node_dir(node), env=_no_proxy_env(), start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def start(self) -> Self:
        """Start every node and block until each is ready; ServerStartError otherwise."""
        self._prepare()
        _LIVE.add(self)
        try:
            for node in range(self.nodes):
                self._launch(node)
            self._wait_ready(range(self.nodes))
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, node: int) -> None:
        """(Re)start one stopped or killed node and wait until it is ready."""
        if self.is_running(node):
            return
        self._launch(node)
        self._wait_ready([node])

    def is_running(self, node: int) -> bool:
        proc = self._procs[node]
        return proc is not None and proc.poll() is None

    def pid(self, node: int) -> int | None:
        proc = self._procs[node]
        return proc.pid if proc is not None and proc.poll() is None else None

    def _wait_ready(self, nodes: Sequence[int] | range) -> None:
        deadline = time.monotonic() + self.start_timeout
        pending = list(nodes)
        while pending:
            for node in list(pending):
                proc = self._procs[node]
                if proc is None or proc.poll() is not None:
                    code = None if proc is None else proc.returncode
                    raise ServerStartError(f"{self.kind} node {node} exited with {code}\n{self.log_tail()}")
                if self._node_ready(node):
                    pending.remove(node)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.kind} nodes {pending} not ready after {self.start_timeout:.0f} s\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self, node: int) -> None:
        """SIGKILL one node (a crash: no clean shutdown) and reap it."""
        proc = self._procs[node]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop_node(self, node: int, timeout: float = 10.0) -> None:
        """SIGTERM one node, SIGKILL it if it is still running after ``timeout`` seconds."""
        proc = self._procs[node]
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self, *, keep_files: bool = False) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and delete the directory we created; idempotent."""
        for proc in self._procs:  # signal all first: the nodes shut down in parallel
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for node in range(self.nodes):
            self.stop_node(node)
        _LIVE.discard(self)
        if self._own_dir and not keep_files:
            shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of every node's log, labelled, for failure messages."""
        out = []
        for node in range(self.nodes):
            path = self.log_path(node)
            try:
                text = path.read_text("utf-8", "replace").splitlines()[-lines:]
            except OSError:
                text = ["(no log)"]
            out.append(f"--- {self.kind} node {node} ({path}) ---")
            out.extend(text)
        return "\n".join(out)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ZooKeeperServer(_ServerGroup):
    """A standalone ZooKeeper (``nodes=1``) or an N-node ensemble on loopback.

    ``tickTime`` 500 ms, so sessions may negotiate 1-10 s timeouts; four-letter words
    ``ruok,srvr,stat,mntr`` enabled; AdminServer off; client ports bound to 127.0.0.1. Node
    numbers are 0-based (``myid`` is node + 1).

    Tuned for tests by default: ``forceSync=no`` (the transaction log is not fsync'ed) and a
    JVM that starts fast (serial GC, C1 JIT only). A benchmark passes ``force_sync=True``
    (ZooKeeper's own default: fsync before acknowledging) and ``jvm_options=()`` (the JVM's
    defaults, C2 JIT included); ``heap`` is applied either way.
    """

    kind = "zookeeper"

    def __init__(self, nodes: int = 1, *, workdir: str | os.PathLike[str] | None = None,
                 tick_time: int = 500, start_timeout: float = 60.0, heap: str = "256m",
                 hosts: Sequence[str] | None = None,
                 on_host: Callable[[int, list[str]], list[str]] | None = None,
                 force_sync: bool = False, jvm_options: Sequence[str] | None = None,
                 tls: tuple[str, str, str] | None = None) -> None:
        super().__init__(nodes, workdir, start_timeout, hosts, on_host)
        #: (ca, cert, key) PEM paths: each node also serves TLS on ``secure_ports`` (Netty), clients
        #: must present a certificate of ``ca``; the plain ports stay (probes, 4-letter words)
        self.tls = tls
        self.tick_time = tick_time
        self.heap = heap
        #: fsync the transaction log before acknowledging (ZooKeeper's ``forceSync=yes``)
        self.force_sync = force_sync
        #: JVM flags besides the heap; None: the fast-starting test flags
        self.jvm_options = list(_ZK_TEST_JVM_OPTIONS if jvm_options is None else jvm_options)
        ports = free_ports(nodes * 4)
        self.client_ports = ports[:nodes]
        self._quorum_ports = ports[nodes:2 * nodes]
        self._election_ports = ports[2 * nodes:3 * nodes]
        self.secure_ports = ports[3 * nodes:]

    @property
    def connect_string(self) -> str:
        """``host:port,...`` of every node, for kazoo and ``[coordination] connect``."""
        return ",".join(f"{h}:{p}" for h, p in zip(self.hosts, self.client_ports, strict=True))

    @property
    def secure_connect_string(self) -> str:
        """``host:port,...`` of every node's TLS port (with ``tls``)."""
        return ",".join(f"{h}:{p}" for h, p in zip(self.hosts, self.secure_ports, strict=True))

    def _prepare(self) -> None:
        for node in range(self.nodes):
            d = self.node_dir(node)
            (d / "data").mkdir(parents=True, exist_ok=True)
            lines = [
                f"tickTime={self.tick_time}", "initLimit=20", "syncLimit=10",
                f"dataDir={d / 'data'}", f"clientPort={self.client_ports[node]}", f"clientPortAddress={self.hosts[node]}",
                "admin.enableServer=false", "4lw.commands.whitelist=ruok,srvr,stat,mntr",
                "maxClientCnxns=0", f"forceSync={'yes' if self.force_sync else 'no'}", "preAllocSize=4096",
            ]
            if self.tls:
                ca, cert, key = self.tls
                keystore = d / "keystore.pem"  # ZooKeeper's PEM key store: the key and its certificate
                keystore.write_text(Path(key).read_text() + Path(cert).read_text())
                lines += [f"secureClientPort={self.secure_ports[node]}",
                          f"secureClientPortAddress={self.hosts[node]}",  # as the plain port: not every interface
                          "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                          f"ssl.keyStore.location={keystore}", "ssl.keyStore.type=PEM",
                          f"ssl.trustStore.location={ca}", "ssl.trustStore.type=PEM", "ssl.clientAuth=need"]
            if self.nodes > 1:
                (d / "data" / "myid").write_text(f"{node + 1}\n")
                lines += [f"server.{i + 1}={self.hosts[i]}:{self._quorum_ports[i]}:{self._election_ports[i]}"
                          for i in range(self.nodes)]
            (d / "zoo.cfg").write_text("\n".join(lines) + "\n")
            (d / "log4j.properties").write_text(_LOG4J)

    def _command(self, node: int) -> list[str]:
        d = self.node_dir(node)
        return [
            "java", f"-Xmx{self.heap}", *self.jvm_options,
            f"-Dlog4j.configuration=file:{d / 'log4j.properties'}", f"-Dzookeeper.log.dir={d}",
            "-cp", ":".join((ZOOKEEPER_JAR, *ZOOKEEPER_LOG_JARS, *(ZOOKEEPER_NETTY_JARS if self.tls else ()))),
            ZOOKEEPER_MAIN, str(d / "zoo.cfg"),
        ]

    def mode(self, node: int) -> str | None:
        """``leader``, ``follower`` or ``standalone`` from ``srvr``; None if the node does not serve."""
        for line in four_letter_word(self.client_ports[node], "srvr", host=self.hosts[node]).splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    def _node_ready(self, node: int) -> bool:
        # `ruok` answers imok as soon as the port is open; only a Mode means the node serves.
        ruok = four_letter_word(self.client_ports[node], "ruok", host=self.hosts[node])
        return ruok == "imok" and self.mode(node) is not None

    def leader(self, timeout: float = 15.0) -> int:
        """The node that is leader (or the standalone node); waits up to ``timeout`` for an election."""
        deadline = time.monotonic() + timeout
        while True:
            for node in range(self.nodes):
                if self.is_running(node) and self.mode(node) in ("leader", "standalone"):
                    return node
            if time.monotonic() > deadline:
                raise ServerStartError(f"no zookeeper leader after {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.05)


class EtcdServer(_ServerGroup):
    """A single etcd (``nodes=1``) or an N-member cluster on loopback.

    Heartbeat 50 ms, election timeout 500 ms, zap logger at ``warn``. Node numbers are 0-based
    (member names ``n1..nN``). A restarted node reuses its data directory and rejoins.
    ``extra_args`` go to every member's command line (``["--auth-token-ttl", "2"]``). With
    ``tls = (ca, cert, key)`` (PEM paths; the certificate valid for the members' hosts, for server
    and client use) the client URLs are https and require a client certificate of ``ca``.
    """

    kind = "etcd"

    def __init__(self, nodes: int = 1, *, workdir: str | os.PathLike[str] | None = None,
                 start_timeout: float = 30.0, log_level: str = "warn", hosts: Sequence[str] | None = None,
                 on_host: Callable[[int, list[str]], list[str]] | None = None,
                 extra_args: Sequence[str] = (), tls: tuple[str, str, str] | None = None) -> None:
        super().__init__(nodes, workdir, start_timeout, hosts, on_host)
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.tls = tls
        ports = free_ports(nodes * 2)
        self.client_ports = ports[:nodes]
        self.peer_ports = ports[nodes:]
        self._token = f"waltz-{self.client_ports[0]}"

    @property
    def endpoints(self) -> str:
        """``host:port,...`` of every member's client URL, for ``[coordination] connect``."""
        return ",".join(f"{h}:{p}" for h, p in zip(self.hosts, self.client_ports, strict=True))

    def _command(self, node: int) -> list[str]:
        scheme = "https" if self.tls else "http"
        client = f"{scheme}://{self.hosts[node]}:{self.client_ports[node]}"
        tls: list[str] = []
        if self.tls:
            ca, cert, key = self.tls
            tls = ["--trusted-ca-file", ca, "--cert-file", cert, "--key-file", key, "--client-cert-auth"]
        peer = f"http://{self.hosts[node]}:{self.peer_ports[node]}"
        cluster = ",".join(f"n{i + 1}=http://{h}:{p}" for i, (h, p) in enumerate(zip(self.hosts, self.peer_ports,
                                                                                        strict=True)))
        return [
            "etcd", "--name", f"n{node + 1}", "--data-dir", str(self.node_dir(node) / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", self._token,
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--logger", "zap", "--log-level", self.log_level, *tls, *self.extra_args,
        ]

    def _http(self, node: int, path: str, body: dict[str, object] | None = None, timeout: float = 1.0) -> object:
        url = f"{'https' if self.tls else 'http'}://{self.hosts[node]}:{self.client_ports[node]}{path}"
        data = None if body is None else json.dumps(body).encode()
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]  # never through a proxy
        if self.tls:
            import ssl

            ca, cert, key = self.tls
            context = ssl.create_default_context(cafile=ca)
            context.load_cert_chain(cert, key)
            handlers.append(urllib.request.HTTPSHandler(context=context))
        opener = urllib.request.build_opener(*handlers)
        with opener.open(urllib.request.Request(url, data=data), timeout=timeout) as resp:
            return json.loads(resp.read())

    def healthy(self, node: int) -> bool:
        """True when the member answers ``/health`` with ``"health": "true"`` (it has a leader)."""
        try:
            reply = self._http(node, "/health")
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return isinstance(reply, dict) and reply.get("health") == "true"

    def _node_ready(self, node: int) -> bool:
        return self.healthy(node)

    def status(self, node: int) -> dict[str, object] | None:
        """``/v3/maintenance/status`` of one member (JSON; uint64 ids are strings), or None."""
        try:
            reply = self._http(node, "/v3/maintenance/status", {})
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return reply if isinstance(reply, dict) else None

    def leader(self, timeout: float = 15.0) -> int:
        """The node that is the raft leader; waits up to ``timeout`` for an election."""
        deadline = time.monotonic() + timeout
        while True:
            for node in range(self.nodes):
                if not self.is_running(node):
                    continue
                st = self.status(node)
                header = st.get("header") if st else None
                if st and isinstance(header, dict) and st.get("leader") and st.get("leader") == header.get("member_id"):
                    return node
            if time.monotonic() > deadline:
                raise ServerStartError(f"no etcd leader after {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.05)


@atexit.register
def _stop_leftovers() -> None:
    for group in list(_LIVE):
        group.stop()
