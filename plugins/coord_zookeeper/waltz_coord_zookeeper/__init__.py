"""Waltz ZooKeeper coordination backend (reference), built on kazoo."""
