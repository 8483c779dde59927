"""Bad input on every listening port of real processes, and bad config files.

A one-storage, one-server :class:`ProcessCluster` with HTTP endpoints: five listening ports (the
server's client port and HTTP port, the storage node's data, admin and HTTP ports). Each port is
fed seeded random bad input: random bytes, valid-length frames with random payloads (before and
after a valid hello), frames cut short by the peer, a correctly framed but truncated message,
oversize length prefixes, a valid hello followed by garbage, and (HTTP) malformed request lines
and headers. For every bad connection the process must close it, log a line naming that peer, and
keep serving: a good append + read through the server (which also exercises the storage data
port), a good admin request and a good HTTP request pass after every batch.

Processes run with ``-v`` (INFO), the level a deployment would run to see bad peers.
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from waltz_core.app.local_cluster import ClusterSpec, ProcessCluster
from waltz_core.errors import FrameTooLargeError
from waltz_core.protocol import ADMIN, CLIENT, STORAGE, Family
from waltz_core.protocol import client as m
from waltz_core.protocol.framing import LENGTH, FrameDecoder
from waltz_core.protocol.handshake import Hello, encode_hello
from waltz_core.protocol.wire import ReqId, crc32
from waltz_core.storage.client import StorageAdminClient
from waltz_core.testing.probe import PartitionProbe
from waltz_core.transport import open_transport

SEED = 20240909
CLOSE_TIMEOUT = 10.0  # the server closes a bad connection well within this
MAX_FRAME = 16 * 1024 * 1024  # the processes' transport.max_frame_size (the default)


@attrs.frozen
class BadInput:
    kind: str
    data: bytes
    half_close: bool  #: the input may be a prefix of something valid: end our side so the peer sees EOF
    #: False only where the peer just hangs up mid-frame after a valid hello: a client killed while writing
    #: looks the same, so the process closes it quietly (debug level) instead of blaming the peer.
    must_log: bool = True


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def hello_frame(family: Family) -> bytes:
    return frame(encode_hello(Hello(family.protocol, family.versions, "fuzzer")))


def only_a_frame_start(data: bytes) -> bool:
    """``data`` is the start of one frame, cut short (a part of a length prefix, or a length the
    transport accepts with fewer bytes after it): a peer that hangs up there looks like a client
    killed while writing, which a process closes quietly."""
    if len(data) < LENGTH.size:
        return True
    (length,) = LENGTH.unpack_from(data)
    return length <= MAX_FRAME and LENGTH.size + length > len(data)


def waltz_inputs(rng: random.Random, family: Family) -> list[BadInput]:
    """One of each kind of bad input for a framed Waltz port speaking ``family``."""
    hello = hello_frame(family)
    some_message = CLIENT.encode(m.AppendRequest(ReqId(1, 1, 0, 1), -1, (), (), (), 7, b"x" * 40, crc32(b"x" * 40)))
    random_frames = b"".join(frame(rng.randbytes(rng.randint(1, 300))) for _ in range(rng.randint(1, 4)))
    garbage = rng.randbytes(rng.randint(1, 500))
    return [
        BadInput("random-bytes", rng.randbytes(rng.randint(1, 3000)), half_close=True),
        BadInput("random-frames", random_frames, half_close=False),
        BadInput("hello-then-random-frames", hello + random_frames, half_close=False),
        BadInput("truncated-frame", LENGTH.pack(500) + rng.randbytes(rng.randint(0, 499)), half_close=True),
        BadInput("hello-then-truncated-frame", hello + LENGTH.pack(200) + rng.randbytes(rng.randint(0, 199)),
                 half_close=True, must_log=False),
        BadInput("truncated-hello-in-frame", frame(hello[4:rng.randint(5, len(hello) - 1)]), half_close=False),
        BadInput("hello-then-truncated-message", hello + frame(some_message[:rng.randint(1, len(some_message) - 1)]),
                 half_close=False),
        BadInput("oversize-length", LENGTH.pack(rng.randint(MAX_FRAME + 1, 2**32 - 1)) + rng.randbytes(16),
                 half_close=False),
        BadInput("hello-then-oversize-length", hello + LENGTH.pack(0xFFFFFFFF) + rng.randbytes(8), half_close=False),
        BadInput("hello-then-garbage", hello + garbage, half_close=True, must_log=not only_a_frame_start(garbage)),
        BadInput("wrong-protocol-hello", hello_frame(rng.choice([f for f in (CLIENT, STORAGE, ADMIN) if f is not family])),
                 half_close=False),
    ]


def http_inputs(rng: random.Random) -> list[BadInput]:
    printable = bytes(range(0x21, 0x7F))
    word = bytes(rng.choice(printable) for _ in range(rng.randint(1, 40)))
    return [
        BadInput("random-bytes", rng.randbytes(rng.randint(1, 3000)), half_close=True),
        BadInput("request-line-without-version", b"GET /ping\r\n\r\n", half_close=False),
        BadInput("request-line-one-word", word + b"\r\n\r\n", half_close=False),
        BadInput("binary-request-line", rng.randbytes(rng.randint(1, 200)).replace(b"\r\n", b"") + b"\r\n\r\n",
                 half_close=False),
        BadInput("headers-never-end", b"GET /ping HTTP/1.1\r\nHost: x\r\nX-" + word, half_close=True),
        BadInput("oversize-headers", b"GET /ping HTTP/1.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n", half_close=False),
        BadInput("empty-request", b"", half_close=True, must_log=False),  # a TCP health check: not a bad peer
    ]


async def send_bad(address: str, bad: BadInput) -> tuple[str, bytes]:
    """Send ``bad`` on a new connection; return (our address as the server logs it, what it answered).

    Fails unless the server closes the connection within :data:`CLOSE_TIMEOUT`.
    """
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    local = "{}:{}".format(*writer.get_extra_info("sockname")[:2])
    answer = bytearray()
    try:
        try:
            writer.write(bad.data)
            await writer.drain()
            if bad.half_close:
                writer.write_eof()
        except (ConnectionResetError, BrokenPipeError):
            return local, bytes(answer)  # closed on us while we were still writing: closed it is
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{address} kept the {bad.kind} connection from {local} open")
            try:
                chunk = await asyncio.wait_for(reader.read(65536), remaining)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"{address} kept the {bad.kind} connection from {local} open") from None
            if not chunk:
                break
            answer += chunk
    finally:
        writer.close()
    return local, bytes(answer)


def lines_naming(log_file: Path, peer: str, since: int) -> list[str]:
    """Lines of ``log_file`` after byte offset ``since`` that name ``peer``. The offset matters:
    over hundreds of connections the kernel reuses an ephemeral port, and an earlier peer with
    the same address must not be counted (it happened: an HTTP line from a previous round)."""
    with log_file.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    pattern = re.compile(re.escape(peer) + r"(?!\d)")
    return [line for line in text.splitlines() if pattern.search(line)]


async def wait_for_log_lines(log_file: Path, peer: str, since: int, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        found = lines_naming(log_file, peer, since)
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


def http_get(port: int, path: str) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.read()


@pytest.fixture
async def cluster(tmp_path: Path):
    spec = ClusterSpec(tmp_path / "cluster", num_partitions=1, num_storages=1, num_servers=1, http=True)
    procs = ProcessCluster(spec)
    await procs.start()
    try:
        yield procs
    finally:
        procs.stop()


class GoodPeers:
    """A well-behaved client, admin client and HTTP client: each check proves a port still serves."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.appended = 0

    async def check(self) -> None:
        spec = self.spec
        assert spec.coordination is not None
        async with PartitionProbe(spec.transport_config, spec.coordination, 0, client_id=7_000 + self.appended,
                                  registries=spec.runtime.registries) as probe:
            payload = f"good-{self.appended}".encode()
            committed = await probe.write([payload], timeout=60)
            await probe.read_to(committed[payload], timeout=30)
            assert probe.feed[committed[payload]][1] is not None
        self.appended += 1
        key, n = await spec.store_params()
        transport = open_transport(spec.transport_config, spec.runtime.registries)
        try:
            admin = await StorageAdminClient.connect(transport, spec.admin_address(0), key, n)
            try:
                assert await admin.assigned_partition_status() == {0: True}
            finally:
                await admin.close()
        finally:
            await transport.aclose()
        for node in (spec.servers[0], spec.storages[0]):
            assert await asyncio.to_thread(http_get, node.http_port, "/ping") == (200, b"pong\n")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_every_port_survives_bad_peers_and_logs_each(cluster: ProcessCluster) -> None:
    spec = cluster.spec
    rng = random.Random(SEED)
    good = GoodPeers(spec)
    await good.check()
    logs = cluster.log_dir
    ports: list[tuple[str, str, Path, Callable[[random.Random], list[BadInput]]]] = [
        ("server client port", spec.servers[0].address, logs / "server-0.log", lambda r: waltz_inputs(r, CLIENT)),
        ("storage data port", spec.storages[0].address, logs / "storage-0.log", lambda r: waltz_inputs(r, STORAGE)),
        ("storage admin port", spec.admin_address(0), logs / "storage-0.log", lambda r: waltz_inputs(r, ADMIN)),
        ("server http port", f"127.0.0.1:{spec.servers[0].http_port}", logs / "server-0.log", http_inputs),
        ("storage http port", f"127.0.0.1:{spec.storages[0].http_port}", logs / "storage-0.log", http_inputs),
    ]
    bad_peers = logged = quiet = 0
    rounds = 3  # each round: every kind of bad input on every port, then the good checks
    for _ in range(rounds):
        for name, address, log_file, make_inputs in ports:
            for bad in make_inputs(rng):
                since = log_file.stat().st_size
                peer, answer = await send_bad(address, bad)
                bad_peers += 1
                quiet += not bad.must_log
                found = await wait_for_log_lines(log_file, peer, since, timeout=5.0 if bad.must_log else 0.3)
                # One line from the service naming the peer and the error; a framing error is also logged
                # by the TCP transport when it closes the socket (same message), so at most two.
                assert (1 if bad.must_log else 0) <= len(found) <= 2, (
                    f"{name} {bad.kind} from {peer}: expected one log line naming the peer, got {found}; "
                    f"answered {answer[:200]!r}")
                if len(found) == 2:
                    assert "waltz.transport.tcp" in found[0] and found[0].split(": ", 1)[1].endswith(
                        found[1].rsplit(": ", 1)[1]), found
                logged += bool(found)
                assert "Traceback" not in log_file.read_text(errors="replace")
                if address.endswith(f":{spec.servers[0].http_port}") or address.endswith(f":{spec.storages[0].http_port}"):
                    assert answer.startswith(b"HTTP/1.1 400 "), (name, bad.kind, answer[:200])
        await good.check()
    assert cluster.servers[0].poll() is None and cluster.storages[0].poll() is None
    assert bad_peers == rounds * (3 * 11 + 2 * 7)
    assert good.appended == rounds + 1
    assert logged >= bad_peers - quiet  # only hang-ups (mid-frame after a hello; HTTP without a byte) may go unlogged
    assert quiet >= rounds * 5  # at least the hang-ups made on purpose (3 Waltz ports and 2 HTTP ports a round)


