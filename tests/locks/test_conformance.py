"""Both built-in strategies pass the shipped lock-table conformance kit."""

from __future__ import annotations

import pytest

from waltz_core.locks import ExactLockTable, HashedLockTable, HashedOptions
from waltz_core.testing.conformance.lock_table import LockTableConformance, MakeTable


class TestHashedDefault(LockTableConformance):
    @pytest.fixture
    def make_table(self) -> MakeTable:
        return lambda hwm: HashedLockTable.from_options(HashedOptions(), hwm)


class TestHashedOneHash(LockTableConformance):
    @pytest.fixture
    def make_table(self) -> MakeTable:
        return lambda hwm: HashedLockTable(size=4096, hash_count=1, high_water_mark=hwm)


class TestExact(LockTableConformance):
    @pytest.fixture
    def make_table(self) -> MakeTable:
        return lambda hwm: ExactLockTable.from_options(None, hwm)
