"""A transaction the client accepts fits in every frame that carries it alone.

The client refuses a transaction whose data and locks take more than ``max_frame_size -
TRANSACTION_FRAME_HEADROOM`` (``TransactionTooLargeError``). A record that one of these messages
could not carry would be refused by the link to every replica at every recovery: the partition
could never commit past it. So each message that carries one transaction is checked here to add
at most the headroom around it.
"""

from __future__ import annotations

import pytest

from waltz_core.protocol import admin, storage
from waltz_core.protocol import client as m
from waltz_core.protocol.wire import Record, RecordBatch, ReqId, crc32, encode_stored_record

DATA = bytes(range(256)) * 257  # 65,792 bytes: the size does not matter, only what is added around it
LARGEST = 2**31 - 1
REQ = ReqId(LARGEST, LARGEST, LARGEST, LARGEST)
RECORD = Record(2**63 - 1, REQ, -(2**31), DATA, crc32(DATA))


def _carriers() -> dict[str, bytes]:
    batch = RecordBatch(encode_stored_record(RECORD.transaction_id, REQ, RECORD.header, DATA, RECORD.checksum), 1,
                        RECORD.transaction_id)
    return {
        "client append": m.encode_append(LARGEST, LARGEST, LARGEST, LARGEST, 2**63 - 1, (), (), (), -1, DATA,
                                         RECORD.checksum),
        "storage append": storage.encode_append(2**63 - 1, 2**63 - 1, LARGEST, batch),
        "storage append of several partitions, one batch": storage.encode_append_many(
            2**63 - 1, [(2**63 - 1, LARGEST, batch)]),
        "record read": storage.encode(storage.RecordResponse(2**63 - 1, 2**63 - 1, LARGEST, RECORD)),
        "record list read": storage.encode(storage.RecordListResponse(2**63 - 1, 2**63 - 1, LARGEST, batch)),
        "admin record list": admin.encode(admin.AdminRecordListResponse(2**63 - 1, LARGEST, (RECORD,))),
        "transaction data": m.encode(m.TransactionDataResponse(REQ, 2**63 - 1, DATA, RECORD.checksum, None)),
        "transaction data range": m.encode(m.TransactionDataRangeResponse(REQ, 2**63 - 1, (DATA,),
                                                                          (RECORD.checksum,), None)),
    }


@pytest.mark.parametrize("carrier", sorted(_carriers()))
def test_each_message_that_carries_one_transaction_adds_less_than_the_headroom(carrier: str) -> None:
    added = len(_carriers()[carrier]) - len(DATA)
    assert 0 < added <= m.TRANSACTION_FRAME_HEADROOM, f"{carrier} adds {added} bytes"


def test_the_client_append_counts_its_locks_in_the_body() -> None:
    for n in (1, 2, 17, 100):
        locks = tuple(range(n))
        frame = m.encode_append(1, 1, 1, 1, 1, locks, locks, locks, 0, DATA, RECORD.checksum)
        body = len(DATA) + m.APPEND_LOCK_SIZE * 3 * n
        assert len(frame) == m.APPEND_FIXED_SIZE + body <= body + m.TRANSACTION_FRAME_HEADROOM


def test_a_storage_append_adds_less_than_the_batch_headroom_around_its_batch() -> None:
    """The replicated store sends records together in batches of at most ``max_frame_size -
    APPEND_BATCH_HEADROOM`` bytes: alone, or as the one batch of a message of several partitions
    (a message of several batches stays within half a frame)."""
    record = encode_stored_record(RECORD.transaction_id, REQ, RECORD.header, DATA, RECORD.checksum)
    for count in (1, 2, 5):
        batch = RecordBatch(record * count, count, RECORD.transaction_id - count + 1)
        for frame in (storage.encode_append(2**63 - 1, 2**63 - 1, LARGEST, batch),
                      storage.encode_append_many(2**63 - 1, [(2**63 - 1, LARGEST, batch)])):
            assert 0 < len(frame) - batch.nbytes <= storage.APPEND_BATCH_HEADROOM
