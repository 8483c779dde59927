"""Process-wide settings of a ``waltz`` process, applied once at start (not per request).

* **Garbage collector** (``WALTZ_GC``). CPython's full (generation-2) collection walks every
  tracked object of the process; in a server or storage node about 40,000 of them are the modules,
  classes and functions imported at start, which never die. Such a collection took 21-44 ms of CPU
  on the development machine (longer in wall time when the process was preempted meanwhile), and
  every transaction in flight waited for it: that was the p99.9 of an open loop at 70 % of the
  maximum (docs/performance.md, "Where the tail comes from"). ``freeze`` (the default) calls
  :func:`gc.freeze` once the process has started (``waltz_process_started``, i.e. listeners bound,
  or just before a ``waltz perf`` run): the objects of start-up move to the permanent generation,
  which collections skip, and a full collection then walks only what was allocated since.
  ``default`` leaves the collector as Python sets it.
* ``WALTZ_GC_THRESHOLD=T0,T1,T2`` sets :func:`gc.set_threshold` at start (default: Python's
  700,10,10, kept: raising T0 did not measurably change CPU per transaction or the tail).
* **Open files.** The soft limit of open files is raised to the hard limit at start, as the JVM
  does (:mod:`waltz_core.openfiles`): a storage node keeps two files open per partition, and the
  usual soft limit of 1,024 ran out at a few hundred partitions.

Only a process started through :func:`waltz_core.cli.main.main` is configured: a server or storage
node run inside another program (tests, ``InProcessCluster``) leaves that program's collector alone.
"""

from __future__ import annotations

import gc
import os

from ..errors import ConfigError
from ..openfiles import raise_to_hard_limit

GC_ENV = "WALTZ_GC"
GC_THRESHOLD_ENV = "WALTZ_GC_THRESHOLD"
GC_MODES = ("freeze", "default")

#: The environment variables a ``waltz`` process reads at start, rendered into docs/configuration.md
#: by scripts/gen_docs.py (the timeline's are read by :mod:`waltz_core.perf.timeline`).
PROCESS_ENVIRONMENT: dict[str, str] = {
    GC_ENV: "`freeze` (default): once a server or storage node serves (or just before a `waltz perf` run), "
            "`gc.collect()` then `gc.freeze()`, so full collections skip the start-up objects (a 20-60 ms pause "
            "otherwise, docs/performance.md); `default`: Python's collector untouched.",
    GC_THRESHOLD_ENV: "`T0,T1,T2` for `gc.set_threshold` at start (default: Python's, 700,10,10).",
    "WALTZ_TIMELINE_DIR": "Record a timeline (GC, event-loop stalls, fdatasync, transactions) in memory and write "
                          "it to `DIR/<process>-<pid>.json` at exit (docs/performance.md); unset: nothing installed.",
    "WALTZ_TIMELINE_STALL_MS": "With the timeline: an event-loop lateness recorded as a stall, in ms (default 2).",
    "WALTZ_TIMELINE_TICK_MS": "With the timeline: the stall watchdog's period, in ms (default 1).",
}

_mode: str | None = None  # set by configure() in a process the CLI started
_frozen = False


def gc_mode(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    raw = environ.get(GC_ENV, "").strip().lower() or "freeze"
    if raw not in GC_MODES:
        raise ConfigError(f"environment variable {GC_ENV}={environ.get(GC_ENV)!r}: expected one of "
                          f"{', '.join(GC_MODES)}")
    return raw


def gc_threshold(environ: os._Environ[str] | dict[str, str] = os.environ) -> tuple[int, int, int] | None:
    raw = environ.get(GC_THRESHOLD_ENV, "").strip()
    if not raw:
        return None
    parts = [p.strip() for p in raw.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or values[0] < 1 or min(values) < 0:
        raise ConfigError(f"environment variable {GC_THRESHOLD_ENV}={raw!r}: expected three integers "
                          "T0,T1,T2 (T0 >= 1), e.g. 700,10,10")
    return values[0], values[1], values[2]


def configure(environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
    """At process start (the CLI's ``main``): read and check the settings, set the thresholds.
    :class:`~waltz_core.errors.ConfigError` on a bad value."""
    global _mode
    mode = gc_mode(environ)
    threshold = gc_threshold(environ)
    if threshold is not None:
        gc.set_threshold(*threshold)
    _mode = mode
    raise_to_hard_limit()


def started() -> bool:
    """The process finished starting: freeze what start-up allocated (once; only in a process
    :func:`configure` ran in, with ``WALTZ_GC=freeze``). True if it froze now."""
    global _frozen
    if _mode != "freeze" or _frozen:
        return False
    gc.collect()  # start-up garbage is freed first, not frozen
    gc.freeze()
    _frozen = True
    return True
