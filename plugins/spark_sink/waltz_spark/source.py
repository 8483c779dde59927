"""The ``waltz`` PySpark data source (``pyspark.sql.datasource``): batch and streaming reads, sinks.

Register it once per session (``waltz_spark.register(spark)``), then::

    spark.read.format("waltz").option("config", "client.toml").load()
    spark.readStream.format("waltz").option("config", "client.toml").load()
    df.write.format("waltz").mode("append").option("config", "client.toml").save()
    df.writeStream.format("waltz").option("config", "client.toml").option("checkpointLocation", ...).start()

Where the code runs: ``WaltzDataSource.__init__``, ``reader``, ``partitions``, ``initialOffset``,
``latestOffset``, the writers' ``__init__`` and ``commit`` run in Python processes on the driver;
``read`` and ``write`` run in Spark's Python workers, which import this module (the package must
be installed in the environment ``PYSPARK_PYTHON`` names). Objects are pickled between them, so
live clients are created lazily and never pickled.

Rows: ``partition INT, transaction_id BIGINT, header INT, client_id INT, generation INT,
seq_num INT, data BINARY`` (``client_id``/``generation``/``seq_num`` are the request id of the
append that produced the transaction).

Streaming offsets are per-partition high-water marks: ``{"0": 41, "3": -1}`` means transactions
0..41 of partition 0 and none of partition 3 were consumed. Spark stores them in the query's
checkpoint, so a restarted query reads only what is after them (exactly-once into file sinks,
which commit through the same checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from .options import ReadOptions, SparkOptionError, WriteOptions, client_config, parse_offset_json

if TYPE_CHECKING:
    from .logclient import LogInfo

SCHEMA = ("partition INT, transaction_id BIGINT, header INT, client_id INT, generation INT, seq_num INT, "
          "data BINARY")

try:  # Spark >= 4.2: read limits and the availableNow mixin
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow

    _StreamBase: tuple[type, ...] = (DataSourceStreamReader, SupportsTriggerAvailableNow)
except ImportError:  # pragma: no cover - Spark 4.0/4.1
    ReadAllAvailable = ReadMaxRows = None  # type: ignore[assignment,misc]
    _StreamBase = (DataSourceStreamReader,)


class WaltzRange(InputPartition):
    """One Spark partition: transactions ``first..last`` (inclusive) of Waltz partition ``partition``."""

    def __init__(self, partition: int, first: int, last: int) -> None:
        super().__init__((partition, first, last))
        self.partition = partition
        self.first = first
        self.last = last


class WaltzDataSource(DataSource):
    """``format("waltz")``: the log as a table, a stream and a sink (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "waltz"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return WaltzBatchReader(ReadOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return WaltzStreamReader(ReadOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return WaltzBatchWriter(_write_options(self.options, schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return WaltzStreamWriter(_write_options(self.options, schema, overwrite))


def _write_options(options: Any, schema: StructType, overwrite: bool) -> WriteOptions:
    if overwrite:
        raise SparkOptionError("waltz write: the log is append-only; use mode('append') (streaming: outputMode "
                               "'append')")
    return WriteOptions.parse(options, [f.name for f in schema.fields])


def _read_rows(opts: ReadOptions, part: WaltzRange) -> Iterator[tuple[Any, ...]]:
    from .logclient import read_range

    if part.partition < 0:
        return iter(())
    return read_range(client_config(opts.raw), part.partition, part.first, part.last, window=opts.fetch_window)


# ----------------------------------------------------------------------------------------- batch


class WaltzBatchReader(DataSourceReader):
    """``spark.read.format("waltz")``: options ``partitions``, ``startId``, ``endId``, ``rangeSize``."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        from .logclient import LogInfo, split_ranges

        opts = self.opts
        with LogInfo(client_config(opts.raw)) as info:
            chosen = info.check_partitions(opts.partitions)
            marks = info.high_water_marks(chosen)
        bounds = {p: (opts.start_id, hwm if opts.end_id is None else min(opts.end_id, hwm)) for p, hwm in marks.items()}
        ranges = [WaltzRange(*r) for r in split_ranges(bounds, opts.range_size)]
        return ranges or [WaltzRange(-1, 0, -1)]  # Spark needs at least one partition

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, WaltzRange)
        return _read_rows(self.opts, partition)


# ------------------------------------------------------------------------------------- streaming


def _offset(marks: dict[int, int]) -> dict[str, int]:
    return {str(p): v for p, v in sorted(marks.items())}


def _marks(offset: dict[str, Any]) -> dict[int, int]:
    return {int(p): int(v) for p, v in offset.items()}


def cap_offsets(start: dict[int, int], latest: dict[int, int], budget: int | None) -> dict[int, int]:
    """``latest`` limited to ``budget`` new transactions in total, shared fairly across partitions."""
    end = {p: max(start.get(p, -1), latest[p]) for p in latest}
    if budget is None:
        return end
    pending = {p: end[p] - start.get(p, -1) for p in end}
    take = dict.fromkeys(end, 0)
    left = budget
    while left > 0:
        open_ = [p for p in sorted(pending) if pending[p] > take[p]]
        if not open_:
            break
        share = max(1, left // len(open_))
        for p in open_:
            extra = min(share, pending[p] - take[p], left)
            take[p] += extra
            left -= extra
            if left == 0:
                break
    return {p: start.get(p, -1) + take[p] for p in end}


class WaltzStreamReader(*_StreamBase):  # type: ignore[misc]
    """``spark.readStream.format("waltz")``: offsets are per-partition high-water marks.

    Options: ``startingOffsets`` (``earliest`` | ``latest`` | JSON), ``maxTransactionsPerTrigger``,
    ``partitions``, ``rangeSize``. The planning methods run in the query's Python process on the
    driver and share one lazily connected client; ``read`` runs in workers.
    """

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._info: LogInfo | None = None
        self._chosen: tuple[int, ...] | None = None
        self._available_now: dict[int, int] | None = None
        self._last_end: dict[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"opts": self.opts, "_info": None, "_chosen": self._chosen, "_available_now": None, "_last_end": None}

    def _client(self) -> LogInfo:
        if self._info is None:
            from .logclient import LogInfo

            self._info = LogInfo(client_config(self.opts.raw))
            self._chosen = self._info.check_partitions(self.opts.partitions)
        return self._info

    def _latest(self) -> dict[int, int]:
        info = self._client()
        assert self._chosen is not None
        return info.high_water_marks(self._chosen)

    def initialOffset(self) -> dict[str, int]:
        info = self._client()
        assert self._chosen is not None
        starting = self.opts.starting_offsets
        if starting == "earliest":
            marks = dict.fromkeys(self._chosen, -1)
        elif starting == "latest":
            marks = info.high_water_marks(self._chosen)
        else:
            given = parse_offset_json(starting, "startingOffsets")
            marks = {p: given.get(p, -1) for p in self._chosen}
        return _offset(marks)

    def getDefaultReadLimit(self) -> Any:
        if ReadMaxRows is not None and self.opts.max_per_trigger is not None:
            return ReadMaxRows(self.opts.max_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = self._latest()

    def latestOffset(self, start: dict[str, Any] | None = None, limit: Any = None) -> dict[str, int]:
        """Spark >= 4.2 passes ``start`` and ``limit``; 4.0/4.1 pass nothing (the option applies)."""
        latest = self._latest()
        if self._available_now is not None:
            latest = {p: min(v, self._available_now.get(p, v)) for p, v in latest.items()}
        if start is None:
            begin = self._last_end or _marks(self.initialOffset())
            budget = self.opts.max_per_trigger
        else:
            begin = _marks(start)
            if ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
                budget = limit.max_rows
            elif limit is None:
                budget = self.opts.max_per_trigger
            else:
                budget = None  # ReadAllAvailable (or a limit that does not apply to a log)
        end = cap_offsets(begin, latest, budget)
        self._last_end = end
        return _offset(end)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        from .logclient import split_ranges

        begin, stop = _marks(start), _marks(end)
        bounds = {p: (begin.get(p, -1) + 1, last) for p, last in stop.items()}
        return [WaltzRange(*r) for r in split_ranges(bounds, self.opts.range_size)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, WaltzRange)
        return _read_rows(self.opts, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: the log keeps everything and the checkpoint holds the offsets."""

    def stop(self) -> None:
        if self._info is not None:
            self._info.close()
            self._info = None


# ----------------------------------------------------------------------------------------- sinks


class WaltzCommitMessage(WriterCommitMessage):
    """What one writing task appended."""

    def __init__(self, committed: int, duplicates: int, per_partition: tuple[tuple[int, int], ...],
                 false_conflicts: int) -> None:
        self.committed = committed
        self.duplicates = duplicates
        self.per_partition = per_partition
        self.false_conflicts = false_conflicts


def _write(opts: WriteOptions, snapshot: dict[int, int] | None, rows: Iterator[Any]) -> WaltzCommitMessage:
    from .sink import write_rows

    result = write_rows(client_config(opts.raw), rows, opts, snapshot)
    return WaltzCommitMessage(result.committed, result.duplicates, result.per_partition, result.false_conflicts)


class WaltzBatchWriter(DataSourceWriter):
    """``df.write.format("waltz").mode("append")``: rows appended as transactions (see :mod:`.sink`)."""

    def __init__(self, opts: WriteOptions) -> None:
        from .sink import snapshot_for

        self.opts = opts
        self.snapshot = snapshot_for(opts)  # on the driver, before any task: the idempotency snapshot

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return _write(self.opts, self.snapshot, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """The rows are in the log already (appends cannot be staged)."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Rows of tasks that succeeded stay in the log: a retried job writes them again unless idempotent."""


class WaltzStreamWriter(DataSourceStreamWriter):
    """``df.writeStream.format("waltz")``: each micro-batch's rows appended as transactions."""

    def __init__(self, opts: WriteOptions) -> None:
        from .sink import snapshot_for

        self.opts = opts
        self.snapshot = snapshot_for(opts)  # once per query run

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return _write(self.opts, self.snapshot, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """The rows are in the log already."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """See :meth:`WaltzBatchWriter.abort`."""
