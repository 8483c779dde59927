"""Process faults over a :class:`~waltz_core.app.local_cluster.ProcessCluster` and a coordination server.

:class:`ClusterProcesses` names every process of a cluster as ``storage-N``, ``server-N`` or
``coordination-N`` and can SIGKILL, SIGSTOP/SIGCONT and restart each, and, when every process
runs on a host of its own (:class:`~.netns.HostNetwork`), cut its host off the network. It
remembers what is down, paused or isolated so a nemesis can respect "never more than a minority
of storages down" and :meth:`heal` can bring everything back. Methods block (process start, waits); call them from a
worker thread when an event loop must keep running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from typing import Any

from ...app.local_cluster import ProcessCluster
from .netns import HostNetwork


class ClusterProcesses:
    """Kill, pause, resume and restart the processes of one local cluster (and its coordination).

    ``coordination`` is an optional ZooKeeper/etcd launcher from :mod:`waltz_core.testing.servers`
    (``None`` with the embedded ``local`` backend, which has no process).
    """

    def __init__(self, cluster: ProcessCluster, coordination: Any | None = None,
                 network: HostNetwork | None = None) -> None:
        self.cluster = cluster
        self.coordination = coordination
        #: the emulated hosts the processes run on (one per process, same names), if any
        self.network = network
        self.killed: set[str] = set()
        self.paused: set[str] = set()

    @property
    def isolated(self) -> set[str]:
        """Names whose host is cut off the network now."""
        return set(self.network.isolated) if self.network is not None else set()

    # ---------------------------------------------------------------------------- naming

    def names(self, kind: str) -> list[str]:
        spec = self.cluster.spec
        count = {"storage": spec.num_storages, "server": spec.num_servers,
                 "coordination": self.coordination.nodes if self.coordination is not None else 0}[kind]
        return [f"{kind}-{i}" for i in range(count)]

    def down(self, kind: str) -> set[str]:
        """Names of ``kind`` that are killed, paused or isolated now."""
        return {n for n in self.killed | self.paused | self.isolated if n.startswith(kind + "-")}

    def pid(self, name: str) -> int | None:
        kind, _, index = name.rpartition("-")
        i = int(index)
        if kind == "coordination":
            return self.coordination.pid(i) if self.coordination is not None else None
        procs: dict[int, subprocess.Popen[bytes]] = getattr(self.cluster, kind + "s")
        p = procs.get(i)
        return p.pid if p is not None and p.poll() is None else None

    # ---------------------------------------------------------------------------- faults

    def kill(self, name: str) -> None:
        """SIGKILL ``name`` (a crash) and reap it."""
        kind, _, index = name.rpartition("-")
        i = int(index)
        self.resume(name)  # a stopped process must see SIGKILL too; resuming first is harmless
        if kind == "storage":
            self.cluster.kill_storage(i)
        elif kind == "server":
            self.cluster.kill_server(i)
        elif self.coordination is not None:
            self.coordination.kill(i)
        self.killed.add(name)

    def pause(self, name: str) -> None:
        """SIGSTOP ``name`` (a stalled host: its sockets stay open, nothing answers)."""
        pid = self.pid(name)
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            self.paused.add(name)

    def resume(self, name: str) -> None:
        """SIGCONT ``name`` if it is paused."""
        if name in self.paused:
            pid = self.pid(name)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
            self.paused.discard(name)

    def isolate(self, name: str) -> None:
        """Cut ``name``'s host off the network: its packets are dropped, nobody gets a reset."""
        if self.network is None:
            raise RuntimeError("isolation needs processes on hosts of their own (a HostNetwork)")
        self.network.isolate(name)

    def reconnect(self, name: str) -> None:
        """Put ``name``'s host back on the network."""
        if self.network is not None and name in self.network.isolated:
            self.network.restore(name)

    def restart(self, name: str) -> float:
        """Start ``name`` again after :meth:`kill`; returns the seconds it took to start."""
        kind, _, index = name.rpartition("-")
        i = int(index)
        began = time.monotonic()
        if kind == "storage":
            asyncio.run(self.cluster.start_storage(i))
        elif kind == "server":
            self.cluster.start_server(i)
        elif self.coordination is not None:
            self.coordination.start_node(i)
        self.killed.discard(name)
        return time.monotonic() - began

    def heal(self) -> None:
        """Reconnect every isolated host, resume every paused process and restart every killed one."""
        if self.network is not None:
            self.network.restore_all()
        for name in sorted(self.paused):
            self.resume(name)
        for name in sorted(self.killed, key=lambda n: (not n.startswith("coordination"), n)):
            self.restart(name)
