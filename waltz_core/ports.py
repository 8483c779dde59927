"""Free TCP ports for processes that must be told their port before they start (``waltz up``, tests).

Ports are drawn at random below the kernel's ephemeral range, never from it: the ephemeral range is
where every outgoing connection takes its local port, so a port picked there and released (as
``bind(0)`` does) can be taken by some client's connection before its listener binds it; on a busy
machine (a test run making thousands of connections) that happened. Below the range only another
listener can take it, and the random draw makes two pickers unlikely to meet.
"""

from __future__ import annotations

import random
import socket

#: the lowest port drawn: above the well-known and most registered service ports
LOWEST = 10_000
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that ``host`` can bind now, below the ephemeral range.

    Each is checked by binding it; the sockets are held until all are chosen, so none repeats.
    Falls back to ports the OS picks (``bind(0)``) when the range below is too small.
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
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
