"""A memory limit for a process, as a container or a systemd unit's ``MemoryMax=`` sets one: a
cgroup of its own with a memory limit (cgroup v2 ``memory.max``, or v1 ``memory.limit_in_bytes``).

>>> with memory_cgroup(160 * 1024 * 1024) as group:              # doctest: +SKIP
...     subprocess.Popen(group.command(["waltz", "server", "start", ...]))

Needs root and a mounted memory controller (:func:`memory_cgroups_available`). The cgroup is
removed at the end, once the processes in it have exited (they are killed if they have not).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs

_ROOT = Path("/sys/fs/cgroup")


def _parent() -> tuple[Path, str] | None:
    """Where a memory cgroup can be made here, and its limit file's name."""
    if (_ROOT / "memory" / "memory.limit_in_bytes").exists():  # v1 (or hybrid): the memory hierarchy
        return _ROOT / "memory", "memory.limit_in_bytes"
    for base in (_ROOT, _ROOT / "unified"):  # v2: children of the root get memory.max if it is enabled
        controllers = base / "cgroup.subtree_control"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return base, "memory.max"
    return None


def memory_cgroups_available() -> bool:
    """True when this process can make a memory cgroup (root, and a memory controller)."""
    return os.geteuid() == 0 and _parent() is not None


@attrs.define
class MemoryCgroup:
    """A cgroup with a memory limit (see :func:`memory_cgroup`)."""

    path: Path
    limit: int

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the cgroup (a shell moves itself in, then execs it)."""
        return ["sh", "-c", f"echo $$ > {shlex.quote(str(self.path / 'cgroup.procs'))} && exec \"$@\"", "sh", *argv]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit."""
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError):
                for line in (self.path / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """Make a cgroup whose processes may use ``limit`` bytes of memory; remove it at the end."""
    found = _parent()
    if found is None:
        raise RuntimeError("no memory cgroup controller is mounted under /sys/fs/cgroup")
    parent, limit_file = found
    path = parent / f"waltz-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        (path / limit_file).write_text(str(limit))
        yield MemoryCgroup(path, limit)
    finally:
        for pid in MemoryCgroup(path, limit).pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