def test_oversize_prefix_after_complete_frames_is_reported_at_once() -> None:
    """The bug the fuzzing found: a hello and an oversize length prefix in one read gave the hello to
    the service and kept the error for a next read that a bad peer never causes, so the TCP
    connection stayed open (hello-then-oversize-length above hung). The decoder now exposes the
    pending error and the TCP transport closes right after the good frames."""
    decoder = FrameDecoder(max_frame_size=100)
    assert decoder.error is None
    assert decoder.feed(frame(b"abc") + LENGTH.pack(101)) == [b"abc"]
    assert isinstance(decoder.error, FrameTooLargeError) and "101" in str(decoder.error)
    with pytest.raises(FrameTooLargeError):
        decoder.feed(b"")


# ------------------------------------------------------------------------------------- config files

BAD_CONFIGS = {
    "wrong-type": ('[{section}]\nport = "not-a-number"\n', "{section}.port"),
    "unknown-key": ("[{section}]\nport = 1234\nportt = 5\n", "{section}.portt"),
    "unknown-section": ("[{section}]\nport = 1234\n[serverr]\nhost = 'x'\n", "serverr"),
    "section-not-a-table": ("{section} = 5\n", "{section}"),
    "nested-wrong-type": ("[{section}]\nport = 1234\n[coordination]\nsession_timeout = 'soon'\n",
                          "coordination.session_timeout"),
    "not-toml": ("[{section}\nport = \n", ""),
}


@pytest.mark.parametrize("process", ["server", "storage"])
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_file_gives_one_clear_error_line(tmp_path: Path, process: str, case: str) -> None:
    text, key = BAD_CONFIGS[case]
    path = tmp_path / "bad.toml"
    path.write_text(text.format(section=process))
    result = subprocess.run([sys.executable, "-m", "waltz_core.cli", process, "start", "--config", str(path)],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and str(path) in lines[0], lines[0]
    assert key.format(section=process) in lines[0], lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
