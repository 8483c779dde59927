"""File operations shared by the segmented layout and the node journal."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (the kernel may write less per call)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


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
