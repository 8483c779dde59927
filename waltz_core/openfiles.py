"""How many files a process may open, and what to tell an operator when it runs out.

A storage node keeps two files open for each partition it serves (the newest segment's data and
index files of the segmented layout), and more for a partition whose older segments are being read
(up to ``segment_cache_capacity`` segments), so the usual soft limit of a shell or a systemd
service, 1,024 descriptors, runs out at a few hundred partitions: the partitions past it cannot open
their files, each append to them fails with ``[Errno 24] Too many open files``, and the node's
other partitions go on. The JVM raises its soft limit to the hard one when it starts (HotSpot's
``MaxFDLimit``, on by default on Linux), so the original Waltz did not meet the soft limit; a
``waltz`` process does the same at start (:func:`raise_to_hard_limit`, called by the command
line). Past the hard limit only the operator can help: :func:`storage_shortfall` says so at start,
and :func:`explain` puts the limit and what to raise into the error of each failed open. Before
it opens a segment's files a storage node keeps :data:`STORAGE_RESERVE` descriptors free
(:func:`keep_free`): a process out of descriptors cannot accept a connection, so without that
reserve its admin port, ``/readyz`` and the servers' reconnections failed with its partitions.
"""

from __future__ import annotations

import errno
import os
import resource
import time

#: files a partition of the segmented layout keeps open (data and index of its newest segment)
FILES_PER_PARTITION = 2
#: descriptors besides the partitions': listeners, connections, node journals, logs, coordination
STORAGE_RESERVE = 64
#: Linux's own ceiling of a process's descriptors when the hard limit is "unlimited"
_NR_OPEN = "/proc/sys/fs/nr_open"

HINT = ("raise the hard limit of open files of the process (systemd: LimitNOFILE=; a shell: ulimit -Hn); "
        "docs/operations.md, \"Open files\"")


def soft_limit() -> int:
    """Files this process may have open now (``ulimit -n``)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_to_hard_limit() -> tuple[int, int]:
    """Raise the soft limit of open files to the hard limit (capped at the kernel's ``nr_open``
    when the hard limit is unlimited). Returns (before, after); a limit that cannot be raised is
    left as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(_NR_OPEN, encoding="ascii") as fh:
                target = int(fh.read())
        except (OSError, ValueError):
            target = 1 << 20  # Linux's default nr_open
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


class _InUse:
    """How many descriptors the process has open, counted at most once a second while far from
    the limit: counting lists ``/proc/self/fd``, 0.43 ms at 600 open and 4.1 ms at 3,000 (measured),
    too much for each of a thousand partitions opening at a node's start. Between counts the
    estimate grows by what :func:`keep_free` let open and never shrinks, so it errs towards a new
    count, which is made whenever the estimate comes near the limit."""

    __slots__ = ("estimate", "counted_at")

    def __init__(self) -> None:
        self.estimate = 0
        self.counted_at = float("-inf")

    def count(self, now: float) -> int | None:
        try:
            in_use = len(os.listdir("/proc/self/fd")) - 1  # less the descriptor of the listing itself
        except OSError:  # no /proc (not Linux): nothing to go by
            return None
        self.estimate, self.counted_at = in_use, now
        return in_use


_in_use = _InUse()
#: seconds an estimate of the descriptors in use is trusted while far from the limit
COUNT_MAX_AGE = 1.0


def keep_free(opening: int, reserve: int = STORAGE_RESERVE) -> None:
    """Raise ``OSError(EMFILE)`` unless ``opening`` more descriptors leave ``reserve`` of the
    process's limit free; called before the (rare) opens of a segment's files."""
    limit = soft_limit()
    if limit == resource.RLIM_INFINITY:
        return
    now = time.monotonic()
    estimate = _in_use.estimate + opening
    if now - _in_use.counted_at >= COUNT_MAX_AGE or estimate > limit - reserve:
        in_use = _in_use.count(now)
        if in_use is None:
            return
        estimate = in_use + opening
        if estimate > limit - reserve:
            raise OSError(errno.EMFILE, f"Too many open files: {in_use} of {limit} in use, and {reserve} are kept "
                                        f"free for connections")
    _in_use.estimate = estimate


def storage_files_needed(partitions: int, files_per_partition: int = FILES_PER_PARTITION) -> int:
    """Descriptors a storage node serving ``partitions`` partitions may hold at once."""
    return partitions * files_per_partition + STORAGE_RESERVE


def storage_shortfall(partitions: int, files_per_partition: int = FILES_PER_PARTITION,
                      limit: int | None = None) -> str | None:
    """None if a storage node serving ``partitions`` partitions fits in the process's limit of
    open files, else one line that says by how much it does not and what to do."""
    limit = soft_limit() if limit is None else limit
    needed = storage_files_needed(partitions, files_per_partition)
    if limit == resource.RLIM_INFINITY or needed <= limit:
        return None
    return (f"this storage node serves {partitions} partitions, which may hold up to {needed} files open "
            f"({files_per_partition} each, and {STORAGE_RESERVE} for connections and journals), and the process "
            f"may open {limit}: a partition that finds no descriptor free cannot open its files; {HINT}")


def hint(exc: BaseException) -> str:
    """What to add to an error out of descriptors: the process's limit and the remedy ("" for
    any other error)."""
    code = getattr(exc, "errno", None)
    if code == errno.EMFILE:
        return f" (this process may open {soft_limit()} files; {HINT})"
    if code == errno.ENFILE:
        return " (the host's table of open files is full: fs.file-max, or a process that leaks files)"
    return ""


def explain(exc: OSError) -> str:
    """``str(exc)``, with :func:`hint`."""
    return f"{exc}{hint(exc)}"
