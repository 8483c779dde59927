"""Fixtures: real ZooKeeper servers on free loopback ports (session scoped), kazoo log levels."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _quiet_kazoo() -> Iterator[None]:
    # kazoo logs every dropped connection at WARNING; failover tests drop many on purpose.
    names = ("kazoo", "waltz.coordination.zookeeper.kazoo")
    previous = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    yield
    for n, level in previous.items():
        logging.getLogger(n).setLevel(level)


