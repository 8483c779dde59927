"""How fast this machine is at the three things the log's figures scale with.

A report's absolute figures (transactions/s, CPU µs per transaction, p99.9) move with the
machine: the same code gave 47,917 txn/s at 1 partition x 64 on one 2-core virtual machine and
14,072 on another (docs/performance.md). Printed beside the figures, these three measurements say
whether two reports ran on comparable machines:

* ``python_ns_per_op``: one pass of a fixed mix of what the hot paths do per record (a struct
  unpack, a CRC-32 of 256 bytes, a dict lookup, a list append), best of 5 timings;
* ``wakeup_round_trip_us``: a byte sent to a child process that sleeps in ``read`` and sent back,
  the hand-off every stage of a commit pays (client, server, storages), median of 3 batches;
* ``fdatasync_per_s``: 4 KiB appends, each made durable with ``fdatasync``, in the directory the
  benchmark's storages write to.
"""

from __future__ import annotations

import os
import statistics
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import attrs

#: The child of the round trip: echoes each byte it reads until its stdin closes.
_ECHO = ("import os\n"
         "while True:\n"
         "    b = os.read(0, 1)\n"
         "    if not b:\n"
         "        break\n"
         "    os.write(1, b)\n")


@attrs.frozen(slots=True)
class MachineSpeed:
    """The three measurements (see the module's docstring); ``cpu_model`` as /proc/cpuinfo says."""

    cpu_model: str
    python_ns_per_op: float
    wakeup_round_trip_us: float
    fdatasync_per_s: float

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)

    def summary(self) -> str:
        return (f"{self.cpu_model}; Python mix {self.python_ns_per_op:,.0f} ns/op, process wake-up round trip "
                f"{self.wakeup_round_trip_us:,.1f} µs, {self.fdatasync_per_s:,.0f} fdatasyncs/s (4 KiB appends)")


def cpu_model() -> str:
    """The first ``model name`` of /proc/cpuinfo, or the platform's machine name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip() or "unknown"
    except OSError:
        pass
    return os.uname().machine or "unknown"


def python_ns_per_op(ops: int = 50_000, repeat: int = 5) -> float:
    """Nanoseconds per pass of the per-record mix, the best of ``repeat`` timings of ``ops`` passes."""
    if ops < 1 or repeat < 1:
        raise ValueError("ops and repeat must be at least 1")
    head = struct.Struct(">qiI")
    record = head.pack(1, 256, 7) + bytes(256)
    crc32, unpack_from = zlib.crc32, head.unpack_from
    index = {i: i for i in range(64)}
    best = float("inf")
    for _ in range(repeat):
        out: list[int] = []
        append = out.append
        start = time.perf_counter_ns()
        for i in range(ops):
            txn, size, _ = unpack_from(record, 0)
            append(crc32(record[16 : 16 + size]) ^ index[(txn + i) & 63])
        best = min(best, (time.perf_counter_ns() - start) / ops)
    return best


def wakeup_round_trip_us(trips: int = 2_000, batches: int = 3) -> float:
    """Median over ``batches`` of the mean µs of a one-byte round trip to a child process."""
    if trips < 1 or batches < 1:
        raise ValueError("trips and batches must be at least 1")
    child = subprocess.Popen([sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             bufsize=0)
    assert child.stdin is not None and child.stdout is not None
    to_child, from_child = child.stdin.fileno(), child.stdout.fileno()
    try:
        os.write(to_child, b"x")  # the child has started and is reading
        if os.read(from_child, 1) != b"x":
            raise RuntimeError("the echo process did not answer")
        means = []
        for _ in range(batches):
            start = time.perf_counter_ns()
            for _ in range(trips):
                os.write(to_child, b"x")
                os.read(from_child, 1)
            means.append((time.perf_counter_ns() - start) / trips / 1000)
    finally:
        child.stdin.close()
        child.stdout.close()
        child.wait(timeout=10)
    return statistics.median(means)


def fdatasync_per_s(directory: str | os.PathLike[str], seconds: float = 1.0, max_syncs: int = 5_000) -> float:
    """4 KiB appends, each followed by fdatasync, in a scratch file of ``directory`` (removed after)."""
    if seconds <= 0 or max_syncs < 1:
        raise ValueError("seconds must be positive and max_syncs at least 1")
    path = Path(directory) / f".waltz-machine-speed-{os.getpid()}"
    block = bytes(4096)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        syncs = 0
        start = time.perf_counter()
        end = start + seconds
        while syncs < max_syncs:
            os.write(fd, block)
            os.fdatasync(fd)
            syncs += 1
            if time.perf_counter() >= end:
                break
        return syncs / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


def measure(directory: str | os.PathLike[str], fsync_seconds: float = 1.0) -> MachineSpeed:
    """All three, about ``fsync_seconds`` plus a fraction of a second."""
    return MachineSpeed(cpu_model(), python_ns_per_op(), wakeup_round_trip_us(),
                        fdatasync_per_s(directory, fsync_seconds))
