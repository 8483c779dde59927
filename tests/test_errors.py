"""The exception tree: the docstring drawing matches the classes, flags and wire codes; the wire round trip."""

from __future__ import annotations

import inspect
import re

import pytest

import waltz_core.errors as errors
from waltz_core.errors import (
    ClientError,
    ConfigError,
    CoordinationError,
    PluginError,
    ProtocolError,
    ServerError,
    StorageError,
    TransportError,
    WaltzError,
    error_from_wire,
    wire_code,
)

TREE_LINE = re.compile(
    r"^\s*(?:[│ ]*[├└]── )?(?P<name>[A-Z]\w+)\s+(?P<code>\d+)\s+(?P<retriable>yes|no|varies)\s+(?P<meaning>\S.*)$"
)


def parse_tree() -> dict[str, tuple[str | None, str, int]]:
    """class name -> (parent name, retriable column, code column) from the drawing in the module docstring."""
    doc = errors.__doc__ or ""
    block = doc.split("::", 1)[1].split("\n\n", 2)[1]  # the indented literal block after "::"
    out: dict[str, tuple[str | None, str, int]] = {}
    stack: list[tuple[int, str]] = []  # (depth, name)
    root_indent = 0
    for line in block.splitlines():
        if not line.strip() or line.split() == ["class", "code", "retriable", "meaning"]:
            continue
        m = TREE_LINE.match(line)
        assert m, f"unparsable tree line: {line!r}"
        marker = max(line.find("├"), line.find("└"))
        if marker < 0:  # the root
            root_indent = len(line) - len(line.lstrip())
        depth = 0 if marker < 0 else (marker - root_indent) // 4 + 1
        while stack and stack[-1][0] >= depth:
            stack.pop()
        out[m["name"]] = (stack[-1][1] if stack else None, m["retriable"], int(m["code"]))
        stack.append((depth, m["name"]))
    return out


def defined_classes() -> dict[str, type[WaltzError]]:
    return {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
            if cls.__module__ == errors.__name__ and issubclass(cls, WaltzError)}


def test_tree_lists_every_class_and_nothing_else() -> None:
    tree, classes = parse_tree(), defined_classes()
    assert sorted(tree) == sorted(classes)


def test_tree_parents_are_the_real_base_classes() -> None:
    classes = defined_classes()
    for name, (parent, _, _) in parse_tree().items():
        cls = classes[name]
        if parent is None:
            assert cls is WaltzError
        else:
            assert cls.__bases__ == (classes[parent],), f"{name} is drawn under {parent}"


def test_retriable_flags_are_as_documented() -> None:
    classes = defined_classes()
    for name, (_, column, _) in parse_tree().items():
        cls = classes[name]
        if column == "varies":
            # the family mixes retriable and final errors; the base itself is not retriable
            assert cls.retriable is False
            flags = {sub.retriable for sub in classes.values() if issubclass(sub, cls)}
            assert flags == {True, False}, f"{name} is drawn as 'varies' but all of its family is {flags}"
        else:
            assert cls.retriable is (column == "yes"), f"{name}.retriable should be {column}"


def test_refresh_assignment_only_where_the_partition_moved() -> None:
    flagged = {name for name, cls in defined_classes().items() if cls.refresh_assignment}
    assert flagged == {"GenerationMismatchError", "PartitionNotReadyError"}
    assert all(defined_classes()[n].retriable for n in flagged)


# ------------------------------------------------------------------------------- wire codes
FAMILIES = {1: (ConfigError, PluginError), 2: (ProtocolError,), 3: (TransportError,), 4: (CoordinationError,),
            5: (StorageError,), 6: (ServerError,), 7: (ClientError,)}


def test_every_class_has_its_own_code_as_drawn() -> None:
    for name, (_, _, code) in parse_tree().items():
        cls = defined_classes()[name]
        assert "code" in vars(cls), f"{name} inherits its code instead of having its own"
        assert cls.code == code, f"{name}.code is {cls.code}, drawn as {code}"


def test_codes_are_unique() -> None:
    codes = [cls.code for cls in defined_classes().values()]
    assert len(codes) == len(set(codes))


def test_a_duplicate_code_is_refused_at_definition() -> None:
    with pytest.raises(RuntimeError, match="already StorageError's"):
        errors._code(StorageError.code)(type("Dup", (StorageError,), {}))


def test_codes_are_grouped_by_family_hundreds() -> None:
    for cls in defined_classes().values():
        if cls is WaltzError:
            assert cls.code < 100
            continue
        family = next(f for f in cls.__mro__ if issubclass(f, WaltzError) and f.__bases__ == (WaltzError,))
        assert cls.code // 100 == family.code // 100, f"{cls.__name__} ({cls.code}) is outside its family's hundred"
        assert family in FAMILIES[cls.code // 100]
        assert family.code <= cls.code


def test_codes_are_32_bit_signed_ints_for_the_wire() -> None:
    assert all(isinstance(c.code, int) and 0 < c.code < 2**31 for c in defined_classes().values())


@pytest.mark.parametrize("name", sorted(defined_classes()))
def test_error_from_wire_round_trip(name: str) -> None:
    original = defined_classes()[name](f"{name} happened: détails")
    back = error_from_wire(wire_code(original), str(original))
    assert type(back) is type(original)
    assert str(back) == str(original)
    assert back.retriable is original.retriable
    assert back.refresh_assignment is original.refresh_assignment


def test_subclasses_outside_the_module_travel_as_their_nearest_coded_ancestor() -> None:
    class RecoveryRefusedLike(StorageError):
        retriable = True  # not carried: the wire knows codes, and this class has none of its own

    class TimeoutLike(errors.RequestTimeoutError):
        """A subclass without a code of its own."""

    assert wire_code(RecoveryRefusedLike("no")) == StorageError.code
    assert type(error_from_wire(wire_code(TimeoutLike("t")), "t")) is errors.RequestTimeoutError


def test_non_waltz_exceptions_travel_as_the_generic_internal_error() -> None:
    assert wire_code(ValueError("bug")) == StorageError.code
    assert wire_code(OSError("disk")) == StorageError.code
    assert wire_code(KeyError("k"), default=ServerError) == ServerError.code
    assert type(error_from_wire(wire_code(RuntimeError("x")), "internal error: x")) is StorageError


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (120, ConfigError), (149, ConfigError), (152, PluginError), (199, PluginError), (299, ProtocolError),
        (305, TransportError), (499, CoordinationError), (506, StorageError), (699, ServerError),
        (799, ClientError),
    ],
)
def test_an_unknown_code_becomes_its_family_base(code: int, expected: type[WaltzError]) -> None:
    err = error_from_wire(code, "from a newer peer")
    assert type(err) is expected
    assert str(err) == f"error code {code}: from a newer peer"


@pytest.mark.parametrize("code", [0, 2, 99, 800, 999, 1000, 123456, -1, -500, 2**31 - 1, -(2**31)])
def test_a_wholly_unknown_code_becomes_a_storage_error(code: int) -> None:
    err = error_from_wire(code, "1.21 gigawatts")
    assert type(err) is StorageError
    assert not err.retriable
    assert str(err) == f"error code {code}: 1.21 gigawatts"
