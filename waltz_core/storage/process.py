"""The storage node process (``waltz storage start``): config -> layout -> node -> listeners -> HTTP.

Cluster key and partition count come from coordination (``<root>/store``) unless given
explicitly (tests, offline use). Runs until ``stop`` is set or SIGINT/SIGTERM arrives. Transport,
coordination and layout are built from the registries of the runtime the node is given, and its
lifecycle hooks are called on that runtime's plugin manager.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from typing import TYPE_CHECKING, Any

from ..config import CoordinationConfig, StorageProcessConfig
from ..eventloop import loop_name
from ..http import HttpEndpoint
from ..metrics import MetricsRegistry
from ..plugins import core_version
from ..transport import check_plaintext_allowed, is_plaintext, open_transport
from ..transport.expiry import CertificateWatch
from . import open_layout
from .node import StorageNode

if TYPE_CHECKING:
    from ..plugins import Registries
    from ..runtime import Runtime

log = logging.getLogger("waltz.storage")


async def store_params_from_coordination(coordination: CoordinationConfig,
                                         registries: Registries) -> tuple[uuid.UUID, int]:
    """Read the cluster key and partition count from the coordination backend."""
    from ..coordination import open_coordination
    from ..coordination.recipes import StoreMetadata

    backend = open_coordination(coordination, registries)
    await backend.start()
    try:
        params = await StoreMetadata(backend, coordination.root).get_store_params()
    finally:
        await backend.close()
    return params.cluster_key, params.num_partitions


async def run_storage(config: StorageProcessConfig, runtime: Runtime, *, cluster_key: uuid.UUID | None = None,
                      num_partitions: int | None = None, stop: asyncio.Event | None = None,
                      announce: bool = True) -> None:
    """Run a storage node with ``runtime`` (the process's) until ``stop`` is set (or a termination
    signal arrives)."""
    cfg = config.storage
    registries = runtime.registries
    runtime.warn_unsafe(log, f"storage node {cfg.host}:{cfg.port}")
    transport = open_transport(config.transport, registries)
    try:
        # Before anything is read or opened: off loopback, plaintext or an admin port that does not
        # authenticate its clients needs --insecure.
        check_plaintext_allowed(transport, cfg.host, config.security.insecure, "storage.host", admin=True)
        if cluster_key is None or num_partitions is None:
            cluster_key, num_partitions = await store_params_from_coordination(config.coordination, registries)
        layout = open_layout(cfg, registries)
        metrics = MetricsRegistry()
        name = f"storage-{cfg.host}:{cfg.port}"
        node = StorageNode(layout, cluster_key, num_partitions, queue_size=cfg.queue_size,
                           max_batch_records=cfg.max_batch_records, max_frame_size=config.transport.max_frame_size,
                           io_threads=cfg.io_threads, journal=cfg.journal,
                           journal_checkpoint_bytes=cfg.journal_checkpoint_bytes, metrics=metrics, name=name)
        await node.start()
    except BaseException:
        await transport.aclose()
        raise
    for rep in node.repairs:
        log.warning("repaired at start: partition %d %s: %s (%s)", rep.partition_id, rep.file, rep.action, rep.detail)
    if is_plaintext(transport):
        log.warning("storage node: server and admin links are not encrypted (development mode; see [transport.%s] tls_*)", config.transport.name)
    certificates = CertificateWatch(transport)
    certificates.log_at_start("storage node")

    def healthy() -> tuple[bool, dict[str, Any]]:
        ready, details = node.healthy()
        expired = certificates.reasons()
        return ready and not expired, {**details, "reasons": details["reasons"] + expired}
    listeners: list[Any] = []
    http: HttpEndpoint | None = None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    hook = runtime.hook
    try:
        data = await transport.listen(cfg.host, cfg.port, node.serve_data)
        listeners.append(data)
        admin = await transport.listen(cfg.host, cfg.admin_port, node.serve_admin)
        listeners.append(admin)
        http_address = "disabled"
        if config.http.port:
            http = HttpEndpoint(service_name="waltz-storage", version=core_version(), metrics=metrics,
                                health=healthy)
            certificates.register(http.process_metrics)
            await http.start(config.http.host, config.http.port)
            http_address = http.address
        hook.waltz_process_started(kind="storage", name=name, address=data.address)
        if announce:
            print(f"waltz storage ready data={data.address} admin={admin.address} http={http_address} "
                  f"partitions={num_partitions} repairs={len(node.repairs)} event_loop={loop_name()}", flush=True)
        await stop.wait()
    finally:
        hook.waltz_process_stopping(kind="storage", name=name)
        if http is not None:
            await http.close()
        for listener in listeners:
            await listener.close()
        await node.close()
        await transport.aclose()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass
