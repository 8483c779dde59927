"""File operations shared by the segmented layout and the node journal."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (the kernel may write less per call)."""
    view = memoryview(data)
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n
    finally:
        # A failed write's traceback keeps this frame: without the release a bytearray written
        # here (a store's pending batches) stays exported and cannot be cleared while the
        # failure is handled (BufferError instead of the OSError).
        view.release()


#: buffers per pwritev (Linux allows 1024)
IOV_MAX = 1024


def pwritev_all(fd: int, buffers: Sequence[bytes | bytearray | memoryview], offset: int) -> int:
    """Write ``buffers`` at ``offset``, one ``pwritev`` unless the kernel writes less; bytes written."""
    total = sum(len(b) for b in buffers)
    if len(buffers) > IOV_MAX:  # hundreds of batches: one copy, one write
        buffers = [b"".join(buffers)]
    written = os.pwritev(fd, buffers, offset)
    if written < total:  # short write (a signal, a full disk): finish it from a joined copy
        pwrite_all(fd, memoryview(b"".join(buffers))[written:], offset + written)
    return total


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  #: start writeback of the range's dirty pages, do not wait


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` to the device without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing). Durability still comes only
    from fdatasync; this lets the writes of several files proceed while the first fdatasync
    waits (measured: 4 partitions synced in 0.29 ms a round instead of 0.38 serially)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # a failure leaves it to fdatasync
