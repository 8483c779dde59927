"""``/metrics`` as Prometheus tooling reads it: promtool's linter and prometheus_client's parser.

Every registry kind (storage node, server, client library, process) renders text that
``promtool check metrics`` accepts and that parses into typed families (none 'unknown', counters as
counters); the client library counts what happens to its appends; the Grafana dashboard in
deploy/grafana and the alerting rules in deploy/prometheus name only metrics a live cluster
exports, and promtool checks the rules and runs their unit tests. promtool comes from Debian's
``prometheus`` package (scripts/bootstrap.sh installs it); under CI its absence is a failure.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz_core.client import AsyncWaltzClient, TransactionBuilder, TransactionContext, WaltzClientCallbacks
from waltz_core.metrics import DEFAULT_BUCKETS, Histogram, MetricsRegistry, process_registry
from waltz_core.testing import require
from waltz_core.testing.cluster import ClusterSpec, InProcessCluster
from waltz_core.testing.mock_cluster import MockCluster

pytestmark = pytest.mark.timeout(120)

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "waltz-dashboard.json"
ALERTS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "waltz-alerts.yml"
ALERT_TESTS = ALERTS.with_name("waltz-alerts.test.yml")
#: what alert rules may name besides a plaintext cluster's metrics: Prometheus's own ``up``, and
#: the certificate gauge, which only a process with TLS exports (tests/transport/test_expiry.py)
NOT_FROM_A_PLAINTEXT_CLUSTER = {"up", "waltz_tls_certificate_expiry_timestamp_seconds"}


def families(text: str) -> dict[str, Any]:
    """Parsed families by name; fails on any family the parser could not type."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        require(False, "prometheus_client (pip install -e '.[testing]')")
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    untyped = sorted(name for name, f in parsed.items() if f.type == "unknown")
    assert not untyped, f"families without a usable # TYPE: {untyped}"
    declared = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(parsed) == len(declared), "a family was split (samples that do not match their # TYPE)"
    for f in parsed.values():
        if f.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in f.samples), f.name
        else:
            assert not f.name.endswith("_total"), f"{f.type} {f.name} has a counter's suffix"
    return parsed


def _promtool() -> str:
    promtool = shutil.which("promtool")
    require(promtool is not None, "promtool (apt-get install prometheus)")
    assert promtool is not None
    return promtool


def promtool_check(text: str) -> None:
    promtool = _promtool()
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"promtool check metrics:\n{result.stdout}{result.stderr}\n--- text ---\n{text}"


def check(text: str) -> dict[str, Any]:
    promtool_check(text)
    return families(text)


def sample_names(parsed: dict[str, Any]) -> set[str]:
    return {s.name for f in parsed.values() for s in f.samples}


# ----------------------------------------------------------------------------------- renderer


def test_every_metric_kind_renders_as_typed_families() -> None:
    r = MetricsRegistry("waltz_test")
    r.counter("requests", "Requests by type.", {"type": "append"}).inc(3)
    r.counter("requests", "Requests by type.", {"type": "read"})
    r.counter("read_from_int", "A count kept elsewhere.", fn=lambda: 7)
    r.counter("no_help")
    r.gauge("queue_size", 'Help with "quotes", a \\ and a\nnewline.', {"path": 'C:\\x "y"\n'}).set(2)
    r.gauge("callback", "Read at render time.", fn=lambda: 0.5)
    r.gauge("not_a_number", "NaN is a value.").set(float("nan"))
    h = r.histogram("latency_seconds", "Latency.", {"partition": "0"}, buckets=(0.001, 1))
    for v in (0.0005, 0.5, 2.0):
        h.observe(v)
    text = r.render_prometheus()
    parsed = check(text)
    assert {name: f.type for name, f in parsed.items()} == {
        "waltz_test_requests": "counter", "waltz_test_read_from_int": "counter", "waltz_test_no_help": "counter",
        "waltz_test_queue_size": "gauge", "waltz_test_callback": "gauge", "waltz_test_not_a_number": "gauge",
        "waltz_test_latency_seconds": "histogram"}
    assert "# TYPE waltz_test_requests_total counter" in text
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parsed.values() for s in f.samples}
    assert values[("waltz_test_requests_total", (("type", "append"),))] == 3
    assert values[("waltz_test_read_from_int_total", ())] == 7
    assert values[("waltz_test_queue_size", (("path", 'C:\\x "y"\n'),))] == 2
    assert parsed["waltz_test_queue_size"].documentation == 'Help with "quotes", a \\ and a\nnewline.'
    assert values[("waltz_test_latency_seconds_bucket", (("le", "1.0"), ("partition", "0")))] == 2
    assert values[("waltz_test_latency_seconds_count", (("partition", "0"),))] == 3
    assert r.snapshot()["waltz_test_read_from_int"] == [{"labels": {}, "value": 7}]
    assert MetricsRegistry().render_prometheus() == ""


