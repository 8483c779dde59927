"""Waltz ZooKeeper coordination backend (reference), built on kazoo.

Registered as ``zookeeper`` through the ``waltz`` entry point; see README.md for the znode
layout, the value encoding and how to read values with zkCli.
"""
