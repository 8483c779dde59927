"""Emulated hosts on one Linux machine: network namespaces on a private switch, and a nemesis
that makes a host *vanish* without a reset.

Every :class:`HostNetwork` is a switch (a bridge inside a network namespace of its own) and a
set of hosts, each a network namespace with one veth port into the switch and one address of a
``/24`` taken from 198.18.0.0/15 (RFC 2544 benchmarking space; no other range is ever used).
The process that builds the network joins it as one more host (the *driver*: a veth in the
caller's own namespace) so that tests can bootstrap the cluster and run clients directly.

:meth:`HostNetwork.isolate` sets the host's switch port down: every packet to or from the host
is dropped and nobody receives a reset, which is what a pulled cable, a power loss or a network
partition look like to the other hosts (a TCP proxy that refuses or resets cannot show it).
:meth:`HostNetwork.restore` sets it up again; connections that were open resume or time out as
TCP decides.

Needs root (CAP_NET_ADMIN) and ``ip`` from iproute2; :func:`netns_available` says whether both
are there. Names carry the creating PID so that :func:`remove_stale_networks` can delete the
leftovers of a killed test run. All methods block; they take milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from typing import Self

import attrs

log = logging.getLogger("waltz.testing.faults.netns")

#: The only addresses the emulated hosts use (RFC 2544: reserved for network benchmarks).
ADDRESS_SPACE = ipaddress.IPv4Network("198.18.0.0/15")
_PREFIX = "wz"  # namespaces "wz<pid hex>x<n>.<host>", driver link "wz<pid hex>x<n>d"
_LOCK_FILE = "/run/waltz-netns.lock"
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and its stderr."""


def netns_available() -> bool:
    """True when this process can create network namespaces (root and iproute2's ``ip``)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@attrs.frozen(slots=True)
class Host:
    """One emulated host: its name in the test, its namespace, its address and its switch port."""

    name: str
    namespace: str
    address: str
    port: str  #: the switch-side veth (in the switch namespace); down = the host vanished

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class HostNetwork:
    """A switch and its hosts. Use as a context manager, or call :meth:`close`.

    >>> with HostNetwork() as net:                      # doctest: +SKIP
    ...     storage = net.add_host("storage-0")          # 198.18.x.1
    ...     subprocess.Popen(storage.command(["waltz", "storage", "start", ...]))
    ...     net.isolate("storage-0")                     # gone, without a reset
    """

    def __init__(self) -> None:
        self.tag = f"{os.getpid():x}x{next(_counter)}"  # "x" separates the hex pid from the count
        self.switch = f"{_PREFIX}{self.tag}.switch"
        self.hosts: dict[str, Host] = {}
        self.isolated: set[str] = set()
        self._driver_if = f"{_PREFIX}{self.tag}d"
        self._closed = False
        self.subnet = ipaddress.ip_network("0.0.0.0/32")
        self.driver_address = ""
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------ building

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        # The subnet and the driver's address are chosen and configured under one lock, so that
        # two test processes building networks at once never pick the same /24.
        with open(_LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = self._free_subnet()
            self.driver_address = str(self.subnet[254])
            _ip("link", "add", self._driver_if, "type", "veth", "peer", "name", "drv", "netns", self.switch)
            _ip("addr", "add", f"{self.driver_address}/24", "dev", self._driver_if)
            _ip("link", "set", self._driver_if, "up")
        _ip("-n", self.switch, "link", "set", "drv", "master", "br0", "up")

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """A /24 of 198.18.0.0/15 that no interface of this namespace uses yet."""
        used = {ipaddress.IPv4Interface(a).network for a in re.findall(r"inet (\S+)", _ip("-o", "-4", "addr", "show"))}
        subnets = list(ADDRESS_SPACE.subnets(new_prefix=24))
        start = os.getpid() % len(subnets)
        for i in range(len(subnets)):
            candidate = subnets[(start + i) % len(subnets)]
            if not any(candidate.overlaps(u) for u in used):
                return candidate
        raise NetnsError(f"every /24 of {ADDRESS_SPACE} is in use on this machine")

    def add_host(self, name: str) -> Host:
        """A new host on the switch, with the next free address of the subnet (from .1)."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts) + 1
        if index >= 254:
            raise NetnsError("a network holds at most 253 hosts")
        namespace = f"{_PREFIX}{self.tag}.{name}"
        host = Host(name, namespace, str(self.subnet[index]), f"p{index}")
        _ip("netns", "add", namespace)
        self.hosts[name] = host  # registered before it is complete: close() removes it
        _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return host

    # ------------------------------------------------------------------------------ faults

    def isolate(self, name: str) -> None:
        """The host vanishes: its switch port goes down, its packets are dropped, no reset."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")
        self.isolated.add(name)
        log.info("host %s (%s) isolated", name, self.hosts[name].address)

    def restore(self, name: str) -> None:
        """The host is back on the network."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")
        self.isolated.discard(name)
        log.info("host %s (%s) restored", name, self.hosts[name].address)

    def restore_all(self) -> None:
        for name in list(self.isolated):
            self.restore(name)

    # ------------------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Delete every namespace of this network (their veths go with them); idempotent."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            _ip("netns", "del", host.namespace, check=False)
        _ip("link", "del", self._driver_if, check=False)
        _ip("netns", "del", self.switch, check=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _namespaces() -> Iterator[str]:
    for line in _ip("netns", "list", check=False).splitlines():
        if line.strip():
            yield line.split()[0]


def remove_stale_networks() -> list[str]:
    """Delete the namespaces and driver links of networks whose creating process is gone."""
    removed = []
    for name in list(_namespaces()):
        m = re.fullmatch(rf"{_PREFIX}([0-9a-f]+)x\d+\.\S+", name)
        if m is None:
            continue
        pid = int(m.group(1), 16)
        if _alive(pid):
            continue
        _ip("netns", "del", name, check=False)
        removed.append(name)
    for line in _ip("-o", "link", "show", check=False).splitlines():
        m = re.match(rf"\d+: ({_PREFIX}([0-9a-f]+)x\d+d)[@:]", line)
        if m and not _alive(int(m.group(2), 16)):
            _ip("link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    return removed


def _alive(pid: int) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        return True
    return False