def test_renders_follow_values_and_metrics_that_come_and_go() -> None:
    # Each metric keeps the text of its lines before the value from its first render: the values,
    # and metrics added or removed after it, must still show in the next render.
    r = MetricsRegistry("waltz_test")
    c = r.counter("appends", "Appends.", {"partition": "0"})
    g = r.gauge("lag", "Lag.", {"partition": "0"})
    h = r.histogram("latency_seconds", "Latency.", {"partition": "0"}, buckets=(0.001, 1))

    def values() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        parsed = check(r.render_prometheus())
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parsed.values() for s in f.samples}

    first = values()
    assert first[("waltz_test_appends_total", (("partition", "0"),))] == 0
    assert first[("waltz_test_latency_seconds_count", (("partition", "0"),))] == 0
    c.inc(5)
    g.set(2.5)
    h.observe_many([0.0005, 0.5, 0.7, 3.0])
    r.counter("appends", "Appends.", {"partition": "1"}).inc()
    second = values()
    assert second[("waltz_test_appends_total", (("partition", "0"),))] == 5
    assert second[("waltz_test_appends_total", (("partition", "1"),))] == 1
    assert second[("waltz_test_lag", (("partition", "0"),))] == 2.5
    assert second[("waltz_test_latency_seconds_bucket", (("le", "0.001"), ("partition", "0")))] == 1
    assert second[("waltz_test_latency_seconds_bucket", (("le", "1.0"), ("partition", "0")))] == 3
    assert second[("waltz_test_latency_seconds_bucket", (("le", "+Inf"), ("partition", "0")))] == 4
    assert second[("waltz_test_latency_seconds_sum", (("partition", "0"),))] == pytest.approx(4.2005)
    r.remove({"partition": "0"})
    assert set(values()) == {("waltz_test_appends_total", (("partition", "1"),))}


@pytest.mark.parametrize("make", [
    lambda r: r.counter("appends_total"), lambda r: r.gauge("appends_total"), lambda r: r.gauge("bad-name"),
])
def test_names_promtool_would_reject_are_refused(make: Any) -> None:
    with pytest.raises(ValueError, match="bad metric name"):
        make(MetricsRegistry())


def test_process_metrics_match_prometheus_client() -> None:
    """The same process_* families, types and units as prometheus_client's ProcessCollector."""
    from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

    reference = CollectorRegistry()
    ProcessCollector(registry=reference)
    want = {name: f.type for name, f in families(generate_latest(reference).decode()).items()}
    got = check(process_registry("waltz-server", "1.2.3").render_prometheus())
    assert {name: f.type for name, f in got.items() if name.startswith("process_")} == want
    assert len(want) == 6
    (info,) = got["waltz_build_info"].samples
    assert info.value == 1 and info.labels["service"] == "waltz-server" and info.labels["version"] == "1.2.3"
    assert got["process_resident_memory_bytes"].samples[0].value > 1 << 20


# ------------------------------------------------------------------------------ client library


class _App(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.hwm = -1

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    def apply_transaction(self, transaction: Any) -> None:
        self.hwm = transaction.transaction_id

    def uncaught_exception(self, partition_id: int, transaction_id: int, exc: BaseException) -> None:
        raise exc


class _Write(TransactionContext):
    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data(b"x")
        return True


def _values(parsed: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parsed.values() for s in f.samples}


async def test_client_metrics_count_lock_failures_retries_and_commits() -> None:
    async with MockCluster(2) as cluster:
        app = _App()
        async with cluster.async_client(app) as client:
            await client.wait_mounted(10)
            for _ in range(5):
                await client.submit(_Write())
            cluster.force_next_lock_fail()
            await client.submit(_Write())
            cluster.force_next_append_fail()
            await client.submit(_Write())
            await client.flush()
            parsed = check(client.metrics.render_prometheus())
    v = _values(parsed)
    assert v[("waltz_client_lock_failures_total", ())] == 1
    assert v[("waltz_client_retries_total", ())] == 2  # the lock-failed append and the dropped one
    assert v[("waltz_client_commit_latency_seconds_count", ())] == 7  # each transaction committed once
    assert v[("waltz_client_high_water_mark", (("partition", "0"),))] == app.hwm == 6
    assert v[("waltz_client_high_water_mark", (("partition", "1"),))] == -1
    assert v[("waltz_client_pending_appends", ())] == 0
    assert v[("waltz_client_lock_waits_total", ())] == 0  # the writes take no locks: nothing held back
    assert {name: f.type for name, f in parsed.items()} == {
        "waltz_client_lock_failures": "counter", "waltz_client_lock_waits": "counter", "waltz_client_retries": "counter",
        "waltz_client_commit_latency_seconds": "histogram", "waltz_client_high_water_mark": "gauge",
        "waltz_client_pending_appends": "gauge"}


def test_blocking_client_exposes_the_same_registry() -> None:
    with MockCluster(1) as cluster, cluster.client(_App()) as client:
        client.wait_mounted(10)
        assert client.metrics is client.async_client.metrics
        assert "waltz_client_pending_appends 0" in client.metrics.render_prometheus()


# --------------------------------------------------------------------------- live cluster


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords, label
    names (matchers, ``by (...)`` lists), Grafana variables or durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if m.group() not in PROMQL_WORDS and not expr[m.end():].lstrip().startswith("("):
            names.add(m.group())
    return names


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, partition) (rate(a_bucket{job=~"$job", x="b_c"}[$__rate_interval])))'
        " / on (instance) group_left (version) c_info * 1e3") == {"a_bucket", "c_info"}


