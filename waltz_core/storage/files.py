"""File operations shared by the segmented layout and the node journal."""

from __future__ import annotations

import os
from pathlib import Path


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (the kernel may write less per call)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
