"""What the store layer needs from one storage node, whatever carries it.

:class:`ReplicaApi` is the narrow seam between the replicated store (sessions, recovery,
quorum) and the storage client. Every call carries the store session id: the storage node
adopts a higher session id and rejects lower ones from then on (fencing). Calls raise
:mod:`waltz_core.errors` classes; any of them makes the store treat the replica as failed.

Records travel as :class:`~waltz_core.protocol.wire.RecordBatch` (the stored layout, encoded once
by the store session); a batch is also a sequence of :class:`Record`, for implementations that
want objects.

An implementation may also offer ``append_nowait(session_id, partition_id, records, done)``,
which sends the append without awaiting and calls ``done(None)`` once it is durable or
``done(error)`` (raising at once instead when the connection has already failed), as
:meth:`~waltz_core.storage.client.StorageClient.append_nowait` does. Replica sessions then stream
to it from callbacks instead of driving it from a task per batch (:mod:`.store`). Such an
implementation may hold the appends back to send several partitions' in one message; it then
offers ``send_appends()``, which the store calls once it has pumped the appends of a loop step.
It must still send what it holds by itself by the end of the loop step (the storage client
schedules a loop callback): the store does not call it after every append.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..protocol.wire import Record, RecordBatch, RecordHeader, SessionInfo


class ReplicaApi(Protocol):
    @property
    def endpoint(self) -> str:
        """"host:port" of the storage node (the replica id of the metadata)."""
        ...

    async def last_session_info(self, session_id: int, partition_id: int) -> SessionInfo: ...

    async def max_transaction_id(self, session_id: int, partition_id: int) -> int: ...

    async def truncate(self, session_id: int, partition_id: int, transaction_id: int) -> None: ...

    async def set_low_water_mark(self, session_id: int, partition_id: int, low_water_mark: int) -> None: ...

    async def append(self, session_id: int, partition_id: int, records: RecordBatch) -> None: ...

    async def record_header_list(self, session_id: int, partition_id: int, transaction_id: int,
                                 max_records: int) -> Sequence[RecordHeader]: ...

    async def record_list(self, session_id: int, partition_id: int, transaction_id: int,
                          max_records: int) -> Sequence[Record]: ...
