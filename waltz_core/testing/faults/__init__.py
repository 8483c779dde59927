"""Fault tooling for reliability tests: a TCP fault proxy, process control, disk faults.

* :mod:`.proxy` - :class:`FaultProxy` / :class:`ThreadedFaultProxy` (cut, reset, delay, one-way drop);
* :mod:`.process` - :class:`ClusterProcesses` (SIGKILL, SIGSTOP/SIGCONT, restart, isolate) over
  a :class:`~waltz_core.app.local_cluster.ProcessCluster` and its ZooKeeper/etcd launcher;
* :mod:`.netns` - :class:`HostNetwork`: every process on a host of its own (network namespaces on
  a private switch, 198.18.0.0/15); a host vanishes without a reset (packets dropped);
* :mod:`.disk` - the fsync journal and :func:`crash_lose_unsynced` (lost/torn/garbled unsynced
  bytes at a simulated power loss), :func:`flip_bits`, and :func:`small_filesystem` (a real full
  disk: a tmpfs of a fixed size);
* :mod:`.memory` - :func:`memory_cgroup` (a process under a memory limit, as in a container).
"""

from .disk import (
    CrashMode,
    SmallFilesystem,
    crash_lose_unsynced,
    flip_bits,
    small_filesystem,
    small_filesystems_available,
    storage_files,
    sync_journal_env,
    synced_sizes,
)
from .memory import MemoryCgroup, memory_cgroup, memory_cgroups_available
from .netns import HostNetwork, netns_available
from .process import ClusterProcesses
from .proxy import FaultProxy, ThreadedFaultProxy

__all__ = ["ClusterProcesses", "CrashMode", "FaultProxy", "HostNetwork", "MemoryCgroup", "SmallFilesystem",
           "ThreadedFaultProxy", "crash_lose_unsynced", "flip_bits", "memory_cgroup", "memory_cgroups_available",
           "netns_available", "small_filesystem", "small_filesystems_available", "storage_files", "sync_journal_env",
           "synced_sizes"]
