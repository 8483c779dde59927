"""Disk faults: lost unsynced writes at a simulated crash, torn/garbled tails, bit flips.

**Lost unsynced writes** (the FoundationDB ``AsyncFileNonDurable`` / Jepsen lazyfs model, done
offline): a process started with ``WALTZ_TEST_SYNC_JOURNAL=<file>`` (and this package's
``_site`` directory on ``PYTHONPATH``, see :func:`sync_journal_env`) appends one JSON line
``{"path", "size"}`` to the journal after every successful ``os.fsync``/``os.fdatasync``: the
file's size at its last durable sync. After the process is killed, :func:`crash_lose_unsynced`
plays the power loss: every journaled file loses, truncates or garbles whatever lies past its
last synced size. Files never synced are left alone (the conservative choice: a false alarm
would be worse than a missed one). A storage node that skips ``fdatasync`` (the layout
``unsafe-no-fsync`` of the negative control :mod:`waltz_core.testing.sabotage`) then loses
acknowledged records, which the checker must catch.

**Bit flips** (:func:`flip_bits`): flip ``count`` random bits (or one bit at a fixed offset) of a
segment (``.seq``), index (``.idx``) or control file, offline.

**A full disk** (:class:`SmallFilesystem`): a directory on a tmpfs of a fixed size (root only),
so a node that writes there gets real ``ENOSPC`` errors from the kernel; it can be filled to
leave a given number of bytes free, and freed again, while the node runs.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import random
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

JOURNAL_ENV = "WALTZ_TEST_SYNC_JOURNAL"
_SITE_DIR = Path(__file__).resolve().parent / "_site"


def sync_journal_env(journal: Path | str) -> dict[str, str]:
    """Environment for a subprocess whose fsync/fdatasync calls are journaled to ``journal``."""
    path = os.environ.get("PYTHONPATH", "")
    return {JOURNAL_ENV: str(journal), "PYTHONPATH": os.pathsep.join(p for p in (str(_SITE_DIR), path) if p)}


def install_sync_journal(journal: Path | str) -> None:
    """Wrap ``os.fsync``/``os.fdatasync`` in this process so each success is journaled.

    Called by the ``_site/sitecustomize.py`` hook at interpreter start; idempotent.
    """
    if getattr(os.fdatasync, "waltz_journaled", False):
        return
    fd_out = os.open(str(journal), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def record(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(fd)
        except OSError:
            return
        if not os.path.isfile(path):
            return  # directory syncs: names are not modelled
        # One write(2) per line with O_APPEND: lines of concurrent threads never interleave.
        os.write(fd_out, (json.dumps({"path": path, "size": st.st_size}) + "\n").encode())

    def fsync(fd: int) -> None:
        real_fsync(fd)
        record(fd if isinstance(fd, int) else fd.fileno())

    def fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        record(fd if isinstance(fd, int) else fd.fileno())

    # Marks the wrappers as ours: the check at the top makes a second call a no-op.
    fsync.waltz_journaled = True  # type: ignore[attr-defined]
    fdatasync.waltz_journaled = True  # type: ignore[attr-defined]
    os.fsync, os.fdatasync = fsync, fdatasync  # type: ignore[assignment]


def synced_sizes(journal: Path | str) -> dict[Path, int]:
    """The last synced size of every journaled file (a torn last line is ignored)."""
    out: dict[Path, int] = {}
    p = Path(journal)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        out[Path(entry["path"])] = int(entry["size"])
    return out


class CrashMode(enum.Enum):
    """What happens to the unsynced suffix of a file at a simulated power loss."""

    DROP = "drop"  #: lost entirely (truncated to the synced size)
    TORN = "torn"  #: a random prefix of it survives
    GARBLE = "garble"  #: a random prefix survives with random bytes garbled in it


@attrs.frozen
class CrashEffect:
    path: Path
    synced: int
    size_before: int
    size_after: int
    garbled: int


def crash_lose_unsynced(root: Path | str, journal: Path | str, mode: CrashMode = CrashMode.DROP,
                        rng: random.Random | None = None) -> list[CrashEffect]:
    """Simulate a power loss for every journaled file under ``root`` (the process must be dead).

    Returns what was done to each file that had unsynced bytes.
    """
    rng = rng or random.Random(0)
    root = Path(root).resolve()
    effects = []
    for path, synced in sorted(synced_sizes(journal).items()):
        try:
            path.relative_to(root)
        except ValueError:
            continue
        if not path.exists():
            continue
        size = path.stat().st_size
        if size <= synced:
            continue
        keep = synced if mode is CrashMode.DROP else synced + rng.randrange(0, size - synced + 1)
        garbled = 0
        with open(path, "r+b") as f:
            f.truncate(keep)
            if mode is CrashMode.GARBLE and keep > synced:
                for _ in range(max(1, (keep - synced) // 512)):
                    at = rng.randrange(synced, keep)
                    f.seek(at)
                    f.write(bytes([rng.randrange(256)]))
                    garbled += 1
        effects.append(CrashEffect(path, synced, size, keep, garbled))
    return effects


@attrs.frozen
class BitFlip:
    path: Path
    offset: int
    bit: int


def flip_bits(path: Path | str, count: int = 1, rng: random.Random | None = None, offset: int | None = None,
              start: int = 0) -> list[BitFlip]:
    """Flip ``count`` random bits of ``path`` at or after byte ``start`` (or one bit at ``offset``)."""
    rng = rng or random.Random(0)
    path = Path(path)
    size = path.stat().st_size
    if size <= start:
        return []
    flips = []
    with open(path, "r+b") as f:
        for _ in range(1 if offset is not None else count):
            at = offset if offset is not None else rng.randrange(start, size)
            bit = rng.randrange(8)
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << bit)]))
            flips.append(BitFlip(path, at, bit))
    return flips


def storage_files(directory: Path | str, kinds: Iterable[str] = (".seq", ".idx", ".ctl")) -> list[Path]:
    """The segment (``.seq``), index (``.idx``) and control (``.ctl``) files of a storage directory."""
    kinds = tuple(kinds)
    return [p for p in sorted(Path(directory).rglob("*")) if p.is_file() and p.suffix in kinds]


def small_filesystems_available() -> bool:
    """True when this process can mount a tmpfs (root and ``mount``)."""
    return os.geteuid() == 0 and shutil.which("mount") is not None and shutil.which("umount") is not None


@attrs.define
class SmallFilesystem:
    """A tmpfs of ``size`` bytes mounted on ``path`` (see :func:`small_filesystem`)."""

    path: Path
    size: int
    filler: Path = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.filler = self.path / ".filler"

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int) -> None:
        """Grow the filler file until at most ``leave`` bytes are free (about: tmpfs counts pages)."""
        chunk = b"\0" * (64 * 1024)
        with open(self.filler, "ab") as fh:
            while self.free_bytes() > leave:
                fh.write(chunk[: min(len(chunk), self.free_bytes() - leave)])
                fh.flush()

    def free(self) -> None:
        """Remove the filler: what the operator does by deleting files or growing the volume."""
        self.filler.unlink(missing_ok=True)


@contextlib.contextmanager
def small_filesystem(path: Path | str, size: int) -> Iterator[SmallFilesystem]:
    """Mount a tmpfs of ``size`` bytes on ``path`` (created if missing) and unmount it at the end."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "waltz-test-small", str(path)], check=True,
                   capture_output=True)
    try:
        yield SmallFilesystem(path, size)
    finally:
        # A process still holding files there (a failed test) must not keep the mount: detach it.
        subprocess.run(["umount", "--lazy", str(path)], check=False, capture_output=True)
