"""Open files: the limit a storage node needs, what it says when out of descriptors, no descriptor
left open behind a failed segment (the real process runs out in tests/storage/test_process.py)."""

from __future__ import annotations

import errno
import os
import resource
import uuid
from pathlib import Path
from typing import Any

import pytest

from waltz_core import openfiles
from waltz_core.storage import segmented
from waltz_core.storage.segmented import SegmentedLayout

from .conftest import make_records


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_node_that_fits_in_its_limit_gets_no_warning() -> None:
    assert openfiles.storage_shortfall(100, 2, limit=264) is None
    assert openfiles.storage_shortfall(0, 2, limit=64) is None


def test_a_node_that_does_not_fit_is_told_by_how_much_and_what_to_raise() -> None:
    text = openfiles.storage_shortfall(300, 2, limit=512)
    assert text == ("this storage node serves 300 partitions, which may hold up to 664 files open (2 each, and 64 "
                    "for connections and journals), and the process may open 512: a partition that finds no "
                    "descriptor free cannot open its files; raise the hard limit of open files of the process "
                    "(systemd: LimitNOFILE=; a shell: ulimit -Hn); docs/operations.md, \"Open files\"")


def test_an_error_out_of_descriptors_names_the_limit_and_the_remedy() -> None:
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    emfile = OSError(errno.EMFILE, "Too many open files", "/data/7")
    assert openfiles.explain(emfile) == (f"[Errno 24] Too many open files: '/data/7' (this process may open {limit} "
                                         f"files; {openfiles.HINT})")
    assert "fs.file-max" in openfiles.explain(OSError(errno.ENFILE, "Too many open files in system"))
    assert openfiles.explain(OSError(errno.ENOSPC, "No space left on device")) == "[Errno 28] No space left on device"


def test_the_segmented_layout_says_what_a_partition_may_hold_open(tmp_path: Path) -> None:
    layout = SegmentedLayout(tmp_path, segment_cache_capacity=5)
    assert layout.open_files_per_partition == 10  # the tail and 4 cached sealed segments, 2 files each
    assert SegmentedLayout(tmp_path, segment_cache_capacity=1).open_files_per_partition == 2


@pytest.mark.parametrize("fails", ["data", "index"])
def test_a_segment_that_cannot_be_created_leaves_no_descriptor_open(tmp_path: Path, fails: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors at a segment's creation: every descriptor it opened is closed again
    (before, the data file's stayed open when the index's failed, one more at each retry), and
    the partition opens and appends once descriptors are free."""
    layout = SegmentedLayout(tmp_path, index_checkpoint_interval=5)
    layout.open(uuid.uuid4(), 1)
    store = layout.open_partition(0)
    real_open = os.open

    def open_file(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(segmented.DATA_SUFFIX if fails == "data" else segmented.INDEX_SUFFIX):
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return real_open(path, flags, *args, **kwargs)

    before = _open_descriptors()
    monkeypatch.setattr(segmented.os, "open", open_file)
    for _ in range(3):  # as a node's retries would
        with pytest.raises(OSError, match="Too many open files"):
            store.append(make_records(0, 2))
    monkeypatch.setattr(segmented.os, "open", real_open)
    assert _open_descriptors() == before
    store.close()
    store = layout.open_partition(0)
    store.append(make_records(0, 2))
    assert store.read_records(0, 10) == make_records(0, 2)
    store.close()
    layout.close()


def test_a_node_keeps_descriptors_free_for_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process out of descriptors cannot accept a connection: segment files may not take the
    last STORAGE_RESERVE of them."""
    in_use = len(os.listdir("/proc/self/fd")) - 1
    monkeypatch.setattr(openfiles, "soft_limit", lambda: in_use + 66)
    monkeypatch.setattr(openfiles, "_in_use", openfiles._InUse())
    openfiles.keep_free(2, reserve=64)  # leaves exactly 64
    with pytest.raises(OSError) as refused:
        openfiles.keep_free(3, reserve=64)
    assert refused.value.errno == errno.EMFILE
    assert str(refused.value) == (f"[Errno 24] Too many open files: {in_use} of {in_use + 66} in use, and 64 are "
                                  f"kept free for connections")


def test_descriptors_are_counted_at_most_once_a_second_far_from_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    counts: list[int] = []
    real_listdir = os.listdir

    def listdir(path: Any) -> list[str]:
        if str(path) == "/proc/self/fd":
            counts.append(1)
        return real_listdir(path)

    monkeypatch.setattr(openfiles, "_in_use", openfiles._InUse())
    monkeypatch.setattr(openfiles.os, "listdir", listdir)
    monkeypatch.setattr(openfiles, "soft_limit", lambda: 1 << 20)
    for _ in range(500):  # a thousand partitions opening at a node's start
        openfiles.keep_free(2)
    assert len(counts) == 1
    monkeypatch.setattr(openfiles, "soft_limit", lambda: openfiles._in_use.estimate + 65)
    openfiles.keep_free(2)  # near the limit: counted again before it answers
    assert len(counts) == 2
