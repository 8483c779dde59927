"""The exception tree: the docstring drawing matches the classes, retriable flags, wire round trip."""

from __future__ import annotations

import inspect
import re

import pytest

import waltz_core.errors as errors
from waltz_core.errors import StorageError, WaltzError, error_from_wire

TREE_LINE = re.compile(r"^\s*(?:[│ ]*[├└]── )?(?P<name>[A-Z]\w+)\s+(?P<retriable>yes|no|varies)\s+(?P<meaning>\S.*)$")


def parse_tree() -> dict[str, tuple[str | None, str]]:
    """class name -> (parent name, retriable column) from the drawing in the module docstring."""
    doc = errors.__doc__ or ""
    block = doc.split("::", 1)[1].split("\n\n", 2)[1]  # the indented literal block after "::"
    out: dict[str, tuple[str | None, str]] = {}
    stack: list[tuple[int, str]] = []  # (depth, name)
    root_indent = 0
    for line in block.splitlines():
        if not line.strip():
            continue
        if line.split()[1:] == ["retriable", "meaning"]:  # the root, on the column-title line
            out[line.split()[0]] = (None, "no")
            root_indent = len(line) - len(line.lstrip())
            stack.append((0, line.split()[0]))
            continue
        m = TREE_LINE.match(line)
        assert m, f"unparsable tree line: {line!r}"
        marker = max(line.find("├"), line.find("└"))
        depth = 0 if marker < 0 else (marker - root_indent) // 4 + 1
        while stack and stack[-1][0] >= depth:
            stack.pop()
        out[m["name"]] = (stack[-1][1] if stack else None, m["retriable"])
        stack.append((depth, m["name"]))
    return out


def defined_classes() -> dict[str, type[WaltzError]]:
    return {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
            if cls.__module__ == errors.__name__ and issubclass(cls, BaseException)}


def test_tree_lists_every_class_and_nothing_else() -> None:
    tree, classes = parse_tree(), defined_classes()
    assert sorted(tree) == sorted(classes)


def test_tree_parents_are_the_real_base_classes() -> None:
    classes = defined_classes()
    for name, (parent, _) in parse_tree().items():
        cls = classes[name]
        if parent is None:
            assert cls is WaltzError
        else:
            assert cls.__bases__ == (classes[parent],), f"{name} is drawn under {parent}"


def test_retriable_flags_are_as_documented() -> None:
    classes = defined_classes()
    for name, (_, column) in parse_tree().items():
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


@pytest.mark.parametrize("name", sorted(defined_classes()))
def test_error_from_wire_round_trip(name: str) -> None:
    original = defined_classes()[name](f"{name} happened: détails")
    back = error_from_wire(type(original).__name__, str(original))
    assert type(back) is type(original)
    assert str(back) == str(original)
    assert back.retriable is original.retriable


def test_error_from_wire_unknown_name_becomes_a_storage_error() -> None:
    err = error_from_wire("FluxCapacitorError", "1.21 gigawatts")
    assert type(err) is StorageError
    assert str(err) == "FluxCapacitorError: 1.21 gigawatts"


def test_error_from_wire_does_not_resolve_non_waltz_names() -> None:
    # a peer must not be able to make us instantiate arbitrary exception classes
    for name in ("Exception", "SystemExit", "KeyboardInterrupt", "object"):
        assert type(error_from_wire(name, "x")) is StorageError
