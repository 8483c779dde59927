"""Waltz for Spark: the log as a PySpark data source and DataFrames as transactions.

``register(spark)`` makes ``format("waltz")`` available; :mod:`.decoders` turns the binary
``data`` column into typed columns; :mod:`.summarize` is the demo bank's derived-data job.
Importing this package does not import PySpark.
"""

from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Register the ``waltz`` data source with a SparkSession."""
    from .session import register as _register

    _register(spark)


__all__ = ["register"]
