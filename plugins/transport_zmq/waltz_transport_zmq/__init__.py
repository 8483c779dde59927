"""Waltz ZeroMQ transport: DEALER/ROUTER with heartbeats."""
