"""A real storage process (`waltz storage start`) over TCP: CLI admin, data, HTTP, kill -9 and restart."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_core.config import TransportConfig
from waltz_core.errors import ConnectionClosedError, FrameTooLargeError, ProtocolError, StorageError
from waltz_core.protocol import storage as sm
from waltz_core.runtime import Runtime
from waltz_core.storage.client import StorageClient
from waltz_core.testing import require
from waltz_core.transport import open_transport

from .conftest import make_record, make_records

WALTZ = [str(Path(sys.executable).parent / "waltz")]


#: the plugins of this test module's own connections (the node under test runs its own)
RUNTIME = Runtime.load()


def _tcp_available() -> bool:
    return "tcp" in RUNTIME.registries.transport


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return bytes(resp.read())


class StorageProcess:
    def __init__(self, directory: Path, key: uuid.UUID, max_frame_size: int = 1 << 20, tcp: str = "",
                 num_partitions: int = 2, open_files: tuple[int, int] | None = None) -> None:
        self.key = key
        self.num_partitions = str(num_partitions)
        self.open_files = open_files  #: (soft, hard) limit of open files the process starts with
        self.config = directory / "storage.toml"
        self.config.write_text(
            f'[storage]\ndirectory = "{directory / "data"}"\nport = 0\nadmin_port = 0\nindex_checkpoint_interval = 50\n'
            f'[transport]\nname = "tcp"\nmax_frame_size = {max_frame_size}\n[http]\nport = {_free_port()}\n'
            + (f"[transport.tcp]\n{tcp}\n" if tcp else ""))
        self.stderr_path = directory / "storage.stderr"
        self.proc: subprocess.Popen[str] | None = None
        self.data = self.admin = self.http = ""

    def start(self) -> None:
        # stderr to a file, not a pipe: a node that logs much (a test of failures) never blocks on it
        with open(self.stderr_path, "a") as stderr:
            self.proc = subprocess.Popen(
                [*WALTZ, "storage", "start", "--config", str(self.config), "--cluster-key", str(self.key),
                 "--num-partitions", self.num_partitions],
                stdout=subprocess.PIPE, stderr=stderr, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=self._limit if self.open_files else None)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"data=(\S+) admin=(\S+) http=(\S+)", line)
        if not m:
            self.proc.kill()
            self.proc.communicate(timeout=30)
            raise AssertionError(f"storage did not start: {line!r} {self.log()}")
        self.data, self.admin, self.http = m.groups()

    def log(self) -> str:
        """What the process (and its earlier runs) wrote to stderr."""
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def _limit(self) -> None:
        assert self.open_files is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, self.open_files)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*WALTZ, "storage", *args, "-a", self.admin, "--cluster-key", str(self.key),
                               "--num-partitions", self.num_partitions], capture_output=True, text=True, timeout=60)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return rc


@pytest.fixture
def storage_process(tmp_path: Path) -> Iterator[StorageProcess]:
    require(_tcp_available(), "the tcp transport plugin")
    sp = StorageProcess(tmp_path, uuid.uuid4(), max_frame_size=64 * 1024)
    sp.start()
    try:
        yield sp
    finally:
        if sp.proc is not None and sp.proc.poll() is None:
            sp.stop(signal.SIGKILL)


@pytest.mark.slow
async def test_real_process_admin_data_http_and_kill(storage_process: StorageProcess) -> None:
    sp = storage_process
    result = await asyncio.to_thread(sp.cli, "add-partition", "-p", "0-1")
    assert result.returncode == 0, result.stderr
    transport = open_transport(TransportConfig(name="tcp", max_frame_size=1 << 20), RUNTIME.registries)
    client = await StorageClient.connect(transport, sp.data, sp.key, 2)
    recs = make_records(0, 120)
    for i in range(0, 120, 10):
        await client.append(1, 0, recs[i : i + 10])
    await client.set_low_water_mark(1, 0, 119)
    # Oversize: the node's max frame is 64 KiB; the tcp transport closes that link (its contract), the
    # node logs why, and every other link keeps being served.
    big = await StorageClient.connect(transport, sp.data, sp.key, 2)
    assert big.max_frame_size == 64 * 1024  # the node said so in its answer to the open (protocol 5)
    with pytest.raises(StorageError, match=r"its transport\.max_frame_size is 65536"):
        await big.append(1, 1, [make_record(0, b"y" * 100_000)])
    assert not big.closed  # refused before sending
    with pytest.raises((FrameTooLargeError, ProtocolError, ConnectionClosedError)):  # sent past that check
        await big._p.request(99, sm.StorageAppendRequest(1, 99, 1, [make_record(0, b"y" * 100_000)]))
    assert big.closed
    assert await client.max_transaction_id(1, 0) == 119
    await big.close()

    listing = await asyncio.to_thread(sp.cli, "list")
    assert listing.returncode == 0, listing.stderr
    assert "119" in listing.stdout
    listing = await asyncio.to_thread(sp.cli, "list", "--json")
    rows = {row["partition"]: row for row in json.loads(listing.stdout)["partitions"]}
    assert rows[0] == {"partition": 0, "session_id": 1, "low_water_mark": 119, "local_low_water_mark": 119,
                       "assigned": True, "available": True}
    metrics = (await asyncio.to_thread(http_get, f"http://{sp.http}/metrics")).decode()
    assert 'waltz_storage_appended_records_total{partition="0"} 120' in metrics
    assert await asyncio.to_thread(http_get, f"http://{sp.http}/ping") == b"pong\n"
    await client.close()

    sp.stop(signal.SIGKILL)  # no clean shutdown: the restart must recover from the files alone
    sp.start()
    client = await StorageClient.connect(transport, sp.data, sp.key, 2)
    got = []
    while len(got) < 120:
        got.extend(await client.record_list(1, 0, len(got), 50))
    assert got == recs
    info = await client.last_session_info(1, 0)
    assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == (1, 119, 119)
    await client.close()
    await transport.aclose()
    assert sp.stop() == 0


def test_disk_tools_on_a_stopped_node(storage_process: StorageProcess) -> None:
    sp = storage_process
    assert sp.cli("add-partition", "-p", "0").returncode == 0

    async def write() -> None:
        transport = open_transport(TransportConfig(name="tcp"), RUNTIME.registries)
        client = await StorageClient.connect(transport, sp.data, sp.key, 2)
        await client.append(1, 0, make_records(0, 7))
        await client.close()
        await transport.aclose()

    asyncio.run(write())
    assert sp.stop() == 0
    data = Path(str(sp.config).replace("storage.toml", "data"))
    (segment,) = (data / "0").glob("*.seq")

    def disk(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*WALTZ, "disk", *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "COLUMNS": "200"})

    ok = disk("verify-segment", str(segment))
    assert ok.returncode == 0 and "7 records verified, 0 failures" in ok.stdout, ok.stdout + ok.stderr
    stats = disk("segment-stats", str(segment))
    assert "records" in stats.stdout and " 7 " in stats.stdout
    dump = disk("dump-segment", str(segment), "-t", "3")
    assert "cluster key" in dump.stdout and str(sp.key) in dump.stdout
    ctl = disk("dump-control-file", str(data / "waltz-storage.ctl"))
    assert str(sp.key) in ctl.stdout and "assigned,available" in ctl.stdout
    journal = disk("dump-journal", str(data / "journal" / "io-0.wal"), "--json")
    assert journal.returncode == 0, journal.stderr
    assert json.loads(journal.stdout)["entries"] == []  # a clean stop synced the partition files
    raw = bytearray(segment.read_bytes())
    raw[200] ^= 0xFF
    segment.write_bytes(bytes(raw))
    bad = disk("verify-segment", str(segment))
    assert bad.returncode == 1 and "fails its record checksum" in bad.stdout


def test_a_node_whose_certificate_has_expired_says_so(tmp_path: Path) -> None:
    """A certificate loads whatever its dates, and peers then refuse the handshakes: the node logs
    it at the start, exports the date, and /readyz answers 503 naming the file."""
    require(_tcp_available(), "the tcp transport plugin")
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from waltz_transport_tcp.certs import create_test_ca

    certs = create_test_ca(tmp_path / "tls", hosts=("127.0.0.1",))
    ca_key = serialization.load_pem_private_key((tmp_path / "tls" / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    expired = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=90)).not_valid_after(now - datetime.timedelta(days=1))
               .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "expired.pem", tmp_path / "expired.key"
    cert_path.write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    sp = StorageProcess(tmp_path, uuid.uuid4(),
                        tcp=f'tls_cert = "{cert_path}"\ntls_key = "{key_path}"\ntls_ca = "{certs.ca}"')
    sp.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as answer:
            http_get(f"http://{sp.http}/readyz")
        ready = json.loads(answer.value.read())
        assert answer.value.code == 503
        assert [r for r in ready["reasons"] if r.startswith(f"certificate tls_cert {cert_path} expired at ")], ready
        metrics = http_get(f"http://{sp.http}/metrics").decode()
        gauge = f'waltz_tls_certificate_expiry_timestamp_seconds{{certificate="tls_cert {cert_path}"}}'
        assert f"{gauge} {expired.not_valid_after_utc.timestamp():.1f}" in metrics, metrics[-1500:]
    finally:
        sp.stop()
    err = sp.log()
    assert f"certificate tls_cert {cert_path} expired at " in err and "peers refuse its handshakes" in err, err


@pytest.mark.parametrize(("directory", "why"), [("afile", "it is a file, not a directory"),
                                                ("afile/data", "Not a directory")])
def test_a_storage_directory_that_cannot_be_used_is_one_error_line(tmp_path: Path, directory: str, why: str) -> None:
    (tmp_path / "afile").write_text("not a directory")
    config = tmp_path / "storage.toml"
    config.write_text(f'[storage]\ndirectory = "{tmp_path / directory}"\nport = 0\nadmin_port = 0\n')
    done = subprocess.run([*WALTZ, "storage", "start", "--config", str(config), "--cluster-key", str(uuid.uuid4()),
                           "--num-partitions", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: cannot open the storage directory {tmp_path / directory}: {why}"), done.stderr
    assert "Traceback" not in done.stderr


def _open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open files line in /proc/{pid}/limits")


def test_a_waltz_process_raises_its_soft_limit_of_open_files_to_the_hard_one(tmp_path: Path) -> None:
    """As the JVM does: the usual soft limit of 1,024 would leave a few hundred partitions per node."""
    require(_tcp_available(), "the tcp transport plugin")
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    assert hard > 256, f"this machine's hard limit of open files is {hard}"
    sp = StorageProcess(tmp_path, uuid.uuid4(), open_files=(256, hard))
    sp.start()
    try:
        assert sp.proc is not None
        assert _open_files_limit(sp.proc.pid) == (hard, hard)
    finally:
        assert sp.stop() == 0


@pytest.mark.slow
async def test_a_node_out_of_open_files_says_which_limit_and_what_to_raise(tmp_path: Path) -> None:
    """A hard limit too low for the partitions assigned: a warning when the assignment passes it,
    and every append that cannot open its partition's files gets the limit and the remedy, while
    the partitions that fit go on (real EMFILE: the process runs with a hard limit of 160)."""
    require(_tcp_available(), "the tcp transport plugin")
    partitions = 120
    sp = StorageProcess(tmp_path, uuid.uuid4(), num_partitions=partitions, open_files=(160, 160))
    sp.start()
    transport = open_transport(TransportConfig(name="tcp", max_frame_size=1 << 20), RUNTIME.registries)
    try:
        result = await asyncio.to_thread(sp.cli, "add-partition", "-p", f"0-{partitions - 1}")
        assert result.returncode == 0, result.stderr
        client = await StorageClient.connect(transport, sp.data, sp.key, partitions)
        written, refused = [], []
        for pid in range(partitions):
            try:
                await client.append(1, pid, make_records(0, 1))
                written.append(pid)
            except StorageError as exc:
                assert "Too many open files" in str(exc) and "may open 160 files" in str(exc) \
                    and "LimitNOFILE" in str(exc), exc
                refused.append(pid)
        assert written and refused, (written, refused)
        assert await client.max_transaction_id(1, written[-1]) == 0  # the partitions that fit go on
        # The node kept descriptors free for connections: /readyz answers, and says why not ready.
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            await asyncio.to_thread(http_get, f"http://{sp.http}/readyz")
        assert not_ready.value.code == 503
        reasons = json.loads(not_ready.value.read())["reasons"]
        assert any("kept free for connections" in r and "may open 160 files" in r for r in reasons), reasons
        await client.close()
    finally:
        await transport.aclose()
        sp.stop()
    assert re.search(r"serves \d+ partitions, which may hold up to \d+ files open \(10 each, and 64 for "
                     r"connections and journals\), and the process may open 160: a partition that finds no "
                     r"descriptor free cannot open its files; raise the hard limit", sp.log()), sp.log()[-3000:]
