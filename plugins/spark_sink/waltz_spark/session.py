"""A local SparkSession set up the way the Waltz data source needs it (tests, CLI, benchmarks).

What matters on one machine (see docs/spark.md): Python workers must run the interpreter that has
``waltz_spark`` and pyarrow installed (``PYSPARK_PYTHON``), Spark stays on the loopback interface,
the UI is off, and the serial GC with C1-only JIT shortens start-up by a couple of seconds.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def local_session(app_name: str = "waltz", cores: int = 2, conf: dict[str, str] | None = None) -> Any:
    """Start (or get) a ``local[cores]`` SparkSession with the ``waltz`` data source registered.

    Blocking (5-10 s for a new JVM). Sets ``PYSPARK_PYTHON`` and ``SPARK_LOCAL_IP`` in this
    process's environment when they are not set already.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    java_opts = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
    builder = (SparkSession.builder.master(f"local[{cores}]").appName(app_name)
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(max(2, cores)))
               .config("spark.driver.extraJavaOptions", java_opts)
               .config("spark.executor.extraJavaOptions", java_opts)
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.memory", "1g"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def register(spark: Any) -> None:
    """Register the ``waltz`` data source with ``spark`` (idempotent)."""
    from .source import WaltzDataSource

    spark.dataSource.register(WaltzDataSource)
