"""The CRC-32 of every checksum: the fastest implementation installed, always zlib's values.

Checked: the chosen implementation agrees with zlib on any bytes, continuation and memoryview
slice; an accelerator that computes wrong values is passed over for zlib; a process without the
accelerator installed uses zlib, and its records and appends are byte for byte the same.
"""

from __future__ import annotations

import subprocess
import sys
import zlib

from hypothesis import given
from hypothesis import strategies as st

from waltz_core.protocol import checksum
from waltz_core.protocol.wire import ReqId, crc32, encode_stored_record


@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1), st.integers(0, 50), st.integers(0, 50))
def test_the_chosen_crc32_is_zlibs(data: bytes, start: int, cut_head: int, cut_tail: int) -> None:
    assert crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, start) == zlib.crc32(data, start)
    view = memoryview(data)[cut_head : max(cut_head, len(data) - cut_tail)]
    assert checksum.crc32(view) == zlib.crc32(view)


def test_an_accelerator_with_wrong_values_is_passed_over(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(checksum, "_candidates", lambda: [("broken", lambda data, value=0: 0), ("zlib", zlib.crc32)])
    assert checksum._choose() == ("zlib", zlib.crc32)

    def raising(data: bytes, value: int = 0) -> int:
        raise SystemError("a broken build")

    monkeypatch.setattr(checksum, "_candidates", lambda: [("raising", raising), ("zlib", zlib.crc32)])
    assert checksum._choose()[0] == "zlib"


def test_without_the_accelerator_zlib_computes_the_same_bytes() -> None:
    # A fresh interpreter where importing isal fails, as where the extra is not installed.
    code = (
        "import sys; sys.modules['isal'] = None\n"
        "from waltz_core.protocol import checksum\n"
        "from waltz_core.protocol.wire import ReqId, encode_stored_record\n"
        "print(checksum.IMPLEMENTATION)\n"
        "print(encode_stored_record(7, ReqId(1, 2, 3, 4), 5, b'data' * 70, 123).hex())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name, record = done.stdout.split()
    assert name == "zlib"
    assert bytes.fromhex(record) == encode_stored_record(7, ReqId(1, 2, 3, 4), 5, b"data" * 70, 123)
