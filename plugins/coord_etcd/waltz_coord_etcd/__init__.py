"""Waltz etcd v3 coordination backend (etcd-sdk-python, ``import pyetcd``).

Registered as ``etcd`` through the ``waltz`` entry point; see README.md for the key layout and
how to read values with etcdctl.
"""