def dashboard_queries() -> Iterator[str]:
    dash = json.loads(DASHBOARD.read_text())
    stack = list(dash["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield target["expr"]
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["definition"])
        assert m, f"template variable {var['name']}: unexpected query {var['definition']!r}"
        yield m.group(1)


def alert_queries() -> Iterator[str]:
    for m in re.finditer(r"^\s+expr: (.+)$", ALERTS.read_text(), re.M):
        yield m.group(1)


def test_the_alerting_rules_pass_promtool_and_their_unit_tests() -> None:
    """deploy/prometheus/waltz-alerts.yml loads in Prometheus (``promtool check rules``), and every
    alert fires in a case of waltz-alerts.test.yml and stays quiet in another (``promtool test rules``)."""
    promtool = _promtool()
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    alerts = re.findall(r"^\s+- alert: (\w+)$", ALERTS.read_text(), re.M)
    assert len(alerts) == len(set(alerts)) == int(re.search(r"SUCCESS: (\d+) rules", checked.stdout).group(1))
    cases = ALERT_TESTS.read_text()
    for name in alerts:
        expectations = re.findall(rf"alertname: {name}\n\s+exp_alerts:( \[\])?", cases)
        assert " []" in expectations and "" in expectations, f"{name}: no case where it fires and one where it does not"
    tested = subprocess.run([promtool, "test", "rules", ALERT_TESTS.name], cwd=ALERTS.parent, capture_output=True,
                            text=True, timeout=60)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def _get(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()  # type: ignore[no-any-return]


async def test_live_endpoints_pass_promtool_and_the_dashboard_names_only_real_metrics(tmp_path: Path) -> None:
    spec = ClusterSpec(tmp_path, num_partitions=2, num_storages=1, num_servers=1, transport="tcp", http=True)
    async with InProcessCluster(spec) as cluster:
        app = _App()
        async with AsyncWaltzClient(app, spec.client_config()) as client:
            await client.wait_mounted(10)
            for _ in range(3):
                await client.submit(_Write())
            await client.flush()
            client_text = client.metrics.render_prometheus()
        urls = (f"http://127.0.0.1:{spec.storages[0].http_port}/metrics",
                f"http://{cluster.servers[0].http_address}/metrics")
        wanted = set().union(*map(promql_metric_names, dashboard_queries()))
        deadline = time.monotonic() + 10
        while True:  # the server sets some gauges once a second; the check below names what never came
            texts = [await asyncio.to_thread(_get, url) for url in urls]
            shown = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", "".join(texts), re.M))
            if wanted <= shown or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        storage, server = (check(text) for text in texts)
    client_metrics = check(client_text)
    assert _values(client_metrics)[("waltz_client_commit_latency_seconds_count", ())] == 3
    for parsed, service in ((storage, "waltz-storage"), (server, "waltz-server")):
        assert parsed["process_cpu_seconds"].type == "counter"
        assert parsed["waltz_build_info"].samples[0].labels["service"] == service
    assert server["waltz_server_appends"].type == "counter" and server["waltz_server_lock_failures"].type == "counter"
    assert _values(server)[("waltz_server_appends_total", (("partition", "0"),))] == 3
    assert storage["waltz_storage_appended_records"].type == "counter"

    exported = sample_names(storage) | sample_names(server)
    named: set[str] = set()
    for expr in dashboard_queries():
        names = promql_metric_names(expr)
        assert names, f"no metric in dashboard query {expr!r}"
        assert names <= exported, f"dashboard query {expr!r} names metrics nobody exports: {sorted(names - exported)}"
        named |= names
    assert {"waltz_server_appends_total", "waltz_server_commit_latency_seconds_bucket",
            "waltz_server_lock_failures_total", "waltz_server_storage_reachable", "waltz_server_cache_bytes",
            "process_resident_memory_bytes", "process_cpu_seconds_total"} <= named
    for expr in alert_queries():
        names = promql_metric_names(expr)
        assert names, f"no metric in alert expression {expr!r}"
        unknown = names - exported - NOT_FROM_A_PLAINTEXT_CLUSTER
        assert not unknown, f"alert expression {expr!r} names metrics nobody exports: {sorted(unknown)}"


@given(st.lists(st.one_of(st.floats(0, 100, allow_nan=False), st.sampled_from(DEFAULT_BUCKETS)), max_size=80),
       st.integers(0, 3))
def test_observing_many_values_at_once_counts_as_observing_each(values: list[float], before: int) -> None:
    each, many = Histogram({}), Histogram({})
    for h in (each, many):  # some observations already there
        for i in range(before):
            h.observe(DEFAULT_BUCKETS[i])
    for v in values:
        each.observe(v)
    many.observe_many(values)
    assert many.counts == each.counts and many.count == each.count
    assert many.sum == pytest.approx(each.sum)
