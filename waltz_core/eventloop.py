"""Which event loop a Waltz process runs on: asyncio's own, or uvloop when it is installed.

A server, a storage node and ``waltz perf`` spend much of their CPU in the event loop itself
(selecting, scheduling callbacks, socket transports). uvloop does that work in C: measured on the
development machine, CPU per transaction of a whole local cluster fell by about a tenth at 1
partition x 64 in flight (docs/performance.md). It is an optional dependency (``pip install
'waltz-core[speedups]'``); ``[process] event_loop`` chooses:

* ``auto`` (the default): uvloop when it imports, else asyncio;
* ``asyncio``: the standard library's loop, whatever is installed;
* ``uvloop``: uvloop, and a :class:`~waltz_core.errors.ConfigError` when it is not installed.

Only the processes the ``waltz`` command starts choose their loop. A client library runs on the
application's loop (``uvloop.run(main())`` gives it the same gain), and the HTTP endpoint's own
thread keeps asyncio's (it is not on any hot path).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from .errors import ConfigError

T = TypeVar("T")

#: the values of ``[process] event_loop``
EVENT_LOOPS: Final = ("auto", "asyncio", "uvloop")
#: what ``waltz perf`` (which reads no process config) takes its choice from; the same variable
#: overrides ``[process] event_loop`` of the servers and storage nodes it starts
ENV_EVENT_LOOP: Final = "WALTZ_PROCESS_EVENT_LOOP"

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _uvloop_factory() -> LoopFactory | None:
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: LoopFactory = uvloop.new_event_loop
    return factory


def loop_factory(event_loop: str) -> LoopFactory:
    """The factory of the loop ``event_loop`` names (ConfigError for an unknown name, or for
    ``uvloop`` when it is not installed)."""
    if event_loop not in EVENT_LOOPS:
        raise ConfigError(f"[process] event_loop = {event_loop!r}: must be one of {', '.join(EVENT_LOOPS)}")
    if event_loop == "asyncio":
        return asyncio.new_event_loop
    uv = _uvloop_factory()
    if uv is not None:
        return uv
    if event_loop == "uvloop":
        raise ConfigError("[process] event_loop = 'uvloop' but uvloop is not installed: pip install "
                          "'waltz-core[speedups]' (or choose auto or asyncio)")
    return asyncio.new_event_loop


def event_loop_from_env(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """``WALTZ_PROCESS_EVENT_LOOP``, or ``auto`` when it is unset or empty (ConfigError naming
    the variable for any other value than those of :data:`EVENT_LOOPS`)."""
    value = environ.get(ENV_EVENT_LOOP, "").strip() or "auto"
    if value not in EVENT_LOOPS:
        raise ConfigError(f"environment variable {ENV_EVENT_LOOP}={value!r}: must be one of {', '.join(EVENT_LOOPS)}")
    return value


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``uvloop`` or ``asyncio``: the implementation of ``loop`` (default: the running loop)."""
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return "none"
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


#: called with each loop :func:`run` makes on the main thread (see :func:`on_main_loop`)
_main_loop_callbacks: list[Callable[[asyncio.AbstractEventLoop], None]] = []


def on_main_loop(callback: Callable[[asyncio.AbstractEventLoop], None]) -> None:
    """Call ``callback(loop)`` with each loop :func:`run` makes on the main thread, before it runs:
    how the perf timeline (``WALTZ_TIMELINE_DIR``) puts its watchdog on a loop of either kind."""
    _main_loop_callbacks.append(callback)


def run(main: Coroutine[Any, Any, T], event_loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``event_loop`` names (see the module doc)."""
    try:
        factory = loop_factory(event_loop)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning on a config error
        raise

    def new_loop() -> asyncio.AbstractEventLoop:
        loop = factory()
        if threading.current_thread() is threading.main_thread():
            for callback in _main_loop_callbacks:
                callback(loop)
        return loop

    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)
