"""Spark and the log: rows/s of a batch read (4 Spark partitions), a plain-client read, a streaming write.

Starts a local cluster as real processes (1 storage node, 1 server, 4 partitions, tcp, local
coordination), loads ``--count`` transactions with one client (stopping early at
``--max-load-seconds`` and then measuring what was loaded; the output says so), then measures:

* a plain client in one process reading every partition (the same reader Spark tasks use);
* ``spark.read.format("waltz")`` with one Spark partition per Waltz partition, on ``local[2]``;
* ``writeStream.format("waltz")`` of ``--write-rows`` rows from a Parquet source.

Usage: python benchmarks/spark_read.py [--count 1000000] [--max-load-seconds 600] [--write-rows 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from waltz_core.client import WaltzClient
from waltz_core.testing.cluster import ClusterSpec, ProcessCluster
from waltz_spark.logclient import LogInfo, read_range
from waltz_spark.testing import Put, Recorder


class _Tail(Recorder):
    """A loading client follows the feed from the current end (it applies nothing old)."""

    def __init__(self, marks: dict[int, int]) -> None:
        super().__init__()
        self.marks = marks

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.marks[partition_id]

    def apply_transaction(self, transaction: object) -> None:
        pass


def load(spec: ClusterSpec, count: int, budget: float) -> tuple[int, float]:
    config = spec.client_config(max_concurrent_transactions=1000)
    with LogInfo(config) as info:
        marks = info.high_water_marks(range(info.num_partitions))
    payload = b"x" * 100
    start = time.perf_counter()
    sent = 0
    with WaltzClient(_Tail(marks), config) as client:
        client.wait_mounted(30)
        while sent < count and time.perf_counter() - start < budget:
            for i in range(sent, min(count, sent + 10_000)):
                client.submit(Put(i % 4, payload, i & 0x7FFF))
            sent = min(count, sent + 10_000)
        client.flush(600)
    return sent, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--max-load-seconds", type=float, default=600.0)
    ap.add_argument("--write-rows", type=int, default=50_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="waltz-spark-bench-") as tmp:
        spec = ClusterSpec(Path(tmp) / "cluster", num_partitions=4, num_storages=1, num_servers=1)
        cluster = ProcessCluster(spec)
        asyncio.run(cluster.start())
        try:
            config = spec.client_config()
            with LogInfo(config) as info:  # waits for discovery; then for every partition to answer
                deadline = time.monotonic() + 60
                while True:
                    try:
                        info.high_water_marks(range(4))
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
            loaded, secs = load(spec, args.count, args.max_load_seconds)
            note = "" if loaded == args.count else f"  (stopped at the {args.max_load_seconds:.0f}s load budget)"
            print(f"load   : {loaded:>9,} transactions by one client in {secs:7.1f}s = {loaded / secs:>9,.0f} rows/s{note}")
            with LogInfo(config) as info:
                marks = info.high_water_marks(range(4))
            total = sum(v + 1 for v in marks.values())

            start = time.perf_counter()
            n = 0
            for p, hwm in marks.items():
                for _ in read_range(config, p, 0, hwm):
                    n += 1
            secs = time.perf_counter() - start
            print(f"read   : {n:>9,} rows, plain client, one process        {secs:7.1f}s = {n / secs:>9,.0f} rows/s")
            assert n == total

            from pyspark.sql import functions as F

            from waltz_spark.session import local_session

            spark = local_session("waltz-spark-bench", cores=2)
            try:
                client_toml = str(spec.directory / "client.toml")
                range_size = max(1, max(v + 1 for v in marks.values()))
                df = (spark.read.format("waltz").option("config", client_toml).option("rangeSize", str(range_size))
                      .load())
                warm = spark.read.format("waltz").option("config", client_toml).option("endId", "0").load()
                warm.count()  # spawn the Python workers outside the measurement
                start = time.perf_counter()
                row = df.agg(F.count(F.lit(1)).alias("n"), F.sum(F.length("data")).alias("bytes")).first()
                secs = time.perf_counter() - start
                print(f"spark  : {row['n']:>9,} rows, batch read, {df.rdd.getNumPartitions()} Spark partitions "
                      f"(local[2]) {secs:7.1f}s = {row['n'] / secs:>9,.0f} rows/s")
                assert row["n"] == total

                source = Path(tmp) / "incoming"
                spark.range(args.write_rows).select(F.concat(F.lit("event-"), F.col("id").cast("string")).alias("data")) \
                    .repartition(4).write.parquet(str(source))
                before = sum(marks.values())
                start = time.perf_counter()
                query = (spark.readStream.schema("data STRING").parquet(str(source)).writeStream.format("waltz")
                         .option("config", client_toml).option("checkpointLocation", str(Path(tmp) / "cp"))
                         .trigger(availableNow=True).start())
                query.awaitTermination()
                secs = time.perf_counter() - start
                with LogInfo(config) as info:
                    written = sum(info.high_water_marks(range(4)).values()) - before
                print(f"sink   : {written:>9,} rows, writeStream.format('waltz'), 4 tasks   {secs:7.1f}s = "
                      f"{written / secs:>9,.0f} rows/s")
            finally:
                spark.stop()
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
