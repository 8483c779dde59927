"""Lock hashes are the Java client's: String.hashCode() ^ Long.hashCode(id), as signed int32."""

from __future__ import annotations

import pytest

from waltz_core.locks import PartitionLocalLock, java_long_hash, java_string_hash, lock_hash, lock_hashes


def polynomial_hash(text: str) -> int:
    """String.hashCode straight from its definition s[0]*31^(n-1) + ... + s[n-1] (UTF-16 units, int32)."""
    raw = text.encode("utf-16-be")
    units = [int.from_bytes(raw[i:i + 2], "big") for i in range(0, len(raw), 2)]
    n = len(units)
    total = sum(u * 31 ** (n - 1 - i) for i, u in enumerate(units)) % 2**32
    return total - 2**32 if total >= 2**31 else total


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", 0),
        ("a", 97),
        ("Aa", 2112),  # the classic collision with "BB"
        ("BB", 2112),
        ("hello", 99162322),
        ("account", -1177318867),  # 97*31^6 + 99*31^5 + 99*31^4 + 111*31^3 + 117*31^2 + 110*31 + 116, wrapped
        ("withdrawal", polynomial_hash("withdrawal")),
        ("polygenelubricants", -2147483648),  # famous: hashes to Integer.MIN_VALUE
        ("\u00e9t\u00e9", polynomial_hash("\u00e9t\u00e9")),  # BMP, non-ASCII
        ("\U0001F600", 0xD83D * 31 + 0xDE00),  # outside the BMP: a surrogate pair, two units
    ],
)
def test_java_string_hash(text: str, expected: int) -> None:
    assert java_string_hash(text) == expected
    assert java_string_hash(text) == polynomial_hash(text)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (42, 42),
        (-1, 0),  # 0xFFFFFFFF_FFFFFFFF ^ 0x00000000_FFFFFFFF -> low word 0
        (-2, 1),
        (1 << 32, 1),
        ((1 << 32) + 5, 4),
        (2**63 - 1, -2147483648),  # 0x7FFFFFFF_FFFFFFFF -> low word 0x80000000
        (-(2**63), -2147483648),
        (2**31, -2147483648),
    ],
)
def test_java_long_hash(value: int, expected: int) -> None:
    assert java_long_hash(value) == expected


def test_long_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="signed 64-bit"):
        java_long_hash(2**63)
    with pytest.raises(ValueError, match="signed 64-bit"):
        PartitionLocalLock("account", -(2**63) - 1)


def test_partition_local_lock_hash() -> None:
    assert PartitionLocalLock("account", 0).lock_hash == -1177318867
    assert PartitionLocalLock("account", 7).lock_hash == -1177318867 ^ 7
    # id 2**32 hashes to 1: same as id 1
    assert PartitionLocalLock("account", 2**32).lock_hash == PartitionLocalLock("account", 1).lock_hash
    assert lock_hash("hello", -2) == 99162322 ^ 1
    assert lock_hash("polygenelubricants", 1) == -2147483647
    assert lock_hashes([PartitionLocalLock("a", 1), 5]) == (96, 5)


def test_subclass_names_a_lock_family() -> None:
    class AccountLock(PartitionLocalLock):
        def __init__(self, account_id: int) -> None:
            super().__init__("account", account_id)

    assert AccountLock(7).lock_hash == PartitionLocalLock("account", 7).lock_hash
    assert AccountLock(7).name == "account"


def test_bad_types_are_refused() -> None:
    with pytest.raises(TypeError):
        PartitionLocalLock(None, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PartitionLocalLock("a", 1.5)  # type: ignore[arg-type]


def test_the_hash_is_made_once_and_is_not_part_of_the_value() -> None:
    import copy
    import pickle

    import attrs

    lock = PartitionLocalLock("account", 7)
    assert lock.lock_hash == lock_hash("account", 7)
    # The cached hash is not a field of the value: equality, hashing and repr are name and id.
    assert lock == PartitionLocalLock("account", 7) and hash(lock) == hash(PartitionLocalLock("account", 7))
    assert repr(lock) == "PartitionLocalLock(name='account', id=7)"
    # Copies carry the hash of their own name and id.
    assert attrs.evolve(lock, id=8).lock_hash == lock_hash("account", 8)
    assert pickle.loads(pickle.dumps(lock)).lock_hash == lock.lock_hash
    assert copy.copy(lock).lock_hash == lock.lock_hash
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        lock._lock_hash = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        PartitionLocalLock("a", True)  # a bool is not a lock id


@pytest.mark.parametrize("name", ["account", "hello", "polygenelubricants", "", "\u00e9t\u00e9"])
def test_a_locks_hash_is_lock_hash_on_both_sides_of_the_int32_ids(name: str) -> None:
    """Ids in 0..2**31-1 take a shorter path (Long.hashCode of such an id is the id)."""
    for id in (0, 1, 7, 2**31 - 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, -1, -2, -(2**31), 2**63 - 1, -(2**63)):
        lock = PartitionLocalLock(name, id)
        assert lock.lock_hash == lock_hash(name, id), (name, id)
        assert -(2**31) <= lock.lock_hash < 2**31


def test_a_subclass_made_with_attrs_hashes_its_locks_too() -> None:
    """attrs makes such a subclass its own ``__init__``, which calls ``__attrs_post_init__``."""
    import attrs

    @attrs.frozen
    class RegionLock(PartitionLocalLock):
        region: str = "eu"

    lock = RegionLock("account", 7, "us")
    assert lock.lock_hash == lock_hash("account", 7) and lock.region == "us"
    assert RegionLock("account", 2**40).lock_hash == lock_hash("account", 2**40)
    with pytest.raises(TypeError):
        RegionLock("account", 1.5)  # type: ignore[arg-type]
