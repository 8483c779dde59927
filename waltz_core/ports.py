"""Free TCP ports for processes that must be told their port before they start (``waltz up``, tests).

Ports are drawn at random below the kernel's ephemeral range, never from it: the ephemeral range is
where every outgoing connection takes its local port, so a port picked there and released (as
``bind(0)`` does) can be taken by some client's connection before its listener binds it; on a busy
machine (a test run making thousands of connections) that happened. Below the range only another
listener can take it, and the random draw makes two pickers unlikely to meet.

Unlikely is not never: two clusters starting side by side (test workers, a benchmark beside a test
run) once drew the same port, and the second node to bind it exited with "Address already in use".
:func:`reserve_ports` closes that window: it keeps each port bound (not listening) until released.
The kernel then refuses the port to every plain ``bind`` (other pickers check ports that way), but
a listener that sets ``SO_REUSEADDR`` (asyncio servers, ZeroMQ, the JVM and Go servers) may bind
and listen on it, because the reserving socket sets that option after its own bind and never
listens.
"""

from __future__ import annotations

import random
import socket
from types import TracebackType
from typing import Self

#: the lowest port drawn: above the well-known and most registered service ports
LOWEST = 10_000
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


class PortReservation:
    """Ports held bound by this process until :meth:`release` (or the process ends)."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self._sockets = sockets
        self.ports: list[int] = [s.getsockname()[1] for s in sockets]

    def release(self) -> None:
        """Let the ports go (idempotent): any process may bind them from now on."""
        sockets, self._sockets = self._sockets, []
        for s in sockets:
            s.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def reserve_ports(count: int, host: str = "127.0.0.1") -> PortReservation:
    """``count`` distinct ports of ``host``, below the ephemeral range, held until released.

    Each is checked with a plain bind (so a port another picker holds is skipped), then marked
    ``SO_REUSEADDR`` so that the listener it is meant for can bind it while it is held (see the
    module documentation). Falls back to ports the OS picks (``bind(0)``) when the range below is
    too small.
    """
    high = _ephemeral_low() - 1
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        tries = 0
        while len(socks) < count:
            port = rng.randint(LOWEST, high) if high - LOWEST >= 1_000 and tries < 50 * count else 0
            tries += 1
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            socks.append(s)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return PortReservation(socks)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that ``host`` can bind now, below the ephemeral range, released at
    once (prefer :func:`reserve_ports` when the listeners start later)."""
    with reserve_ports(count, host) as reservation:
        return reservation.ports
