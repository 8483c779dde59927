"""Sample a server process with py-spy during a benchmark, and summarise where its time went.

py-spy is an optional tool (``pip install py-spy``), never a dependency; it needs ptrace rights
on the target (root, or ``kernel.yama.ptrace_scope = 0`` for a child process).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")


class PySpyRecording:
    """``py-spy record --format raw`` of ``pid``, started after ``delay`` seconds, for ``duration``."""

    def __init__(self, pid: int, output: Path, delay: float, duration: float, rate: int = 250) -> None:
        self.output = output
        self.notes: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).exists():
            self.notes.append("no profile: py-spy is not installed (pip install py-spy)")
            self._timer = None
            return
        args = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(duration))), "--rate", str(rate),
                "--format", "raw", "--output", str(output), "--nonblocking"]

        def start() -> None:
            self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        self._timer = threading.Timer(delay, start)
        self._timer.start()

    def finish(self, timeout: float = 60.0) -> list[str]:
        """Wait for py-spy to write its file (blocking); notes on failure."""
        if self._timer is not None:
            self._timer.join()
        if self._proc is not None:
            try:
                _, err = self._proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                _, err = self._proc.communicate()
            if self._proc.returncode != 0:
                self.notes.append(f"py-spy failed ({self._proc.returncode}): {err.decode(errors='replace')[-300:]}")
        return self.notes


def py_spy_record(pid: int, output: Path, delay: float, duration: float) -> PySpyRecording:
    """Start sampling ``pid`` in the background; call ``finish()`` after the run."""
    return PySpyRecording(pid, output, delay, duration)


def top_functions(collapsed: Path, limit: int = 15) -> list[str]:
    """The functions with the most *own* samples in a py-spy raw (collapsed-stack) file, plus the
    share of samples whose stack passes through each (inclusive), as printable lines."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = [_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    if not total:
        return ["(no samples)"]
    lines = [f"{'own %':>6} {'incl %':>6}  function ({total} samples)"]
    for name, samples in own.most_common(limit):
        lines.append(f"{100 * samples / total:6.1f} {100 * inclusive[name] / total:6.1f}  {name}")
    return lines


def _name(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match.group("file")
    short = "/".join(Path(path).parts[-2:])
    return f"{match.group('fn')} ({short})"
