"""Both built-in strategies pass the shipped lock-table conformance kit."""

from __future__ import annotations

import pytest

from waltz_core.config import ServerConfig
from waltz_core.locks import ExactLockTable, HashedLockTable
from waltz_core.testing.conformance.lock_table import LockTableConformance, MakeTable


class TestHashedDefault(LockTableConformance):
    @pytest.fixture
    def make_table(self) -> MakeTable:
        return lambda hwm: HashedLockTable(high_water_mark=hwm)


class TestHashedOneHash(LockTableConformance):
    @pytest.fixture
    def make_table(self) -> MakeTable:
        return lambda hwm: HashedLockTable(size=4096, hash_count=1, high_water_mark=hwm)


class TestExact(LockTableConformance):
    @pytest.fixture
    def make_table(self) -> MakeTable:
        def make(hwm: int) -> ExactLockTable:
            table = ExactLockTable.from_config(ServerConfig(lock_table="exact"))  # as the server builds it
            table.reset(hwm)
            return table

        return make
