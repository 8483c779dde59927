"""Codec micro-benchmark: encode/decode rates of the sans-IO protocol on one core.

Run: ``python benchmarks/codec.py [--seconds 0.5]``. Prints operations per second (best of a few
rounds) for the messages on the hot paths: client appends, feed data, storage append batches,
and frame decoding of a batched buffer. Goal: >= 300,000 FeedData decodes/s (a client's feed must never be the bottleneck).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable

import attrs

from waltz_core.protocol import client, storage
from waltz_core.protocol.framing import FrameDecoder, encode_frames
from waltz_core.protocol.wire import Record, ReqId, crc32

FEED_DATA_GOAL = 300_000


def rate(fn: Callable[[], object], items_per_call: int, seconds: float, rounds: int = 3) -> float:
    """Best-of-``rounds`` items per second of calling ``fn`` repeatedly for about ``seconds``."""
    # calibrate the number of calls so that one round lasts about `seconds`
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds / 10:
            break
        calls *= 4
    calls = max(1, int(calls * seconds / elapsed))
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = max(best, calls * items_per_call / (time.perf_counter() - t0))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="duration of one measuring round")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core

    q = ReqId(17, 3, 5, 123456)
    data = os.urandom(256)
    append = client.AppendRequest(q, 1_000_000, (11, 12), (), (), 42, data, crc32(data))
    append_raw = client.encode(append)
    one_lock_raw = client.encode(attrs.evolve(append, write_locks=(11,)))  # the usual locked append
    feed = client.FeedData(q, 1_000_001, 42)
    feed_raw = client.encode(feed)
    records = tuple(Record(1_000_000 + i, ReqId(17, 3, 5, i), 42, data, crc32(data)) for i in range(100))
    st_append = storage.StorageAppendRequest(9, 77, 5, records)
    st_raw = storage.encode(st_append)
    batch = encode_frames([feed_raw] * 1000)

    def decode_batch() -> None:
        dec = FrameDecoder()
        decode = client.decode
        for frame in dec.feed(batch):
            decode(frame)

    s = args.seconds
    rows: list[tuple[str, float, str]] = [
        ("AppendRequest encode (256 B, 2 write locks)", rate(lambda: client.encode(append), 1, s), "msg/s"),
        ("AppendRequest decode (with CRC-32 check)", rate(lambda: client.decode(append_raw), 1, s), "msg/s"),
        ("AppendRequest decode (1 write lock)", rate(lambda: client.decode(one_lock_raw), 1, s), "msg/s"),
        ("AppendRequest encode+decode", rate(lambda: client.decode(client.encode(append)), 1, s), "msg/s"),
        ("FeedData encode", rate(lambda: client.encode(feed), 1, s), "msg/s"),
        ("FeedData decode", rate(lambda: client.decode(feed_raw), 1, s), "msg/s"),
        ("FeedData encode+decode", rate(lambda: client.decode(client.encode(feed)), 1, s), "msg/s"),
        ("storage append 100 x 256 B encode", rate(lambda: storage.encode(st_append), 100, s), "records/s"),
        ("storage append 100 x 256 B decode", rate(lambda: storage.decode(st_raw), 100, s), "records/s"),
        ("storage append 100 x 256 B encode+decode", rate(lambda: storage.decode(storage.encode(st_append)), 100, s),
         "records/s"),
        ("frames: split 1000 FeedData frames from one buffer", rate(lambda: FrameDecoder().feed(batch), 1000, s),
         "frames/s"),
        ("frames: split + decode 1000 FeedData frames", rate(decode_batch, 1000, s), "msg/s"),
    ]
    print(f"waltz codec benchmark - Python {platform.python_version()} ({platform.python_implementation()}), "
          f"one core, best of 3 rounds of {s:g} s")
    for name, value, unit in rows:
        print(f"  {name:<52} {value:>13,.0f} {unit}")
    feed_decode = rows[5][1]
    verdict = "meets" if feed_decode >= FEED_DATA_GOAL else "BELOW"
    print(f"FeedData decode: {feed_decode:,.0f}/s {verdict} the goal of {FEED_DATA_GOAL:,}/s")


if __name__ == "__main__":
    sys.exit(main())
