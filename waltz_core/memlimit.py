"""The memory a process may use (its cgroup's limit, or the host's memory), and whether a
server's budgets fit in it.

A server's caches are budgets (``server.feed_cache_budget``, ``data_cache_budget``,
``replication_buffer_budget``: 256 MiB by default) that it fills under load. Started in a
container or a systemd unit whose memory limit is below what they add up to, it ran, then was
killed by the kernel once the caches filled (measured: a server with the defaults in a 120 MiB
cgroup was killed after about 20,000 transactions of 4 KiB). :func:`server_shortfall` says so at
start, with the figures, so the operator lowers the budgets or raises the limit before that.
The figures per process are those of docs/operations.md, "Sizing a server's memory".
"""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1024 * 1024
#: a server's memory besides its budgets and partitions: interpreter, code, a coordination session
SERVER_BASE_BYTES = 38 * MIB
#: bytes a hashed lock table slot takes (``server.lock_table_size`` slots per partition)
LOCK_SLOT_BYTES = 9
#: a cgroup v1 "no limit" is the largest page-aligned signed 64-bit number; anything this big is none
_UNLIMITED = 1 << 60

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_limit(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if raw == "max":
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def cgroup_memory_limit(proc_cgroup: str | None = None, root: Path = _CGROUP_ROOT) -> int | None:
    """The memory limit of this process's cgroup in bytes (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``, the lowest on the way up to the root), or None if it has none."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    limits: list[int] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _id, controllers, path = parts
        if controllers == "":  # v2: unified hierarchy (mounted at the root, or at unified/ beside v1)
            bases, name = [root, root / "unified"], "memory.max"
        elif "memory" in controllers.split(","):
            bases, name = [root / "memory", root / controllers], "memory.limit_in_bytes"
        else:
            continue
        for base in bases:
            here = base / path.lstrip("/")
            if not (here / name).exists():
                here = base  # a container's own cgroup namespace: its cgroup is the mount's root
                if not (here / name).exists():
                    continue
            while True:  # a parent's limit binds too
                found = _read_limit(here / name)
                if found is not None:
                    limits.append(found)
                if here == base or here.parent == here:
                    break
                here = here.parent
            break
    return min(limits) if limits else None


def host_memory() -> int | None:
    """The host's memory (``MemTotal``) in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None


def memory_limit() -> tuple[int, str] | None:
    """(bytes, what sets them): the cgroup's limit or the host's memory, the lower; None if neither is known."""
    found = [(v, what) for v, what in ((cgroup_memory_limit(), "its cgroup's memory limit"),
                                       (host_memory(), "the host's memory")) if v is not None]
    return min(found) if found else None


def server_memory_needed(budgets: int, partitions: int, lock_table_size: int) -> int:
    """Bytes a server needs when its caches are full and it owns ``partitions`` partitions."""
    return SERVER_BASE_BYTES + budgets + partitions * lock_table_size * LOCK_SLOT_BYTES


def server_shortfall(budgets: dict[str, int], partitions: int, lock_table_size: int,
                     limit: tuple[int, str] | None = None) -> str | None:
    """None if a server with these budgets fits its memory limit, else one line with the figures
    and what to do. ``budgets``: config key -> bytes."""
    limit = memory_limit() if limit is None else limit
    if limit is None:
        return None
    total = sum(budgets.values())
    needed = server_memory_needed(total, partitions, lock_table_size)
    if needed <= limit[0]:
        return None
    each = ", ".join(f"{key} {value / MIB:.0f} MiB" for key, value in budgets.items())
    return (f"its caches may hold {total / MIB:.0f} MiB ({each}), and the interpreter and the lock tables of "
            f"the {partitions} partition(s) it may own about {(needed - total) / MIB:.0f} MiB: "
            f"{needed / MIB:.0f} MiB in all, and {limit[1]} is {limit[0] / MIB:.0f} MiB: it would be killed for "
            f"memory once the caches fill; lower the budgets or raise the limit (docs/operations.md, \"Sizing a "
            f"server's memory\")")
