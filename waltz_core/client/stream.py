"""The stream side of the client: partitions bound to their servers' streams, mounts, and what
the streams say (Waltz design, "Client-Server Interactions").

:class:`Streams` follows the assignment (a partition that moves - new endpoint or generation - is
bound to its new server's link and mounted there), mounts partitions when their link connects,
and hands every stream message to the partition's :class:`~waltz_core.protocol.session.Session`,
then acts on what the session decided:

* a feed record (:meth:`Streams.on_feed`, the stream reader's fast path, no message object):
  an own append committed frees its slot; older ones the session failed go to the sender for
  re-execution; the record goes to the partition's feed queue for the applier;
* mount answered: READY (appends may go; those sent before failed), NOT_READY (mount again
  later), CLIENT_AHEAD (submitters raise ClientAheadError);
* a lock failure goes to the sender, and so does a refused append (its transaction fails for
  good); a flush answer may decide appends (failed) and flushes;
* a suspended feed: mount again later.

A lost link blocks its partitions' appends (UNMOUNTED) until the link reconnects and mounts them
again. Event loop only.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..protocol import client as m
from ..protocol.session import ClientAhead, LockFailed, Mounted, Refused, RemountLater, SessionState

if TYPE_CHECKING:
    import asyncio

    from ..coordination.recipes import PartitionOwner
    from ..metrics import Histogram
    from .context import ClientContext
    from .link import ServerLink
    from .partition import FeedItem, Partition
    from .sender import Sender

log = logging.getLogger("waltz.client")

_INACTIVE = SessionState.INACTIVE
_SESSION_MESSAGES = frozenset({m.MountResponse, m.LockFailure, m.FlushResponse, m.FeedSuspended, m.AppendRefused})


class Streams:
    """Binds, mounts and listens for the partitions of one client (see the module docstring)."""

    def __init__(self, ctx: ClientContext, sender: Sender, commit_latency: Histogram) -> None:
        self._ctx = ctx
        self._partitions = ctx.partitions
        self._sender = sender
        self._commit_latency = commit_latency

    # ------------------------------------------------------------------------- binding

    def follow(self, owners: dict[int, PartitionOwner]) -> None:
        """The assignment changed: bind the partitions that moved to their new owner."""
        ctx = self._ctx
        for pid, p in self._partitions.items():
            if p.state is _INACTIVE:
                continue
            owner = owners.get(pid)
            if owner != p.owner:
                log.info("client %d: partition %d moves to %s", ctx.client_id, pid, owner)
                self.bind(p, owner)

    def bind(self, p: Partition, owner: PartitionOwner | None) -> None:
        """Attach ``p`` to its owner's stream and mount it there (appends wait until READY)."""
        self.unbind(p)
        p.bind(owner)
        if owner is None:
            return  # not assigned right now: wait for the watch
        links = self._ctx.links
        assert links is not None
        link = links.get(owner.endpoint)
        link.partitions.add(p.id)
        p.link = link
        link.ensure_stream()
        if link.connected:
            self.mount(p)

    def unbind(self, p: Partition) -> None:
        if p.mount_retry is not None:
            p.mount_retry.cancel()
            p.mount_retry = None
        link = p.link
        p.link = None
        if link is not None:
            link.partitions.discard(p.id)
            if not link.partitions:
                # After the current step: a partition that moves to the same endpoint (a new
                # generation) is bound to it again in the same step, and the link stays.
                links = self._ctx.links
                loop = self._ctx.loop
                if links is not None and loop is not None:
                    loop.call_soon(links.retire_if_idle, link)

    def mount(self, p: Partition) -> None:
        """Mount ``p`` on its link now (if the link is up and the client open)."""
        link = p.link
        if link is None or not link.connected or self._ctx.closed or p.state is _INACTIVE:
            return
        link.post(p.mount(link.net_seq))

    def remount_later(self, p: Partition, delay: float) -> None:
        if p.mount_retry is not None:
            p.mount_retry.cancel()
        loop = self._ctx.loop
        assert loop is not None
        p.mount_retry = loop.call_later(delay, self.mount, p)

    # ------------------------------------------------------------------------ link events

    def on_connected(self, link: ServerLink) -> None:
        for pid in sorted(link.partitions):
            p = self._partitions.get(pid)
            if p is not None and p.link is link:
                self.mount(p)

    def on_lost(self, link: ServerLink) -> None:
        """Block the appends of the link's partitions; the link reconnects and mounts them again."""
        for pid in link.partitions:
            p = self._partitions.get(pid)
            if p is not None and p.link is link and p.state is not _INACTIVE:
                p.link_lost()

    # ---------------------------------------------------------------------- stream messages

    def on_feed(self, link: ServerLink, fields: FeedItem) -> asyncio.Future[None] | None:
        """One feed record (the stream reader's fast path, no message object); returns a future
        to await when the partition's feed queue is full. The fields tuple is the feed item."""
        client_id, _, pid, seq, tid, _ = fields
        p = self._partitions.get(pid)
        if p is None:
            return None
        session = p.session
        if session.state is _INACTIVE:
            return None
        entry = session.on_feed(client_id, seq, tid)
        if entry is not None:
            p.own[tid] = entry.item  # the applier finds it there (a redelivery too)
            if entry.held is not None:
                p.held.committed(tid, entry.held)  # its locks are released once it is applied
            if p.slot_waiters:
                p.release_slot()  # passes the slot on
            else:
                p.inflight -= 1  # release_slot's answer when nobody waits for a slot
            self._commit_latency.observe(time.monotonic() - entry.registered)
        if session.failed:
            self._sender.failed(p, session.take_failed())
        if session.flushed:
            session.take_flushed()
            self._ctx.ping()
        return p.feed.put(fields)

    def on_lock_failure(self, link: ServerLink, fields: tuple[int, int, int, int, int]) -> None:
        """One LockFailure (the stream reader's fast path, no message object): what
        :meth:`on_message` does with one, whose session answer changes no state."""
        client_id, _, pid, seq, transaction_id = fields
        p = self._partitions.get(pid)
        if p is None or p.state is _INACTIVE:
            return
        session = p.session
        decision = session.on_lock_failure(client_id, seq, transaction_id)
        if session.failed:
            self._sender.failed(p, session.take_failed())
        if session.flushed:
            session.take_flushed()
            self._ctx.ping()
        if decision is not None:
            self._sender.lock_failed(p, decision)

    def on_message(self, link: ServerLink, msg: Any) -> None:
        t = type(msg)
        p = self._partitions.get(msg.req_id.partition_id)
        if p is None or p.state is _INACTIVE:
            return
        ctx = self._ctx
        if t not in _SESSION_MESSAGES:
            log.warning("client %d: unexpected %s on the stream from %s", ctx.client_id, t.__name__, link.endpoint)
            return
        if t is m.FeedSuspended and p.link is not link:
            return  # a link the partition has left
        action = p.receive(msg)
        session = p.session
        if session.failed:
            self._sender.failed(p, session.take_failed())
        if session.flushed:
            session.take_flushed()
            ctx.ping()
        if action is None:
            return
        if isinstance(action, LockFailed):
            self._sender.lock_failed(p, action)
        elif isinstance(action, Refused):
            self._sender.refused(p, action)
        elif isinstance(action, Mounted):
            ctx.ping()
        elif isinstance(action, RemountLater):
            if t is m.FeedSuspended:
                log.info("client %d: feed of partition %d suspended by %s", ctx.client_id, p.id, link.endpoint)
            self.remount_later(p, action.delay)
        elif isinstance(action, ClientAhead):
            log.error("client %d: partition %d: the client high-water mark %d is ahead of the server's",
                      ctx.client_id, p.id, action.client_high_water_mark)
