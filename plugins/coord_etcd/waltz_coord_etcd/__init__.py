"""Waltz etcd v3 coordination backend (etcd-sdk-python)."""
